"""The dead-letter handler with real agents (issue 16): rqpctl dlq replay --follow --drain on a
simulated host with a sending MCA, a receiving MCA on another; every action of the rules table,
dead letters arriving while it runs, kill -9, and the one-off repair (dlq show, dlq resubmit
--edit with a scripted editor)."""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import signal
import sys

from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import REPLAYED_NOTE, AgentKind, DeadLetterRecord
from rqp.storage.archive import (
    ROW_KEYS, ArchiveWriter, archive_files, read_archive, record_to_row,
)
from rqp.tools.replay import RetryLedger
from tests.agents import (
    DLQ, make_queue, receive, start_receiver, start_sender, write_rqprc,
)
from tests.testbed import wait_for

Q1, Q2, Q3 = 0x52510001, 0x52510002, 0x52510003
CTL = [sys.executable, "-m", "rqp.tools.ctl", "dlq"]

PUT = r"""
import sys
from rqp.system.queues import LocalQueue
q = LocalQueue.open(int(sys.argv[1])) if LocalQueue.exists(int(sys.argv[1])) else \
    LocalQueue.create(int(sys.argv[1]))
with open(sys.argv[2]) as f:
    for line in f:
        q.put(bytes.fromhex(line.strip()), block=False)
"""

DEPTH = r"""
import sys, sysv_ipc
try:
    print(sysv_ipc.MessageQueue(int(sys.argv[1])).current_messages)
except sysv_ipc.ExistentialError:
    print(0)
"""

PEEK = r"""
import sys
from rqp.system.queues import LocalQueue
key, out, i = int(sys.argv[1]), [], 0
if LocalQueue.exists(key):
    q = LocalQueue.open(key)
    while (item := q.peek(i)) is not None:
        out.append(item[0].hex())
        i += 1
print(" ".join(out))
"""

TAKE_RAW = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(int(sys.argv[1]), max_message_size=1 << 16)
data, mtype = q.receive(block=False)
print(data.hex(), mtype)
"""


def dead_letter(reason, key: int, payload: bytes, queue_key: int = Q1) -> bytes:
    """A dead-letter record as a sending MCA writes it (SURE, with its key)."""
    return DeadLetterRecord(
        reason=reason, message_type=0, agent=AgentKind.SENDER, queue_key=queue_key,
        message_key=key, attempts=1, host="a", source_host="a", destination_host="",
        detail="made by the test", payload=payload).to_bytes()


def put_dead_letters(host, records: list[bytes]) -> None:
    path = host.workdir / "records.hex"
    path.write_text("".join(r.hex() + "\n" for r in records))
    host.python(PUT, str(DLQ), str(path))


def depth(host, key: int) -> int:
    return int(host.python(DEPTH, str(key)))


def peek(host, key: int) -> list[bytes]:
    """The messages on a queue, left there."""
    return [bytes.fromhex(x) for x in host.python(PEEK, str(key)).split()]


def rows(archive) -> list[dict]:
    return list(read_archive(archive)) if archive.exists() else []


def ledger(archive) -> dict:
    """What the replay ledger says of each message, as the handler reads it."""
    return {name: dataclasses.asdict(entry)
            for name, entry in RetryLedger(archive, writable=False).entries.items()}


def start_handler(host, archive, rules, rqprc, *extra: str):
    rules_path = host.workdir / "rules.yaml"
    rules_path.write_text(rules)
    proc = host.popen([*CTL, "replay", "--follow", "--drain", "--archive", str(archive),
                       "--rules", str(rules_path), "--rqprc", str(rqprc), "--poll", "0.5",
                       *extra])
    wait_for(lambda: "following" in host.output(proc) or proc.poll() is not None, timeout=20,
             message="the handler did not start")
    assert proc.poll() is None, host.output(proc, "stderr")
    return proc


EVERY_ACTION = """
rules:
  - reason: [NO_ROUTE, RETRY_BUDGET_EXHAUSTED]
    queue: 0x52510001
    action: retry
    retries: 2
    interval: 1s
  - reason: QUEUE_FULL
    action: forward
    to: PROD_THE_SPARE_COMMON
    header: no
  - reason: UNKNOWN_QUEUE
    action: forward
    to: 0x52510003
    header: yes
  - reason: MESSAGE_TOO_BIG
    action: discard
  - reason: NOT_AUTHORIZED
    action: ignore
