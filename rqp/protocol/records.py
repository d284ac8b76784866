"""The two records RQP keeps on local System V queues, declared with ``construct``.

Every integer is an unsigned big-endian number. Records are packed: there is no padding and no
alignment anywhere, so a C program must read and write them field by field (or with a
``__attribute__((packed))`` struct and ``htobe16/32/64`` / ``be16/32/64toh``). Every record is
exactly one System V message: the ``mtext`` of the message is the record, nothing more.

Transmission record
===================

What ``sendMessage`` puts on the transmission queue (``RQP.XMIT.Q``), always with
``mtype = constants.DEFAULT_MTYPE`` (1). A sending agent takes it off and sends it. Version 2 is
what this version writes; version 1 (the first 36 bytes of version 2, then the payload) is still
read, as ``mtype`` 1, priority 4, no expiry. ``rqp.h`` (:func:`rqp.get_include`) builds it in C.

======  ====  ===============  ==============================================================
offset  size  field            meaning
======  ====  ===============  ==============================================================
0       4     magic            the bytes ``"RQPX"`` (0x52 0x51 0x50 0x58)
4       1     version          2 (1: no fields from offset 36 on but the payload)
5       1     message_type     0 = SURE_MSG, 1 = UNSURE_MSG. The parser accepts any byte: the
                               agent validates it so that a bad value is dead-lettered with
                               ``BAD_MESSAGE_TYPE`` instead of being unreadable.
6       2     flags            bit 0 = SYNC (the producer waits for a journal
                               acknowledgement; reserved for later). bit 1 = REPLAY_KEY:
                               ``sequence`` holds the message's original RQP key (a dead
                               letter put back by ``rqpctl dlq replay``); the sending MCA
                               sends it with that key instead of a new one, so the receiving
                               MCA recognises a repeat. bit 2 = BATCH: the payload is an
                               atomic batch (below). Other bits are 0.
8       8     queue_key        destination queue key: the ``key_t`` in the low 32 bits;
                               0 (``IPC_PRIVATE``) means "none".
16      4     producer_pid     pid of the producing process (0 if unknown)
20      8     sequence         per-producer sequence number (0 if unused); with
                               REPLAY_KEY, the message key to send it with
28      8     enqueued_ns      unix time in nanoseconds when the record was made
36      8     mtype            (version 2) signed: the System V ``mtype`` the message is put
                               with at the destination, 1 or more
44      8     expires_at_ms    (version 2) unix time in milliseconds after which the message
                               must not be delivered; 0 = never
52      1     priority         (version 2) 0 (lowest) .. 9 (highest); 4 is the default
53      11    reserved         (version 2) zero
64      n     payload          the application's message: every remaining byte of the
                               System V message (n = message length - 64, may be 0)
======  ====  ===============  ==============================================================

The header is :data:`TRANSMISSION_HEADER_SIZE` (64) bytes, so the largest application payload
is ``msgmax - 64`` bytes (:func:`rqp.system.queues.max_payload`). A record whose ``mtype`` is
below 1, whose priority is over 9 or whose reserved bytes are not zero is malformed.

**Batch** (flag BATCH): the messages of one atomic batch (``rqp.batch``, spec section 6) in one
record, so that the kernel's ``msgsnd`` makes the commit atomic: the record is on the
transmission queue whole, or not at all. The header's ``message_type``, ``queue_key``,
``priority`` and ``expires_at_ms`` hold for every message of it, its ``mtype`` is 1; the payload
is 1 .. 256 members, one after the other, up to the end of the record:

======  ====  ===============  ==============================================================
offset  size  field            meaning
======  ====  ===============  ==============================================================
+0      8     mtype            signed, 1 or more: the member's System V ``mtype``
+8      4     length           n: the member's size
+12     n     data             the member's bytes
======  ====  ===============  ==============================================================

A batch's members together (12 bytes each plus their data) must fit ``msgmax - 64``.

Dead-letter record
==================

What an agent puts on ``DEAD.LETTER.Q`` (also with ``mtype = 1``) when it cannot deliver a
message; IBM MQ's MQDLH is the model. The first 64 bytes are fixed, then come five
length-prefixed UTF-8 strings (the length counts bytes, there is no terminating NUL) and the
length-prefixed payload. The record ends exactly at the end of the payload. Version 2 is
written; version 1 (without the 17 bytes at offset 47: no strings move but by 17) is still
read, as ``mtype`` 1, priority 4, no expiry.

======  ====  =================  ============================================================
offset  size  field              meaning
======  ====  =================  ============================================================
0       4     magic              the bytes ``"RQDL"`` (0x52 0x51 0x44 0x4C)
4       1     version            2 (1: no offsets 47..63, everything after them 17 earlier)
5       2     reason             :class:`ReasonCode` (readers must accept unknown numbers)
7       1     message_type       0 = SURE, 1 = UNSURE, 255 = unknown
8       2     flags              bit 0 = TRUNCATED: the payload was cut to fit ``msgmax``; the
                                 full payload is in the file ``spill_path`` (if not empty).
                                 bit 1 = HEADER_ONLY: the payload was never read (e.g. an
                                 oversized message skipped on the wire). Other bits are 0.
10      1     agent              :class:`AgentKind` that dead-lettered it (1 API, 2 SENDER,
                                 3 RECEIVER, 4 TOOL)
11      8     queue_key          the original queue key exactly as received (may be > 2**32-1)
19      8     message_key        RQP unique message key (0 if none yet)
27      8     timestamp_ns       unix time in nanoseconds when it was dead-lettered
35      4     attempts           times it was sent (MESSAGE frames that carried it; a try
                                 that found no route or no connection sends none)
39      8     original_length    length in bytes of the original payload
47      8     mtype              (version 2) signed: the System V type the message was to be
                                 put with (1 or more), so that a replay keeps it
55      8     expires_at_ms      (version 2) its expiry, Unix ms; 0 = never
63      1     priority           (version 2) its priority, 0..9
64      1     H                  length of host
65      H     host               host name where it was dead-lettered
A=65+H  1     S                  length of source_host
A+1     S     source_host        host the message came from ('' if local)
B=A+1+S 1     D                  length of destination_host
B+1     D     destination_host   host it was going to ('' if unknown)
C=B+1+D 2     T                  length of detail
C+2     T     detail             human-readable detail, e.g. "errno 13: Permission denied"
E=C+2+T 2     P                  length of spill_path
E+2     P     spill_path         file holding the full payload when TRUNCATED, else empty
F=E+2+P 4     N                  payload_length
F+4     N     payload            the (possibly truncated) payload; F+4+N = message length
======  ====  =================  ============================================================

The strings are UTF-8 without a terminating NUL; their lengths count bytes. With all strings
empty and no payload a dead-letter record is :data:`DEAD_LETTER_MIN_SIZE` (75) bytes. Strings
longer than their length field allows are cut at a UTF-8 character boundary when the record is
made. A record must fit in one System V message (``msgmax``):
:func:`rqp.storage.deadletters.fit_dead_letter` cuts the payload (flag TRUNCATED) and can spill
the whole payload to a file first.

Decoding untrusted bytes (``from_bytes``) always uses the plain construct parser and raises
:class:`rqp.protocol.errors.RecordError` for anything malformed; the compiled structs (``*_COMPILED``)
are used only for building, where the input is our own validated dataclass.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from dataclasses import dataclass, field

import construct
from construct import (
    Bytes,
    Const,
    GreedyBytes,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64sb,
    Int64ub,
    PascalString,
    Rebuild,
    Struct,
    Terminated,
    len_,
    this,
)

from rqp.protocol.constants import (
    DEFAULT_PRIORITY, INT64_MAX, MAX_BATCH, MAX_PRIORITY, SURE_MSG, UINT64_MAX, UNSURE_MSG,
    MessageType,
)
from rqp.protocol.codec import struct_of
from rqp.protocol.errors import RecordError
from rqp.protocol.reasons import ReasonCode, describe

__all__ = [
    "AgentKind",
    "BATCH_MEMBER",
    "BATCH_MEMBER_HEADER_SIZE",
    "check_extras",
    "check_mtype",
    "decode_batch",
    "encode_batch",
    "encode_transmission",
    "DEAD_LETTER_FIXED",
    "DEAD_LETTER_FIXED_SIZE",
    "DEAD_LETTER_MAGIC",
    "DEAD_LETTER_MIN_SIZE",
    "DEAD_LETTER_RECORD",
    "DEAD_LETTER_RECORD_COMPILED",
    "DEAD_LETTER_VERSION",
    "REPLAYED_NOTE",
    "DeadLetterFlags",
    "DeadLetterRecord",
    "TRANSMISSION_HEADER",
    "TRANSMISSION_HEADER_SIZE",
    "TRANSMISSION_MAGIC",
    "TRANSMISSION_RECORD",
    "TRANSMISSION_RECORD_COMPILED",
    "TRANSMISSION_RECORD_V1",
    "TRANSMISSION_HEADER_V1_SIZE",
    "TRANSMISSION_VERSION",
    "TransmissionFlags",
    "TransmissionRecord",
    "UNKNOWN_MESSAGE_TYPE",
]

TRANSMISSION_MAGIC = b"RQPX"
TRANSMISSION_VERSION = 2
DEAD_LETTER_MAGIC = b"RQDL"
DEAD_LETTER_VERSION = 2

#: ``message_type`` of a dead-letter record whose message type is not known.
UNKNOWN_MESSAGE_TYPE = 255

#: What the sending MCA adds, in brackets, to the ``detail`` of the dead-letter record of a
#: message it was given with flag REPLAY_KEY (``rqpctl dlq replay`` / ``resubmit``): the
#: archive row of a message dead-lettered AGAIN says it is a replay, with the same
#: ``message_key`` as before. (A receiving MCA cannot tell: the wire carries no such mark.)
REPLAYED_NOTE = "a replay: sent again with its original key"

_UINT8_MAX = (1 << 8) - 1
_UINT16_MAX = (1 << 16) - 1
_UINT32_MAX = (1 << 32) - 1

# --------------------------------------------------------------------------------------------
# Declarations
# --------------------------------------------------------------------------------------------

#: The fields both versions of a transmission record begin with (36 bytes, without the version).
_TRANSMISSION_COMMON = (
    "message_type" / Int8ub,
    "flags" / Int16ub,
    "queue_key" / Int64ub,
    "producer_pid" / Int32ub,
    "sequence" / Int64ub,
    "enqueued_ns" / Int64ub,
)

#: The fixed 64-byte header of a transmission record (version 2, the one written).
TRANSMISSION_HEADER = Struct(
    "magic" / Const(TRANSMISSION_MAGIC),
    "version" / Const(TRANSMISSION_VERSION, Int8ub),
    *_TRANSMISSION_COMMON,
    "mtype" / Int64sb,
    "expires_at_ms" / Int64ub,
    "priority" / Int8ub,
    "reserved" / Const(bytes(11)),
)

TRANSMISSION_HEADER_SIZE: int = TRANSMISSION_HEADER.sizeof()

#: A whole transmission record: the header, then the payload up to the end of the message.
TRANSMISSION_RECORD = Struct(
    *TRANSMISSION_HEADER.subcons,
    "payload" / GreedyBytes,
)

#: One member of a batch record's payload (flag BATCH).
BATCH_MEMBER = Struct(
    "mtype" / Int64sb,
    "length" / Rebuild(Int32ub, len_(this.data)),
    "data" / Bytes(this.length),
)
BATCH_MEMBER_HEADER_SIZE = 12

#: Version 1 (read only): the first 36 bytes of version 2, then the payload.
TRANSMISSION_RECORD_V1 = Struct(
    "magic" / Const(TRANSMISSION_MAGIC),
    "version" / Const(1, Int8ub),
    *_TRANSMISSION_COMMON,
    "payload" / GreedyBytes,
)
TRANSMISSION_HEADER_V1_SIZE = 36

#: What version 1 and 2 share at the start of a dead-letter record (after the version byte).
_DEAD_LETTER_COMMON = (
    "reason" / Int16ub,
    "message_type" / Int8ub,
    "flags" / Int16ub,
    "agent" / Int8ub,
    "queue_key" / Int64ub,
    "message_key" / Int64ub,
    "timestamp_ns" / Int64ub,
    "attempts" / Int32ub,
    "original_length" / Int64ub,
)

#: The fixed part of a dead-letter record (version 2), up to ``priority`` (64 bytes).
DEAD_LETTER_FIXED = Struct(
    "magic" / Const(DEAD_LETTER_MAGIC),
    "version" / Const(DEAD_LETTER_VERSION, Int8ub),
    *_DEAD_LETTER_COMMON,
    "mtype" / Int64sb,
    "expires_at_ms" / Int64ub,
    "priority" / Int8ub,
)

DEAD_LETTER_FIXED_SIZE: int = DEAD_LETTER_FIXED.sizeof()

#: What follows the fixed part in both versions: the strings and the payload.
_DEAD_LETTER_TAIL = (
    "host" / PascalString(Int8ub, "utf8"),
    "source_host" / PascalString(Int8ub, "utf8"),
    "destination_host" / PascalString(Int8ub, "utf8"),
    "detail" / PascalString(Int16ub, "utf8"),
    "spill_path" / PascalString(Int16ub, "utf8"),
    "payload_length" / Rebuild(Int32ub, len_(this.payload)),
    "payload" / Bytes(this.payload_length),
    Terminated,
)

#: A whole dead-letter record. The record must end exactly where the payload ends.
DEAD_LETTER_RECORD = Struct(*DEAD_LETTER_FIXED.subcons, *_DEAD_LETTER_TAIL)

#: Version 1 (read, and written again only as it was read): no mtype, expiry, priority.
DEAD_LETTER_RECORD_V1 = Struct(
    "magic" / Const(DEAD_LETTER_MAGIC),
    "version" / Const(1, Int8ub),
    *_DEAD_LETTER_COMMON,
    *_DEAD_LETTER_TAIL,
)

#: Size of the prefixes that follow the fixed part: 3 x uint8, 2 x uint16, 1 x uint32.
_DEAD_LETTER_PREFIXES = (
    Int8ub.sizeof() * 3 + Int16ub.sizeof() * 2 + Int32ub.sizeof()
)
DEAD_LETTER_MIN_SIZE: int = DEAD_LETTER_FIXED_SIZE + _DEAD_LETTER_PREFIXES

# Compiled structs: for BUILDING only. Compiled parsers are not safe on untrusted bytes (a
# short read returns short data instead of failing), so from_bytes uses the plain structs.
TRANSMISSION_RECORD_COMPILED = TRANSMISSION_RECORD.compile()
_PARSE_TRANSMISSION = TRANSMISSION_RECORD_COMPILED.parse
# The hot path (every record a sender takes, every record a producer puts): the header as a
# struct derived from TRANSMISSION_HEADER (rqp.protocol.codec); tests check both agree.
_TX_HEADER = struct_of(TRANSMISSION_HEADER)
_UNPACK_TX = _TX_HEADER.unpack_from
_PACK_TX = _TX_HEADER.pack
_TX_RESERVED = bytes(11)
_PARSE_TRANSMISSION_V1 = TRANSMISSION_RECORD_V1.compile().parse
DEAD_LETTER_RECORD_COMPILED = DEAD_LETTER_RECORD.compile()
_DEAD_LETTER_V1_COMPILED = DEAD_LETTER_RECORD_V1.compile()


# --------------------------------------------------------------------------------------------
# Enumerations
# --------------------------------------------------------------------------------------------

class AgentKind(enum.IntEnum):
    """Who made a dead-letter record (the ``agent`` field)."""

    API = 1
    SENDER = 2
    RECEIVER = 3
    TOOL = 4


class TransmissionFlags(enum.IntFlag):
    """Bits of a transmission record's ``flags``."""

    SYNC = 1 << 0
    REPLAY_KEY = 1 << 1  # ``sequence`` is the RQP message key to send it with
    BATCH = 1 << 2  # the payload is the members of an atomic batch


