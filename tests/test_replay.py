"""rqpctl dlq replay: the rules table, the replay engine, and a real replay through the sending
MCA to a receiving MCA (and to tests/fake_receiver.py, which shows the message keys)."""

from __future__ import annotations

import base64
import gzip
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rqp.config
from rqp.config import sender_config_from_mapping
from rqp.protocol.constants import SURE_MSG, UNSURE_MSG
from rqp.protocol.errors import ConfigError, RQPError
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import AgentKind, DeadLetterFlags, DeadLetterRecord
from rqp.storage.archive import (
    ArchiveWriter, DrainState, archive_files, archived_ids, read_archive, read_archive_lines,
    record_to_row,
    row_raw_bytes, row_to_record, write_drain_state,
)
from rqp.tools import ctl
from rqp.report.schema import row_problem
from rqp.tools.replay import (
    Follower, NotConfirmed, Replayer, RetryLedger, RulesFile, TokenBucket, decide, load_rules,
    replay_lock, resubmit,
    rules_from_data,
)
from tests.agents import PORT, receive, start_receiver, start_sender, write_rqprc, make_queue
from tests.testbed import wait_for

Q1, Q2, Q3, Q4 = 0x52510001, 0x52510002, 0x52510003, 0x52510004
NOW = 1_700_000_000 * 10**9
CONFIG = sender_config_from_mapping({"hosts": ["localhost"],
                                     "queues": {"PROD_THE_SCHED_COMMON": Q1,
                                                "PROD_THE_SPARE_COMMON": Q2}})


def row(reason=ReasonCode.NO_ROUTE, *, queue_key=Q1, key=0, payload=b"payload", age=0.0,
        mtype=1, host="h1", source="src1", destination="dst1:7460", flags=0, spill="",
        original_length=None, agent=AgentKind.RECEIVER, detail="") -> dict:
    record = DeadLetterRecord(
        reason=reason, queue_key=queue_key, message_key=key or (0xD00D << 32 | id(payload) % 997),
        payload=payload, timestamp_ns=NOW - int(age * 1e9), message_type=mtype,
        agent=agent, host=host, source_host=source, destination_host=destination,
        flags=flags, spill_path=spill, original_length=original_length, detail=detail)
    return record_to_row(record.to_bytes(), archived_by="drainer")


def rules_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# The rules table


@pytest.mark.parametrize("text, message", [
    ("rules:\n  - reason: NO_ROUTE\n    action: retry\n  - reasn: NO_ROUTE\n    action: keep\n",
     r"rules.yaml: rules\[1\]: unknown key 'reasn' \(did you mean 'reason'\?\); known keys: "
     r"reason, queue, .* \(line 4\)"),
    ("rules:\n  - reason: NO_ROUT\n    action: retry\n",
     r"rules.yaml: rules\[0\]: key 'reason': bad value 'NO_ROUT': expected a reason name: .*"
     r"\(did you mean 'NO_ROUTE'\?\) \(line 2\)"),
    ("rules:\n  - action: retyr\n",
     r"rules\[0\]: key 'action': bad value 'retyr': expected one of retry, forward, discard, "
     r"keep, ignore \(did you mean 'retry'\?\) \(line 2\)"),
    ("rules:\n  - reason: NO_ROUTE\n", r"rules\[0\]: key 'action' is required"),
    ("rules:\n  - action: forward\n", r"rules\[0\]: action 'forward' needs key 'to'"),
    ("rules:\n  - action: retry\n    to: 0x52510002\n",
     r"rules\[0\]: key 'to': .*only for action 'forward' or 'then: forward'"),
    ("rules:\n  - action: retry\n    retries: 0\n",
     r"rules\[0\]: key 'retries': bad value '0': expected a whole number of retries, 1 or more "
     r".*\(line 3\)"),
    ("rules:\n  - action: retry\n    retries: 2\n    interval: soon\n",
     r"rules\[0\]: key 'interval': bad value 'soon': expected a duration.*\(line 4\)"),
    ("rules:\n  - action: retry\n    retries: 2\n    then: discrad\n",
     r"rules\[0\]: key 'then': bad value 'discrad': expected what to do once the retries are "
     r"used up: keep, discard, forward \(did you mean 'discard'\?\) \(line 4\)"),
    ("rules:\n  - action: retry\n    then: discard\n",
     r"rules\[0\]: key 'then': .*give 'retries' too"),
    ("rules:\n  - action: retry\n    retries: 2\n    then: forward\n",
     r"rules\[0\]: 'then: forward' needs key 'to'"),
    ("rules:\n  - action: discard\n    retries: 2\n",
     r"rules\[0\]: key 'retries': .*only for action 'retry' \(this rule's action is 'discard'\)"),
    ("rules:\n  - action: forward\n    to: 0x52510002\n    header: maybe\n",
     r"rules\[0\]: key 'header': bad value 'maybe': expected yes .* or no .*\(line 4\)"),
    ("rules:\n  - action: keep\n    header: yes\n",
     r"rules\[0\]: key 'header': .*only for action 'forward'"),
    ("rules:\n  - action: forward\n    to: 'web-2:0x52510002'\n",
     r"rules\[0\]: key 'to': .*RQP cannot pin a host, the sending MCA sends to the first host "
     r"that offers the queue \(QUEUE_ASK\)"),
    # (a trial's rule forwarded to DEAD.LETTER.Q: the rows left the archive and waited for ever)
    ("rules:\n  - action: forward\n    to: DEAD.LETTER.Q\n",
     r"rules\[0\]: key 'to': bad value 'DEAD.LETTER.Q': expected an application's queue: "
     r"0x5251dead is DEAD.LETTER.Q of the agents, which no receiving MCA offers"),
    ("rules:\n  - action: retry\n    retries: 1\n    then: forward\n    to: 0x52510000\n",
     r"rules\[0\]: key 'to': bad value '0x52510000': .*0x52510000 is the transmission queue of "
     r"the agents"),
    ("rules:\n  - action: forward\n    to: 0x52510002\n    retires: 2\n",
     r"rules\[0\]: unknown key 'retires' \(did you mean 'retries'\?\)"),
    ("rules:\n  - action: keep\n  - older_than: soon\n    action: keep\n",
     r"rules\[1\]: key 'older_than': bad value 'soon': expected a duration.*\(line 3\)"),
    ("rules:\n  - older_than: 2h\n    newer_than: 1h\n    action: keep\n",
     r"rules\[0\]: key 'newer_than': .*no record is both older than 2h and newer than 1h"),
    ("rules:\n  - queue: PROD_THE_SCHED_COMON\n    action: retry\n",
     r"rules\[0\]: key 'queue': bad value 'PROD_THE_SCHED_COMON': expected a queue key or a queue name "
     r"defined under 'queues' \(did you mean 'PROD_THE_SCHED_COMMON'\?\)"),
    ("rules:\n  - queue: [0x52510001, 0]\n    action: retry\n",
     r"rules\[0\]: key 'queue': bad value '0'"),
    ("rules:\n  - message_type: SUER\n    action: keep\n",
     r"key 'message_type': bad value 'SUER': expected SURE, UNSURE or UNKNOWN "
     r"\(did you mean 'SURE'\?\)"),
    ("rulez: []\n", r"rules.yaml: unknown key 'rulez' \(did you mean 'rules'\?\)"),
    ("- action: keep\n", r"rules.yaml: expected a mapping with the key 'rules'"),
    ("{}\n", r"rules.yaml: key 'rules' is required"),
    ("rules: {action: keep}\n", r"rules.yaml: rules: bad value .*expected a list of rules"),
    ("rules:\n  - keep\n", r"rules\[0\]: bad value 'keep': expected a mapping with an 'action'"),
    ("rules:\n  - action: keep\n  action: retry\n", r"invalid YAML"),
])
def test_rule_errors_name_the_file_the_rule_and_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_rules(rules_file(tmp_path, text), config=CONFIG)


def test_a_queue_name_needs_an_rqprc_and_resolves_with_one(tmp_path):
    path = rules_file(tmp_path, "rules:\n  - queue: PROD_THE_SCHED_COMMON\n    action: forward\n"
                                "    to: PROD_THE_SPARE_COMMON\n")
    with pytest.raises(ConfigError, match=r"rules\[0\]: key 'queue': .*needs a \.rqprc"):
        load_rules(path)
    [rule] = load_rules(path, config=CONFIG)
    assert rule.queues == {Q1} and rule.to == Q2 and rule.action == "forward"


def test_the_first_matching_rule_wins_and_no_match_keeps(tmp_path):
    rules = load_rules(rules_file(tmp_path, """
rules:
  - reason: MALFORMED
    action: discard
  - reason: [no_route, "RETRY_*"]      # names are case-insensitive, wildcards allowed
    queue: [PROD_THE_SCHED_COMMON, 0x52510003]
    message_type: SURE
    action: retry
  - host: "web-*"                      # host, source_host or destination_host (without :port)
    action: forward
    to: 0x52510002
  - older_than: 1h
    newer_than: 1d
    action: discard
  - reason: NO_ROUTE
    action: keep
  - action: retry
"""), config=CONFIG)
    cases = [
        (record_to_row(b"junk", archived_by="x"), "discard", 0),
        (row(ReasonCode.NO_ROUTE, mtype=0), "retry", 1),
        (row(ReasonCode.RETRY_BUDGET_EXHAUSTED, mtype=0, queue_key=Q3), "retry", 1),
        (row(ReasonCode.NO_ROUTE, mtype=0, queue_key=Q4), "keep", 4),  # not rule 1: queue
        (row(ReasonCode.NO_ROUTE, mtype=1, host="WEB-7"), "forward", 2),  # not rule 1: type
        (row(ReasonCode.QUEUE_FULL, source="web-1"), "forward", 2),
        (row(ReasonCode.QUEUE_FULL, destination="web-2:7460"), "forward", 2),
        (row(ReasonCode.QUEUE_FULL, destination="[::1]:7460", age=7200), "discard", 3),
        (row(ReasonCode.QUEUE_FULL, age=90000), "retry", 5),  # older than a day
        (row(ReasonCode.NO_ROUTE, age=60), "keep", 4),
    ]
    for r, action, index in cases:
        decision = decide(rules, r, NOW)
        assert (decision.action, decision.rule.index) == (action, index), r
    assert decide(rules[:1], row(), NOW).action == "keep" and decide([], row(), NOW).rule is None