"""


def test_every_action_as_dead_letters_arrive(testbed):
    """Nothing but the handler runs besides the agents: dead letters put on DEAD.LETTER.Q while
    it follows are drained and handled. The retried message has no host (b lacks Q1), so the
    real sending MCA dead-letters it again (retry budget 1), with its ORIGINAL key: it is
    retried twice, at least the interval apart, then kept."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b)
    make_queue(b, Q2)
    make_queue(b, Q3)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SPARE_COMMON": Q2}, retry_max_attempts=1)
    sender = start_sender(a, rqprc)
    archive = a.workdir / "archive"
    handler = start_handler(a, archive, EVERY_ACTION, rqprc)
    k1, k2, k3 = 0x1600_0000_0000_0001, 0x1600_0000_0000_0002, 0x1600_0000_0000_0003
    wrapped = dead_letter(ReasonCode.UNKNOWN_QUEUE, k3, b"wrap me", queue_key=0x52510005)
    ignored = dead_letter(ReasonCode.NOT_AUTHORIZED, 0x99, b"ignore me")
    put_dead_letters(a, [dead_letter(ReasonCode.NO_ROUTE, k1, b"retry me"),
                         dead_letter(ReasonCode.QUEUE_FULL, k2, b"forward me", 0x52510004),
                         wrapped, dead_letter(ReasonCode.MESSAGE_TOO_BIG, 0x98, b"drop me"),
                         ignored])
    seen = []  # (retries, last_ns) of k1 in the ledger, as they change

    def used_up():
        entry = ledger(archive).get(f"{k1:#018x}")
        if entry and (not seen or seen[-1] != (entry["retries"], entry["last_ns"])):
            seen.append((entry["retries"], entry["last_ns"]))
        return "its retries are used up (2 of 2" in a.output(handler) or handler.poll()

    wait_for(used_up, timeout=60, message="the retries were not used up")
    assert handler.poll() is None, a.output(handler, "stderr")
    assert [n for n, _ in seen] == [1, 2] and seen[1][1] - seen[0][1] >= 1e9  # interval 1s
    # the real sending MCA dead-lettered the retried message twice, with its original key
    again = [line for line in a.output(sender, "stderr").splitlines()
             if "dead letter reason=RETRY_BUDGET_EXHAUSTED" in line]
    assert len(again) == 2 and all(f"key={k1:#018x}" in line for line in again)
    # an archive file another host's drain wrote (the archive is shared) is picked up too
    ArchiveWriter(archive, host="c").write([record_to_row(
        dead_letter(ReasonCode.QUEUE_FULL, k2 + 0x10, b"from c", 0x52510004), archived_by="c")])
    # header no: the payload; header yes: the dead-letter record itself, as it was queued
    assert sorted(receive(b, Q2, 2)) == ["forward me", "from c"]
    raw, mtype = b.python(TAKE_RAW, str(Q3)).split()
    assert bytes.fromhex(raw) == wrapped and mtype == "1"
    assert DeadLetterRecord.from_bytes(bytes.fromhex(raw)).payload == b"wrap me"
    # left: the ignored row, untouched, and the last dead letter of the retried message
    wait_for(lambda: depth(a, DLQ) == 0 and len(rows(archive)) == 2, timeout=20,
             message="the archive did not settle")
    ignored_row, last = rows(archive)
    assert ignored_row == {**record_to_row(ignored, archived_by=ignored_row["archived_by"]),
                           "archived_at": ignored_row["archived_at"]}
    assert (last["reason"], last["agent"], last["message_key"], last["queue_key"]) == \
        ("RETRY_BUDGET_EXHAUSTED", "sender", f"{k1:#018x}", Q1)
    assert last["detail"].endswith(f" [{REPLAYED_NOTE}]")  # the row says it is a replay
    out = a.output(handler)
    assert re.search(r"^discarded .* MESSAGE_TOO_BIG .*\[rules\[3\]\]$", out, re.M)
    assert re.search(r"^forwarded .* -> 0x52510002 \(PROD_THE_SPARE_COMMON\) key "
                     f"{k2:#018x}", out, re.M)
    assert re.search(r"^waiting .* retry 2 of 2 not before .* \(interval 1s\)$", out, re.M)
    assert "ignore me" not in out and "NOT_AUTHORIZED" not in out  # kept, nothing said
    assert a.stop(handler, timeout=20) == 0
    assert re.search(r"^SIGTERM: stopping after the record in hand$", a.output(handler), re.M)
    assert a.output(handler).splitlines()[-1] == \
        "replayed 2, forwarded 3, discarded 1, kept 2, failed 0 (stopped by a signal)"
    assert "repeat of SURE" not in b.output(receiver, "stderr")


