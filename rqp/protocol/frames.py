"""The RQP wire format (spec section 4), declared once with construct, and a sans-IO decoder.

This module contains no networking code. The caller owns the socket::

    decoder = FrameDecoder(accept=REQUESTS, max_message_size=8192)
    decoder.receive_data(sock.recv(65536))      # b"" means the peer closed
    while (event := decoder.next_event()) is not NEED_DATA:
        ...                                     # an Event, or CLOSED at a clean end of stream
    sock.sendall(encode(DeliveredYes()))

Each frame has one module-level construct: ``MESSAGE``, ``DELIVERED_YES``, ``DELIVERED_ERROR``,
``QUEUE_ASK``, ``QUEUE_YES``, ``QUEUE_NO`` and section 6's ``MESSAGE_EX`` (which a decoder
accepts only when told to: a receiving MCA, once it has answered with ``EXT_MESSAGE``). ``build`` fills in ``message_code`` and
``message_length`` and defaults ``data`` to 0; ``parse`` returns every field. ``FRAME`` parses
any one frame by switching on its code.
"""

from __future__ import annotations

import struct
from typing import Final

from construct import (
    Bytes, Const, ConstructError, Default, Int8ub, Int64sb, Int64ub, OneOf, Peek,
    Rebuild, Struct, Switch, len_, this,
)

from rqp.protocol import constants as c
from rqp.protocol.codec import struct_of
from rqp.protocol.errors import LocalProtocolError, RemoteProtocolError
from rqp.protocol.events import (
    DeliveredError, DeliveredYes, Event, Message, MessageEx, OversizedMessage, QueueAsk, QueueNo,
    QueueYes, check_extras, unchecked_message, unchecked_message_ex,
)

__all__ = [
    "MESSAGE", "DELIVERED_YES", "DELIVERED_ERROR", "QUEUE_ASK", "QUEUE_YES", "QUEUE_NO", "FRAME",
    "MESSAGE_EX", "MESSAGE_EX_HEADER", "MESSAGE_EX_HEADER_SIZE",
    "MESSAGE_HEADER", "MESSAGE_HEADER_SIZE", "ANSWER_SIZE", "encode", "encode_message",
    "encode_message_ex",
    "decode", "FrameDecoder",
    "NEED_DATA", "CLOSED",
]

_message_type = OneOf(Int8ub, (c.SURE_MSG, c.UNSURE_MSG))


def _message_frame(code: int, *extras) -> tuple[Struct, Struct]:
    """The fixed header (up to ``message_length``) and the whole frame of a message-carrying
    frame: code, type, key, queue key, then ``extras``, then the length and the body."""
    head = ("message_code" / Const(code, Int8ub), "message_type" / _message_type,
            "key" / Int64ub, "queue_key" / Int64ub, *extras)
    return (Struct(*head, "message_length" / Int64ub),
            Struct(*head, "message_length" / Rebuild(Int64ub, len_(this.message)),
                   "message" / Bytes(this.message_length)))


#: MESSAGE: the fixed 26 octets in front of its body, and the whole frame.
MESSAGE_HEADER, MESSAGE = _message_frame(c.MESSAGE)
MESSAGE_HEADER_SIZE: Final = MESSAGE_HEADER.sizeof()
#: MESSAGE_EX (spec section 6): the fixed 44 octets in front of its body, and the whole frame.
MESSAGE_EX_HEADER, MESSAGE_EX = _message_frame(
    c.MESSAGE_EX, "mtype" / Int64sb, "priority" / Int8ub, "flags" / Int8ub,
    "expires_at_ms" / Int64ub)
MESSAGE_EX_HEADER_SIZE: Final = MESSAGE_EX_HEADER.sizeof()


def _reply(code: int) -> Struct:
    return Struct("message_code" / Const(code, Int8ub), "data" / Default(Int8ub, 0))


DELIVERED_YES = _reply(c.DELIVERED_YES)
DELIVERED_ERROR = _reply(c.DELIVERED_ERROR)
QUEUE_YES = _reply(c.QUEUE_YES)
QUEUE_NO = _reply(c.QUEUE_NO)
#: Every answer (DELIVERED_YES/ERROR, QUEUE_YES/NO) is this many octets.
ANSWER_SIZE: Final = DELIVERED_YES.sizeof()
QUEUE_ASK = Struct(
    "message_code" / Const(c.QUEUE_ASK, Int8ub),
    "data" / Default(Int8ub, 0),
    "queue_key" / Int64ub,
)