# The bits as plain ints for the hot path (``int & IntFlag`` goes through enum code: ~1 us).
_SYNC, _REPLAY_KEY, _BATCH = (int(f) for f in (TransmissionFlags.SYNC,
                                                TransmissionFlags.REPLAY_KEY,
                                                TransmissionFlags.BATCH))


class DeadLetterFlags(enum.IntFlag):
    """Bits of a dead-letter record's ``flags``."""

    TRUNCATED = 1 << 0
    HEADER_ONLY = 1 << 1


def _known(enum_cls: type[enum.IntEnum], value: int) -> int:
    """``enum_cls(value)`` if the number is known, else the plain int."""
    try:
        return enum_cls(value)
    except ValueError:
        return int(value)


_MESSAGE_TYPES = {int(t): t for t in MessageType}  # _known(MessageType, ...) by lookup


def _check_uint(name: str, value: int, maximum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise ValueError(f"{name} must be an integer in 0..{maximum}, got {value!r}")


def _cut_utf8(text: str, limit: int) -> str:
    """``text`` cut so that its UTF-8 encoding is at most ``limit`` bytes, at a character boundary.

    Characters that cannot be encoded (lone surrogates) become ``?``.
    """
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw.decode("utf-8")
    # A prefix of valid UTF-8 can only end in one incomplete character; "ignore" drops it.
    return raw[:limit].decode("utf-8", "ignore")


def _decode_error(kind: str, magic: bytes, versions: tuple[int, ...], header_size: int,
                  data: bytes, exc: Exception) -> RecordError:
    """Turn a parse failure into a RecordError that says what is wrong with ``data``."""
    found = bytes(data[: len(magic)])
    if found != magic[: len(found)]:
        return RecordError(f"not a {kind}: bad magic {found!r}, expected {magic!r}")
    if len(data) > len(magic) and data[len(magic)] not in versions:
        readable = " and ".join(map(str, versions))
        return RecordError(
            f"unsupported {kind} version {data[len(magic)]} (this program reads version "
            f"{readable})"
        )
    if len(data) < header_size:
        return RecordError(
            f"truncated {kind}: {len(data)} bytes, shorter than its {header_size}-byte header"
        )
    if isinstance(exc, construct.ConstError):  # magic and version are right: the reserved bytes
        return RecordError(f"{kind} has reserved bytes that are not zero")
    if isinstance(exc, construct.TerminatedError):
        return RecordError(f"{kind} of {len(data)} bytes has trailing bytes after the payload")
    if isinstance(exc, (UnicodeDecodeError, construct.StringError)):
        return RecordError(f"{kind} has a string field that is not valid UTF-8: {exc}")
    field_path = (getattr(exc, "path", None) or "").replace("(parsing)", "").strip(" ->")
    return RecordError(
        f"truncated {kind}: {len(data)} bytes, but field {field_path or '?'!r} "
        f"needs more bytes than remain"
    )


# --------------------------------------------------------------------------------------------
# Transmission record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransmissionRecord:
    """One application message waiting on the transmission queue.

    ``message_type`` is kept as read (any byte): :meth:`is_valid_type` tells the agent whether
    it must dead-letter it with ``BAD_MESSAGE_TYPE``. ``mtype``, ``priority`` and
    ``expires_at_ms`` are the System V extras of spec section 6 (a version 1 record reads as the
    defaults); a record with values out of their range cannot be made (or read).
    """

    message_type: int
    queue_key: int
    payload: bytes
    flags: int = 0
    producer_pid: int = 0
    sequence: int = 0
    enqueued_ns: int = 0
    mtype: int = 1
    priority: int = DEFAULT_PRIORITY
    expires_at_ms: int = 0

    def __post_init__(self) -> None:
        _check_uint("message_type", self.message_type, _UINT8_MAX)
        _check_uint("flags", self.flags, _UINT16_MAX)
        _check_uint("queue_key", self.queue_key, UINT64_MAX)
        _check_uint("producer_pid", self.producer_pid, _UINT32_MAX)
        _check_uint("sequence", self.sequence, UINT64_MAX)
        _check_uint("enqueued_ns", self.enqueued_ns, UINT64_MAX)
        _check_uint("expires_at_ms", self.expires_at_ms, UINT64_MAX)
        check_extras(self.mtype, self.priority)
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(self.payload).__name__}")
        if not isinstance(self.payload, bytes):
            object.__setattr__(self, "payload", bytes(self.payload))
        if self.flags & _BATCH:  # decoded once, here: members() keeps it
            try:
                object.__setattr__(self, "_members", decode_batch(self.payload))
            except RecordError as exc:
                raise ValueError(str(exc)) from None

    @property
    def sync(self) -> bool:
        return bool(self.flags & _SYNC)

    @property
    def replays_key(self) -> bool:
        """``sequence`` is the RQP message key to send it with (a replayed dead letter)."""
        return bool(self.flags & _REPLAY_KEY)

    def is_valid_type(self) -> bool:
        return self.message_type in (SURE_MSG, UNSURE_MSG)

    @property
    def is_batch(self) -> bool:
        return bool(self.flags & _BATCH)

    def members(self) -> tuple[tuple[int, bytes], ...]:
        """A batch record's messages, ``((mtype, data), ...)``; :class:`RecordError` says what
        is wrong with a malformed one."""
        if not self.flags & _BATCH:
            return decode_batch(self.payload)  # (not a batch: what its payload would say)
        return self._members

    def _fields(self) -> dict:
        return {
            "message_type": self.message_type,
            "flags": self.flags,
            "queue_key": self.queue_key,
            "producer_pid": self.producer_pid,
            "sequence": self.sequence,
            "enqueued_ns": self.enqueued_ns,
            "mtype": self.mtype,
            "expires_at_ms": self.expires_at_ms,
            "priority": self.priority,
            "payload": self.payload,
        }

    def to_bytes(self) -> bytes:
        """The record (version 2) as the bytes of one System V message."""
        return encode_transmission(self.message_type, self.queue_key, self.payload, self.flags,
                                   self.producer_pid, self.sequence, self.enqueued_ns,
                                   self.mtype, self.priority, self.expires_at_ms)

    @classmethod
    def from_bytes(cls, data: bytes) -> "TransmissionRecord":
        """Decode one System V message (version 2 or 1); :class:`RecordError` says what is wrong
        if it can't."""
        data = bytes(data)
        if len(data) >= TRANSMISSION_HEADER_SIZE:  # the hot path: a well-formed version 2
            (magic, version, message_type, flags, queue_key, producer_pid, sequence,
             enqueued_ns, mtype, expires_at_ms, priority, reserved) = _UNPACK_TX(data)
            if magic == TRANSMISSION_MAGIC and version == TRANSMISSION_VERSION and \
                    reserved == _TX_RESERVED and mtype >= 1 and priority <= MAX_PRIORITY:
                # Every field is in range by its width and the checks above: the record is
                # made without __init__'s checks (a third of this path's cost).
                record = object.__new__(cls)
                record.__dict__.update(
                    message_type=_MESSAGE_TYPES.get(message_type, message_type),
                    queue_key=queue_key, payload=data[TRANSMISSION_HEADER_SIZE:], flags=flags,
                    producer_pid=producer_pid, sequence=sequence, enqueued_ns=enqueued_ns,
                    mtype=mtype, priority=priority, expires_at_ms=expires_at_ms)
                if flags & _BATCH:
                    try:
                        record.__dict__["_members"] = decode_batch(record.payload)
                    except RecordError as exc:
                        raise RecordError(f"transmission record: {exc}") from None
                return record
        v1 = len(data) > 4 and data[4] == 1
        try:  # anything else: construct, which says what is wrong
            # The record is a fixed header and then every remaining byte, so once the header is
            # all there the compiled parser (which checks the magic and version Consts but not
            # lengths) is safe, and about three times faster: this is the sender's hot path.
            if v1:
                c = (_PARSE_TRANSMISSION_V1(data) if len(data) >= TRANSMISSION_HEADER_V1_SIZE
                     else TRANSMISSION_RECORD_V1.parse(data))
            elif len(data) >= TRANSMISSION_HEADER_SIZE:
                c = _PARSE_TRANSMISSION(data)
            else:
                c = TRANSMISSION_RECORD.parse(data)
        except (construct.ConstructError, UnicodeDecodeError) as exc:
            raise _decode_error(
                "transmission record", TRANSMISSION_MAGIC, (TRANSMISSION_VERSION, 1),
                TRANSMISSION_HEADER_V1_SIZE if v1 else TRANSMISSION_HEADER_SIZE, data, exc,
            ) from None
        extras = {} if v1 else {"mtype": c.mtype, "priority": c.priority,
                                "expires_at_ms": c.expires_at_ms}
        try:
            return cls(
                message_type=_known(MessageType, c.message_type),
                queue_key=c.queue_key,
                payload=c.payload,
                flags=c.flags,
                producer_pid=c.producer_pid,
                sequence=c.sequence,
                enqueued_ns=c.enqueued_ns,
                **extras,
            )
        except ValueError as exc:
            raise RecordError(f"transmission record: {exc}") from None


