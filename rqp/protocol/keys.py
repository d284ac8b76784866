"""Which numbers name a System V queue: the one queue-key validator.

A ``key_t`` is a 32-bit int. RQP carries it in the low 32 bits of a uint64 (spec 5.5) and the
project writes it as an unsigned number; a negative ``key_t`` (as C or ``sysv_ipc`` may show
it) is the same key. ``0`` is ``IPC_PRIVATE`` and names no queue. The config parser, the
System V adapter, the sending MCA (which dead-letters ``NO_QUEUE_KEY``) and the receiving MCA
(which refuses ``INVALID_QUEUE_KEY`` and answers ``QUEUE_NO``) all ask :func:`queue_key_problem`.
"""

from __future__ import annotations

import re

from rqp.protocol.constants import IPC_PRIVATE, KEY_T_MAX

__all__ = ["KEY_T_MIN", "queue_key_problem", "normalize_key", "is_broadcast_name"]

#: A broadcast name (spec section 6, NetarchiveSuite's ``<ENV>_ALL_<REPLICA>...``): its part
#: after the environment prefix is ``ALL`` (``PROD_ALL_BA``), or it starts with ``ALL_``; in
#: any case (``prod_all_ba`` too).
_BROADCAST_NAME = re.compile(r"(?:[^_]+_)?ALL_.+", re.IGNORECASE)

#: The most negative ``key_t``; ``-1`` is the same key as ``0xffffffff``.
KEY_T_MIN = -(1 << 31)


def queue_key_problem(key: int) -> str | None:
    """Why the unsigned ``key`` (from the wire, a record or a config) names no System V queue,
    or None if it may name one."""
    if key == IPC_PRIVATE:
        return "queue key 0 is IPC_PRIVATE and names no queue"
    if not 0 < key <= KEY_T_MAX:
        return (f"queue key {key:#x} does not fit a 32-bit key_t" if key > 0
                else f"queue key {key} is negative")
    return None


def normalize_key(key: int) -> int:
    """A ``key_t`` written either way (``-1`` or ``0xffffffff``) as the unsigned number; other
    numbers unchanged (then :func:`queue_key_problem` says what is wrong with them)."""
    return key & KEY_T_MAX if KEY_T_MIN <= key < 0 else key


def is_broadcast_name(name: str) -> bool:
    """Whether a queue name names a broadcast channel: every host of ``.rqprc`` that offers it
    gets a copy (spec section 6). ``PROD_ALL_BA_TWO``, ``ALL_BA`` and ``prod_all_ba`` do;
    ``PROD_ANY_BA``, ``PROD_THE_ALL_X`` and ``PROD_ALL`` (no replica part) do not."""
    return _BROADCAST_NAME.fullmatch(name) is not None