# --------------------------------------------------------------------------------------------
# The replay engine, with a fake sending path (no queues)


class FakeSend:
    """Records what would be sent; checks that the row is still archived while it is sent."""

    def __init__(self, archive: Path, fail: set[bytes] = frozenset()) -> None:
        self.archive = archive
        self.fail = fail
        self.calls: list[tuple[int, bytes, int]] = []
        self.extras: list[tuple[int, int]] = []  # (mtype, priority) of each call
        self.times: list[float] = []

    def __call__(self, queue_key: int, payload: bytes, replay_key: int, *, mtype: int,
                 priority: int) -> None:
        self.times.append(time.monotonic())
        assert self.archive_has(payload)  # never removed before it is confirmed
        if payload in self.fail:
            raise RQPError(f"cannot send {payload!r}")
        self.calls.append((queue_key, payload, replay_key))
        self.extras.append((mtype, priority))

    def archive_has(self, payload: bytes) -> bool:
        rows = (r for path in archive_files(self.archive) for r in read_archive_lines(path))
        return any(base64.b64decode(r["payload_b64"]) in (payload, payload[:4])
                   or r["reason"] != "MALFORMED" and row_raw_bytes(r) == payload  # header yes
                   for r in rows if isinstance(r, dict) and row_problem(r) is None)


def write_archive(directory: Path, *files: list[dict]) -> list[Path]:
    writer = ArchiveWriter(directory, host="drainer")
    return [writer.write(rows) for rows in files]


def payloads(directory: Path) -> list[bytes]:
    return [base64.b64decode(r["payload_b64"]) for r in read_archive(directory)]


def replay(directory: Path, text: str, send=None, **kw) -> tuple[Replayer, list[str]]:
    rules = rules_from_data(__import__("yaml").safe_load(text), config=CONFIG)
    lines: list[str] = []
    replayer = Replayer(directory, rules, send=send, out=lines.append, config=CONFIG,
                        now_ns=NOW, **kw)
    replayer.run()
    return replayer, lines


RULES = """
rules:
  - reason: NO_ROUTE
    action: retry
  - reason: QUEUE_FULL
    action: forward
    to: PROD_THE_SPARE_COMMON
  - reason: UNKNOWN_QUEUE
    action: discard
"""


def test_rows_leave_the_archive_only_when_confirmed_or_discarded(tmp_path):
    archive = tmp_path / "archive"
    spill = tmp_path / "full.payload"
    spill.write_bytes(b"longer payload, spilled")
    f1, f2, f3 = write_archive(
        archive,
        [row(key=0x11, payload=b"retry me"), row(ReasonCode.UNKNOWN_QUEUE, payload=b"drop"),
         row(ReasonCode.NOT_AUTHORIZED, payload=b"keep me"),
         row(key=0x22, payload=b"send fails")],
        [row(ReasonCode.UNKNOWN_QUEUE, payload=b"drop too")],
        [row(ReasonCode.QUEUE_FULL, queue_key=Q4, key=0x33, payload=b"forward me"),
         row(key=0x44, payload=b"head", flags=DeadLetterFlags.HEADER_ONLY),
         row(key=0x55, payload=b"long", flags=DeadLetterFlags.TRUNCATED, spill=str(spill),
             original_length=23),
         row(key=0x66, payload=b"lost", flags=DeadLetterFlags.TRUNCATED,
             spill=str(tmp_path / "missing.payload"), original_length=99),
         record_to_row(b"not a record", archived_by="drainer")],
    )
    send = FakeSend(archive, fail={b"send fails"})
    replayer, lines = replay(archive, RULES + "  - reason: MALFORMED\n    action: retry\n", send)
    assert send.calls == [(Q1, b"retry me", 0x11), (Q2, b"forward me", 0x33),
                          (Q1, b"longer payload, spilled", 0x55)]
    assert dict(replayer.counts) == {"replayed": 2, "forwarded": 1, "discarded": 2, "kept": 1,
                                     "failed": 4}
    assert replayer.summary() == "replayed 2, forwarded 1, discarded 2, kept 1, failed 4"
    assert archive_files(archive) == [f1, f3]  # f2 had nothing left
    assert payloads(archive) == [b"keep me", b"send fails", b"head", b"lost", b"not a record"]
    failures = [line for line in lines if line.startswith("failed")]
    assert "cannot send b'send fails'" in failures[0]
    assert "header only: the payload was never read" in failures[1]
    assert f"spill file {tmp_path / 'missing.payload'} cannot be read here" in failures[2]
    assert "MALFORMED record holds no message" in failures[3]
    assert any(line.startswith("forwarded") and "-> 0x52510002 (PROD_THE_SPARE_COMMON)" in line
               for line in lines)
    assert list((archive / ".incoming").iterdir()) == []


@pytest.mark.parametrize("follow", [False, True])
def test_a_row_that_is_no_archive_line_fails_alone_and_the_others_go_on(tmp_path, follow):
    """A trial: a row with "queue_key": "0x52510009" (a string), or "reason": null, stopped
    rqpctl dlq replay with a traceback, --follow (the rqp-dlq-handler service) too, and
    every good row after it was never handled."""
    archive = tmp_path / "archive"
    good = row(key=0x71, payload=b"good one")
    bad = [dict(row(key=0x72), queue_key="0x52510009"), dict(row(key=0x73), reason=None),
           {"schema": 2, "id": "x"}, dict(row(key=0x74), id=["not", "an", "id"]),
           dict(row(key=0x75), attempts=True), dict(row(key=0x76), schema=9),
           {k: v for k, v in row(key=0x77).items() if k not in ("payload_b64", "mtype")},
           dict(row(key=0x78), mtype=2**64), dict(row(key=0x79), mtype=0),
           dict(row(key=0x7A), priority=10), dict(row(key=0x7B), message_key="0xZZ"),
           dict(row(key=0x7C), message_key="0x100000000000000000000")]
    write_archive(archive, bad, [good])
    send = FakeSend(archive)
    rules = rules_from_data({"rules": [{"action": "retry"}]})
    lines: list[str] = []
    replayer = Replayer(archive, rules, send=send, out=lines.append, config=CONFIG,
                        now_ns=NOW, follow=follow)
    with replayer.locked():
        replayer.run_round()
        if follow:  # the next round says nothing new of the rows it failed
            replayer.run_round()
    assert send.calls == [(Q1, b"good one", 0x71)]
    failed = [line for line in lines if line.startswith("failed")]
    assert len(failed) == 12, lines
    for line, why in zip(failed, ["queue_key '0x52510009' is not a number", "no reason",
                                  "no reason, queue_key, message_key, message_type, "
                                  "payload_b64, record_version, mtype, priority, expires_at_ms",
                                  "id ['not', 'an', 'id'] is not a string",
                                  "attempts True is not a number",
                                  "schema 9: this rqp reads archive schemas 1, 2 (a newer one "
                                  "wrote it?)", "no payload_b64, mtype",
                                  f"mtype {2**64} is out of range (1..{2**63 - 1})",
                                  f"mtype 0 is out of range (1..{2**63 - 1})",
                                  "priority 10 is out of range (0..9)",
                                  "message_key '0xZZ' is not 0x and 1 to 16 hex digits",
                                  "message_key '0x100000000000000000000' is not 0x and 1 to 16 "
                                  "hex digits"]):
        assert f"is no dead-letter archive line: {why}; kept in the archive" in line, line
    assert "line 1 " in failed[0] and "line 12 " in failed[11]
    assert len(list(read_archive(archive))) == 12  # the bad rows stay, the good one is gone
    assert RetryLedger(archive).entries.keys() == {"0x0000000000000071"}  # (none charged)