def encode_transmission(message_type: int, queue_key: int, payload: bytes, flags: int,
                        producer_pid: int, sequence: int, enqueued_ns: int, mtype: int,
                        priority: int, expires_at_ms: int) -> bytes:
    """A transmission record's bytes from values already checked (a
    :class:`TransmissionRecord`'s, or ``sendMessage``'s after :func:`check_extras`): the
    producer's hot path, without making the object."""
    return _PACK_TX(TRANSMISSION_MAGIC, TRANSMISSION_VERSION, message_type, flags, queue_key,
                    producer_pid, sequence, enqueued_ns, mtype, expires_at_ms, priority,
                    _TX_RESERVED) + payload


def check_mtype(mtype: int) -> None:
    """ValueError, in words that name it, for an ``mtype`` System V would refuse."""
    if not isinstance(mtype, int) or isinstance(mtype, bool) or not 1 <= mtype <= INT64_MAX:
        raise ValueError(f"mtype must be an integer in 1..{INT64_MAX} (System V message "
                         f"types are positive), got {mtype!r}")


def check_extras(mtype: int, priority: int) -> None:
    """ValueError, in words that name them, for an ``mtype`` or priority no record can hold."""
    _check_uint("priority", priority, MAX_PRIORITY)
    check_mtype(mtype)


