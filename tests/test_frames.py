"""The wire codec: spec section 4 byte for byte, round trips, fragmented input, malformed input."""

from __future__ import annotations

import pytest
from construct import ConstructError
from hypothesis import given, settings, strategies as st

import rqp
from rqp.protocol import frames
from rqp.protocol.constants import HARD_MESSAGE_CAP
from rqp.protocol.events import (
    ANSWERS, REQUESTS, DeliveredError, DeliveredYes, Message, OversizedMessage, QueueAsk, QueueNo,
    QueueYes,
)
from rqp.protocol.frames import CLOSED, NEED_DATA, FrameDecoder, decode, encode

# --- the spec's examples, a comment per field ----------------------------------------------

HELLO = bytes.fromhex(
    "01"                  # message_code = MESSAGE
    "00"                  # message_type = SURE_MSG
    "0000000100000001"    # key
    "0000000052510001"    # queue_key
    "0000000000000005"    # message_length
    "68656c6c6f"          # message = "hello"
)
ASK = bytes.fromhex(
    "04"                  # message_code = QUEUE_ASK
    "00"                  # data
    "0000000052510001"    # queue_key
)
HELLO_EVENT = Message(message_type=rqp.SURE_MSG, key=0x0000000100000001, queue_key=0x52510001,
                      message=b"hello")

SPEC_VECTORS = [
    pytest.param(frames.MESSAGE, {"message_type": 0, "key": 0x0000000100000001,
                                  "queue_key": 0x52510001, "message": b"hello"},
                 HELLO, HELLO_EVENT, id="MESSAGE"),
    pytest.param(frames.DELIVERED_YES, {}, b"\x02\x00", DeliveredYes(), id="DELIVERED_YES"),
    pytest.param(frames.DELIVERED_ERROR, {}, b"\x03\x00", DeliveredError(), id="DELIVERED_ERROR"),
    pytest.param(frames.QUEUE_YES, {}, b"\x05\x00", QueueYes(), id="QUEUE_YES"),
    pytest.param(frames.QUEUE_NO, {}, b"\x06\x00", QueueNo(), id="QUEUE_NO"),
    pytest.param(frames.QUEUE_ASK, {"queue_key": 0x52510001}, ASK,
                 QueueAsk(queue_key=0x52510001), id="QUEUE_ASK"),
]


@pytest.mark.parametrize("construct, fields, wire, event", SPEC_VECTORS)
def test_spec_examples_build_parse_encode_decode(construct, fields, wire, event):
    assert construct.build(fields) == wire
    parsed = construct.parse(wire)
    assert parsed.message_code == wire[0]
    for name, value in fields.items():
        assert parsed[name] == value
    assert encode(event) == wire
    assert decode(wire) == event
    assert FrameDecoder().events(wire) == [event]


def test_build_computes_code_and_length_and_defaults_data():
    parsed = frames.MESSAGE.parse(HELLO)
    assert (parsed.message_code, parsed.message_length, parsed.message) == (1, 5, b"hello")
    assert frames.QUEUE_ASK.parse(ASK).data == 0
    assert frames.DELIVERED_YES.build({"data": 7}) == b"\x02\x07"


def test_codes_and_constants_importable_from_rqp():
    assert (rqp.MESSAGE, rqp.DELIVERED_YES, rqp.DELIVERED_ERROR, rqp.QUEUE_ASK, rqp.QUEUE_YES,
            rqp.QUEUE_NO) == (1, 2, 3, 4, 5, 6)
    assert (rqp.SURE_MSG, rqp.UNSURE_MSG, rqp.ERROR_LIMIT) == (0, 1, 3)


def test_data_is_ignored_on_receipt_but_kept():
    assert decode(b"\x05\x2a") == QueueYes(data=0x2A)
    assert FrameDecoder().events(b"\x04\xff" + bytes(8)) == [QueueAsk(data=0xFF, queue_key=0)]


# --- round trips -----------------------------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
u8 = st.integers(0, 255)
events = st.one_of(
    st.builds(Message, message_type=st.sampled_from([0, 1]), key=u64, queue_key=u64,
              message=st.binary(max_size=300)),
    st.builds(QueueAsk, queue_key=u64, data=u8),
    *(st.builds(cls, data=u8) for cls in (DeliveredYes, DeliveredError, QueueYes, QueueNo)),
)