def test_a_line_that_is_no_json_object_fails_alone_and_stays_as_it_was(tmp_path):
    """A trial: one line '[1,2,3]' (or '{not json', 'null') in a file and replay failed the
    whole file: the good rows before and after it were never handled."""
    archive = tmp_path / "archive"
    [path] = write_archive(archive, [row(key=0x91, payload=b"before"),
                                     row(key=0x92, payload=b"after")])
    good = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    bad = [b"[1,2,3]\n", b"{not json\n", b"null\n",
           b'{"schema": 2, "id": "x", "id": "y", "priority": 1e400}\n']  # (kept as written)
    # (a row with a key given twice, mtype 99 after its own: it was put with 99, a trial)
    twice = good[1].rstrip(b"}\n") + b',"mtype":99}\n'
    bad.append(twice)
    bad.append(b'{"a":' * 200_000 + b"\n")  # (nested too deeply: a re-check's traceback)
    path.write_bytes(gzip.compress(good[0] + b"".join(bad) + good[1]))
    send = FakeSend(archive)
    lines: list[str] = []
    replayer = Replayer(archive, rules_from_data({"rules": [{"action": "retry"}]}), send=send,
                        out=lines.append, config=CONFIG, now_ns=NOW, follow=True)
    with replayer.locked():
        replayer.run_round()
        replayer.run_round()  # (the file rewritten: the same lines, at other numbers)
    assert send.calls == [(Q1, b"before", 0x91), (Q1, b"after", 0x92)]
    failed = [line for line in lines if line.startswith("failed")]
    assert [f.split(": line ")[1].split(" is no")[0] for f in failed] == ["2", "3", "4",
                                                                          "5", "6", "7"], lines
    assert "line 2 is no dead-letter archive line: not a JSON object; kept" in failed[0]
    assert "line 3 is no dead-letter archive line: not JSON: " in failed[1]
    assert "line 6 is no dead-letter archive line: not JSON: the key 'mtype' is given " \
        "twice" in failed[4]
    assert "line 7 is no dead-letter archive line: nested too deeply" in failed[5]
    assert gzip.decompress(path.read_bytes()) == b"".join(bad)  # kept, byte for byte
    assert dict(replayer.counts) == {"failed": 6}  # (the second round's)


def test_dlq_list_shows_the_readable_files_beside_one_that_is_not(tmp_path, capsys):
    """A trial: one file that is not gzip in the archive and rqpctl dlq list printed nothing
    but the error, where replay skips that file and goes on."""
    archive = tmp_path / "archive"
    [path] = write_archive(archive, [row(key=0x81, payload=b"listed"),
                                     row(key=0x82, payload=b"listed too")])
    first, second = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    path.write_bytes(gzip.compress(first + b"[1,2,3]\n" + second))  # (and one bad line)
    (archive / "dlq-broken-20260101T000000.000000Z-1-000001.jsonl.gz").write_bytes(b"no gzip")
    assert ctl.main(["dlq", "list", "--archive", str(archive)]) == 1
    out, err = capsys.readouterr()
    assert "listed too" in out and "2 archive row(s) in 1 file(s)" in out, out
    assert "dlq-broken-" in err and "(its rows are not listed)" in err, err
    assert f"{path}: line 2: not a JSON object (not listed)" in err, err
    # a file of many lines it cannot list: three named, the rest counted (a re-check: one
    # error line per line of a file of schema 3)
    many = archive / "dlq-many-20260101T000000.000000Z-1-000002.jsonl.gz"
    many.write_bytes(gzip.compress(b"[1]\n" * 50))
    assert ctl.main(["dlq", "list", "--archive", str(archive)]) == 1
    err = capsys.readouterr().err
    assert err.count(f"{many}: line ") == 3 and \
        f"{many}: 47 more line(s) not listed, as those above" in err, err
    many.unlink()
    # show finds a row beside them (a trial: one bad line anywhere disabled show and resubmit)
    [listed] = [line for line in out.splitlines() if "listed too" in line]
    assert ctl.main(["dlq", "show", listed.split()[0], "--archive", str(archive)]) == 0
    assert "listed too" in capsys.readouterr().out
    assert ctl.main(["dlq", "show", "abcdef1234", "--archive", str(archive)]) == 1
    assert "no dead letter with id abcdef1234 in " in capsys.readouterr().err
    # a row that is no archive line is shown, and said so (a trial's 0xZZ key: a traceback)
    [written] = write_archive(archive, [dict(row(key=0x83, payload=b"bad key"),
                                              message_key="0xZZ")])
    [bad] = list(read_archive(written))
    assert ctl.main(["dlq", "show", bad["id"], "--archive", str(archive)]) == 0
    assert "NOT PUT BACK       no dead-letter archive line: message_key '0xZZ' is not 0x and " \
        "1 to 16 hex digits" in capsys.readouterr().out
    # and list names it, as replay and the report would (a trial: listed as any other)
    assert ctl.main(["dlq", "list", "--archive", str(archive)]) == 1
    out, err = capsys.readouterr()
    assert "bad key" not in out and f"{written}: line 1: no dead-letter archive line: " \
        "message_key '0xZZ'" in err, err


def test_dry_run_prints_every_record_and_changes_nothing(tmp_path):
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=0x11), row(ReasonCode.QUEUE_FULL),
                            row(ReasonCode.UNKNOWN_QUEUE), row(ReasonCode.NOT_AUTHORIZED),
                            row(flags=DeadLetterFlags.HEADER_ONLY)])
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in archive.rglob("*")
              if p.is_file()}
    rules = rules_file(tmp_path, RULES)
    rqprc = tmp_path / "rqprc"
    rqprc.write_text("hosts: [localhost]\nqueues: {PROD_THE_SPARE_COMMON: 0x52510002}\n")
    out = subprocess.run([sys.executable, "-m", "rqp.tools.ctl", "dlq", "replay", "--archive",
                          str(archive), "--rules", str(rules), "--rqprc", str(rqprc),
                          "--dry-run"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr  # (the header-only row would fail: as the run)
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:5]] == [
        ["would", "retry"], ["would", "forward"], ["would", "discard"], ["would", "keep"],
        ["would", "fail"]]
    assert lines[5] == ("dry run, nothing changed: would have replayed 1, forwarded 1, "
                        "discarded 1, kept 1, failed 1")
    shorter = subprocess.run([*out.args, "--limit", "3"], capture_output=True, text=True,
                             timeout=60)  # (up to the row that would fail: 0)
    assert shorter.returncode == 0 and "failed 0" in shorter.stdout, shorter.stdout
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in archive.rglob("*")
             if p.is_file()}
    assert after == before and not (archive / ".state").exists()


