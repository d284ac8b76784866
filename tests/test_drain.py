"""rqp-dlq-drain on a simulated host: everything archived exactly once, whenever it is killed."""

from __future__ import annotations

import base64
import collections
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from rqp import UNSURE_MSG
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import AgentKind, DeadLetterRecord
from rqp.storage.archive import (
    archive_files, read_archive, read_drain_state, record_id, row_raw_bytes,
)
from tests.agents import DLQ, HOLDING_SIGNALS, send, start_receiver, start_sender, write_rqprc
from tests.testbed import wait_for

Q1 = 0x52510001
DRAIN = [sys.executable, "-m", "rqp_agents.drain"]

PUT = r"""
import sys
from rqp.system.queues import LocalQueue
q = LocalQueue.create(int(sys.argv[1]))
with open(sys.argv[2]) as f:
    for line in f:
        q.put(bytes.fromhex(line.strip()), block=False)
"""

CONTENTS = r"""
import json, sys
from rqp.system.queues import LocalQueue
key = int(sys.argv[1])
if not LocalQueue.exists(key):
    print("null")
else:
    q, out, i = LocalQueue.open(key), [], 0
    while (item := q.peek(i)) is not None:
        out.append(item[0].hex())
        i += 1
    print(json.dumps(out))
"""

# Runs the drain in a process that dies (os._exit, like a kill -9: no clean-up) at a point.
CRASH = r"""
import os, sys
import rqp.storage.archive as archive
from rqp.system.queues import LocalQueue
from rqp_agents import drain
point, argv = sys.argv[1], sys.argv[2:]
if point.startswith("before-rename"):          # before-rename:N = die at the N-th rename
    limit, calls = int(point.split(":")[1]), [0]
    publish = archive._publish
    def dying_publish(tmp, final):
        calls[0] += 1
        if calls[0] == limit:
            os._exit(9)
        publish(tmp, final)
    archive._publish = dying_publish
elif point == "after-rename":                  # every file renamed, nothing taken off
    drain.Drain._take_off = lambda *a: os._exit(9)
elif point.startswith("mid-take-off"):         # mid-take-off:N = die after N records taken
    limit, calls = int(point.split(":")[1]), [0]
    get = LocalQueue.get
    def dying_get(self, **kw):
        if calls[0] == limit:
            os._exit(9)
        calls[0] += 1
        return get(self, **kw)
    LocalQueue.get = dying_get
sys.exit(drain.main(argv))
"""


def make_records(n: int, malformed_at: int | None = None) -> list[bytes]:
    reasons = list(ReasonCode)
    out = []
    for i in range(n):
        out.append(DeadLetterRecord(
            reason=reasons[i % len(reasons)], message_type=i % 2, agent=AgentKind.RECEIVER,
            queue_key=Q1 + i % 3, message_key=(0xABC << 32) | i, attempts=i % 5,
            host="h", source_host="src", destination_host="dst:7460", detail=f"record {i}",
            payload=bytes([i % 256]) + f"payload {i} é".encode()).to_bytes())
        if i == malformed_at:
            out.append(b"RQDL\x01 this is no dead-letter record \xff\x00")
    return out


def put(host, records: list[bytes], key: int = DLQ) -> None:
    path = host.workdir / "records.hex"
    path.write_text("".join(r.hex() + "\n" for r in records))
    host.python(PUT, str(key), str(path))


def contents(host, key: int = DLQ) -> list[bytes] | None:
    out = json.loads(host.python(CONTENTS, str(key)))
    return None if out is None else [bytes.fromhex(x) for x in out]


def drain(host, archive: Path, *args: str, check: bool = True):
    if "--rqprc" not in args:  # never whatever /etc/rqp/rqprc this machine may have
        args = ("--rqprc", str(host.rqprc), *args)
    return host.run([*DRAIN, "--archive", str(archive), "--once", *args], check=check)


@pytest.fixture
def host(testbed):
    h = testbed.add_host("a")
    h.sysctl("kernel.msgmnb", 1 << 20)  # room for many records on DEAD.LETTER.Q
    h.archive = h.workdir / "archive"
    h.rqprc = write_rqprc(h, [h])
    return h