_BY_CODE = {
    c.MESSAGE: MESSAGE, c.DELIVERED_YES: DELIVERED_YES, c.DELIVERED_ERROR: DELIVERED_ERROR,
    c.QUEUE_ASK: QUEUE_ASK, c.QUEUE_YES: QUEUE_YES, c.QUEUE_NO: QUEUE_NO,
    c.MESSAGE_EX: MESSAGE_EX,
}
#: Any one frame, chosen by its first octet.
FRAME = Struct("message_code" / Peek(Int8ub), "frame" / Switch(this.message_code, _BY_CODE))

# Building is done from validated events (trusted input), so the compiled forms are safe there
# (construct's docs: compiled parsers skip checks; we never parse network bytes with them).
_BUILD = {code: struct.compile() for code, struct in _BY_CODE.items()}
_EVENT_FOR_CODE = {
    c.DELIVERED_YES: DeliveredYes, c.DELIVERED_ERROR: DeliveredError,
    c.QUEUE_YES: QueueYes, c.QUEUE_NO: QueueNo,
}


def _unpacker(header: Struct) -> struct.Struct:
    """A :mod:`struct` reader of a fixed-size header, derived from its construct declaration
    (:func:`rqp.protocol.codec.struct_of`): the decoder's hot path, about thirty times faster
    than even the compiled construct parser. ``tests/test_frames.py`` checks both read the
    same."""
    return struct_of(header)


#: The fixed fields of MESSAGE and MESSAGE_EX as tuples, in declaration order, and back.
_UNPACK_HEADER = _unpacker(MESSAGE_HEADER).unpack_from
_UNPACK_EX_HEADER = _unpacker(MESSAGE_EX_HEADER).unpack_from
_PACK_HEADER = _unpacker(MESSAGE_HEADER).pack
_PACK_EX_HEADER = _unpacker(MESSAGE_EX_HEADER).pack
# The two-octet answers are constant for data=0, which is all we ever send.
_ANSWER_BYTES = {cls: bytes((code, 0)) for code, cls in _EVENT_FOR_CODE.items()}
#: The decoder's two-octet events, made once: frozen, so one object serves every frame alike
#: (a sending MCA decodes one DELIVERED_YES a message).
_REPLY_EVENTS = {code: tuple(cls(data=data) for data in range(256))
                 for code, cls in _EVENT_FOR_CODE.items()}
# Fixed size of each frame up to and including its last fixed field.
_FIXED_SIZE = {c.MESSAGE: MESSAGE_HEADER_SIZE, c.QUEUE_ASK: QUEUE_ASK.sizeof(),
               c.MESSAGE_EX: MESSAGE_EX_HEADER_SIZE,
               **{code: ANSWER_SIZE for code in _EVENT_FOR_CODE}}
_CARRIES_MESSAGE = (c.MESSAGE, c.MESSAGE_EX)


def encode(event: Event) -> bytes:
    """The bytes of one frame. Events validate themselves, so this cannot build a bad frame."""
    answer = _ANSWER_BYTES.get(type(event))
    if answer is not None and event.data == 0:
        return answer
    if isinstance(event, MessageEx):
        return encode_message_ex(event.message_type, event.key, event.queue_key, event.message,
                                 event.mtype, event.priority, event.flags, event.expires_at_ms)
    if isinstance(event, Message):
        return encode_message(event.message_type, event.key, event.queue_key, event.message)
    if isinstance(event, QueueAsk):
        return _BUILD[c.QUEUE_ASK].build({"data": event.data, "queue_key": event.queue_key})
    if type(event) in _EVENT_FOR_CODE.values():
        return _BUILD[event.code].build({"data": event.data})
    raise LocalProtocolError(f"{type(event).__name__} is not a frame that can be sent")


def encode_message(message_type: int, key: int, queue_key: int, message: bytes) -> bytes:
    """A MESSAGE frame from already-validated fields (the sender's hot path: the header by the
    struct writer derived from ``MESSAGE_HEADER``, checked equal to ``MESSAGE.build``)."""
    return _PACK_HEADER(c.MESSAGE, message_type, key, queue_key, len(message)) + message


def encode_message_ex(message_type: int, key: int, queue_key: int, message: bytes, mtype: int,
                      priority: int, flags: int, expires_at_ms: int) -> bytes:
    """A MESSAGE_EX frame from already-validated fields (the sender's hot path; the fields of
    a transmission record are checked when it is read)."""
    return _PACK_EX_HEADER(c.MESSAGE_EX, message_type, key, queue_key, mtype, priority, flags,
                           expires_at_ms, len(message)) + message