def test_retry_without_an_rqprc_is_refused_before_anything_is_touched(tmp_path, monkeypatch,
                                                                       capsys):
    archive = tmp_path / "archive"
    write_archive(archive, [row()])
    rules = rules_file(tmp_path, "rules:\n  - reason: NO_ROUTE\n    action: retry\n")
    monkeypatch.setattr(rqp.config, "SYSTEM_RQPRC", tmp_path / "no-system-rqprc")
    monkeypatch.delenv("RQPRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in archive.rglob("*"))
    assert ctl.main(["dlq", "replay", "--archive", str(archive), "--rules", str(rules)]) == 2
    assert "retry and forward put messages on the transmission queue of a .rqprc: give " \
        "--rqprc" in capsys.readouterr().err
    assert sorted(p.name for p in archive.rglob("*")) == before


def test_a_host_that_only_receives_may_discard_and_keep_but_not_send(tmp_path, capsys):
    """A trial: the handler failed on a host that only receives, its .rqprc still the
    installed template. Rules that do not send run; retry and forward say why they cannot."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x91, payload=b"gone")])
    template = tmp_path / "rqprc"
    template.write_text('rqp_template: "delete this line once the file is filled in"\n')
    discard = rules_file(tmp_path, "rules:\n  - reason: QUEUE_FULL\n    action: discard\n")
    base = ["dlq", "replay", "--archive", str(archive), "--rqprc", str(template)]
    assert ctl.main([*base, "--rules", str(discard)]) == 0
    assert "discarded 1" in capsys.readouterr().out and not list(read_archive(archive))
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x92, payload=b"kept")])
    retry = rules_file(tmp_path, "rules:\n  - reason: QUEUE_FULL\n    action: retry\n")
    assert ctl.main([*base, "--rules", str(retry)]) == 2
    err = capsys.readouterr().err
    assert "retry and forward put messages on the transmission queue of a .rqprc: " \
        f"{template}: this is the template scripts/install put here" in err, err
    assert [r["message_key"] for r in read_archive(archive)] == ["0x0000000000000092"]


def test_the_handlers_drain_looks_at_the_queue_the_drain_empties(tmp_path, monkeypatch):
    """A review: with no .rqprc, replay --drain watched 0x5251DEAD while the rqp-dlq-drain it
    starts drained the receiving MCA's dead_letter_queue (a host that only receives)."""
    receiver = tmp_path / "receiver.yaml"
    receiver.write_text("dead_letter_queue: 0x5251dea0\n")
    monkeypatch.setattr(rqp.config, "SYSTEM_RQPRC", tmp_path / "no-system-rqprc")
    monkeypatch.setattr(rqp.config, "SYSTEM_RECEIVER_CONFIG", receiver)
    monkeypatch.delenv("RQPRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    drain = ctl._Drain(tmp_path / "archive", None)
    assert drain.queue == 0x5251DEA0
    assert drain.argv[-2:] == ["--receiver-config", str(receiver)]
    receiver.unlink()  # neither: the defaults, for both
    drain = ctl._Drain(tmp_path / "archive", None)
    assert drain.queue == 0x5251DEAD and drain.argv[-1] == str(tmp_path / "archive")


def test_bad_command_lines_name_what_is_wrong(tmp_path, capsys):
    archive = tmp_path / "archive"
    write_archive(archive, [row()])
    rules = rules_file(tmp_path, "rules:\n  - action: discard\n")
    base = ["dlq", "replay", "--archive", str(archive), "--rules", str(rules)]
    assert ctl.main([*base, "--poll", "1"]) == 2
    assert "rqpctl: --poll is for --follow" in capsys.readouterr().err
    assert ctl.main(["dlq", "show", "abcdef", "--archive", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such directory (--archive)" in capsys.readouterr().err
    assert ctl.main(["dlq", "list", "--archive", str(rules)]) == 2  # (a file: a re-check's
    assert "rules.yaml: is not a directory (--archive)" in capsys.readouterr().err  # said none)
    with pytest.raises(SystemExit):
        ctl.main([*base, "--follow", "--poll", "0"])
    assert "--poll: expected a number of seconds > 0, got '0'" in capsys.readouterr().err
    rqprc = Path(__file__).resolve().parent.parent / "config" / "rqprc.minimal.yaml"
    assert ctl.main(["dlq", "resubmit", "abcdef", "--archive", str(archive), "--rqprc",
                     str(rqprc), "--to", "otherhost:7460"]) == 2
    assert "--to otherhost:7460: expected a queue (key or .rqprc name): RQP cannot pin a " \
        "host" in capsys.readouterr().err
    assert ctl.main(["dlq", "resubmit", "abcdef", "--archive", str(archive), "--rqprc",
                     str(rqprc), "--to", "RQP.XMIT.Q"]) == 2
    assert "--to RQP.XMIT.Q: 0x52510000 is the transmission queue of the agents, not a " \
        "destination" in capsys.readouterr().err


def test_duplicates_held_batches_and_the_limit(tmp_path):
    archive = tmp_path / "archive"
    same = row(key=0x11, payload=b"twice")
    f1, f2, f3 = write_archive(archive, [same], [same, row(ReasonCode.UNKNOWN_QUEUE)],
                               [row(key=0x22, payload=b"not yet taken off")])
    # the drain wrote f3 and was stopped before taking its records off DEAD.LETTER.Q
    write_drain_state(archive, "drainer", DrainState((f3.name,), 0x5251DEAD, False))
    send = FakeSend(archive)
    replayer, lines = replay(archive, RULES, send)
    assert send.calls == [(Q1, b"twice", 0x11)]  # a duplicate is sent once
    assert replayer.counts["discarded"] == 2 and replayer.counts["kept"] == 1
    assert any("a duplicate of a row already handled" in line for line in lines)
    assert any("run rqp-dlq-drain first" in line for line in lines)
    assert archive_files(archive) == [f3]
    write_drain_state(archive, "drainer", DrainState((f3.name,), 0x5251DEAD, True))
    write_archive(archive, *[[row(ReasonCode.UNKNOWN_QUEUE, payload=bytes([i]))]
                             for i in range(5)])
    replayer, _ = replay(archive, RULES, FakeSend(archive), limit=3)
    assert replayer.acted == 3 and "stopped at --limit 3" in replayer.summary()
    assert len(archive_files(archive)) == 3


def test_a_dead_letter_for_an_agents_queue_is_not_put_back_there(tmp_path):
    """A record a program put for DEAD.LETTER.Q with its own msgsnd (the API refuses it) is
    dead-lettered NO_ROUTE: retried, it would leave the archive and wait for ever, as a trial's
    forward did. Retry (dry run too) and resubmit refuse it; forwarding it elsewhere goes."""
    archive = tmp_path / "archive"
    stray = row(ReasonCode.NO_ROUTE, queue_key=0x5251DEAD, key=0x61, payload=b"stray",
                mtype=SURE_MSG, agent=AgentKind.SENDER)
    write_archive(archive, [stray])
    rules = rules_from_data({"rules": [{"reason": "NO_ROUTE", "action": "retry"}]},
                            config=CONFIG)
    for dry_run in (True, False):
        send, lines = FakeSend(archive), []
        Replayer(archive, rules, send=send, out=lines.append, config=CONFIG, now_ns=NOW,
                 dry_run=dry_run).run()
        assert send.calls == []
        [said] = [line for line in lines if "of the agents" in line]
        assert said.startswith("would fail" if dry_run else "failed"), said
        assert "queue 0x5251dead is DEAD.LETTER.Q of the agents, not a destination" in said
    assert list(read_archive(archive)) == [stray]  # kept
    lines, calls = [], []
    assert resubmit(archive, [stray["id"]], lambda *a, **k: calls.append(a), config=CONFIG,
                    out=lines.append) == {"failed": 1}
    assert not calls and "DEAD.LETTER.Q of the agents" in lines[0]
    assert resubmit(archive, [stray["id"]], lambda *a, **k: calls.append(a), to=Q2,
                    config=CONFIG, out=lines.append) == {"resubmitted": 1}
    assert [queue for queue, *_ in calls] == [Q2]


def test_a_broadcast_copy_is_not_put_back_on_its_broadcast_queue(tmp_path):
    """A trial: the dead letter of host B's copy, retried, went to every host of the broadcast
    name with new keys; host A, which had its own copy, put it a second time, and B, back in
    .rqprc, too. RQP cannot pin a host: retry and resubmit refuse it (dry run too), saying
    what to do; forwarding it to an ordinary queue is the operator's choice, and goes."""
    qb = 0x52510AAA
    config = sender_config_from_mapping({"hosts": ["localhost"],
                                         "queues": {"PROD_THE_SCHED_COMMON": Q1,
                                                    "PROD_ALL_T19": qb}})
    archive = tmp_path / "archive"
    copy = row(ReasonCode.NO_ROUTE, queue_key=qb, key=0x51, payload=b"copy", mtype=SURE_MSG,
               agent=AgentKind.SENDER, destination="hostb:7460")
    plain = row(ReasonCode.NO_ROUTE, key=0x52, payload=b"plain", mtype=SURE_MSG,
                agent=AgentKind.SENDER)
    write_archive(archive, [copy, plain])
    rules = rules_from_data({"rules": [{"reason": "NO_ROUTE", "action": "retry"}]},
                            config=config)
    for dry_run in (True, False):
        send, lines = FakeSend(archive), []
        replayer = Replayer(archive, rules, send=send, out=lines.append, config=config,
                            now_ns=NOW, dry_run=dry_run)
        replayer.run()
        assert [payload for _, payload, _ in send.calls] == ([] if dry_run else [b"plain"])
        [said] = [line for line in lines if "copy for hostb:7460" in line]
        assert said.startswith("would fail" if dry_run else "failed"), said
        assert "broadcast queue 0x52510aaa" in said.lower() and "look on hostb:7460" in said
    assert list(read_archive(archive)) == [copy]  # kept
    # a .rqprc without the broadcast name (a trial's): the sending MCA's detail says it;
    # the message that reached no host (no destination host) goes to every host, as it should
    said_copy = row(ReasonCode.NO_ROUTE, queue_key=qb, key=0x53, payload=b"said", mtype=SURE_MSG,
                    agent=AgentKind.SENDER, destination="hostb:7460",
                    detail=f"copy of broadcast queue {qb:#x} for host hostb:7460, no longer in "
                    ".rqprc")
    whole = row(ReasonCode.NO_ROUTE, queue_key=qb, key=0x54, payload=b"whole", mtype=SURE_MSG,
                agent=AgentKind.SENDER, destination="")
    other = tmp_path / "other"
    write_archive(other, [said_copy, whole])
    send = FakeSend(other)
    Replayer(other, rules_from_data({"rules": [{"reason": "NO_ROUTE", "action": "retry"}]},
                                    config=CONFIG), send=send, out=print, config=CONFIG,
             now_ns=NOW).run()
    assert [payload for _, payload, _ in send.calls] == [b"whole"]
    assert [r["message_key"] for r in read_archive(other)] == [said_copy["message_key"]]
    lines, calls = [], []
    counts = resubmit(archive, [copy["id"]], lambda *a, **k: calls.append(a), config=config,
                      out=lines.append)
    assert counts == {"failed": 1} and not calls and "copy for hostb:7460" in lines[0]
    counts = resubmit(archive, [copy["id"]], lambda *a, **k: calls.append(a), to=Q2,
                      config=config, out=lines.append)
    assert counts == {"resubmitted": 1} and calls == [(Q2, b"copy", 0x51)]


def test_resubmit_leaves_rows_of_an_unfinished_drain_batch(tmp_path):
    archive = tmp_path / "archive"
    [path] = write_archive(archive, [row(key=0x71, payload=b"not yet taken off"),
                                     row(key=0x72, payload=b"edit me")])
    ids = [r["id"] for r in read_archive(archive)]
    write_drain_state(archive, "drainer", DrainState((path.name,), 0x5251DEAD, False))
    calls, lines = [], []

    def send(queue_key, payload, replay_key, *, mtype, priority):
        assert len(list(read_archive(archive))) == 2  # the rows leave once all are confirmed
        calls.append((queue_key, payload, replay_key))

    counts = resubmit(archive, [ids[0]], send, out=lines.append)
    assert counts == {"failed": 1} and not calls and "run rqp-dlq-drain first" in lines[0]
    write_drain_state(archive, "drainer", DrainState((path.name,), 0x5251DEAD, True))
    counts = resubmit(archive, [ids[0][:6], ids[0], ids[1]], send, to=Q3, out=lines.append,
                      edit=lambda r, p: p.replace(b"edit", b"edited"))
    assert counts == {"resubmitted": 2} and calls == [
        (Q3, b"not yet taken off".replace(b"edit", b"edited"), 0x71),
        (Q3, b"edited me", 0x72)]  # once each, with their keys
    assert not archive_files(archive)


def test_resubmit_refuses_a_row_replay_refuses_and_keeps_the_files_bad_lines(tmp_path):
    """A trial: resubmit sent a row with priority 10 (replay refuses it), and a bad line
    anywhere in the archive stopped it for every id."""
    archive = tmp_path / "archive"
    [path] = write_archive(archive, [dict(row(key=0x61, payload=b"edited"), priority=10),
                                     row(key=0x62, payload=b"fine")])
    first, second = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    path.write_bytes(gzip.compress(first + b"{not json\n" + second))
    ids = [r["id"] for r in read_archive_lines(path) if isinstance(r, dict)]
    calls, lines = [], []
    counts = resubmit(archive, ids, lambda *a, **k: calls.append(a[:3]), out=lines.append)
    assert counts == {"failed": 1, "resubmitted": 1} and calls == [(Q1, b"fine", 0x62)]
    assert f"{path}: line 1 is no dead-letter archive line: priority 10 is out of range " \
        "(0..9)" in lines[0], lines
    assert gzip.decompress(path.read_bytes()) == first + b"{not json\n"  # (kept as they were)


def test_the_rate_limit_is_a_lower_bound_on_the_time(tmp_path):
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=i + 1, payload=bytes([i])) for i in range(6)])
    send = FakeSend(archive)
    replayer, _ = replay(archive, RULES, send, rate=20.0)
    assert replayer.counts["replayed"] == 6
    assert send.times[-1] - send.times[0] >= 5 / 20.0


def test_token_bucket_spaces_takes_by_the_rate():
    now = [100.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(4.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(9):
        bucket.take()
    assert now[0] - 100.0 == pytest.approx(8 / 4.0)
    now[0] += 10  # idle for a while: still at most one at once (burst 1)
    bucket.take()
    bucket.take()
    assert slept[-1] == pytest.approx(0.25)


HANDLER_RULES = """
rules:
  - reason: NO_ROUTE
    queue: PROD_THE_SCHED_COMMON
    action: retry
    retries: 2
    interval: 30s
  - reason: NO_ROUTE
    action: retry
    retries: 1
    interval: 10s
    then: forward
    to: PROD_THE_SPARE_COMMON
    header: yes
  - reason: QUEUE_FULL
    action: forward
    to: 0x52510002
    header: no
  - reason: UNKNOWN_QUEUE
    action: discard
  - reason: NOT_AUTHORIZED
    action: ignore
"""


def test_retries_are_counted_and_spaced_per_message_across_restarts(tmp_path):
    """RETRY(2) RETRYINT(30): each replay run is a new Replayer (a restart); the ledger in
    .state/ keeps the count and the time. A retried message dead-lettered again comes back as
    a NEW row with the same key: it is counted with the first."""
    archive = tmp_path / "archive"
    rules = rules_from_data(__import__("yaml").safe_load(HANDLER_RULES), config=CONFIG)

    def run(at: float, send=None):
        lines: list[str] = []
        replayer = Replayer(archive, rules, send=send or FakeSend(archive), out=lines.append,
                            config=CONFIG, now_ns=NOW + int(at * 1e9))
        replayer.run()
        return replayer, lines

    write_archive(archive, [row(key=0x11, payload=b"again and again")])
    send = FakeSend(archive)
    replayer, lines = run(0, send)
    assert send.calls == [(Q1, b"again and again", 0x11)] and not archive_files(archive)
    assert lines[0].startswith("replayed") and lines[0].endswith("[rules[0]]: retry 1 of 2")
    ledger = RetryLedger(archive, writable=False)
    assert ledger.entries["0x0000000000000011"].retries == 1

    def dead_lettered_again(age: float) -> None:  # what the drain archives when it comes back
        write_archive(archive, [row(ReasonCode.NO_ROUTE, key=0x11, payload=b"again and again",
                                    age=-age)])

    dead_lettered_again(5)
    replayer, lines = run(10)  # 10 s after the first retry: not yet
    assert replayer.counts["kept"] == 1 and replayer.next_due_ns == NOW + 30 * 10**9
    assert lines == [line for line in lines if line.startswith("waiting")] and \
        "retry 2 of 2 not before 2023-11-14T22:13:50" in lines[0] and "(interval 30s)" in lines[0]
    send = FakeSend(archive)
    replayer, lines = run(30, send)  # the interval has passed
    assert send.calls == [(Q1, b"again and again", 0x11)] and lines[0].endswith("retry 2 of 2")
    dead_lettered_again(35)
    replayer, lines = run(3600)  # used up: kept, and said why
    assert replayer.counts["kept"] == 1 and not replayer.counts["replayed"]
    assert lines[0].startswith("kept") and "its retries are used up (2 of 2, the last at " \
        "2023-11-14T22:13:50" in lines[0]
    assert len(list(read_archive(archive))) == 1


class Killed(BaseException):
    """A kill -9 between a confirmation and the rewrite that takes its row out."""


@pytest.mark.parametrize("rules_text", [
    "rules:\n  - reason: NO_ROUTE\n    action: retry\n    retries: 1\n    then: forward\n"
    "    to: PROD_THE_SPARE_COMMON\n",
    "rules:\n  - reason: NO_ROUTE\n    action: retry\n    interval: 60s\n",
], ids=["retries-then-forward", "interval"])
def test_a_row_put_back_by_a_run_killed_before_the_rewrite_is_sent_again_uncounted(
        tmp_path, rules_text):
    """A trial: a replay killed after its messages were confirmed left their rows in the
    archive, counted as retried: the next run gave them their 'then:' (keep; forward would
    have sent a delivered message elsewhere) or a wait for the interval. The README says they
    are sent again with their key (recognised where they arrived): now they are, at once,
    counting no second retry."""
    archive = tmp_path / "archive"
    rules = rules_from_data(__import__("yaml").safe_load(rules_text), config=CONFIG)
    write_archive(archive, [row(key=0x71, payload=b"confirmed, then killed")])

    class KilledAfterSend(FakeSend):
        def __call__(self, *args, **kwargs):
            super().__call__(*args, **kwargs)
            raise Killed()
    first = KilledAfterSend(archive)
    with pytest.raises(Killed):
        Replayer(archive, rules, send=first, config=CONFIG, now_ns=NOW, out=lambda _: None).run()
    assert first.calls == [(Q1, b"confirmed, then killed", 0x71)]
    assert len(list(read_archive(archive))) == 1  # (the row is still there)
    lines: list[str] = []
    again = FakeSend(archive)
    replayer = Replayer(archive, rules, send=again, config=CONFIG, now_ns=NOW + 10**9,
                        out=lines.append)
    replayer.run()
    assert again.calls == [(Q1, b"confirmed, then killed", 0x71)], lines  # its queue, its key
    assert dict(replayer.counts) == {"replayed": 1} and not archive_files(archive)
    assert "again: put back at 2023-11-14T22:13:20" in lines[0], lines
    assert RetryLedger(archive, writable=False).entries["0x0000000000000071"].retries == 1


def test_the_ledger_survives_a_cut_line_and_compacts_itself(tmp_path, monkeypatch):
    archive = tmp_path / "archive"
    one, two = row(key=0x41), row(key=0x42)
    ledger = RetryLedger(archive)
    ledger.note(one, NOW, retry=True)
    ledger.note(two, NOW, retry=False)
    path = archive / ".state" / RetryLedger.NAME
    with open(path, "ab") as f:  # a crash in the middle of the next line
        f.write(b'{"message":"0x0000000000000041","retries":2,"la')
    ledger = RetryLedger(archive)
    assert (ledger.get(one).retries, ledger.get(one).last_ns) == (1, NOW)
    assert (ledger.get(two).resent, ledger.get(two).retries) == (1, 0)
    ledger.note(one, NOW + 5, retry=True)
    assert RetryLedger(archive).get(one).retries == 2  # appended after the cut line
    monkeypatch.setattr(RetryLedger, "SLACK", 1)
    for i in range(3):
        ledger.note(two, NOW + i, retry=True)
    assert len(path.read_bytes().splitlines()) == 7
    old = row(key=0x43)
    ledger.note(old, NOW - (RetryLedger.KEEP_DAYS + 1) * 86400 * 10**9, retry=True)
    ledger = RetryLedger(archive, now_ns=NOW)  # 8 lines > 2 x 3 entries + 1: compacted
    assert len(path.read_bytes().splitlines()) == 2  # one line each; the old entry dropped
    assert (ledger.get(one).retries, ledger.get(two).retries, ledger.get(old).retries) == \
        (2, 3, 0)
    assert RetryLedger(archive, writable=False).entries == ledger.entries
    assert (ledger.unreadable, ledger.cut_short) == (0, 1)  # (as read, before it compacted)


@pytest.mark.parametrize("follow", [False, True])
def test_ledger_lines_that_cannot_be_read_are_said_once(tmp_path, follow):
    """A trial: garbage lines in the replay ledger were skipped without a word, and with
    them the retries they counted (a message could be retried more than its rule says)."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.NOT_AUTHORIZED, key=0x51)])
    RetryLedger(archive).note(row(key=0x52), NOW, retry=True)
    path = archive / ".state" / RetryLedger.NAME
    with open(path, "ab") as f:
        f.write(b'{"message":"0x0000000000000053","retries":1,"la\n')  # a crash's: said apart
        f.write(b'garbage\n[1]\n{"message":"0x54","retries":1e400}\n')  # (1e400: a trial's
        # stopped every run, OverflowError; -3: gave a rule of 2 five retries)
        f.write(b'{"message":"0x0000000000000052","retries":-3,"last_ns":0}\n')
        # (a re-check's: a line of no count set 3 retries back to 0; true read as 1)
        f.write(b'{"message":"0x0000000000000052"}\n{"message":"0x52","retries":true}\n')
        f.write(b'{"message":"0x0000000000000052","retries":1,"retries":0}\n')  # (read as 0)
        f.write(b'{"message":"0x52","row":' + b"[" * 200_000 + b'}\n')  # (a traceback)
    assert RetryLedger(archive).get(row(key=0x52)).retries == 1  # the good line's count
    lines: list[str] = []
    replayer = Replayer(archive, [], out=lines.append, config=CONFIG, now_ns=NOW,
                        follow=follow)
    with replayer.locked():
        for _ in range(2 if follow else 1):
            replayer.run_round()
    assert [line for line in lines if line.startswith("warning")] == [
        f"warning        {path}: 8 line(s) cannot be read: the retries and forwards they "
        "counted are not counted",
        f"warning        {path}: 1 line(s) cut short, as by a replay killed while it wrote "
        "one (its message was not put back then): not counted"]


def test_used_up_retries_then_forward_the_dead_letter_itself(tmp_path):
    archive = tmp_path / "archive"
    rules = rules_from_data(__import__("yaml").safe_load(HANDLER_RULES), config=CONFIG)
    first = row(queue_key=Q3, key=0x21, payload=b"nobody offers Q3")
    write_archive(archive, [first])
    send = FakeSend(archive)
    Replayer(archive, rules, send=send, out=print, config=CONFIG, now_ns=NOW).run()
    back = row(ReasonCode.NO_ROUTE, queue_key=Q3, key=0x21, payload=b"nobody offers Q3",
               age=-20)
    write_archive(archive, [back])
    lines: list[str] = []
    Replayer(archive, rules, send=send, out=lines.append, config=CONFIG,
             now_ns=NOW + 20 * 10**9).run()
    assert [c[0] for c in send.calls] == [Q3, Q2]
    queue_key, payload, replay_key = send.calls[1]
    assert replay_key == 0  # a new message: the dead letter, not the message
    assert DeadLetterRecord.from_bytes(payload) == row_to_record(back)
    assert send.extras[1] == (1, 4)
    assert lines[0].startswith("forwarded") and "-> 0x52510002 (PROD_THE_SPARE_COMMON)" in \
        lines[0] and "its retries are used up (1 of 1" in lines[0]
    assert not archive_files(archive)


def test_forward_header_no_discard_and_ignore(tmp_path):
    archive = tmp_path / "archive"
    rules = rules_from_data(__import__("yaml").safe_load(HANDLER_RULES), config=CONFIG)
    assert [r.action for r in rules] == ["retry", "retry", "forward", "discard", "keep"]
    ignored = row(ReasonCode.NOT_AUTHORIZED, payload=b"ignored")
    junk = record_to_row(b"junk", archived_by="d")
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x31, payload=b"the payload"),
                            row(ReasonCode.UNKNOWN_QUEUE, payload=b"dropped"), ignored, junk])
    send = FakeSend(archive)
    lines: list[str] = []
    replayer = Replayer(archive, rules, send=send, out=lines.append, config=CONFIG, now_ns=NOW)
    replayer.run()
    assert send.calls == [(Q2, b"the payload", 0x31)]  # header no: the payload, with its key
    assert list(read_archive(archive)) == [ignored, junk]  # untouched
    assert replayer.summary() == "replayed 0, forwarded 1, discarded 1, kept 2, failed 0"
    # header yes refuses what is not a dead-letter record
    rules = rules_from_data({"rules": [{"action": "forward", "to": Q2, "header": "yes"}]})
    replayer = Replayer(archive, rules, send=send, out=lines.append, now_ns=NOW)
    replayer.run()
    assert "a MALFORMED record is not a dead-letter record: it cannot be forwarded with " \
        "header: yes" in lines[-1]
    assert DeadLetterRecord.from_bytes(send.calls[-1][1]) == row_to_record(ignored)


def test_a_receivers_notice_of_a_sure_message_is_not_put_back(tmp_path):
    """A trial: a SURE message refused once for QUEUE_FULL, then delivered by its sender,
    arrived twice when the receiving host's replay retried the row (`retry` is what the
    report suggests for QUEUE_FULL): a receiving MCA knows a repeat only from the peer that
    sent it first. Such a row is a notice, its sender keeps the message: kept, saying why.
    The sender's own row of it (its retry budget ran out) and an UNSURE row are put back."""
    archive = tmp_path / "archive"
    notice = row(ReasonCode.QUEUE_FULL, key=0x41, payload=b"notice", mtype=SURE_MSG)
    write_archive(archive, [
        notice,
        row(ReasonCode.RETRY_BUDGET_EXHAUSTED, key=0x42, payload=b"given up", mtype=SURE_MSG,
            agent=AgentKind.SENDER),
        row(ReasonCode.QUEUE_FULL, key=0x43, payload=b"unsure", mtype=UNSURE_MSG)])
    rules = rules_from_data({"rules": [{"reason": ["QUEUE_FULL", "RETRY_BUDGET_EXHAUSTED"],
                                        "action": "retry"}]}, config=CONFIG)
    send, lines = FakeSend(archive), []
    replayer = Replayer(archive, rules, send=send, out=lines.append, config=CONFIG, now_ns=NOW)
    replayer.run()
    assert [payload for _, payload, _ in send.calls] == [b"given up", b"unsure"]
    assert replayer.summary() == "replayed 2, forwarded 0, discarded 0, kept 1, failed 0"
    assert list(read_archive(archive)) == [notice]
    [said] = [line for line in lines if line.startswith("kept")]
    assert "SURE [rules[0]]: a notice: the sending MCA of the source host keeps this SURE " \
        "message and sends it again itself" in said and "rqpctl dlq resubmit" in said
    # forwarded with its key, it would be the same message twice as well; the dead letter
    # itself (header: yes) is a new message
    for rule, calls, left in (({"action": "forward", "to": Q2}, 2, [notice]),
                              ({"action": "forward", "to": Q2, "header": "yes"}, 3, [])):
        Replayer(archive, rules_from_data({"rules": [rule]}), send=send, out=print,
                 now_ns=NOW).run()
        assert len(send.calls) == calls and list(read_archive(archive)) == left, rule


def test_resubmit_refuses_a_notice_unless_told_its_sender_is_gone(tmp_path):
    """A trial resubmitted a receiver's notice of a SURE message its sender had delivered
    meanwhile: it arrived twice, exit 0, no word. Refused now (failed, saying why); with
    --notices (the sender gone for good) it is put back."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x44, payload=b"notice",
                                mtype=SURE_MSG),
                            row(ReasonCode.QUEUE_FULL, key=0x45, payload=b"unsure",
                                mtype=UNSURE_MSG)])
    ids = [r["id"] for r in read_archive(archive)]
    calls, lines = [], []
    counts = resubmit(archive, ids, lambda *a, **k: calls.append(a[:3]), out=lines.append)
    assert counts == {"failed": 1, "resubmitted": 1} and calls == [(Q1, b"unsure", 0x45)]
    assert f"failed         {ids[0]}: a notice: the sending MCA of the source host keeps " \
        "this SURE message" in lines[0] and "Give --notices only if" in lines[0], lines
    counts = resubmit(archive, ids[:1], lambda *a, **k: calls.append(a[:3]), out=lines.append,
                      notices=True)
    assert counts == {"resubmitted": 1} and calls[-1] == (Q1, b"notice", 0x44)
    assert not archive_files(archive)


def test_dlq_list_and_show_mark_a_notice(tmp_path, capsys):
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x46, payload=b"receiver's",
                                mtype=SURE_MSG),
                            row(ReasonCode.QUEUE_FULL, key=0x47, payload=b"the sender's",
                                mtype=SURE_MSG, agent=AgentKind.SENDER)])
    assert ctl.main(["dlq", "list", "--archive", str(archive)]) == 0
    out = capsys.readouterr().out
    [notice] = [line for line in out.splitlines() if "receiver's" in line]
    [own] = [line for line in out.splitlines() if "the sender's" in line]
    assert " SURE* " in notice and " SURE " in own and "SURE*: a notice, written by a " \
        "receiving MCA" in out, out
    for line, marked in ((notice, True), (own, False)):
        assert ctl.main(["dlq", "show", line.split()[0], "--archive", str(archive)]) == 0
        assert ("NOTICE             a notice: the sending MCA of the source host keeps"
                in capsys.readouterr().out) is marked


def test_a_message_is_forwarded_once_not_round_and_round(tmp_path):
    """A forward (header: no, the message keeps its key) whose copy is dead-lettered again and
    matches the rule again is kept, saying so: else --follow would send it round every round."""
    archive = tmp_path / "archive"
    rules = rules_from_data({"rules": [{"reason": "QUEUE_FULL", "action": "forward",
                                        "to": Q2}]})
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x71, payload=b"round")])
    send = FakeSend(archive)
    Replayer(archive, rules, send=send, out=print, now_ns=NOW).run()
    assert send.calls == [(Q2, b"round", 0x71)]
    # its copy, dead-lettered on Q2 after the forward (the fake clock: 10 s later)
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, queue_key=Q2, key=0x71,
                                payload=b"round", age=-10)])
    lines: list[str] = []
    replayer = Replayer(archive, rules, send=send, out=lines.append, now_ns=NOW + 20 * 10**9)
    replayer.run()
    assert send.calls == [(Q2, b"round", 0x71)]  # not again
    assert replayer.counts["kept"] == 1 and lines[0].startswith("kept")
    assert "dead-lettered again: kept, not forwarded round again" in lines[0]
    assert len(list(read_archive(archive))) == 1


def test_follow_waits_with_a_bounded_backoff_and_wakes_for_work(tmp_path):
    """The waits between rounds (given to an injected wait, so no real time passes): from 0.1 s
    doubling to --poll while nothing happens; cut short by a retry falling due or a new
    archive file; a sending MCA that takes nothing pauses for --poll."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=0x61, payload=b"retried")])
    now = [NOW]
    rules = rules_from_data({"rules": [{"action": "retry", "interval": "3s"}]})
    send = FakeSend(archive)
    lines: list[str] = []
    replayer = Replayer(archive, rules, send=send, out=lines.append, clock=lambda: now[0],
                        follow=True)
    waits: list[float] = []
    script: list = []  # what happens during each wait

    def wait(seconds: float) -> bool:
        waits.append(round(seconds, 3))
        now[0] += int(seconds * 1e9)
        if script:
            script.pop(0)()
        return replayer.stop.is_set()

    follower = Follower(replayer, poll=0.4, out=lines.append, wait=wait)

    def dead_lettered_again():  # comes back: waits for its interval (3 s after the retry)
        write_archive(archive, [row(key=0x61, payload=b"retried", age=-1)])

    def refused():
        send.fail = {b"retried"}
        def sending_mca_gone(*args, **kw):
            raise NotConfirmed("no sending MCA took it")
        replayer.send = sending_mca_gone

    idle = [lambda: None] * 3
    script += [*idle, dead_lettered_again,  # a new file: round 2 (it waits for its interval)
               *idle, *idle[:2], refused,  # the retry falls due: round 3, refused: paused
               replayer.stop.set]
    follower.run()
    assert send.calls == [(Q1, b"retried", 0x61)] and follower.rounds == 3
    assert waits[:4] == [0.1, 0.2, 0.4, 0.4]  # idle: doubling up to --poll
    assert waits[4:10] == [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]  # and cut short when it falls due:
    assert sum(waits[:10]) == pytest.approx(3.0)  # 3 s after the first retry
    assert waits[10:] == [0.4]  # paused
    assert any(line.startswith("waiting") for line in lines)
    assert "paused         the sending MCA is not taking records: trying again every 0.4s" \
        in lines
    assert follower.summary() == \
        "replayed 1, forwarded 0, discarded 0, kept 1, failed 0 (stopped by a signal)"


def test_follow_waits_for_a_replay_by_hand_instead_of_failing(tmp_path):
    """A trial: the handler (`--follow`) met a replay run by hand holding the lock and exited
    1 at once (its unit, restarting every 5 s, gives up after 5 tries). It now says so once,
    waits --poll between tries, and goes on once the lock is free."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=0x61, payload=b"after the other")])
    send = FakeSend(archive)
    lines: list[str] = []
    replayer = Replayer(archive, rules_from_data({"rules": [{"action": "retry"}]}), send=send,
                        out=lines.append, follow=True)
    other = replay_lock(archive)
    other.__enter__()  # (another open of the lock file: flock conflicts as across processes)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == 3:
            other.__exit__(None, None, None)  # the replay by hand ends
        if send.calls:
            replayer.stop.set()
        return replayer.stop.is_set()

    Follower(replayer, poll=0.4, out=lines.append, wait=wait).run()
    assert waits[:3] == [0.4] * 3 and send.calls == [(Q1, b"after the other", 0x61)]
    waiting = [line for line in lines if line.startswith("waiting ")]
    assert len(waiting) == 1 and f"already runs (pid {os.getpid()};" in waiting[0] \
        and waiting[0].endswith("trying again every 0.4s"), lines
    assert "resumed        the other replay has ended" in lines


def test_a_replay_meeting_another_exits_75_as_a_drain_does(tmp_path, capsys):
    archive = tmp_path / "archive"
    write_archive(archive, [row()])
    rules = rules_file(tmp_path, "rules:\n  - action: discard\n")
    with replay_lock(archive):
        assert ctl.main(["dlq", "replay", "--archive", str(archive), "--rules",
                         str(rules)]) == 75
    assert "an rqpctl dlq replay or resubmit of" in capsys.readouterr().err
    assert len(list(read_archive(archive))) == 1  # nothing done


def test_follow_reads_its_rules_again_on_sighup_only(tmp_path):
    """A trial: a rule added to the handler's file was never applied, and SIGHUP ended the
    handler without a word. The file is read again when asked (SIGHUP), and only then: a
    re-check's file, read as it changed, was read half written, a valid file that discarded
    every row. A change not yet applied is said once; a file with a mistake is said, and
    the rules it had are kept."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=0x61, payload=b"no rule yet")])
    path = rules_file(tmp_path, "rules:\n  - reason: QUEUE_FULL\n    action: discard\n")
    rules = RulesFile(path, CONFIG)
    send = FakeSend(archive)
    lines: list[str] = []
    replayer = Replayer(archive, load_rules(path, config=CONFIG), send=send, out=lines.append,
                        follow=True, config=CONFIG)
    script = [
        lambda: path.write_text("rules:\n  - action: discard\n"),  # half written: not applied
        lambda: path.write_text("rules:\n  - action: forward\n    to: nowhere_q\n"),  # a typo
        rules.request,
        lambda: path.write_text("rules:\n  - action: forward\n    to: PROD_THE_SPARE_COMMON\n"),
        lambda: None, rules.request, lambda: None, replayer.stop.set]

    def wait(seconds: float) -> bool:
        script.pop(0)()
        return replayer.stop.is_set()

    follower = Follower(replayer, poll=0.4, out=lines.append, wait=wait, rules=rules)
    follower.run()
    assert send.calls == [(Q2, b"no rule yet", 0x61)]  # (never discarded)
    said = [line for line in lines if line.startswith(("reloaded", "not reloaded",
                                                       "rules changed"))]
    changed = f"rules changed  {path} changed since it was read; not applied until SIGHUP " \
        "(systemctl reload rqp-dlq-handler.service)"
    assert said[0] == changed, lines  # (once for both writes, the half file and the typo)
    assert said[1].startswith("not reloaded") and "key 'to': bad value 'nowhere_q'" in said[1] \
        and said[1].endswith("still applying the rules it had")
    assert said[2:] == [changed, f"reloaded       {path} (1 rule(s))"], lines


def test_a_sighup_ends_a_followers_wait(tmp_path):
    """A re-check: idle, with --poll 30, the reload came 11 s after the SIGHUP (the wait was
    on the stop event alone). The wait ends at the request; a stop still ends it."""
    import threading
    archive = tmp_path / "archive"
    archive.mkdir()
    path = rules_file(tmp_path, "rules:\n  - action: keep\n")
    rules = RulesFile(path, CONFIG)
    replayer = Replayer(archive, load_rules(path, config=CONFIG), out=print, follow=True)
    follower = Follower(replayer, poll=30, out=print, rules=rules)
    for end, expected in ((rules.request, False), (replayer.stop.set, True)):
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(follower.wait(30)))
        waiter.start()
        end()
        waiter.join(10)  # (not a measure: 30 s without the fix, against 10)
        replayer.stop.set()  # (so that a waiter still there ends)
        waiter.join()
        assert result == [expected]
        rules.load(print)
        replayer.stop.clear()


def test_a_sighup_ends_a_round_after_the_record_in_hand(tmp_path):
    """A re-check: a SIGHUP during a long round (10,000 rows at 100/s: 100 s) changed nothing
    until the round ended. The round ends after the record in hand; the next one, at once,
    applies the rules read again, to the rows not yet handled."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x100 + n, payload=b"%d" % n)
                            for n in range(6)])
    path = rules_file(tmp_path, "rules:\n  - action: forward\n    to: PROD_THE_SPARE_COMMON\n")
    rules = RulesFile(path, CONFIG)
    fake = FakeSend(archive)

    def send(*args, **kw):
        fake(*args, **kw)
        if len(fake.calls) == 2:  # an operator changes the rules and reloads, mid-round
            path.write_text("rules:\n  - action: keep\n")
            rules.request()

    lines: list[str] = []
    replayer = Replayer(archive, load_rules(path, config=CONFIG), send=send, out=lines.append,
                        follow=True, config=CONFIG)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        replayer.stop.set()
        return True

    Follower(replayer, poll=0.4, out=lines.append, wait=wait, rules=rules).run()
    assert [payload for _, payload, _ in fake.calls] == [b"0", b"1"]
    assert f"reloaded       {path} (1 rule(s))" in lines and len(waits) == 1
    assert len(list(read_archive(archive))) == 4  # kept by the new rule


def test_sighup_reads_a_handlers_rules_again_and_stops_a_replay_with_its_summary(tmp_path):
    """The real command, signals and all: SIGHUP (`systemctl reload`) makes `--follow` read
    its rules again and go on; a replay that does not follow stops at it as at SIGTERM, with
    its summary (a trial's died of it without a word: Python's default for SIGHUP)."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x61, payload=b"discard me later")])
    rules = rules_file(tmp_path, "rules:\n  - action: keep\n")
    out = tmp_path / "out.txt"
    command = [sys.executable, "-m", "rqp.tools.ctl", "dlq", "replay", "--archive", str(archive),
               "--rules", str(rules)]
    with out.open("wb") as sink:
        proc = subprocess.Popen([*command, "--follow", "--poll", "60"], stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "following" in out.read_text(), timeout=60, message="no start")
        rules.write_text("rules:\n  - action: discard\n")
        wait_for(lambda: "rules changed" in out.read_text(), timeout=60, interval=0.2,
                 message="the change was not said")  # (said, not applied: not asked yet)
        assert len(list(read_archive(archive))) == 1
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in out.read_text(), timeout=60, message="no reload")
        wait_for(lambda: not list(read_archive(archive)), timeout=60, message="not discarded")
        assert proc.poll() is None  # still following
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert "replayed 0, forwarded 0, discarded 1, kept 0, failed 0 (stopped by a signal)" in text
    write_archive(archive, [row(ReasonCode.QUEUE_FULL, key=0x100 + n, payload=b"kept")
                            for n in range(20_000)])
    lock = os.open(archive / ".state" / "rqpctl-replay.lock", os.O_RDONLY)
    with out.open("wb") as sink:  # a replay that does not follow, stopped by SIGHUP
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:  # SIGHUP while it runs: stopped (SIGSTOP) while it holds the replay lock
        wait_for(lambda: _held(lock), timeout=60, interval=0.001, message="no start")
        proc.send_signal(signal.SIGSTOP)
        assert _held(lock), "the replay ended before it was stopped: give it more rows"
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(lock)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert "SIGHUP: stopping after the record in hand" in text and \
        "(stopped by a signal)" in text.splitlines()[-1], text