def roundtrip(construct, fields: dict) -> None:
    """parse(build(x)) == x, build(parse(b)) == b, and compiled agrees with plain."""
    wire = construct.build(fields)
    parsed = construct.parse(wire)
    for name, value in fields.items():
        assert parsed[name] == value
    assert construct.build(parsed) == wire
    compiled = construct.compile()
    assert compiled.build(fields) == wire
    assert compiled.parse(wire) == parsed


@given(events)
def test_event_roundtrip(event):
    wire = encode(event)
    assert decode(wire) == event
    assert FrameDecoder().events(wire) == [event]
    fields = {k: getattr(event, k) for k in ("message_type", "key", "queue_key", "message", "data")
              if hasattr(event, k)}
    roundtrip(frames._BY_CODE[event.code], fields)


@settings(max_examples=50)
@given(st.lists(events, max_size=20), st.data())
def test_stream_split_anywhere(evs, data):
    wire = b"".join(map(encode, evs))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    decoder, out, last = FrameDecoder(), [], 0
    for cut in cuts + [len(wire)]:
        if cut > last:  # an empty chunk would mean end of stream
            out += decoder.events(wire[last:cut])
            last = cut
    assert out == evs
    assert decoder.buffered == 0
    decoder.receive_data(b"")
    assert decoder.next_event() is CLOSED


STREAM = HELLO + ASK + b"\x02\x00" + HELLO


@pytest.mark.parametrize("split", [
    pytest.param(1, id="in_code"), pytest.param(2, id="in_type"), pytest.param(5, id="in_key"),
    pytest.param(14, id="in_queue_key"), pytest.param(20, id="in_length"),
    pytest.param(26, id="before_body"), pytest.param(28, id="in_body"),
    pytest.param(31, id="between_frames"), pytest.param(33, id="in_ask"),
])
def test_split_at_each_field(split):
    decoder = FrameDecoder()
    first = decoder.events(STREAM[:split])
    assert first + decoder.events(STREAM[split:]) == [HELLO_EVENT, QueueAsk(queue_key=0x52510001),
                                                      DeliveredYes(), HELLO_EVENT]


def test_one_byte_at_a_time():
    decoder, out = FrameDecoder(), []
    for i in range(len(STREAM)):
        out += decoder.events(STREAM[i:i + 1])
        assert decoder.buffered <= len(HELLO)
    assert len(out) == 4 and out[0] == out[3] == HELLO_EVENT


# --- malformed input -----------------------------------------------------------------------

@pytest.mark.parametrize("code", [0, 8, 0x41, 0xFF])
def test_unknown_message_code_names_the_value(code):
    decoder = FrameDecoder()
    decoder.receive_data(bytes([code, 0]))
    with pytest.raises(rqp.RemoteProtocolError, match=f"unknown message_code {code} "):
        decoder.next_event()
    with pytest.raises(rqp.RemoteProtocolError, match=f"unknown message_code {code} "):
        decode(bytes([code, 0]))


def test_a_peer_that_speaks_text_is_told_apart():
    """A peer answering 'HTTP/1.1 400 ...' (rqpctl ping to a web server, a trial's finding) is
    named a text protocol, not only 'unknown message_code 72'."""
    decoder = FrameDecoder()
    decoder.receive_data(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(rqp.RemoteProtocolError, match=r"unknown message_code 72 \(0x48, 'H': "
                       r"a text protocol \(HTTP, SMTP, ...\), not an RQP peer\)"):
        decoder.next_event()
    decoder = FrameDecoder()
    decoder.receive_data(b"220 mail.example ESMTP ready\r\n")  # (a trial's SMTP peer)
    with pytest.raises(rqp.RemoteProtocolError, match=r"unknown message_code 50 \(0x32, '2': "):
        decoder.next_event()
    decoder = FrameDecoder()
    decoder.receive_data(bytes([9, 0]))
    with pytest.raises(rqp.RemoteProtocolError, match=r"unknown message_code 9 \(0x09\)$"):
        decoder.next_event()


def test_a_peer_that_speaks_tls_to_a_plaintext_port_is_told_apart():
    """A trial: a sending MCA with a tls: block for a plaintext receiver; the receiver said
    only 'unknown message_code 22 (0x16)'. A real ClientHello, from Python's ssl."""
    import ssl

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="b")
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    decoder = FrameDecoder()
    decoder.receive_data(outgoing.read())
    with pytest.raises(rqp.RemoteProtocolError, match=r"unknown message_code 22 \(0x16: TLS, "
                       r"a handshake -- the peer speaks TLS to a plaintext port"):
        decoder.next_event()
    decoder = FrameDecoder()  # (a trial's random bytes: one printable octet is no text)
    decoder.receive_data(bytes([0x29, 0x8F, 0x03, 0xE1, 0x00, 0x41, 0xFF, 0x10]))
    with pytest.raises(rqp.RemoteProtocolError, match=r"unknown message_code 41 \(0x29\)$"):
        decoder.next_event()


