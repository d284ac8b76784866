"""One event class per RQP frame: frozen, keyword-only dataclasses that validate themselves.

Events are what the protocol core works with; :mod:`rqp.protocol.frames` turns them into bytes and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rqp.protocol.constants import MESSAGE, DELIVERED_YES, DELIVERED_ERROR, QUEUE_ASK, QUEUE_YES, QUEUE_NO
from rqp.protocol.constants import SURE_MSG, UNSURE_MSG
from rqp.protocol.constants import (
    DEFAULT_PRIORITY, INT64_MAX, KNOWN_FLAGS, MAX_PRIORITY, MESSAGE_EX, MIN_PRIORITY,
)
from rqp.protocol.errors import LocalProtocolError

__all__ = [
    "Event", "Message", "MessageEx", "DeliveredYes", "DeliveredError", "QueueAsk", "QueueYes", "QueueNo",
    "OversizedMessage", "ANSWERS", "REQUESTS", "REQUESTS_EX", "check_extras",
]


def _check_uint(name: str, value: object, bits: int) -> None:
    if type(value) is not int or not 0 <= value < (1 << bits):  # bool is not a valid field value
        raise LocalProtocolError(f"{name} must be an integer in 0..{(1 << bits) - 1}, got {value!r}")


def _check_type(value: object) -> None:
    if value not in (SURE_MSG, UNSURE_MSG) or type(value) is bool:
        raise LocalProtocolError(
            f"message_type must be SURE_MSG ({SURE_MSG}) or UNSURE_MSG ({UNSURE_MSG}), got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """Base class of every frame event. ``code`` is the frame's ``message_code``."""

    code = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class _Reply(Event):
    data: int = 0

    def __post_init__(self) -> None:
        _check_uint("data", self.data, 8)


@dataclass(frozen=True, kw_only=True, slots=True)
class Message(Event):
    """A ``MESSAGE`` frame: one application message for the queue ``queue_key``."""

    code = MESSAGE
    message_type: int
    key: int
    queue_key: int
    message: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_type(self.message_type)
        _check_uint("key", self.key, 64)
        _check_uint("queue_key", self.queue_key, 64)
        if not isinstance(self.message, (bytes, bytearray, memoryview)):
            raise LocalProtocolError(f"message must be bytes, got {type(self.message).__name__}")

    @property
    def message_length(self) -> int:
        return len(self.message)

    def __repr__(self) -> str:  # keep payloads out of logs
        return (f"Message(message_type={self.message_type}, key={self.key:#018x}, "
                f"queue_key={self.queue_key:#x}, message_length={len(self.message)})")


def check_extras(mtype: object, priority: object, flags: object, expires_at_ms: object,
                 error=LocalProtocolError) -> None:
    """Raise ``error`` if the fields a ``MESSAGE_EX`` adds are out of range (spec section 6):
    ``mtype`` 1..2**63-1 (System V refuses anything else), ``priority`` 0..9, only known
    ``flags``, ``expires_at_ms`` a uint64."""
    if type(mtype) is not int or not 1 <= mtype <= INT64_MAX:
        raise error(f"mtype must be an integer in 1..{INT64_MAX} (System V message types are "
                    f"positive), got {mtype!r}")
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise error(f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got "
                    f"{priority!r}")
    if type(flags) is not int or flags & ~KNOWN_FLAGS or not 0 <= flags < 256:
        raise error(f"flags must hold only BATCH_MORE (0x01), got {flags!r}")
    _check_uint("expires_at_ms", expires_at_ms, 64)


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageEx(Message):
    """A ``MESSAGE_EX`` frame (spec section 6): a :class:`Message` with the System V
    ``mtype`` it is put with, a ``priority``, ``flags`` (``BATCH_MORE``) and an expiry
    (``expires_at_ms``, Unix milliseconds; 0: never)."""

    code = MESSAGE_EX
    mtype: int = 1
    priority: int = DEFAULT_PRIORITY
    flags: int = 0
    expires_at_ms: int = 0

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        check_extras(self.mtype, self.priority, self.flags, self.expires_at_ms)

    def __repr__(self) -> str:
        return (f"MessageEx(message_type={self.message_type}, key={self.key:#018x}, "
                f"queue_key={self.queue_key:#x}, mtype={self.mtype}, priority={self.priority}, "
                f"flags={self.flags:#x}, expires_at_ms={self.expires_at_ms}, "
                f"message_length={len(self.message)})")


