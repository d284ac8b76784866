"""Why a message was dead-lettered: the one table of reasons.

Every reader takes its vocabulary from :data:`REASONS`: the dead-letter record's ``reason``
field (:class:`ReasonCode`), the archive's ``reason``/``reason_code`` columns (including the
archive's own :data:`MALFORMED` row), the report's transient and message-intrinsic sets, the
synthetic archives of the tests and benchmarks, the replay filters, the receiving MCA's answer
on the wire and the README's table (``tests/test_reasons.py`` compares them all).

Each row says:

* ``code``: the number in a dead-letter record (uint16; ``-1`` for :data:`MALFORMED`, which is
  never in a record: the drain writes it to the archive for a record it cannot read);
* ``by``: who records it: ``sender`` (the sending MCA, or the API on its behalf), ``receiver``
  (the receiving MCA), ``both`` (either, each on its own side) or ``tool`` (the drain);
* ``on_wire``: what the peer hears of it: the receiving MCA answers ``DELIVERED_ERROR``, the
  sending MCA sends nothing (``None``);
* ``transient``: the destination's state at the time, not the message: sent again once the
  cause is fixed, the same message would be delivered (the report's "likely recoverable");
* ``intrinsic``: a property of the message itself: sending it again fails again;
* ``description``: one line for the docs, ``rqpctl dlq`` and the report.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Reason", "REASONS", "BY_NAME", "BY_CODE", "ReasonCode", "MALFORMED",
           "describe", "reason_name", "TRANSIENT", "INTRINSIC"]


@dataclass(frozen=True)
class Reason:
    code: int
    name: str
    by: str
    on_wire: str | None
    transient: bool
    intrinsic: bool
    description: str


_S, _R = "sender", "receiver"
_ERR = "DELIVERED_ERROR"

#: The reasons, in code order. Sending side 1..19, receiving side 20.., the archive's own -1.
REASONS: tuple[Reason, ...] = (
    Reason(1, "NO_QUEUE_KEY", _S, None, False, True,
           "the transmission record's queue key names no queue (0 = IPC_PRIVATE, or over "
           "2**32-1)"),
    Reason(2, "BAD_MESSAGE_TYPE", _S, None, False, True,
           "the message type is neither SURE_MSG (0) nor UNSURE_MSG (1)"),
    Reason(3, "MALFORMED_RECORD", _S, None, False, True,
           "the transmission record is unreadable (bad magic or version, or truncated)"),
    Reason(4, "NO_ROUTE", _S, None, True, False,
           "no host in .rqprc offers the queue (UNSURE message)"),
    Reason(5, "RETRY_BUDGET_EXHAUSTED", _S, None, False, False,
           "the SURE message's retry budget ran out"),
    Reason(6, "NOT_CONFIRMED", _S, None, False, False,
           "reserved: the UNSURE message was not confirmed (recorded only if configured)"),
    Reason(7, "EXPIRED", "both", _ERR, False, True,
           "the message's expiry time passed before it was delivered (the sending MCA drops it "
           "before sending, the receiving MCA on arrival)"),
    Reason(8, "EXTENSION_UNSUPPORTED", _S, None, False, False,
           "the hosts that offer the queue speak plain RQP/1 and cannot carry what the message "
           "needs (an mtype other than 1, or a place in an atomic batch, even a batch of one)"),
    Reason(20, "UNKNOWN_QUEUE", _R, _ERR, True, False,
           "the receiving host has no queue with that key"),
    Reason(21, "NOT_AUTHORIZED", _R, _ERR, False, False,
           "the receiving agent has no write permission on the queue"),
    Reason(22, "QUEUE_FULL", _R, _ERR, True, False,
           "the destination queue was still full after bounded retry"),
    Reason(23, "MESSAGE_TOO_BIG", _R, _ERR, False, True,
           "the message is over the receiver's max_message_size or the queue's limit"),
    Reason(24, "INVALID_QUEUE_KEY", _R, _ERR, False, True,
           "the queue key is above 2**32-1 or is 0 (IPC_PRIVATE)"),
    Reason(25, "QUEUE_NOT_OFFERED", _R, _ERR, True, False,
           "the receiver's configuration does not offer that queue"),
    Reason(26, "PUT_FAILED", _R, _ERR, False, False,
           "putting to the queue failed for another reason (see detail)"),
    Reason(-1, "MALFORMED", "tool", None, False, True,
           "a DEAD.LETTER.Q record the drain could not read (archive rows only)"),
)

BY_NAME: dict[str, Reason] = {r.name: r for r in REASONS}
BY_CODE: dict[int, Reason] = {r.code: r for r in REASONS}

#: The reasons a dead-letter record can carry (every row with a code of 1 or more).
ReasonCode = enum.IntEnum("ReasonCode", {r.name: r.code for r in REASONS if r.code > 0},
                          module=__name__)
ReasonCode.__doc__ = "Why a message was dead-lettered (the ``reason`` field of a dead-letter " \
                     "record); see :data:`REASONS`."
ReasonCode.description = property(lambda self: BY_CODE[self.value].description)

#: The archive's reason for an unreadable DEAD.LETTER.Q record.
MALFORMED: Reason = BY_NAME["MALFORMED"]

TRANSIENT: tuple[str, ...] = tuple(r.name for r in REASONS if r.transient)
INTRINSIC: tuple[str, ...] = tuple(r.name for r in REASONS if r.intrinsic)


def describe(code: int) -> str:
    """Describe a reason code; unknown numbers (from a newer writer) are described too."""
    reason = BY_CODE.get(int(code))
    return reason.description if reason else f"unknown reason {int(code)}"


def reason_name(code: int) -> str:
    """The name of a reason code, ``UNKNOWN_<n>`` for a number this version does not know."""
    reason = BY_CODE.get(int(code))
    return reason.name if reason else f"UNKNOWN_{int(code)}"