def assert_archived_once(archive: Path, records: list[bytes]) -> list[dict]:
    rows = list(read_archive(archive))
    assert collections.Counter(r["id"] for r in rows) == \
        collections.Counter(record_id(r) for r in records)
    assert [row_raw_bytes(r) for r in rows] == records  # the order of the queue, too
    assert list((archive / ".incoming").iterdir()) == []
    return rows


def test_once_drains_everything_and_keeps_a_malformed_record(host):
    records = make_records(700, malformed_at=350)
    put(host, records)
    rqprc = write_rqprc(host, [host], queues={"PROD_THE_SCHED_COMMON": Q1})
    out = drain(host, host.archive, "--rqprc", str(rqprc), "--batch", "300",
                "--max-file-records", "128").stdout
    counts = [int(n) for n in re.findall(r"^drained (\d+) record\(s\) into \S+$", out, re.M)]
    assert sum(counts) == 701 and max(counts) == 128 and len(counts) == len(
        archive_files(host.archive)) == 7  # batches of 300, 300, 101: 3 + 3 + 1 files
    rows = assert_archived_once(host.archive, records)
    assert contents(host) == []
    malformed = rows[351]
    assert malformed["reason"] == "MALFORMED" and malformed["reason_code"] == -1
    assert "not a dead-letter record" in malformed["detail"]
    assert row_raw_bytes(malformed) == records[351]
    first = rows[0]
    assert first["reason"] == "NO_QUEUE_KEY" and first["agent"] == "receiver"
    assert first["queue_name"] == "PROD_THE_SCHED_COMMON" and rows[1]["queue_name"] is None
    assert first["message_key"] == f"0x{0xABC << 32:016x}" and first["message_type"] == "SURE"
    assert first["detail"] == "record 0" and first["destination_host"] == "dst:7460"
    state = read_drain_state(host.archive, rows[0]["archived_by"])
    assert state.done and state.queue == DLQ
    # nothing more to do
    again = drain(host, host.archive).stdout
    assert again.startswith("drained 0 record(s)") and len(archive_files(host.archive)) == 7


def test_a_host_that_only_receives_drains_the_receivers_dead_letter_queue(host):
    """A trial: the drain timer, run with the .rqprc scripts/install put there, failed every
    run on a host that only receives (the file stays a template there). The receiving MCA's
    config gives DEAD.LETTER.Q's key and the queue names instead."""
    template = host.workdir / "rqprc"
    template.write_text('rqp_template: "delete this line once the file is filled in"\n'
                        "dead_letter_queue: 0x5251dead\n")
    receiver = host.workdir / "receiver.yaml"
    receiver.write_text("dead_letter_queue: 0x5251dea0\nqueues: {PROD_ONE: 0x52510001}\n")
    records = [DeadLetterRecord(reason=ReasonCode.QUEUE_FULL, queue_key=Q1, message_key=i + 1,
                                payload=b"p%d" % i, timestamp_ns=1, message_type=UNSURE_MSG,
                                agent=AgentKind.RECEIVER).to_bytes() for i in range(2)]
    put(host, records, key=0x5251DEA0)
    out = drain(host, host.archive, "--rqprc", str(template), "--receiver-config",
                str(receiver))
    assert f"{template} is the template scripts/install put there" in out.stderr, out.stderr
    assert f"dead_letter_queue 0x5251dea0 from {receiver}" in out.stderr, out.stderr
    rows = assert_archived_once(host.archive, records)
    assert {r["queue_name"] for r in rows} == {"PROD_ONE"}
    assert contents(host, 0x5251DEA0) == []
    # a template and no receiver config: which DEAD.LETTER.Q is unknown, refused as before
    out = drain(host, host.archive, "--rqprc", str(template), check=False)
    assert out.returncode == 2 and f"{template}: this is the template" in out.stderr, \
        out.stderr
    # a .rqprc that is wrong otherwise is still refused, naming it
    template.write_text("dead_letter_queue: [1]\n")
    out = drain(host, host.archive, "--rqprc", str(template), "--receiver-config",
                str(receiver), check=False)
    assert out.returncode == 2 and str(template) in out.stderr, out.stderr
    # an --archive that is a file (a trial's said "cannot create the directory: File exists")
    a_file = host.archive.parent / "archive.jsonl.gz"
    a_file.write_bytes(b"")
    out = drain(host, a_file, "--receiver-config", str(receiver), check=False)
    assert out.returncode == 2 and f"--archive {a_file}: is not a directory" in out.stderr, \
        out.stderr


