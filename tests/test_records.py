"""rqp.protocol.records: the transmission record and the dead-letter record."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rqp.protocol.constants import SURE_MSG, UINT64_MAX, UNSURE_MSG, MessageType
from rqp.protocol.errors import MessageTooBig, RecordError
from rqp.protocol.reasons import ReasonCode, describe
from rqp.protocol.records import (
    DEAD_LETTER_FIXED_SIZE,
    DEAD_LETTER_MIN_SIZE,
    DEAD_LETTER_RECORD,
    DEAD_LETTER_RECORD_COMPILED,
    TRANSMISSION_HEADER_SIZE,
    TRANSMISSION_RECORD,
    TRANSMISSION_RECORD_COMPILED,
    UNKNOWN_MESSAGE_TYPE,
    AgentKind,
    DeadLetterFlags,
    DeadLetterRecord,
    TransmissionFlags,
    TransmissionRecord,
)
from rqp.storage.deadletters import fit_dead_letter

# --------------------------------------------------------------------------------------------
# Hand-written vectors
# --------------------------------------------------------------------------------------------

TRANSMISSION = TransmissionRecord(
    message_type=UNSURE_MSG,
    queue_key=0x52510001,
    payload=b"hi",
    flags=TransmissionFlags.SYNC,
    producer_pid=0x1234,
    sequence=7,
    enqueued_ns=0x0102030405060708,
    mtype=0x1_0000_0005,
    priority=9,
    expires_at_ms=0x0000_0199_0000_0001,
)
TRANSMISSION_BYTES = (
    b"RQPX"  # magic
    b"\x02"  # version 2
    b"\x01"  # message_type UNSURE_MSG
    b"\x00\x01"  # flags: SYNC
    b"\x00\x00\x00\x00\x52\x51\x00\x01"  # queue_key 0x52510001
    b"\x00\x00\x12\x34"  # producer_pid 0x1234
    b"\x00\x00\x00\x00\x00\x00\x00\x07"  # sequence 7
    b"\x01\x02\x03\x04\x05\x06\x07\x08"  # enqueued_ns
    b"\x00\x00\x00\x01\x00\x00\x00\x05"  # mtype 0x100000005 (int64)
    b"\x00\x00\x01\x99\x00\x00\x00\x01"  # expires_at_ms
    b"\x09"  # priority 9
    + bytes(11)  # reserved
    + b"hi"  # payload: the rest of the message
)
#: The same message as a version 1 record (still read): no extras, so the defaults.
TRANSMISSION_V1_BYTES = TRANSMISSION_BYTES[:4] + b"\x01" + TRANSMISSION_BYTES[5:36] + b"hi"

DEAD_LETTER = DeadLetterRecord(
    reason=ReasonCode.QUEUE_FULL,
    message_type=SURE_MSG,
    flags=DeadLetterFlags.TRUNCATED,
    agent=AgentKind.RECEIVER,
    queue_key=0x1_0000_0002,
    message_key=0xAABBCCDDEEFF0011,
    timestamp_ns=0x0102030405060708,
    attempts=10,
    original_length=5,
    host="a",
    source_host="src",
    destination_host="",
    detail="é",
    spill_path="/s",
    payload=b"abc",
    mtype=5,
    priority=9,
    expires_at_ms=0x0A0B0C0D0E0F1011,
)
DEAD_LETTER_V1 = dataclasses.replace(DEAD_LETTER, mtype=1, priority=4, expires_at_ms=0,
                                     version=1)
DEAD_LETTER_V1_BYTES = (
    b"RQDL"  # magic
    b"\x01"  # version 1
    b"\x00\x16"  # reason 22 QUEUE_FULL
    b"\x00"  # message_type SURE
    b"\x00\x01"  # flags: TRUNCATED
    b"\x03"  # agent RECEIVER
    b"\x00\x00\x00\x01\x00\x00\x00\x02"  # queue_key 0x100000002 (kept although > 2**32-1)
    b"\xaa\xbb\xcc\xdd\xee\xff\x00\x11"  # message_key
    b"\x01\x02\x03\x04\x05\x06\x07\x08"  # timestamp_ns
    b"\x00\x00\x00\x0a"  # attempts 10
    b"\x00\x00\x00\x00\x00\x00\x00\x05"  # original_length 5
    b"\x01" b"a"  # host: uint8 length + UTF-8
    b"\x03" b"src"  # source_host
    b"\x00"  # destination_host: empty
    b"\x00\x02" b"\xc3\xa9"  # detail "é": uint16 length + UTF-8
    b"\x00\x02" b"/s"  # spill_path
    b"\x00\x00\x00\x03"  # payload_length 3
    b"abc"  # payload
)
DEAD_LETTER_BYTES = (
    b"RQDL" b"\x02" + DEAD_LETTER_V1_BYTES[5:47]  # version 2, then as version 1 up to offset 47
    + b"\x00\x00\x00\x00\x00\x00\x00\x05"  # mtype 5
    + b"\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11"  # expires_at_ms
    + b"\x09"  # priority 9
    + DEAD_LETTER_V1_BYTES[47:]  # the strings and the payload
)


def test_sizes():
    assert TRANSMISSION_HEADER_SIZE == 64
    assert DEAD_LETTER_FIXED_SIZE == 64
    assert DEAD_LETTER_MIN_SIZE == 75


def test_dead_letter_version_1_is_read_and_written_back_as_it_was():
    parsed = DeadLetterRecord.from_bytes(DEAD_LETTER_V1_BYTES)
    assert parsed == DEAD_LETTER_V1 and parsed.version == 1
    assert parsed.to_bytes() == DEAD_LETTER_V1_BYTES  # (so its archive id stays)
    assert parsed.encoded_size() == len(DEAD_LETTER_V1_BYTES)
    with pytest.raises(ValueError, match="version-1 dead-letter record has no mtype"):
        dataclasses.replace(parsed, mtype=2)


def test_transmission_vector():
    assert TRANSMISSION.to_bytes() == TRANSMISSION_BYTES
    assert TransmissionRecord.from_bytes(TRANSMISSION_BYTES) == TRANSMISSION
    parsed = TransmissionRecord.from_bytes(TRANSMISSION_BYTES)
    assert parsed.message_type is MessageType.UNSURE
    assert parsed.sync and parsed.is_valid_type()


def test_version_1_is_read_with_the_defaults_and_written_as_version_2():
    parsed = TransmissionRecord.from_bytes(TRANSMISSION_V1_BYTES)
    assert parsed == dataclasses.replace(TRANSMISSION, mtype=1, priority=4, expires_at_ms=0)
    assert parsed.to_bytes()[4] == 2 and len(parsed.to_bytes()) == TRANSMISSION_HEADER_SIZE + 2


@pytest.mark.parametrize("offset,value,words", [
    (36, bytes(8), "mtype must be an integer in 1.."),
    (36, b"\xff" * 8, "got -1"),
    (52, b"\x0a", "priority must be an integer in 0..9, got 10"),
    (53, b"\x01", "reserved bytes that are not zero"),
    (63, b"\x80", "reserved bytes that are not zero"),
])
def test_extras_out_of_range_are_malformed(offset, value, words):
    raw = TRANSMISSION_BYTES[:offset] + value + TRANSMISSION_BYTES[offset + len(value):]
    with pytest.raises(RecordError, match=re.escape(words)):
        TransmissionRecord.from_bytes(raw)


@pytest.mark.parametrize("fields", [{"mtype": 0}, {"mtype": -5}, {"mtype": 1 << 63},
                                    {"priority": 10}, {"expires_at_ms": -1}])
def test_extras_out_of_range_cannot_be_made(fields):
    with pytest.raises(ValueError):
        TransmissionRecord(SURE_MSG, 1, b"", **fields)


def test_dead_letter_vector():
    assert DEAD_LETTER.to_bytes() == DEAD_LETTER_BYTES
    parsed = DeadLetterRecord.from_bytes(DEAD_LETTER_BYTES)
    assert parsed == DEAD_LETTER
    assert parsed.reason is ReasonCode.QUEUE_FULL and parsed.agent is AgentKind.RECEIVER
    assert parsed.truncated and not parsed.header_only
    assert DEAD_LETTER.encoded_size() == len(DEAD_LETTER_BYTES)


def test_empty_dead_letter_is_min_size():
    r = DeadLetterRecord(reason=1, host="", timestamp_ns=0)
    assert len(r.to_bytes()) == DEAD_LETTER_MIN_SIZE


def test_transmission_any_message_type_parses():
    raw = bytearray(TRANSMISSION_BYTES)
    raw[5] = 7
    rec = TransmissionRecord.from_bytes(bytes(raw))
    assert rec.message_type == 7 and not rec.is_valid_type()


def test_empty_payload():
    rec = TransmissionRecord(SURE_MSG, 1, b"")
    assert len(rec.to_bytes()) == TRANSMISSION_HEADER_SIZE
    assert TransmissionRecord.from_bytes(rec.to_bytes()) == rec


# --------------------------------------------------------------------------------------------
# Enumerations
# --------------------------------------------------------------------------------------------


def test_reason_codes_exact():
    assert {r.name: r.value for r in ReasonCode} == {
        "NO_QUEUE_KEY": 1, "BAD_MESSAGE_TYPE": 2, "MALFORMED_RECORD": 3, "NO_ROUTE": 4,
        "RETRY_BUDGET_EXHAUSTED": 5, "NOT_CONFIRMED": 6, "EXPIRED": 7,
        "EXTENSION_UNSUPPORTED": 8, "UNKNOWN_QUEUE": 20,
        "NOT_AUTHORIZED": 21, "QUEUE_FULL": 22, "MESSAGE_TOO_BIG": 23,
        "INVALID_QUEUE_KEY": 24, "QUEUE_NOT_OFFERED": 25, "PUT_FAILED": 26,
    }
    for r in ReasonCode:
        assert r.description and describe(r) == r.description and describe(int(r)) == r.description
    assert describe(999) == "unknown reason 999"


def test_agent_kind():
    assert [(a.name, a.value) for a in AgentKind] == [
        ("API", 1), ("SENDER", 2), ("RECEIVER", 3), ("TOOL", 4)]


def test_unknown_reason_and_agent_kept_as_int():
    raw = bytearray(DEAD_LETTER_BYTES)
    raw[5:7] = (999).to_bytes(2, "big")
    raw[10] = 77
    rec = DeadLetterRecord.from_bytes(bytes(raw))
    assert rec.reason == 999 and type(rec.reason) is int
    assert rec.agent == 77 and type(rec.agent) is int
    assert rec.description == "unknown reason 999"
    assert rec.to_bytes() == bytes(raw)


# --------------------------------------------------------------------------------------------
# Round trips (hypothesis)
# --------------------------------------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, UINT64_MAX)

transmission_records = st.builds(
    TransmissionRecord,
    message_type=u8, queue_key=u64, payload=st.binary(max_size=300),
    flags=u16.map(lambda f: f & ~0x0004),  # (BATCH needs a batch payload: tested below)
    producer_pid=u32, sequence=u64, enqueued_ns=u64,
    mtype=st.integers(1, (1 << 63) - 1), priority=st.integers(0, 9), expires_at_ms=u64,
)

dead_letter_records = st.builds(
    DeadLetterRecord,
    reason=u16, message_type=u8, flags=u16, agent=u8, queue_key=u64, message_key=u64,
    timestamp_ns=u64, attempts=u32, original_length=u64,
    host=st.text(max_size=300), source_host=st.text(max_size=80),
    destination_host=st.text(max_size=80), detail=st.text(max_size=200),
    spill_path=st.text(max_size=80), payload=st.binary(max_size=300),
)


@given(transmission_records)
def test_transmission_round_trip(rec):
    raw = rec.to_bytes()
    assert TransmissionRecord.from_bytes(raw) == rec
    assert TransmissionRecord.from_bytes(raw).to_bytes() == raw
    assert len(raw) == TRANSMISSION_HEADER_SIZE + len(rec.payload)


@given(st.binary(min_size=47, max_size=200))
def test_transmission_parse_then_build_is_identity(rest):
    raw = b"RQPX\x02" + rest[:31] + b"\x00\x00\x00\x00\x00\x00\x00\x01" + rest[31:39] \
        + b"\x04" + bytes(11) + rest[39:]
    raw = raw[:7] + bytes([raw[7] & ~0x04]) + raw[8:]  # (BATCH: a batch payload, tested below)
    assert TransmissionRecord.from_bytes(raw).to_bytes() == raw


@given(dead_letter_records)
def test_dead_letter_round_trip(rec):
    raw = rec.to_bytes()
    assert DeadLetterRecord.from_bytes(raw) == rec
    assert DeadLetterRecord.from_bytes(raw).to_bytes() == raw
    assert rec.encoded_size() == len(raw)


@given(transmission_records)
def test_transmission_compiled_equals_plain(rec):
    fields = dataclasses.asdict(rec)
    assert TRANSMISSION_RECORD_COMPILED.build(fields) == TRANSMISSION_RECORD.build(fields)


@given(dead_letter_records)
def test_dead_letter_compiled_equals_plain(rec):
    fields = dataclasses.asdict(rec)
    assert DEAD_LETTER_RECORD_COMPILED.build(fields) == DEAD_LETTER_RECORD.build(fields)


@settings(max_examples=300)
@given(st.one_of(
    st.binary(max_size=80),
    st.binary(max_size=80).map(lambda b: b"RQPX\x01" + b),
    st.binary(max_size=120).map(lambda b: b"RQPX\x02" + b),
    st.binary(max_size=80).map(lambda b: b"RQDL\x01" + b),
))
def test_arbitrary_bytes_give_record_or_record_error(raw):
    for cls in (TransmissionRecord, DeadLetterRecord):
        try:
            rec = cls.from_bytes(raw)
        except RecordError as exc:
            assert exc.__cause__ is None and exc.__suppress_context__
        else:
            if cls is TransmissionRecord and raw[4] == 1:  # version 1 is rewritten as 2
                assert cls.from_bytes(rec.to_bytes()) == rec
            else:
                assert rec.to_bytes() == raw


# --------------------------------------------------------------------------------------------
# Malformed records
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls,good", [(TransmissionRecord, TRANSMISSION_BYTES),
                                      (DeadLetterRecord, DEAD_LETTER_BYTES)])
def test_bad_magic_names_the_bytes(cls, good):
    with pytest.raises(RecordError, match=re.escape("bad magic b'XQPZ'")):
        cls.from_bytes(b"XQPZ" + good[4:])


@pytest.mark.parametrize("cls,good", [(TransmissionRecord, TRANSMISSION_BYTES),
                                      (DeadLetterRecord, DEAD_LETTER_BYTES)])
def test_unsupported_version_names_the_number(cls, good):
    with pytest.raises(RecordError, match="version 3"):
        cls.from_bytes(good[:4] + b"\x03" + good[5:])


def test_other_record_kind_is_bad_magic():
    with pytest.raises(RecordError, match="bad magic b'RQDL'"):
        TransmissionRecord.from_bytes(DEAD_LETTER_BYTES)
    with pytest.raises(RecordError, match="bad magic b'RQPX'"):
        DeadLetterRecord.from_bytes(TRANSMISSION_BYTES)


@pytest.mark.parametrize("length", range(TRANSMISSION_HEADER_SIZE))
def test_transmission_truncated_header(length):
    with pytest.raises(RecordError, match=rf"truncated transmission record: {length} bytes"):
        TransmissionRecord.from_bytes(TRANSMISSION_BYTES[:length])


@pytest.mark.parametrize("length", range(len(DEAD_LETTER_BYTES)))
def test_dead_letter_truncated_anywhere(length):
    with pytest.raises(RecordError, match=rf"truncated dead-letter record: {length} bytes"):
        DeadLetterRecord.from_bytes(DEAD_LETTER_BYTES[:length])


def test_payload_length_past_the_end():
    raw = DEAD_LETTER_BYTES[:-7] + (4).to_bytes(4, "big") + b"abc"
    with pytest.raises(RecordError, match="'payload' needs more bytes"):
        DeadLetterRecord.from_bytes(raw)


def test_trailing_bytes_after_dead_letter_payload():
    with pytest.raises(RecordError, match="trailing bytes"):
        DeadLetterRecord.from_bytes(DEAD_LETTER_BYTES + b"\x00")


def test_invalid_utf8_string():
    raw = DEAD_LETTER_BYTES.replace(b"\x01a\x03src", b"\x01\xff\x03src")
    with pytest.raises(RecordError, match="UTF-8"):
        DeadLetterRecord.from_bytes(raw)


def test_out_of_range_fields_rejected_when_made():
    with pytest.raises(ValueError, match="queue_key"):
        TransmissionRecord(SURE_MSG, 1 << 64, b"")
    with pytest.raises(ValueError, match="message_type"):
        TransmissionRecord(256, 1, b"")
    with pytest.raises(ValueError, match="attempts"):
        DeadLetterRecord(reason=1, attempts=-1)
    with pytest.raises(TypeError):
        TransmissionRecord(SURE_MSG, 1, "text")


# --------------------------------------------------------------------------------------------
# Strings and defaults
# --------------------------------------------------------------------------------------------


def test_long_strings_are_cut_at_a_character_boundary():
    rec = DeadLetterRecord(reason=1, host="é" * 200, detail="€" * 30000,
                           source_host="x" * 254 + "é")
    assert rec.host == "é" * 127  # 254 bytes: a 128th "é" would need 256
    assert len(rec.detail.encode()) <= 0xFFFF and rec.detail == "€" * 21845
    assert rec.source_host == "x" * 254
    assert DeadLetterRecord.from_bytes(rec.to_bytes()) == rec


def test_unencodable_characters_are_replaced():
    rec = DeadLetterRecord(reason=1, detail="a\udcffb")
    assert rec.detail == "a?b"


def test_dead_letter_defaults():
    rec = DeadLetterRecord(reason=ReasonCode.NO_ROUTE, payload=b"12345")
    assert rec.original_length == 5 and rec.timestamp_ns > 0 and rec.host
    assert rec.message_type == UNKNOWN_MESSAGE_TYPE and rec.agent is AgentKind.TOOL


def test_from_transmission():
    rec = DeadLetterRecord.from_transmission(TRANSMISSION, reason=ReasonCode.NO_ROUTE,
                                             agent=AgentKind.SENDER, attempts=3)
    assert (rec.message_type, rec.queue_key, rec.payload, rec.attempts) == (
        UNSURE_MSG, 0x52510001, b"hi", 3)
    bad = dataclasses.replace(TRANSMISSION, message_type=9)
    rec = DeadLetterRecord.from_transmission(bad, reason=ReasonCode.BAD_MESSAGE_TYPE,
                                             agent=AgentKind.SENDER)
    assert rec.message_type == UNKNOWN_MESSAGE_TYPE and "9" in rec.detail


# --------------------------------------------------------------------------------------------
# fit_dead_letter
# --------------------------------------------------------------------------------------------


def test_fit_returns_a_fitting_record_unchanged():
    assert fit_dead_letter(DEAD_LETTER, len(DEAD_LETTER_BYTES)) is DEAD_LETTER


def test_fit_without_spill_dir_flags_truncation():
    rec = DeadLetterRecord(reason=ReasonCode.MESSAGE_TOO_BIG, payload=bytes(range(256)) * 40)
    fitted = fit_dead_letter(rec, 1000)
    assert len(fitted.to_bytes()) == 1000
    assert fitted.truncated and fitted.spill_path == ""
    assert fitted.original_length == 10240
    assert rec.payload.startswith(fitted.payload)
    assert DeadLetterRecord.from_bytes(fitted.to_bytes()) == fitted


def test_fit_with_spill_dir_writes_full_payload_atomically(tmp_path):
    payload = os.urandom(20000)
    rec = DeadLetterRecord(reason=ReasonCode.MESSAGE_TOO_BIG, message_key=0xABC,
                           timestamp_ns=123, payload=payload)
    fitted = fit_dead_letter(rec, 4096, spill_dir=tmp_path)
    assert len(fitted.to_bytes()) == 4096 and fitted.truncated
    assert fitted.original_length == 20000
    files = os.listdir(tmp_path)
    assert len(files) == 1  # no temp file left behind
    assert re.fullmatch(r"dl-123-0000000000000abc-[0-9a-f]{16}\.payload", files[0])
    assert fitted.spill_path == str(tmp_path / files[0])
    assert (tmp_path / files[0]).read_bytes() == payload
    # Already spilled: fitting tighter cuts more but writes no second file.
    tighter = fit_dead_letter(fitted, 2000, spill_dir=tmp_path)
    assert len(tighter.to_bytes()) == 2000 and tighter.spill_path == fitted.spill_path
    assert len(os.listdir(tmp_path)) == 1


def test_fit_header_too_big_raises_and_writes_nothing(tmp_path):
    rec = DeadLetterRecord(reason=1, detail="d" * 5000, payload=b"x" * 10)
    with pytest.raises(MessageTooBig) as info:
        fit_dead_letter(rec, 1000, spill_dir=tmp_path)
    assert info.value.limit == 1000 and info.value.size > 5000
    assert str(info.value.size) in str(info.value) and "1000" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_fit_spill_failure_leaves_no_temp_file(tmp_path):
    missing = tmp_path / "nope"
    rec = DeadLetterRecord(reason=1, payload=b"x" * 5000)
    with pytest.raises(OSError):
        fit_dead_letter(rec, 1000, spill_dir=missing)
    assert os.listdir(tmp_path) == []


def test_batch_record_members_and_malformed_batches():
    from rqp.protocol.records import TransmissionFlags, decode_batch, encode_batch
    payload = encode_batch([(5, b"hi"), (1, b"")])
    assert payload == bytes.fromhex("0000000000000005 00000002 6869 0000000000000001 00000000")
    record = TransmissionRecord(message_type=0, queue_key=0x52510001, payload=payload,
                                flags=TransmissionFlags.BATCH)
    back = TransmissionRecord.from_bytes(record.to_bytes())
    assert back.is_batch and back.members() == ((5, b"hi"), (1, b""))
    for bad, words in ((payload[:-1], "too few"), (payload + b"\0", "too few"),
                       (b"", "no messages"), (encode_batch([(1, b"x")])[:-1], "claims 1 bytes")):
        broken = TransmissionRecord(message_type=0, queue_key=1, payload=b"").to_bytes()
        broken = broken[:6] + b"\x00\x04" + broken[8:] + bad  # flags BATCH
        with pytest.raises(RecordError, match=words):
            TransmissionRecord.from_bytes(broken)
        with pytest.raises(ValueError, match=words):  # nor can one be made
            TransmissionRecord(message_type=0, queue_key=1, payload=bad,
                               flags=TransmissionFlags.BATCH)
    with pytest.raises(RecordError, match="more than 256"):
        decode_batch(encode_batch([(1, b"")] * 256) + encode_batch([(1, b"")]))
    for members, words in (([], "1..256"), ([(0, b"")], "mtype must be"),
                           ([(1, b"")] * 257, "1..256")):
        with pytest.raises(ValueError, match=words):
            encode_batch(members)


def test_key_blocks_are_consecutive_and_never_reused(tmp_path):
    from rqp.system.service import KeySource
    keys = KeySource(tmp_path, "s")
    first = keys()
    block = keys.block(3)
    assert block == first + 1 and keys() == first + 4
    keys._counter = 0xFFFFFFFF - 1  # a block that would pass the counter's end
    start = keys.block(5)
    assert start >> 32 == (first >> 32) + 1 and start & 0xFFFFFFFF == 1


@given(transmission_records)
def test_the_struct_codec_and_the_construct_declaration_agree(rec):
    """Issue 14: the hot path's struct (derived from TRANSMISSION_HEADER) writes and reads
    exactly what the construct declaration does, field by field."""
    from rqp.protocol.records import TRANSMISSION_RECORD
    raw = rec.to_bytes()
    assert raw == TRANSMISSION_RECORD.build(rec._fields())
    parsed = TRANSMISSION_RECORD.parse(raw)
    fast = TransmissionRecord.from_bytes(raw)
    assert {name: getattr(fast, name) for name in rec._fields()} == \
        {name: parsed[name] for name in rec._fields()}