@pytest.mark.parametrize("mtype", [2, 0x80, 0xFF])
def test_bad_message_type_names_the_value(mtype):
    bad = HELLO[:1] + bytes([mtype]) + HELLO[2:]
    with pytest.raises(rqp.RemoteProtocolError, match=f"message_type {mtype}:"):
        FrameDecoder().events(bad[:2])  # detected as soon as the octet arrives
    with pytest.raises(rqp.RemoteProtocolError, match=f"message_type {mtype}:"):
        decode(bad)
    with pytest.raises(ConstructError):
        frames.MESSAGE.parse(bad)
    with pytest.raises(rqp.LocalProtocolError, match=f"got {mtype}"):
        Message(message_type=mtype, key=1, queue_key=1, message=b"")


def test_decoder_stays_failed_after_protocol_error():
    decoder = FrameDecoder()
    decoder.receive_data(b"\x09")
    for _ in range(2):
        with pytest.raises(rqp.RemoteProtocolError, match="unknown message_code 9"):
            decoder.next_event()


@pytest.mark.parametrize("frame", [HELLO, ASK, b"\x02\x00"])
def test_truncated_frame_at_end_of_stream(frame):
    for cut in range(1, len(frame)):
        decoder = FrameDecoder()
        decoder.receive_data(frame[:cut])
        assert decoder.next_event() is NEED_DATA
        decoder.receive_data(b"")
        with pytest.raises(rqp.RemoteProtocolError, match=f"stream closed inside .* {cut} of"):
            decoder.next_event()
        with pytest.raises(rqp.RemoteProtocolError):
            decode(frame[:cut])


def test_trailing_bytes_after_whole_frame_rejected_by_decode():
    with pytest.raises(rqp.RemoteProtocolError, match="1 bytes after a whole QUEUE_YES"):
        decode(b"\x05\x00\x00")
    with pytest.raises(rqp.RemoteProtocolError, match="empty input"):
        decode(b"")


@pytest.mark.parametrize("accept, frame", [
    (REQUESTS, b"\x02\x00"), (REQUESTS, b"\x05\x00"), (ANSWERS, HELLO), (ANSWERS, ASK)])
def test_frames_the_other_side_sends_are_protocol_errors(accept, frame):
    with pytest.raises(rqp.RemoteProtocolError, match="unexpected .* this side only receives"):
        FrameDecoder(accept=accept).events(frame)


def test_clean_close_between_frames():
    decoder = FrameDecoder()
    assert decoder.events(HELLO) == [HELLO_EVENT]
    decoder.receive_data(b"")
    assert decoder.next_event() is CLOSED
    with pytest.raises(rqp.LocalProtocolError):
        decoder.receive_data(b"x")


# --- size limits (spec 5.4) ------------------------------------------------------------------

def header(length: int, key: int = 7, mtype: int = 1) -> bytes:
    return frames.MESSAGE_HEADER.build(
        {"message_type": mtype, "key": key, "queue_key": 0x52510001, "message_length": length})


def test_oversized_message_is_reported_then_skipped():
    decoder = FrameDecoder(max_message_size=4)
    out = decoder.events(header(10) + b"0123")
    assert out == [OversizedMessage(message_type=1, key=7, queue_key=0x52510001,
                                    message_length=10, limit=4)]
    assert decoder.skipping == 6 and decoder.buffered == 0
    assert decoder.events(b"456789" + b"\x04\x00" + bytes(8)) == [QueueAsk(queue_key=0)]


def test_message_at_the_limit_is_delivered():
    decoder = FrameDecoder(max_message_size=5)
    assert decoder.events(HELLO) == [HELLO_EVENT]


def test_claimed_length_2_to_the_63_keeps_memory_bounded():
    decoder = FrameDecoder(max_message_size=8192, hard_cap=None)
    assert decoder.events(header(2**63)) == [
        OversizedMessage(message_type=1, key=7, queue_key=0x52510001, message_length=2**63,
                         limit=8192)]
    chunk = bytes(1 << 16)
    for _ in range(256):  # 16 MiB of body streams past without being held
        assert decoder.events(chunk) == []
        assert decoder.buffered == 0
    assert decoder.skipping == 2**63 - 256 * len(chunk)
    decoder.receive_data(b"")
    with pytest.raises(rqp.RemoteProtocolError, match="before the end of an oversized MESSAGE"):
        decoder.next_event()