def _held(fd: int) -> bool:
    """Whether another open file holds an flock on the file of ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def test_follow_handles_a_file_another_host_wrote_while_a_round_ran(tmp_path):
    """A fresh machine's suite: a dead letter another host's drain wrote into the shared
    archive while a round ran, after that round had listed the archive, stayed unhandled:
    the wait that followed took the archive as it found it, file and all, and waited for a
    change that never came. Now the round after it comes at once."""
    archive = tmp_path / "archive"
    write_archive(archive, [row(key=0x61, payload=b"first")])
    rules = rules_from_data({"rules": [{"action": "forward", "to": Q2}]})
    send = FakeSend(archive)
    elsewhere = ArchiveWriter(archive, host="c")

    def send_while_another_host_drains(*args, **kw):
        send(*args, **kw)
        if len(send.calls) == 1:  # (during the first round, after it listed the archive)
            elsewhere.write([row(key=0x62, payload=b"from c")])

    replayer = Replayer(archive, rules, send=send_while_another_host_drains, out=print,
                        follow=True)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == 8:  # (doubling to --poll: 3.1 s of nothing)
            replayer.stop.set()
        return replayer.stop.is_set()

    follower = Follower(replayer, poll=0.8, out=print, wait=wait)
    follower.run()
    assert [payload for _, payload, _ in send.calls] == [b"first", b"from c"]
    assert follower.rounds == 2 and waits == [0.1, 0.2, 0.4] + [0.8] * 5  # (then nothing)
    assert payloads(archive) == []


def test_follow_drains_when_the_queue_holds_records_and_retries_a_failed_drain_slowly(
        tmp_path):
    archive = tmp_path / "archive"
    archive.mkdir()
    replayer = Replayer(archive, [], out=print, follow=True)
    queue = [0]  # records on DEAD.LETTER.Q
    drains: list[int] = []  # the wait count at each drain
    waits: list[float] = []

    def drain() -> bool:
        drains.append(len(waits))
        if len(drains) == 1:
            write_archive(archive, [row(payload=b"drained")])
            queue[0] = 0
            return True
        return False  # another drain holds the lock: the records stay

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == 2:
            queue[0] = 1  # a dead letter arrives
        if len(waits) == 6:
            queue[0] = 2
        if len(waits) == 16:
            replayer.stop.set()
        return replayer.stop.is_set()

    Follower(replayer, drain=drain, pending=lambda: queue[0] > 0, poll=0.4, out=print,
             wait=wait).run()
    # drained at once when it arrived; the failing drain only every --poll (0.4 s)
    assert drains[:2] == [2, 6] and drains[2:] == [9, 12, 15]
    assert waits[6:9] == [0.1, 0.2, 0.4] and waits[9:12] == [0.1, 0.2, 0.4]


# --------------------------------------------------------------------------------------------
# For real: a sending MCA, a receiving MCA, and the fake receiver that shows keys

FAKE = str(Path(__file__).with_name("fake_receiver.py"))
REPLAY = [sys.executable, "-m", "rqp.tools.ctl", "dlq", "replay"]
DEPTH = r"""
import sys, sysv_ipc
try:
    print(sysv_ipc.MessageQueue(int(sys.argv[1])).current_messages)
