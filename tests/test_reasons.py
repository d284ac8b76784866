"""One reason table (rqp.protocol.reasons), read by every part that names a reason: this test
compares each reader with it, and the table with the numbers of the published record format
(the README and existing archives hold them, so they may never change)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rqp.protocol import errors, reasons
from rqp.protocol.reasons import REASONS, ReasonCode

ROOT = Path(__file__).resolve().parent.parent

#: The published codes, written out by hand: a renumbering breaks every archive and every
#: other implementation, so the table must keep exactly these.
PUBLISHED = {
    "NO_QUEUE_KEY": 1, "BAD_MESSAGE_TYPE": 2, "MALFORMED_RECORD": 3, "NO_ROUTE": 4,
    "RETRY_BUDGET_EXHAUSTED": 5, "NOT_CONFIRMED": 6, "EXPIRED": 7, "EXTENSION_UNSUPPORTED": 8,
    "UNKNOWN_QUEUE": 20, "NOT_AUTHORIZED": 21,
    "QUEUE_FULL": 22, "MESSAGE_TOO_BIG": 23, "INVALID_QUEUE_KEY": 24, "QUEUE_NOT_OFFERED": 25,
    "PUT_FAILED": 26, "MALFORMED": -1,
}


def test_the_table_keeps_the_published_codes():
    assert {r.name: r.code for r in REASONS} == PUBLISHED
    assert len({r.code for r in REASONS}) == len(REASONS)
    for r in REASONS:
        assert r.by in ("sender", "receiver", "both", "tool") and r.description
        assert not (r.transient and r.intrinsic), r.name
        # what the peer hears follows from who records it: the receiving MCA answers
        assert r.on_wire == ("DELIVERED_ERROR" if r.by in ("receiver", "both") else None), r.name
        assert (1 <= r.code <= 19) if r.by in ("sender", "both") else True
        assert (r.code >= 20) if r.by == "receiver" else True


def test_record_reasons_are_the_table():
    assert {m.name: m.value for m in ReasonCode} == {
        r.name: r.code for r in REASONS if r.code > 0}
    assert ReasonCode.QUEUE_FULL.description == reasons.BY_NAME["QUEUE_FULL"].description
    assert reasons.reason_name(999) == "UNKNOWN_999" and reasons.describe(999) == \
        "unknown reason 999"


def test_the_archive_reads_the_table():
    from rqp.protocol.records import AgentKind, DeadLetterRecord
    from rqp.storage import archive

    raw = DeadLetterRecord(reason=ReasonCode.QUEUE_FULL, message_type=0,
                           agent=AgentKind.RECEIVER, host="h").to_bytes()
    row = archive.record_to_row(raw, archived_by="h")
    assert (row["reason"], row["reason_code"]) == ("QUEUE_FULL", 22)
    newer = bytearray(raw)
    newer[5:7] = (999).to_bytes(2, "big")  # a reason from a newer writer
    row = archive.record_to_row(bytes(newer), archived_by="h")
    assert (row["reason"], row["reason_code"]) == ("UNKNOWN_999", 999)
    row = archive.record_to_row(b"not a record", archived_by="h")
    assert (row["reason"], row["reason_code"]) == ("MALFORMED", -1)


def test_the_report_and_the_generator_read_the_table():
    from rqp.report import generate, schema

    assert set(schema.REASONS) == set(PUBLISHED)
    assert set(schema.TRANSIENT_REASONS) == {"QUEUE_FULL", "UNKNOWN_QUEUE", "NO_ROUTE",
                                             "QUEUE_NOT_OFFERED"}
    assert set(schema.MESSAGE_INTRINSIC_REASONS) == {
        "NO_QUEUE_KEY", "BAD_MESSAGE_TYPE", "MALFORMED_RECORD", "MESSAGE_TOO_BIG",
        "INVALID_QUEUE_KEY", "MALFORMED", "EXPIRED"}
    assert generate.REASON_CODES == PUBLISHED  # it had MALFORMED as 0, the archive -1
    assert set(generate.REASON_WEIGHTS) <= set(PUBLISHED)


def test_replay_filters_know_every_reason():
    from rqp.tools import replay

    assert set(replay.REASON_NAMES) == set(PUBLISHED)


@pytest.mark.parametrize("error,reason", [
    (errors.QueueNotFound, "UNKNOWN_QUEUE"), (errors.QueuePermissionDenied, "NOT_AUTHORIZED"),
    (errors.QueueFull, "QUEUE_FULL"), (errors.MessageTooBig, "MESSAGE_TOO_BIG"),
    (errors.QueueError, "PUT_FAILED"), (errors.RecordError, "MALFORMED_RECORD"),
])
def test_errors_carry_their_reason(error, reason):
    assert error.reason is ReasonCode[reason]


def test_every_project_exception_is_an_rqp_error():
    import rqp.report.job
    import rqp.report.schema
    import rqp.system.control
    import rqp.tools.bench
    import rqp.tools.replay
    import rqp.storage.archive
    import rqp.system.queues
    import rqp.api
    import rqp_agents.receiver

    modules = [rqp.report.job, rqp.report.schema, rqp.system.control, rqp.tools.bench,
               rqp.tools.replay, rqp.storage.archive, rqp.system.queues, rqp.api,
               rqp_agents.receiver, errors]
    found = {obj for m in modules for obj in vars(m).values()
             if isinstance(obj, type) and issubclass(obj, BaseException)
             and obj.__module__.startswith(("rqp", "rqp_agents"))}
    assert len(found) >= 15
    assert [e.__qualname__ for e in found if not issubclass(e, errors.RQPError)] == []


def test_the_readme_table_is_the_table():
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (-?\d+) \| `(\w+)` \| (\w+) \| ([\w-]+) \| (.+) \|$", text, re.M)
    assert [(int(c), n, b, None if w == "-" else w, d) for c, n, b, w, d in rows] == \
        [(r.code, r.name, r.by, r.on_wire, r.description) for r in REASONS]