def test_a_record_longer_than_a_lowered_msgmax_is_archived_and_the_drain_moves_on(host):
    # Put while msgmax was 8192, drained after it was lowered to 2048: the kernel copies at
    # most msgmax bytes, so the copy of the long one failed at every run, for ever, and every
    # record behind it stayed. It is taken, archived, and the others follow, in order.
    records = make_records(5)
    records[2] = DeadLetterRecord(
        reason=ReasonCode.QUEUE_FULL, message_type=1, agent=AgentKind.RECEIVER, queue_key=Q1,
        message_key=0xABC << 32, host="h", detail="long", payload=b"L" * 6000).to_bytes()
    put(host, records)
    host.sysctl("kernel.msgmax", 2048)
    done = drain(host, host.archive, "--batch", "10")
    rows = assert_archived_once(host.archive, records)
    assert rows[2]["detail"] == "long" and row_raw_bytes(rows[2]) == records[2]
    assert contents(host) == []
    assert "queue 0x5251dead: message 0 is longer than kernel.msgmax (2048 bytes" in done.stderr
    assert "taken off before it is archived" in done.stderr


@pytest.mark.parametrize("point, archived_before_restart", [
    ("before-rename:1", 0),    # the first file of a batch written, not renamed
    ("before-rename:3", 100),  # two files of three renamed
    ("after-rename", 120),     # the whole batch archived, nothing taken off
    ("mid-take-off:50", 120),  # the whole batch archived, 50 records taken off
])
def test_killed_at_any_point_then_rerun_archives_each_record_exactly_once(
        host, point, archived_before_restart):
    records = make_records(300)
    put(host, records)
    args = ["--archive", str(host.archive), "--rqprc", str(host.rqprc), "--once", "--batch", "120",
            "--max-file-records", "50"]
    crashed = host.run([sys.executable, "-c", CRASH, point, *args], check=False)
    assert crashed.returncode == 9, crashed.stderr
    assert len(list(read_archive(host.archive))) == archived_before_restart
    half_written = list((host.archive / ".incoming").iterdir())
    assert len(half_written) == (1 if point.startswith("before-rename") else 0)
    [state_file] = (host.archive / ".state").glob("*.last")
    assert json.loads(state_file.read_text())["done"] is False
    taken = int(point.split(":")[1]) if point.startswith("mid") else 0
    assert contents(host) == records[taken:]  # nothing lost yet
    out = drain(host, host.archive, "--batch", "120", "--max-file-records", "50").stdout
    assert sum(map(int, re.findall(r"drained (\d+)", out))) == 300 - archived_before_restart
    assert_archived_once(host.archive, records)
    assert contents(host) == []


def test_continuous_mode_keeps_draining_and_stops_on_sigterm(host):
    """Started holding the signals, as a supervisor's thread might: it lets go of those it
    stops on (a signal mask survives exec)."""
    proc = host.popen([*HOLDING_SIGNALS, *DRAIN, "--archive", str(host.archive), "--rqprc",
                       str(host.rqprc), "--interval", "0.1"])
    wait_for(lambda: "draining queue" in host.output(proc, "stderr"), timeout=20,
             message="the drain did not start")
    first, second = make_records(10), make_records(15)[10:]
    put(host, first)
    wait_for(lambda: len(list(read_archive(host.archive))) == 10, timeout=20,
             message="the first records were not drained")
    put(host, second)
    wait_for(lambda: len(list(read_archive(host.archive))) == 15, timeout=20,
             message="the later records were not drained")
    # a second drain of the queue is refused while this one runs, into the same archive or
    # into another (a trial: two drains into two directories archived 1,935 records twice),
    # exit 75, which the unit counts as success (the other one drains)
    elsewhere = host.workdir / "another-archive"
    for archive in (host.archive, elsewhere):
        other = drain(host, archive, check=False)
        assert other.returncode == 75 and f"(pid {proc.pid}" in other.stderr, other.stderr
        assert "nothing done" in other.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert "stopped" in host.output(proc, "stderr")
    assert_archived_once(host.archive, first + second)
    assert contents(host) == []
    assert not elsewhere.exists() or not list(read_archive(elsewhere))