except sysv_ipc.ExistentialError:
    print(-1)
"""


def test_replay_through_the_real_sending_path(testbed):
    a, b, c = testbed.add_host("a"), testbed.add_host("b"), testbed.add_host("c")
    receiver = start_receiver(b)
    make_queue(b, Q1)
    make_queue(b, Q2)
    fake = c.popen([sys.executable, FAKE, f"{c.address}:{PORT}", str(c.workdir / "mode")])
    wait_for(lambda: "listening" in c.output(fake), timeout=20, message="fake receiver")
    # b serves Q1 and Q2; Q3 only the fake receiver on c says it has
    rqprc = write_rqprc(a, [b, c], queues={"PROD_THE_SCHED_COMMON": Q1,
                                           "PROD_THE_SPARE_COMMON": Q2})
    start_sender(a, rqprc)
    archive = a.workdir / "archive"
    spill = a.workdir / "spilled.payload"
    spill.write_bytes(b"big-payload-in-full")
    k1, k2 = 0x1234_5678_0000_0001, 0x1234_5678_0000_0002
    first = row(key=k1, payload=b"first", mtype=1)
    write_archive(archive, [
        first,
        row(ReasonCode.RETRY_BUDGET_EXHAUSTED, queue_key=Q3, key=k2, payload=b"to the fake",
            mtype=0, agent=AgentKind.SENDER),
        row(ReasonCode.QUEUE_FULL, queue_key=Q4, key=0x77, payload=b"forwarded"),
        row(ReasonCode.UNKNOWN_QUEUE, payload=b"discarded"),
        row(ReasonCode.NOT_AUTHORIZED, payload=b"kept"),
        row(key=0x88, payload=b"big-", flags=DeadLetterFlags.TRUNCATED,
            spill=str(a.workdir / "gone.payload"), original_length=19),
        row(key=0x99, payload=b"big-", flags=DeadLetterFlags.TRUNCATED, spill=str(spill),
            original_length=19),
    ])
    rules = rules_file(a.workdir, """
