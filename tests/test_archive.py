"""The dead-letter archive format (rqp.storage.archive): rows, previews, the atomic writer."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import stat

import pytest
from hypothesis import given, settings, strategies as st

import rqp.storage.archive as archive
from rqp.protocol.errors import RecordError
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import AgentKind, DeadLetterFlags, DeadLetterRecord
from rqp.storage.archive import (
    ROW_KEYS, ArchiveError, ArchiveWriter, archive_files, archived_ids, payload_preview,
    read_archive, record_id, record_to_row, rewrite_archive_file, row_raw_bytes, row_to_record,
)

SPEC_KEYS = [
    "schema", "id", "archived_by", "archived_at", "host", "agent", "reason", "reason_code",
    "queue_key", "queue_key_hex", "queue_name", "message_key", "message_type", "timestamp",
    "timestamp_ns", "attempts", "original_length", "payload_length", "truncated",
    "header_only", "source_host", "destination_host", "detail", "spill_path", "payload_b64",
    "payload_preview", "record_version", "mtype", "priority", "expires_at_ms",
]
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def full_record(**changes) -> DeadLetterRecord:
    fields = dict(
        reason=ReasonCode.MESSAGE_TOO_BIG, message_type=0,
        flags=DeadLetterFlags.TRUNCATED | DeadLetterFlags.HEADER_ONLY,
        agent=AgentKind.RECEIVER, queue_key=(1 << 40) | 0x52510001,
        message_key=(1 << 64) - 1, timestamp_ns=1_700_000_000_123_456_789, attempts=7,
        original_length=100_000, host="höst-ä", source_host="src.example",
        destination_host="10.0.0.2:7460", detail="errno 90: Message too long — ünïcode",
        spill_path="/var/lib/rqp/spill/dl-1.payload", payload=b"\x00\xffbin\\ary\n",
        mtype=(1 << 63) - 1, priority=9, expires_at_ms=1_700_000_060_000,
    )
    fields.update(changes)
    return DeadLetterRecord(**fields)


def test_every_field_goes_into_the_row_and_comes_back():
    record = full_record()
    raw = record.to_bytes()
    row = record_to_row(raw, archived_by="drainer", queue_names={"PROD_X_Y": 0x52510001},
                        archived_at_ns=1_700_000_100_000_000_000)
    assert list(row) == SPEC_KEYS == list(ROW_KEYS)
    assert row == {
        "schema": 2,
        "id": hashlib.sha256(raw).hexdigest()[:32],
        "archived_by": "drainer",
        "archived_at": "2023-11-14T22:15:00.000000Z",
        "host": "höst-ä",
        "agent": "receiver",
        "reason": "MESSAGE_TOO_BIG",
        "reason_code": 23,
        "queue_key": (1 << 40) | 0x52510001,
        "queue_key_hex": "0x10052510001",
        "queue_name": None,  # the name is for 0x52510001, not for this 41-bit key
        "message_key": "0xffffffffffffffff",
        "message_type": "SURE",
        "timestamp": "2023-11-14T22:13:20.123456Z",
        "timestamp_ns": 1_700_000_000_123_456_789,
        "attempts": 7,
        "original_length": 100_000,
        "payload_length": 10,
        "truncated": True,
        "header_only": True,
        "source_host": "src.example",
        "destination_host": "10.0.0.2:7460",
        "detail": "errno 90: Message too long — ünïcode",
        "spill_path": "/var/lib/rqp/spill/dl-1.payload",
        "payload_b64": base64.b64encode(b"\x00\xffbin\\ary\n").decode(),
        "payload_preview": "\\x00\\xffbin\\x5cary\\x0a",
        "record_version": 2,
        "mtype": (1 << 63) - 1,
        "priority": 9,
        "expires_at_ms": 1_700_000_060_000,
    }
    assert row_to_record(row) == record
    assert row_raw_bytes(row) == raw and record_id(row_raw_bytes(row)) == row["id"]
    # through JSON, as it is stored
    again = json.loads(json.dumps(row))
    assert row_to_record(again) == record


def test_schema_1_rows_and_version_1_records_read_and_keep_their_ids():
    record = full_record(version=1, mtype=1, priority=4, expires_at_ms=0)
    raw = record.to_bytes()
    assert raw[4] == 1 and len(raw) == len(full_record(mtype=1).to_bytes()) - 17
    row = record_to_row(raw, archived_by="drainer")
    assert (row["record_version"], row["mtype"], row["priority"]) == (1, 1, 4)
    old = {k: v for k, v in row.items()
           if k not in ("record_version", "mtype", "priority", "expires_at_ms")}
    old["schema"] = 1  # a row a drain of the previous version wrote
    assert row_to_record(old) == record
    assert record_id(row_raw_bytes(old)) == old["id"] == record_id(raw)


def test_queue_name_comes_from_the_rqprc_names_and_is_null_otherwise():
    raw = full_record(queue_key=0x52510001).to_bytes()
    names = {"PROD_THE_SCHED_COMMON": 0x52510001, "ALIAS": 0x52510001, "OTHER": 2}
    assert record_to_row(raw, archived_by="h", queue_names=names)["queue_name"] == \
        "PROD_THE_SCHED_COMMON"
    assert record_to_row(raw, archived_by="h")["queue_name"] is None
    assert record_to_row(raw, archived_by="h", queue_names={"OTHER": 2})["queue_name"] is None
    assert record_to_row(raw, archived_by="h")["queue_key_hex"] == "0x52510001"


@pytest.mark.parametrize("fields, expect", [
    ({"reason": 999}, {"reason": "UNKNOWN_999", "reason_code": 999}),
    ({"agent": 9}, {"agent": "9"}),
    ({"agent": AgentKind.API}, {"agent": "api"}),
    ({"agent": AgentKind.SENDER}, {"agent": "sender"}),
    ({"agent": AgentKind.TOOL}, {"agent": "tool"}),
    ({"message_type": 1}, {"message_type": "UNSURE"}),
    ({"message_type": 255}, {"message_type": "UNKNOWN"}),
    ({"message_type": 7}, {"message_type": "UNKNOWN_7"}),
    ({"flags": 0, "payload": b""}, {"truncated": False, "header_only": False,
                                    "payload_b64": "", "payload_preview": ""}),
])
def test_unknown_numbers_and_edge_values_round_trip(fields, expect):
    record = full_record(**fields)
    raw = record.to_bytes()
    row = record_to_row(raw, archived_by="h")
    assert {k: row[k] for k in expect} == expect
    assert row_to_record(json.loads(json.dumps(row))) == record
    assert row_raw_bytes(row) == raw


_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(reason=st.integers(0, 0xFFFF), mtype=st.integers(0, 255), agent=st.integers(0, 255),
       flags=st.integers(0, 3), queue_key=st.integers(0, (1 << 64) - 1),
       message_key=st.integers(0, (1 << 64) - 1), ts=st.integers(0, (1 << 64) - 1),
       attempts=st.integers(0, (1 << 32) - 1), original=st.integers(0, (1 << 64) - 1),
       host=_text, source=_text, destination=_text, detail=_text, spill=_text,
       payload=st.binary(max_size=200))
def test_any_record_round_trips_exactly(reason, mtype, agent, flags, queue_key, message_key, ts,
                                         attempts, original, host, source, destination, detail,
                                         spill, payload):
    record = DeadLetterRecord(
        reason=reason, message_type=mtype, agent=agent, flags=flags, queue_key=queue_key,
        message_key=message_key, timestamp_ns=ts, attempts=attempts, original_length=original,
        host=host, source_host=source, destination_host=destination, detail=detail,
        spill_path=spill, payload=payload)
    raw = record.to_bytes()
    row = json.loads(json.dumps(record_to_row(raw, archived_by="h")))
    assert row_to_record(row) == record
    assert record_id(row_raw_bytes(row)) == row["id"] == record_id(raw)
    assert ISO.fullmatch(row["timestamp"]) and ISO.fullmatch(row["archived_at"])
    assert row["message_key"] == f"0x{message_key:016x}"
    assert row["payload_length"] == len(payload)


def test_a_malformed_record_keeps_its_raw_bytes():
    raw = b"RQDL\x01 this is not a dead-letter record \xff"
    row = record_to_row(raw, archived_by="drainer")
    assert list(row) == SPEC_KEYS
    assert row["reason"] == "MALFORMED" and row["reason_code"] == -1
    assert base64.b64decode(row["payload_b64"]) == raw
    with pytest.raises(RecordError) as parse_error:
        DeadLetterRecord.from_bytes(raw)
    assert row["detail"] == f"not a dead-letter record: {parse_error.value}"
    assert row["host"] == "drainer" and row["id"] == record_id(raw)
    assert row["payload_length"] == row["original_length"] == len(raw)
    assert row_raw_bytes(row) == raw
    with pytest.raises(ArchiveError, match="MALFORMED"):
        row_to_record(row)


@pytest.mark.parametrize("payload, preview", [
    (b"plain text 123", "plain text 123"),
    (b"\x00\x01\x7f\x80\xff", "\\x00\\x01\\x7f\\x80\\xff"),
    ("é€😀".encode(), "\\xc3\\xa9\\xe2\\x82\\xac\\xf0\\x9f\\x98\\x80"),
    (b"tab\there\r\n", "tab\\x09here\\x0d\\x0a"),
    (b"a\\x41", "a\\x5cx41"),  # a backslash cannot pass for an escape
    (b"\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),  # no terminal escape gets through
    (b"x" * 64, "x" * 64),
    (b"x" * 65, "x" * 64 + "\u2026"),
    (b"\xff" * 100, "\\xff" * 64 + "\u2026"),
])
def test_payload_preview_is_safe_for_any_viewer(payload, preview):
    assert payload_preview(payload) == preview


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_payload_preview_is_printable_ascii_whatever_the_bytes(payload):
    text = payload_preview(payload)
    body = text.removesuffix("\u2026")
    assert all(0x20 <= ord(c) < 0x7F for c in body)
    assert text.endswith("\u2026") == (len(payload) > 64)


def rows(n: int, start: int = 0) -> list[dict]:
    return [record_to_row(full_record(attempts=i, payload=f"p{i}".encode()).to_bytes(),
                          archived_by="h") for i in range(start, start + n)]


def test_writer_renames_a_complete_fsynced_file_into_place(tmp_path, monkeypatch):
    events = []
    real_fsync, real_publish = os.fsync, archive._publish

    def spy_fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def spy_publish(tmp, final):
        # nothing is visible in the archive yet; the temporary file is complete
        assert archive_files(tmp_path) == [] and not final.exists()
        assert tmp.parent == tmp_path / ".incoming"
        assert [r["id"] for r in read_archive([tmp])] == [r["id"] for r in batch]
        events.append("rename")
        real_publish(tmp, final)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(archive, "_publish", spy_publish)
    batch = rows(50)
    writer = ArchiveWriter(tmp_path, host="some host/1")
    path = writer.write(batch)
    assert events == ["fsync file", "rename", "fsync dir"]
    assert re.fullmatch(r"dlq-some_host_1-\d{8}T\d{6}\.\d{6}Z-\d+-\d{6}\.jsonl\.gz", path.name)
    assert path.parent == tmp_path and archive_files(tmp_path) == [path]
    assert list((tmp_path / ".incoming").iterdir()) == []
    assert list(read_archive(tmp_path)) == batch
    # plain gzip + JSON Lines, one object per line, ASCII only
    text = gzip.decompress(path.read_bytes())
    assert text.isascii() and text.count(b"\n") == 50 and text.endswith(b"\n")


def test_writer_leaves_nothing_when_writing_fails(tmp_path):
    def broken():
        yield from rows(3)
        raise OSError("disk full")

    writer = ArchiveWriter(tmp_path, host="h")
    with pytest.raises(OSError, match="disk full"):
        writer.write(broken())
    assert archive_files(tmp_path) == []
    assert list((tmp_path / ".incoming").iterdir()) == []


def test_names_sort_in_order_of_writing_and_ids_are_read_back(tmp_path):
    writer = ArchiveWriter(tmp_path, host="h")
    first, second = rows(3), rows(4, start=3)
    p1, p2 = writer.write(first), writer.write(second)
    assert archive_files(tmp_path) == [p1, p2]
    assert list(read_archive(tmp_path)) == first + second
    assert list(read_archive([p2, p1])) == second + first
    assert archived_ids(tmp_path) == {r["id"] for r in first + second}
    assert archived_ids([p1, tmp_path / "gone.jsonl.gz"]) == {r["id"] for r in first}
    # hidden entries are not archive files
    (tmp_path / ".hidden.jsonl.gz").write_bytes(b"")
    assert archive_files(tmp_path) == [p1, p2]


def test_rewrite_replaces_a_file_atomically_and_removes_an_empty_one(tmp_path):
    writer = ArchiveWriter(tmp_path, host="h")
    batch = rows(5)
    path = writer.write(batch)
    inode = path.stat().st_ino
    assert rewrite_archive_file(path, batch[1:4]) == 3
    assert list(read_archive(path)) == batch[1:4]
    assert path.stat().st_ino != inode  # a new file renamed over the old one
    assert list((tmp_path / ".incoming").iterdir()) == []
    assert rewrite_archive_file(path, []) == 0
    assert not path.exists()


def test_a_corrupt_file_is_named_in_the_error(tmp_path):
    bad = tmp_path / "dlq-x.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"id": "1"}\nnot json\n'))
    with pytest.raises(ArchiveError, match=r"dlq-x.jsonl.gz: line 2"):
        list(read_archive(bad))