def test_a_drain_killed_lets_go_of_the_queue(host):
    """The queue's drain lock is a semaphore with SEM_UNDO: a drain killed with -9 holds it
    no longer, and the next drain, into any archive, takes the queue."""
    proc = host.popen([*DRAIN, "--archive", str(host.archive), "--rqprc", str(host.rqprc),
                       "--interval", "0.1"])
    wait_for(lambda: "draining queue" in host.output(proc, "stderr"), timeout=20,
             message="the drain did not start")
    elsewhere = host.workdir / "another-archive"
    assert drain(host, elsewhere, check=False).returncode == 75
    proc.kill()
    proc.wait(timeout=20)
    records = make_records(5)
    put(host, records)
    assert drain(host, elsewhere).returncode == 0
    assert_archived_once(elsewhere, records)
    assert contents(host) == []


DEPTH = r"""
import sys, sysv_ipc
try:
    print(sysv_ipc.MessageQueue(int(sys.argv[1])).current_messages)
except sysv_ipc.ExistentialError:
    print(0)
"""


def test_a_real_dead_letter_from_the_sending_mca_is_archived(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)  # b has no queue 0x52510001: nobody offers it
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SCHED_COMMON": Q1})
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["lost cause"], UNSURE_MSG)
    wait_for(lambda: int(a.python(DEPTH, str(DLQ))) == 1, timeout=20,
             message="no dead letter on a")
    archive = a.workdir / "archive"
    out = drain(a, archive, "--rqprc", str(rqprc)).stdout
    assert out.startswith("drained 1 record(s) into ")
    [row] = read_archive(archive)
    assert row["reason"] == "NO_ROUTE" and row["agent"] == "sender"
    assert row["queue_key"] == Q1 and row["queue_name"] == "PROD_THE_SCHED_COMMON"
    assert row["message_type"] == "UNSURE" and row["message_key"] != f"0x{0:016x}"
    assert base64.b64decode(row["payload_b64"]) == b"lost cause"
    assert DeadLetterRecord.from_bytes(row_raw_bytes(row)).payload == b"lost cause"
    assert b.address in row["detail"]
    assert int(a.python(DEPTH, str(DLQ))) == 0