rules:
  - reason: [NO_ROUTE, "RETRY_BUDGET_*"]
    action: retry
    interval: 0s                       # (replayed again at once below)
  - reason: QUEUE_FULL
    queue: 0x52510004
    action: forward
    to: PROD_THE_SPARE_COMMON
  - reason: UNKNOWN_QUEUE
    action: discard
""")
    args = ["--archive", str(archive), "--rules", str(rules), "--rqprc", str(rqprc)]
    done = a.run([*REPLAY, *args], check=False, timeout=90)
    assert done.returncode == 1, done.stdout + done.stderr  # one record could not be put back
    assert done.stdout.splitlines() and done.stdout.splitlines()[-1] == \
        "replayed 3, forwarded 1, discarded 1, kept 1, failed 1"
    assert "gone.payload cannot be read here" in done.stdout
    # in the original queue, in order; the forwarded one in the other queue
    assert receive(b, Q1, 2) == ["first", "big-payload-in-full"]
    assert receive(b, Q2, 1) == ["forwarded"]
    # with the ORIGINAL key, as SURE
    frames = [json.loads(line) for line in c.output(fake).splitlines()]
    [message] = [f for f in frames if f.get("frame") == "MESSAGE"]
    assert (message["key"], message["queue_key"], message["body"], message["type"]) == \
        (k2, Q3, "to the fake", 0)
    # only the kept and the failed rows are left
    assert sorted(base64.b64decode(r["payload_b64"]) for r in read_archive(archive)) == \
        [b"big-", b"kept"]
    # The same dead letter replayed again keeps its key, so the receiving MCA recognises the
    # repeat and does not put it a second time.
    write_archive(archive, [first])
    again = a.run([*REPLAY, *args], check=False, timeout=90)
    assert "replayed 1," in again.stdout.splitlines()[-1]
    wait_for(lambda: f"repeat of SURE message key={k1:#018x}" in b.output(receiver, "stderr"),
             timeout=20, message="the receiver did not see the repeat")
    assert int(b.python(DEPTH, str(Q1))) == 0
    assert archived_ids(archive) == {r["id"] for r in read_archive(archive)}


def test_a_replay_keeps_the_messages_type_and_priority(tmp_path):
    archive = tmp_path / "archive"
    typed = row(key=0x51, payload=b"typed")
    record = dataclasses.replace(row_to_record(typed), mtype=7, priority=9,
                                 expires_at_ms=1)  # (a replay does not expire)
    typed = record_to_row(record.to_bytes(), archived_by="drainer")
    old = row(key=0x52, payload=b"schema one")
    old = {k: v for k, v in old.items()
           if k not in ("record_version", "mtype", "priority", "expires_at_ms")}
    old["schema"] = 1
    write_archive(archive, [typed, old])
    send = FakeSend(archive)
    replayer, _ = replay(archive, RULES, send)
    assert [c[1] for c in send.calls] == [b"typed", b"schema one"]
    assert send.extras == [(7, 9), (1, 4)]


def test_the_shipped_example_rules_load():
    """config/dlq-rules.example.yaml (installed as /etc/rqp/dlq-rules.yaml.example) is valid and
    does what its comments say."""
    rules = load_rules(Path(__file__).resolve().parent.parent / "config" /
                       "dlq-rules.example.yaml")
    assert [r.action for r in rules] == ["retry", "forward", "discard", "keep"]
    assert (rules[0].retries, rules[0].interval, rules[0].then) == (5, 600.0, "keep")
    assert rules[1].header and rules[1].to == 0x5251FFFF
    assert decide(rules, row(ReasonCode.QUEUE_FULL), NOW).action == "retry"
    assert decide(rules, row(ReasonCode.NOT_AUTHORIZED), NOW).action == "keep"