def test_a_stream_closed_inside_an_oversized_message_ex_names_it():
    from rqp.protocol.frames import encode_message_ex
    decoder = FrameDecoder(max_message_size=10)
    frame = encode_message_ex(0, 7, 0x52510001, b"x" * 100, 1, 4, 0, 0)
    [event] = decoder.events(frame[:-30])
    assert isinstance(event, OversizedMessage) and event.extras == (1, 4, 0, 0)
    decoder.receive_data(b"")
    with pytest.raises(rqp.RemoteProtocolError,
                       match="30 octets before the end of an oversized MESSAGE_EX$"):
        decoder.next_event()


def test_claimed_length_over_hard_cap_closes_at_once():
    decoder = FrameDecoder(max_message_size=8192)
    with pytest.raises(rqp.RemoteProtocolError,
                       match=f"message_length {2**63}, over the hard cap of {HARD_MESSAGE_CAP}"):
        decoder.events(header(2**63))


def test_event_validation():
    with pytest.raises(rqp.LocalProtocolError, match="key must be"):
        Message(message_type=0, key=2**64, queue_key=1, message=b"")
    with pytest.raises(rqp.LocalProtocolError, match="queue_key must be"):
        QueueAsk(queue_key=-1)
    with pytest.raises(rqp.LocalProtocolError, match="data must be"):
        DeliveredYes(data=256)
    with pytest.raises(rqp.LocalProtocolError, match="message must be bytes"):
        Message(message_type=0, key=1, queue_key=1, message="text")
    with pytest.raises(TypeError):
        Message(0, 1, 1, b"")  # keyword-only
    with pytest.raises(rqp.LocalProtocolError, match="not a frame that can be sent"):
        encode(OversizedMessage(message_type=0, key=1, queue_key=1, message_length=9, limit=1))


# --- MESSAGE_EX (spec section 6) ------------------------------------------------------------

from rqp.protocol.events import REQUESTS_EX, MessageEx  # noqa: E402

HI_EX = bytes.fromhex(  # the spec's example, field by field
    "07"                  # message_code = MESSAGE_EX
    "00"                  # message_type = SURE_MSG
    "0000000100000001"    # key
    "0000000052510001"    # queue_key
    "0000000000000005"    # mtype = 5 (int64)
    "09"                  # priority = 9
    "00"                  # flags
    "0000000000000000"    # expires_at_ms = never
    "0000000000000002"    # message_length
    "6869"                # "hi"
)
HI_EX_EVENT = MessageEx(message_type=rqp.SURE_MSG, key=0x0000000100000001,
                        queue_key=0x52510001, message=b"hi", mtype=5, priority=9)


def test_message_ex_matches_the_spec_byte_for_byte():
    assert len(HI_EX) == frames.MESSAGE_EX_HEADER_SIZE + 2 == 46
    assert encode(HI_EX_EVENT) == HI_EX
    assert decode(HI_EX) == HI_EX_EVENT
    assert frames.MESSAGE_EX.parse(HI_EX).mtype == 5
    decoder = FrameDecoder(accept=REQUESTS_EX, max_message_size=8192)
    got = [e for octet in HI_EX for e in decoder.events(bytes([octet]))]  # one octet at a time
    assert got == [HI_EX_EVENT] and isinstance(got[0], Message)  # the core sees a Message


def test_message_ex_only_where_negotiated():
    """Spec section 6: a MESSAGE_EX before the receiver answered with EXT_MESSAGE is a
    protocol error; a plain RQP/1 decoder never accepts it."""
    decoder = FrameDecoder(accept=REQUESTS)
    decoder.receive_data(HI_EX)
    with pytest.raises(rqp.RemoteProtocolError, match="unexpected MESSAGE_EX frame"):
        decoder.next_event()


@pytest.mark.parametrize("field, value, error", [
    ("mtype", 0, "mtype must be an integer in 1.."),
    ("mtype", -3, "mtype must be an integer in 1.."),
    ("priority", 10, "priority must be an integer in 0..9"),
    ("flags", 0x02, "flags must hold only BATCH_MORE"),
])
def test_message_ex_fields_out_of_range_are_protocol_errors(field, value, error):
    fields = {"message_type": 0, "key": 1, "queue_key": 0x52510001, "mtype": 5, "priority": 4,
              "flags": 0, "expires_at_ms": 0, "message": b"x", field: value}
    data = frames.MESSAGE_EX.build(fields)
    decoder = FrameDecoder(accept=REQUESTS_EX)
    decoder.receive_data(data[:frames.MESSAGE_EX_HEADER_SIZE])  # the header is enough to say
    with pytest.raises(rqp.RemoteProtocolError, match=error):
        decoder.next_event()
    with pytest.raises(rqp.RemoteProtocolError, match=error):
        decode(data)
    with pytest.raises(rqp.LocalProtocolError, match=error):  # and we cannot build one
        MessageEx(**{k: v for k, v in fields.items()})