def test_follow_under_kill_9_loses_nothing(testbed):
    """Dead letters arrive while the handler retries them at a limited rate; the handler (and
    a drain it runs) is killed with SIGKILL mid-way, then started again: every dead letter is
    put exactly once (a retry sent again after the kill carries its original key, so the
    receiving MCA recognises the repeat), and none is left over."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    a.sysctl("kernel.msgmnb", 1 << 20)
    b.sysctl("kernel.msgmnb", 1 << 20)
    receiver = start_receiver(b, log_level="INFO")
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc, log_level="INFO")
    archive = a.workdir / "archive"
    rules = "rules:\n  - action: retry\n    interval: 1s\n"
    records = [dead_letter(ReasonCode.NO_ROUTE, 0x1700_0000_0000_0000 + i, f"m{i}".encode())
               for i in range(150)]
    put_dead_letters(a, records[:75])
    handler = start_handler(a, archive, rules, rqprc, "--rate", "50")
    put_dead_letters(a, records[75:])  # (more while it runs)
    wait_for(lambda: depth(b, Q1) >= 40, timeout=60, message="nothing replayed")
    assert a.kill(handler) == -signal.SIGKILL
    # nothing lost: each one is queued on b, still archived, or still on DEAD.LETTER.Q
    assert depth(b, Q1) < 150
    # nothing lost: each one is on b (or on its way: journaled by the sending MCA), still
    # archived, or still on DEAD.LETTER.Q
    everywhere = lambda: set(peek(b, Q1)) | {  # noqa: E731
        base64.b64decode(r["payload_b64"]) for r in rows(archive)} | {
        DeadLetterRecord.from_bytes(r).payload for r in peek(a, DLQ)}
    wait_for(lambda: everywhere() == {f"m{i}".encode() for i in range(150)}, timeout=30,
             message="a dead letter was lost")
    again = start_handler(a, archive, rules, rqprc, "--rate", "50")
    wait_for(lambda: depth(b, Q1) >= 150, timeout=90, message="not everything was replayed")
    wait_for(lambda: not rows(archive) and depth(a, DLQ) == 0, timeout=30,
             message="the archive was not emptied")
    a.kill(again, signal.SIGINT)  # (as ^C does: the whole process group)
    assert again.wait(timeout=20) == 0
    assert "SIGINT: stopping after the record in hand" in a.output(again)
    got = receive(b, Q1, 151, timeout=2)
    assert sorted(got) == sorted(f"m{i}" for i in range(150))  # each one, once
    # once, not following: --drain moves DEAD.LETTER.Q into the archive first
    put_dead_letters(a, [dead_letter(ReasonCode.NO_ROUTE, 0x1700_0000_0000_1000, b"late")])
    once = a.run([*CTL, "replay", "--drain", "--archive", str(archive), "--rules",
                  str(a.workdir / "rules.yaml"), "--rqprc", str(rqprc)], timeout=60)
    assert once.stdout.startswith("drained 1 record(s) into ") and \
        once.stdout.splitlines()[-1] == "replayed 1, forwarded 0, discarded 0, kept 0, failed 0"
    assert receive(b, Q1, 1) == ["late"] and not rows(archive) and depth(a, DLQ) == 0
    assert sum(e["retries"] for e in ledger(archive).values()) >= 150
    # the kill came between confirmations and the archive's rewrite (at most 5 s apart): those
    # rows were sent again, with their keys, and not put twice
    assert "repeat of SURE message key=0x17000000000000" in b.output(receiver, "stderr")


def test_follow_pauses_while_no_sending_mca_runs(testbed):
    """The handler never starts a sending MCA; while none serves the transmission queue it puts
    nothing and counts no retry (a record put there would only wait), and goes on once one
    runs."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    archive = a.workdir / "archive"
    handler = start_handler(a, archive, "rules:\n  - action: retry\n    retries: 1\n", rqprc)
    key = 0x1900_0000_0000_0001
    put_dead_letters(a, [dead_letter(ReasonCode.NO_ROUTE, key, b"waits for a sender")])
    wait_for(lambda: "paused" in a.output(handler), timeout=20, message="it did not pause")
    assert re.search(r"^waiting .* no sending MCA serves transmission queue 0x52510000: "
                     r"nothing put; kept until one runs$", a.output(handler), re.M)
    assert ledger(archive) == {} and depth(a, 0x52510000) == 0 and len(rows(archive)) == 1
    start_sender(a, rqprc)
    assert receive(b, Q1, 1) == ["waits for a sender"]  # its one retry: not used up before
    wait_for(lambda: not rows(archive), timeout=20, message="the row stayed")
    assert ledger(archive)[f"{key:#018x}"]["retries"] == 1
    assert a.stop(handler, timeout=20) == 0
    out = a.output(handler)
    assert out.count("paused ") == 1 and "resumed        the sending MCA takes records again" \
        in out