# The frame decoder's constructors: the same objects as ``Message(...)`` and ``MessageEx(...)``,
# in a third of the time, without the checks of ``__post_init__`` (a frozen dataclass sets each
# field through ``object.__setattr__``, then validates). Only for fields already checked: the
# fixed fields struct-unpacked from a frame whose code and message_type the decoder validated,
# the extras checked by it. tests/test_frames.py proves they set every field.
_new = object.__new__
_SET_TYPE, _SET_KEY, _SET_QUEUE_KEY, _SET_MESSAGE, _SET_MTYPE, _SET_PRIORITY, _SET_FLAGS, \
    _SET_EXPIRES = (getattr(MessageEx, name).__set__ for name in (
        "message_type", "key", "queue_key", "message", "mtype", "priority", "flags",
        "expires_at_ms"))


def unchecked_message(message_type: int, key: int, queue_key: int, message: bytes) -> Message:
    obj = _new(Message)
    _SET_TYPE(obj, message_type)
    _SET_KEY(obj, key)
    _SET_QUEUE_KEY(obj, queue_key)
    _SET_MESSAGE(obj, message)
    return obj


def unchecked_message_ex(message_type: int, key: int, queue_key: int, message: bytes,
                         mtype: int, priority: int, flags: int,
                         expires_at_ms: int) -> MessageEx:
    obj = _new(MessageEx)
    _SET_TYPE(obj, message_type)
    _SET_KEY(obj, key)
    _SET_QUEUE_KEY(obj, queue_key)
    _SET_MESSAGE(obj, message)
    _SET_MTYPE(obj, mtype)
    _SET_PRIORITY(obj, priority)
    _SET_FLAGS(obj, flags)
    _SET_EXPIRES(obj, expires_at_ms)
    return obj


@dataclass(frozen=True, kw_only=True, slots=True)
class OversizedMessage(Event):
    """A ``MESSAGE`` whose claimed length is over the decoder's maximum.

    Not a frame of its own: the decoder reports the header and discards the body as it streams
    past (spec 5.4), so the receiving agent can dead-letter the header and answer
    ``DELIVERED_ERROR``. It counts as one received ``MESSAGE`` for the order of answers.
    """

    code = MESSAGE
    message_type: int
    key: int
    queue_key: int
    message_length: int
    limit: int
    #: For a MESSAGE_EX: its mtype, priority, flags and expiry, as for :class:`MessageEx`.
    extras: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        _check_uint("message_length", self.message_length, 64)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveredYes(_Reply):
    code = DELIVERED_YES


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveredError(_Reply):
    code = DELIVERED_ERROR


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueAsk(Event):
    code = QUEUE_ASK
    queue_key: int
    data: int = 0

    def __post_init__(self) -> None:
        _check_uint("queue_key", self.queue_key, 64)
        _check_uint("data", self.data, 8)


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueYes(_Reply):
    code = QUEUE_YES


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueNo(_Reply):
    code = QUEUE_NO


#: Frames a receiving MCA accepts, and frames a sending MCA accepts.
REQUESTS = frozenset({MESSAGE, QUEUE_ASK})
#: What a receiving MCA accepts once it has answered with EXT_MESSAGE (spec section 6).
REQUESTS_EX = REQUESTS | {MESSAGE_EX}
ANSWERS = frozenset({DELIVERED_YES, DELIVERED_ERROR, QUEUE_YES, QUEUE_NO})