def test_an_oversized_message_ex_keeps_its_extras_and_memory_stays_bounded():
    data = frames.MESSAGE_EX.build({
        "message_type": 1, "key": 2, "queue_key": 3, "mtype": 7, "priority": 1, "flags": 1,
        "expires_at_ms": 1234, "message": b"m" * 5000})
    decoder = FrameDecoder(accept=REQUESTS_EX, max_message_size=100)
    events = decoder.events(data[:200])
    assert events == [OversizedMessage(message_type=1, key=2, queue_key=3, message_length=5000,
                                       limit=100, extras=(7, 1, 1, 1234))]
    assert decoder.buffered == 0 and decoder.skipping == 5000 - (200 - 44)
    assert decoder.events(data[200:] + HI_EX) == [HI_EX_EVENT]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.integers(1, 2**63 - 1), st.integers(0, 9), st.sampled_from([0, 1]),
       st.integers(0, 2**64 - 1), st.binary(max_size=300))
def test_message_ex_round_trips(message_type, key, queue_key, mtype, priority, flags, expires,
                                body):
    event = MessageEx(message_type=message_type, key=key, queue_key=queue_key, message=body,
                      mtype=mtype, priority=priority, flags=flags, expires_at_ms=expires)
    data = encode(event)
    assert decode(data) == event
    assert FrameDecoder(accept=REQUESTS_EX).events(data) == [event]


@given(st.binary(min_size=44, max_size=44))
def test_the_struct_readers_of_the_hot_path_read_what_construct_declares(data):
    """The decoder splits fixed headers with struct readers derived from the declarations."""
    from rqp.protocol import frames as F

    for header, unpack in ((F.MESSAGE_HEADER, F._UNPACK_HEADER),
                           (F.MESSAGE_EX_HEADER, F._UNPACK_EX_HEADER)):
        raw = bytes((header.subcons[0].subcon.value, data[1] & 1)) + data[2:header.sizeof()]
        parsed = header.parse(raw)
        names = [sub.name for sub in header.subcons]
        assert unpack(bytearray(b"xx" + raw), 2) == tuple(parsed[n] for n in names)


@given(st.sampled_from([0, 1]), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.integers(1, 2**63 - 1), st.integers(0, 9), st.sampled_from([0, 1]),
       st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_the_struct_writers_of_the_hot_path_build_what_construct_declares(
        kind, key, queue_key, mtype, priority, flags, expires, body):
    from rqp.protocol import frames as F

    assert F.encode_message(kind, key, queue_key, body) == F.MESSAGE.build(
        {"message_type": kind, "key": key, "queue_key": queue_key, "message": body})
    assert F.encode_message_ex(kind, key, queue_key, body, mtype, priority, flags, expires) == \
        F.MESSAGE_EX.build({"message_type": kind, "key": key, "queue_key": queue_key,
                            "mtype": mtype, "priority": priority, "flags": flags,
                            "expires_at_ms": expires, "message": body})


@given(st.integers(0, 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.integers(1, 2**63 - 1), st.integers(0, 9), st.sampled_from([0, 1]),
       st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_the_decoders_unchecked_constructors_build_what_the_dataclasses_do(
        message_type, key, queue_key, mtype, priority, flags, expires, body):
    """The decoder builds its messages without __post_init__'s second check: the same objects,
    every declared field set (a field added to the dataclass and not to them fails here)."""
    import dataclasses

    from rqp.protocol.events import unchecked_message, unchecked_message_ex

    base = dict(message_type=message_type, key=key, queue_key=queue_key, message=body)
    extras = dict(mtype=mtype, priority=priority, flags=flags, expires_at_ms=expires)
    for cls, made in ((Message, unchecked_message(*base.values())),
                      (MessageEx, unchecked_message_ex(*base.values(), *extras.values()))):
        values = base if cls is Message else base | extras
        assert type(made) is cls
        assert [f.name for f in dataclasses.fields(cls)] == list(values)
        assert {f.name: getattr(made, f.name) for f in dataclasses.fields(cls)} == values
        assert made == cls(**values) and hash(made) == hash(cls(**values))