# --------------------------------------------------------------------------------------------
# One-off repair: show and resubmit


def archive_rows(archive, *records: bytes) -> list[dict]:
    rows_ = [record_to_row(r, archived_by="a") for r in records]
    ArchiveWriter(archive, host="a").write(rows_)
    return rows_


def test_show_and_resubmit_with_an_edit(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b)
    make_queue(b, Q1)
    make_queue(b, Q2)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SPARE_COMMON": Q2})
    start_sender(a, rqprc)
    archive = a.workdir / "archive"
    key = 0x1800_0000_0000_0001
    typo, binary, plain = archive_rows(
        archive, dead_letter(ReasonCode.MESSAGE_TOO_BIG, key, b"helo world"),
        dead_letter(ReasonCode.NO_ROUTE, key + 1, b"\xff\xfe binary"),
        dead_letter(ReasonCode.NO_ROUTE, key + 2, b"as it was"))
    [path] = archive_files(archive)

    def ctl(*args: str, editor: str | None = None, check: bool = False):
        env = {k: v for k, v in os.environ.items() if k not in ("VISUAL", "EDITOR")}
        if editor is not None:
            env["EDITOR"] = editor
        return a.run([*CTL, *args, "--archive", str(archive)], env=env, check=check,
                     timeout=60)

    listed = ctl("list", check=True).stdout.splitlines()
    assert listed[0].startswith("ID            TIMESTAMP") and \
        listed[1].startswith(typo["id"][:12] + "  ")
    # show: every field, where it is, the payload as a hex dump
    shown = ctl("show", typo["id"][:8], check=True).stdout
    assert f"file               {path} (line 1 of 3)" in shown
    for name in ROW_KEYS:
        if name not in ("payload_b64", "payload_preview"):
            assert re.search(rf"^{name} +{re.escape(str(typo[name]))}$", shown, re.M), name
    assert "payload            10 byte(s) kept of 10" in shown
    assert "  00000000  68 65 6c 6f 20 77 6f 72  6c 64" in shown and "|helo world|" in shown
    # (an id that no row has: 1; one that is no id: a usage error, 2, as for resubmit)
    for bad, message, code in (("123456", "no dead letter with id 123456", 1),
                               ("xyz", "'xyz' is not a dead letter's id", 2),
                               (typo["id"][:3], "6 to 32 hex digits", 2)):
        for command in ("show", "resubmit"):
            done = ctl(command, bad, *(("--rqprc", str(rqprc)) if command == "resubmit" else ()))
            assert done.returncode == code and message in done.stderr, (command, done.stderr)
    # refused edits leave the row where it is
    send = ("resubmit", "--rqprc", str(rqprc))
    unchanged = ctl(*send, typo["id"], "--edit", editor="true")
    assert unchanged.returncode == 1 and "the payload is unchanged: nothing resubmitted" in \
        unchanged.stdout
    emptied = ctl(*send, typo["id"], "--edit", editor="truncate -s 0")
    assert emptied.returncode == 1 and "the edited payload is empty" in emptied.stdout
    failed = ctl(*send, typo["id"], "--edit", editor="false")
    assert failed.returncode == 1 and "the editor (false) exited with status 1" in failed.stdout
    not_text = ctl(*send, binary["id"], "--edit", editor="true")
    assert not_text.returncode == 1 and "not UTF-8 text (byte 0)" in not_text.stdout
    no_editor = ctl(*send, typo["id"], "--edit")
    assert no_editor.returncode == 2 and "set $VISUAL or $EDITOR" in no_editor.stderr
    assert len(rows(archive)) == 3
    # the edit, as git commit runs an editor (through the shell, the file as its argument)
    fixed = ctl(*send, typo["id"], "--edit", editor="sed -i 's/helo/hello/'")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert re.search(rf"^resubmitted +{typo['id']} queue 0x52510001 key {key:#018x} \(edited\): "
                     r"11 bytes$", fixed.stdout, re.M)
    assert receive(b, Q1, 1) == ["hello world"]  # (the editor's last newline is not kept)
    # --to another queue, by name; the row leaves the archive once confirmed
    moved = ctl(*send, plain["id"], binary["id"][:10], "--to", "PROD_THE_SPARE_COMMON")
    assert moved.returncode == 0 and moved.stdout.splitlines()[-1] == \
        "resubmitted 2, failed 0"
    assert sorted(receive(b, Q2, 2)) == ["as it was", "\ufffd\ufffd binary"]
    assert rows(archive) == []
    # the same dead letter resubmitted again keeps its key: the receiving MCA had put it
    [back] = archive_rows(archive, dead_letter(ReasonCode.NO_ROUTE, key + 2, b"as it was"))
    assert re.search(r"^replay ledger      this message \(key 0x1800000000000003\) was "
                     r"forwarded or resubmitted 1 time\(s\), the last at \S+: this dead letter "
                     r"came after that \(a replay's\)$",
                     ctl("show", back["id"], check=True).stdout, re.M)
    assert ctl(*send, back["id"], "--to", "0x52510002").returncode == 0
    wait_for(lambda: f"repeat of SURE message key={key + 2:#018x}" in
             b.output(receiver, "stderr"), timeout=20, message="no repeat recognised")
    assert depth(b, Q2) == 0
    archive_rows(archive, plain_bytes := dead_letter(ReasonCode.NO_ROUTE, 7, b"x"))
    unknown = ctl(*send, record_to_row(plain_bytes, archived_by="a")["id"], "--to",
                  "NO_SUCH_QUEUE")
    assert unknown.returncode == 2 and "--to: " in unknown.stderr and "NO_SUCH_QUEUE" in \
        unknown.stderr


def test_the_handlers_drain_meeting_another_is_no_failure(tmp_path, capsys):
    """A trial: the handler's --drain said "drain failed ... exited with 1" each time it met
    the drain timer's run at the lock. A drain that finds another at work exits 75 (it
    drains): no failure for the handler; any other status still is one."""
    from rqp.config import ReceiverConfig
    from rqp.system.service import EXIT_ANOTHER_RUNS
    from rqp.tools.ctl import _Drain

    drain = _Drain(tmp_path, ReceiverConfig())
    drain.argv = [sys.executable, "-c", f"import sys; print('busy', file=sys.stderr); "
                  f"sys.exit({EXIT_ANOTHER_RUNS})"]
    assert drain() is True and "drain failed" not in capsys.readouterr().out
    drain.argv = [sys.executable, "-c", "import sys; print('broken', file=sys.stderr); "
                  "sys.exit(1)"]
    assert drain() is False
    assert "drain failed   rqp-dlq-drain exited with 1: broken" in capsys.readouterr().out