def encode_batch(members) -> bytes:
    """The payload of a batch record: ``members`` is ``[(mtype, data), ...]``, 1..256 of them,
    each ``mtype`` 1 or more (ValueError otherwise)."""
    members = list(members)
    if not 1 <= len(members) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1..{MAX_BATCH} messages, got {len(members)}")
    out = []
    for mtype, data in members:
        check_mtype(mtype)
        out.append(_BUILD_MEMBER({"mtype": mtype, "data": bytes(data)}))
    return b"".join(out)


def decode_batch(payload: bytes) -> tuple[tuple[int, bytes], ...]:
    """The members of a batch record's payload; :class:`RecordError` if it is malformed."""
    members, offset, size = [], 0, len(payload)
    while offset < size:
        if len(members) == MAX_BATCH:
            raise RecordError(f"batch record: more than {MAX_BATCH} messages")
        if size - offset < BATCH_MEMBER_HEADER_SIZE:
            raise RecordError(f"batch record: {size - offset} bytes at offset {offset} are too "
                              f"few for a message's {BATCH_MEMBER_HEADER_SIZE}-byte header")
        try:
            c = BATCH_MEMBER.parse(payload[offset:])
        except construct.ConstructError:
            length = int.from_bytes(payload[offset + 8:offset + 12], "big")
            raise RecordError(f"batch record: message {len(members) + 1} claims {length} bytes, "
                              f"{size - offset - BATCH_MEMBER_HEADER_SIZE} are left") from None
        if c.mtype < 1:
            raise RecordError(f"batch record: message {len(members) + 1} has mtype {c.mtype} "
                              f"(System V message types are 1 or more)")
        members.append((c.mtype, bytes(c.data)))
        offset += BATCH_MEMBER_HEADER_SIZE + c.length
    if not members:
        raise RecordError("batch record: no messages in it")
    return tuple(members)