def _header_error(header: bytes) -> RemoteProtocolError:
    code = header[0]
    if code not in _BY_CODE:
        text = ""
        if len(header) >= 2 and all(0x20 <= b <= 0x7E or b in b"\t\r\n" for b in header):
            # printable, every octet of it: the peer speaks text ('220 ...', 'HTTP/1.1'); one
            # printable octet before binary is only noise (a trial's random bytes)
            text = f", {chr(code)!r}: a text protocol (HTTP, SMTP, ...), not an RQP peer"
        elif header[:2] == b"\x16\x03":  # a TLS record of the handshake: a ClientHello
            text = (": TLS, a handshake -- the peer speaks TLS to a plaintext port (its tls: "
                    "for this host, or this receiver without its tls: block?)")
        return RemoteProtocolError(f"unknown message_code {code} (0x{code:02x}{text})")
    return RemoteProtocolError(
        f"{c.MessageCode(code).name} with message_type {header[1]}: only SURE_MSG (0) and "
        f"UNSURE_MSG (1) exist")


def _extras_error(header) -> None:
    """A MESSAGE_EX header's extra fields out of range: a protocol error (spec section 6)."""
    check_extras(header.mtype, header.priority, header.flags, header.expires_at_ms,
                 error=lambda text: RemoteProtocolError(
                     f"MESSAGE_EX key={header.key:#018x}: {text}"))


def _event_from_parsed(code: int, fields) -> Event:
    if code == c.MESSAGE:
        return Message(message_type=fields.message_type, key=fields.key,
                       queue_key=fields.queue_key, message=bytes(fields.message))
    if code == c.MESSAGE_EX:
        _extras_error(fields)
        return MessageEx(message_type=fields.message_type, key=fields.key,
                         queue_key=fields.queue_key, message=bytes(fields.message),
                         mtype=fields.mtype, priority=fields.priority, flags=fields.flags,
                         expires_at_ms=fields.expires_at_ms)
    if code == c.QUEUE_ASK:
        return QueueAsk(data=fields.data, queue_key=fields.queue_key)
    return _EVENT_FOR_CODE[code](data=fields.data)


def decode(data: bytes) -> Event:
    """Exactly one whole frame to its event; :class:`RemoteProtocolError` if it is not that."""
    if not data:
        raise RemoteProtocolError("empty input: no frame")
    if data[0] not in _BY_CODE:
        raise _header_error(data)
    try:
        fields = FRAME.parse(data).frame
    except ConstructError as exc:
        if data[0] in _CARRIES_MESSAGE and len(data) >= 2 and \
                data[1] not in (c.SURE_MSG, c.UNSURE_MSG):
            raise _header_error(data) from None
        raise RemoteProtocolError(
            f"truncated {c.MessageCode(data[0]).name} frame ({len(data)} bytes)") from exc
    size = len(FRAME.build({"frame": fields, "message_code": data[0]}))
    if size != len(data):
        raise RemoteProtocolError(
            f"{len(data) - size} bytes after a whole {c.MessageCode(data[0]).name} frame")
    return _event_from_parsed(data[0], fields)


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: ``next_event()`` needs more bytes before it can say anything.
NEED_DATA: Final = _Sentinel("NEED_DATA")
#: The peer closed the stream at a frame boundary.
CLOSED: Final = _Sentinel("CLOSED")