def test_spill_files_move_into_the_archive_and_nothing_else_is_touched(host):
    """Issue 12: spill files stayed for ever once their records were archived. The drain keeps
    a copy in {archive}/spill/ (where replay finds it) and removes the original; a record that
    names some other file cannot make it copy or remove that file."""
    from rqp.storage.deadletters import fit_dead_letter
    from rqp.tools.replay import replay_payload

    spill_dir = host.workdir / "state" / "spill"
    spill_dir.mkdir(parents=True)
    big = bytes(range(256)) * 40  # over msgmax: spilled
    record = fit_dead_letter(DeadLetterRecord(
        reason=ReasonCode.MESSAGE_TOO_BIG, message_type=0, agent=AgentKind.RECEIVER,
        queue_key=Q1, message_key=7, host="h", source_host="src", destination_host="dst",
        detail="big", payload=big), 8192, spill_dir)
    spill = Path(record.spill_path)
    assert spill.read_bytes() == big
    victim = host.workdir / "precious.payload"
    victim.write_bytes(b"not a spill file")
    crafted = DeadLetterRecord(
        reason=ReasonCode.MESSAGE_TOO_BIG, message_type=0, agent=AgentKind.RECEIVER,
        queue_key=Q1, message_key=8, host="h", source_host="src", destination_host="dst",
        detail="names another file", payload=b"x", spill_path=str(victim))
    left_over = spill_dir / f"dl-1-{0:016x}-{1:016x}.payload"  # archived by a drain killed
    left_over.write_bytes(b"archived earlier")                 # before removing it
    (host.archive / "spill").mkdir(parents=True)
    (host.archive / "spill" / left_over.name).write_bytes(b"archived earlier")
    unknown = spill_dir / f"dl-2-{0:016x}-{2:016x}.payload"  # not archived: kept
    unknown.write_bytes(b"someone's")
    records = [record.to_bytes(), crafted.to_bytes()]
    put(host, records)
    drain(host, host.archive)
    rows = assert_archived_once(host.archive, records)
    copy = host.archive / "spill" / spill.name
    assert copy.read_bytes() == big and not spill.exists()
    assert rows[0]["spill_path"] == str(spill)  # the record as it was
    assert replay_payload(rows[0], host.archive) == big
    assert victim.read_bytes() == b"not a spill file"
    assert not (host.archive / "spill" / victim.name).exists()
    assert not left_over.exists() and unknown.exists()


def test_lines_about_another_reader_are_rate_limited(tmp_path, caplog):
    """A trial: a second reader of the queue gave an ERROR line per record (1,099 of them).
    One line a minute, the next one counting those held back."""
    from rqp_agents.drain import Drain

    drain = Drain(tmp_path / "archive", 0x5251DEAD, host="h")
    with caplog.at_level("ERROR", logger="rqp.drain"):
        for _ in range(500):
            drain._mismatch(b"x")
        drain.other_reader.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "has another reader" in lines[0], lines
    assert lines[1].startswith("499 more lines about another reader not logged since "), lines


def test_a_drain_once_says_what_it_held_back(host):
    """Left alone a round ago: a ``--once`` run exited without the count of the lines about
    another reader it had held back (only the polling drain said it, at its stop)."""
    code = (
        "import sys\n"
        "from rqp_agents import drain\n"
        "def meets_another_reader(self, stop=None):\n"
        "    for _ in range(5):\n"
        "        self._mismatch(b'x')\n"
        "    return 0\n"
        "drain.Drain.run_until_empty = meets_another_reader\n"
        "sys.exit(drain.main(sys.argv[1:]))\n")
    done = host.run([sys.executable, "-c", code, "--rqprc", str(host.rqprc),
                     "--archive", str(host.archive), "--once"])
    lines = done.stderr.splitlines()
    assert sum("has another reader" in line for line in lines) == 1, done.stderr
    assert any("4 more lines about another reader not logged since " in line
               for line in lines), done.stderr


def test_a_marker_another_user_made_does_not_stop_the_drain(host):
    """A re-check: a drain run by root on a host that only receives made the queue's marker
    semaphore (0660, root's): every later drain as rqp then failed, exit 1, until ipcrm. It
    drains without the semaphore, saying so (the archive's lock still holds)."""
    import shutil
    import tempfile

    records = make_records(4)
    put(host, records)
    host.python(f"import sysv_ipc; q = sysv_ipc.MessageQueue({DLQ}); q.mode = 0o666\n"
                "from rqp.system.service import mark_dead_letter_queue\n"
                f"mark_dead_letter_queue({DLQ})")  # (root's: mode 0660)
    shared = Path(tempfile.mkdtemp(prefix="rqp-drain-", dir="/tmp"))
    try:
        shared.chmod(0o777)
        out = host.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *DRAIN,
                        "--once", "--archive", str(shared / "archive"), "--queue", hex(DLQ)],
                       check=False, cwd=shared, env={**os.environ, "HOME": str(shared)})
        assert out.returncode == 0, out.stderr
        assert "its marker semaphore cannot be held (" in out.stderr, out.stderr
        assert_archived_once(shared / "archive", records)
        assert contents(host) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