_BUILD_MEMBER = BATCH_MEMBER.compile().build


# --------------------------------------------------------------------------------------------
# Dead-letter record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeadLetterRecord:
    """A message that could not be delivered, as kept on ``DEAD.LETTER.Q``.

    Defaults: ``timestamp_ns`` = now, ``host`` = this host's name, ``original_length`` =
    ``len(payload)``. Strings too long for their length field are cut at a UTF-8 character
    boundary here, so ``from_bytes(r.to_bytes()) == r`` always holds.
    """

    reason: ReasonCode | int
    message_type: int = UNKNOWN_MESSAGE_TYPE
    flags: int = 0
    agent: AgentKind | int = AgentKind.TOOL
    queue_key: int = 0
    message_key: int = 0
    timestamp_ns: int | None = None
    attempts: int = 0
    original_length: int | None = None
    host: str | None = None
    source_host: str = ""
    destination_host: str = ""
    detail: str = ""
    spill_path: str = ""
    payload: bytes = field(default=b"", repr=False)
    #: The message's System V extras (spec section 6), so that a replay keeps them.
    mtype: int = 1
    priority: int = DEFAULT_PRIORITY
    expires_at_ms: int = 0
    #: The version it is encoded in: 2, or 1 for a record read as version 1 (which then
    #: encodes to the same bytes, and so keeps its archive id).
    version: int = DEAD_LETTER_VERSION

    def __post_init__(self) -> None:
        setf = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(self.payload).__name__}")
        if not isinstance(self.payload, bytes):
            setf("payload", bytes(self.payload))
        if self.timestamp_ns is None:
            setf("timestamp_ns", time.time_ns())
        if self.original_length is None:
            setf("original_length", len(self.payload))
        if self.host is None:
            setf("host", os.uname().nodename)  # what gethostname() returns
        _check_uint("reason", self.reason, _UINT16_MAX)
        _check_uint("message_type", self.message_type, _UINT8_MAX)
        _check_uint("flags", self.flags, _UINT16_MAX)
        _check_uint("agent", self.agent, _UINT8_MAX)
        _check_uint("queue_key", self.queue_key, UINT64_MAX)
        _check_uint("message_key", self.message_key, UINT64_MAX)
        _check_uint("timestamp_ns", self.timestamp_ns, UINT64_MAX)
        _check_uint("attempts", self.attempts, _UINT32_MAX)
        _check_uint("original_length", self.original_length, UINT64_MAX)
        _check_uint("payload length", len(self.payload), _UINT32_MAX)
        _check_uint("priority", self.priority, _UINT8_MAX)
        _check_uint("expires_at_ms", self.expires_at_ms, UINT64_MAX)
        if not isinstance(self.mtype, int) or isinstance(self.mtype, bool) or \
                not -INT64_MAX - 1 <= self.mtype <= INT64_MAX:
            raise ValueError(f"mtype must be an int64, got {self.mtype!r}")
        if self.version not in (1, DEAD_LETTER_VERSION):
            raise ValueError(f"version must be 1 or {DEAD_LETTER_VERSION}, got {self.version!r}")
        if self.version == 1 and (self.mtype, self.priority, self.expires_at_ms) != \
                (1, DEFAULT_PRIORITY, 0):
            raise ValueError("a version-1 dead-letter record has no mtype, priority or expiry")
        setf("reason", _known(ReasonCode, self.reason))
        setf("agent", _known(AgentKind, self.agent))
        for name, limit in _STRING_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
            setf(name, _cut_utf8(value, limit))

    @property
    def truncated(self) -> bool:
        return bool(self.flags & DeadLetterFlags.TRUNCATED)

    @property
    def header_only(self) -> bool:
        return bool(self.flags & DeadLetterFlags.HEADER_ONLY)

    @property
    def description(self) -> str:
        return describe(self.reason)

    @staticmethod
    def peek_reason(data: bytes) -> int:
        """The ``reason`` of an encoded record (offset 5, uint16) without decoding the rest."""
        return int.from_bytes(data[5:7], "big")

    @classmethod
    def from_transmission(cls, record: TransmissionRecord, *, reason: int, agent: int,
                          **fields) -> "DeadLetterRecord":
        """The dead-letter record of a transmission record (type, key, payload and the
        extras ``mtype``, priority, expiry copied)."""
        mtype = record.message_type if record.is_valid_type() else UNKNOWN_MESSAGE_TYPE
        if not record.is_valid_type() and "detail" not in fields:
            fields["detail"] = f"message type {record.message_type}"
        extras = {"mtype": record.mtype, "priority": record.priority,
                  "expires_at_ms": record.expires_at_ms}
        return cls(reason=reason, agent=agent, message_type=mtype, queue_key=record.queue_key,
                   payload=record.payload, **{**extras, **fields})

    def _fields(self) -> dict:
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def to_bytes(self) -> bytes:
        """The record as the bytes of one System V message (compiled builder), in its
        ``version``."""
        if self.version == 1:
            return _DEAD_LETTER_V1_COMPILED.build(self._fields())
        return DEAD_LETTER_RECORD_COMPILED.build(self._fields())

    def encoded_size(self) -> int:
        """``len(self.to_bytes())`` without building it."""
        return (
            DEAD_LETTER_MIN_SIZE - (_V2_EXTRAS_SIZE if self.version == 1 else 0)
            + sum(len(getattr(self, name).encode("utf-8")) for name in _STRING_LIMITS)
            + len(self.payload)
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "DeadLetterRecord":
        """Decode one System V message; :class:`RecordError` says what is wrong if it can't."""
        data = bytes(data)
        v1 = len(data) > 4 and data[4] == 1
        try:
            c = (DEAD_LETTER_RECORD_V1 if v1 else DEAD_LETTER_RECORD).parse(data)
        except (construct.ConstructError, UnicodeDecodeError) as exc:
            raise _decode_error(
                "dead-letter record", DEAD_LETTER_MAGIC, (DEAD_LETTER_VERSION, 1),
                DEAD_LETTER_MIN_SIZE - (_V2_EXTRAS_SIZE if v1 else 0), data, exc,
            ) from None
        if v1:
            return cls(**{name: c[name] for name in _FIELD_NAMES if name in c})  # version 1
        try:
            return cls(**{name: c[name] for name in _FIELD_NAMES})
        except ValueError as exc:
            raise RecordError(f"dead-letter record: {exc}") from None


_STRING_LIMITS = {
    "host": _UINT8_MAX,
    "source_host": _UINT8_MAX,
    "destination_host": _UINT8_MAX,
    "detail": _UINT16_MAX,
    "spill_path": _UINT16_MAX,
}
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(DeadLetterRecord))
#: The bytes version 2 adds to the fixed part (mtype, expires_at_ms, priority).
_V2_EXTRAS_SIZE = 17