class FrameDecoder:
    """Bytes in, events out. Input may be split anywhere, down to one byte at a time.

    Memory stays bounded whatever the peer claims: at most one frame of up to
    ``max_message_size`` octets of body is held. A ``MESSAGE`` whose claimed length is over
    ``max_message_size`` is reported as :class:`OversizedMessage` as soon as its header is in,
    and its body is then discarded as it arrives. A claimed length over ``hard_cap``
    (default :data:`rqp.protocol.constants.HARD_MESSAGE_CAP`; ``None`` for no cap) is a protocol error
    (spec 5.4: no real message is that big).

    ``accept`` is the set of message codes this side may receive (``REQUESTS`` for a
    receiving MCA, ``ANSWERS`` for a sending one); any other valid frame is a protocol error
    (spec 5.3). After a :class:`RemoteProtocolError` the decoder stays failed: a stream cannot be
    resynchronised.
    """

    __slots__ = ("_buf", "_pos", "_skip", "_skipping", "_eof", "_error", "accept",
                 "max_message_size", "hard_cap")

    def __init__(self, *, accept=frozenset(_BY_CODE), max_message_size: int = c.HARD_MESSAGE_CAP,
                 hard_cap: int | None = c.HARD_MESSAGE_CAP) -> None:
        if max_message_size < 0:
            raise ValueError(f"max_message_size must be >= 0, got {max_message_size}")
        self.accept = frozenset(accept)
        self.max_message_size = max_message_size
        self.hard_cap = hard_cap
        self._buf = bytearray()
        self._pos = 0  # octets of _buf already consumed (compacted lazily, not per frame)
        self._skip = 0  # body octets of an oversized MESSAGE still to discard
        self._skipping = "MESSAGE"  # (its frame's name, for an error)
        self._eof = False
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Octets held, waiting for the rest of their frame."""
        return len(self._buf) - self._pos

    @property
    def skipping(self) -> int:
        """Octets of an oversized message body still to be discarded."""
        return self._skip

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its side."""
        if self._eof:
            raise LocalProtocolError("receive_data() after the end of the stream")
        if not data:
            self._eof = True
            return
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            if dropped == len(data):
                return
            data = memoryview(data)[dropped:]
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def next_event(self):
        """The next :class:`Event`, or :data:`NEED_DATA`, or :data:`CLOSED`."""
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def _next_event(self):
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if self._skip or not avail:
            if self._eof:
                if self._skip:
                    raise RemoteProtocolError(f"stream closed {self._skip} octets before the end "
                                              f"of an oversized {self._skipping}")
                return CLOSED
            return NEED_DATA
        code = buf[pos]
        fixed = _FIXED_SIZE.get(code)
        if fixed is None:
            raise _header_error(buf[pos:pos + 8])
        if code not in self.accept:
            raise RemoteProtocolError(
                f"unexpected {c.MessageCode(code).name} frame: this side only receives "
                + ", ".join(sorted(c.MessageCode(a).name for a in self.accept))
                + (" here (MESSAGE_EX only once an answer to QUEUE_ASK on this connection has "
                   "agreed to it, spec section 6)" if code == c.MessageCode.MESSAGE_EX else ""))
        if code in _CARRIES_MESSAGE and avail >= 2 and buf[pos + 1] > c.UNSURE_MSG:
            raise _header_error(buf[pos:pos + 2])
        if avail < fixed:
            return self._need_more(code, fixed)
        if code not in _CARRIES_MESSAGE:
            self._pos = pos + fixed
            if code == c.QUEUE_ASK:
                return QueueAsk(data=buf[pos + 1],
                                queue_key=int.from_bytes(buf[pos + 2:pos + fixed], "big"))
            return _REPLY_EVENTS[code][buf[pos + 1]]
        # Code and type are checked above; the struct reader only splits the fixed fields.
        extended = code == c.MESSAGE_EX
        if extended:
            _, message_type, key, queue_key, mtype, priority, flags, expires_at_ms, length = \
                _UNPACK_EX_HEADER(buf, pos)
            if mtype < 1 or priority > c.MAX_PRIORITY or flags & ~c.KNOWN_FLAGS:
                _extras_error(MESSAGE_EX_HEADER.parse(bytes(buf[pos:pos + fixed])))
            extras = (mtype, priority, flags, expires_at_ms)
        else:
            _, message_type, key, queue_key, length = _UNPACK_HEADER(buf, pos)
            extras = None
        if self.hard_cap is not None and length > self.hard_cap:
            raise RemoteProtocolError(
                f"{c.MessageCode(code).name} key={key:#018x} claims message_length "
                f"{length}, over the hard cap of {self.hard_cap} octets: no System V message "
                f"can be that long")
        if length > self.max_message_size:
            have = min(avail - fixed, length)
            del buf[:pos + fixed + have]
            self._pos = 0
            self._skip = length - have
            self._skipping = c.MessageCode(code).name
            return OversizedMessage(message_type=message_type, key=key,
                                    queue_key=queue_key, message_length=length,
                                    limit=self.max_message_size, extras=extras)
        if avail < fixed + length:
            return self._need_more(code, fixed + length)
        start = pos + fixed
        self._pos = start + length
        body = bytes(buf[start:start + length])
        if extended:  # (every field checked above: no second check in __post_init__)
            return unchecked_message_ex(message_type, key, queue_key, body, mtype, priority,
                                        flags, expires_at_ms)
        return unchecked_message(message_type, key, queue_key, body)

    def _need_more(self, code: int, size: int):
        if self._eof:
            raise RemoteProtocolError(
                f"stream closed inside a {c.MessageCode(code).name} frame: "
                f"{self.buffered} of {size} octets received")
        return NEED_DATA

    def events(self, data: bytes) -> list:
        """Feed ``data`` and return every event it completes (convenience for tests and tools)."""
        self.receive_data(data)
        out = []
        while (event := self.next_event()) is not NEED_DATA and event is not CLOSED:
            out.append(event)
        return out
