"""Local System V message queues, through ``sysv_ipc`` (the I/O adapter of the project).

Every ``sysv_ipc`` exception is mapped to an :mod:`rqp.protocol.errors` class whose message names the
queue key in hex (``queue 0x52510001``). Facts this module relies on (found by experiment with
sysv_ipc 1.2.0 on Linux):

* ``sysv_ipc.MessageQueue(key, flags, mode, max_message_size)`` calls ``msgget(key, flags |
  mode)`` even when it only opens an existing queue, and the kernel then checks ``mode`` as the
  *requested* access (``ipcperms``). Its default ``mode=0o600`` therefore asks for read AND
  write: a process that may only write (queue mode 0o622 for "other") cannot even open the
  queue that way. :meth:`LocalQueue.open` passes ``mode=0`` (no access requested at open time;
  each send/receive/IPC_STAT is checked by the kernel when it happens).
* ``max_message_size`` is only the receive buffer (library default 2048). We always pass the
  kernel's ``msgmax``; ``send`` of more than ``max_message_size`` raises ``ValueError`` in the
  library, a receive of a longer message fails with ``E2BIG`` and leaves it on the queue.
* A message larger than the queue's ``msg_qbytes`` (``max_size``) is not refused by the kernel:
  a blocking ``msgsnd`` waits forever and a non-blocking one says "full". :meth:`LocalQueue.put`
  therefore checks ``max_size`` first (when IPC_STAT is allowed).
* After the queue is removed, ``send`` on the old object fails with ``OSError(EINVAL)`` (the id
  is gone), ``receive``/IPC_STAT/remove raise ``ExistentialError``, and a blocked
  send/receive wakes up with ``ExistentialError`` (EIDRM). All become :class:`QueueNotFound`.
* A signal interrupts a blocking send/receive with a plain ``sysv_ipc.Error("Signaled while
  waiting")`` (EINTR). Python runs the signal handler right after; if the handler raises, that
  exception propagates, otherwise the call is retried (PEP 475 behaviour). A handler that must
  stop a blocked :meth:`LocalQueue.get` should raise, or the caller should use ``timeout``.
* ``sysv_ipc`` releases the GIL while blocked, so other threads keep running.
* Keys above 0x7fffffff are accepted (cast to the signed ``key_t``); ``.key`` reads back
  negative, so :attr:`LocalQueue.key` is normalised to 0..2**32-1.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import sysv_ipc

from rqp.protocol.constants import DEFAULT_MTYPE, KEY_T_MAX
from rqp.protocol.errors import (
    MessageTooBig,
    QueueError,
    QueueFull,
    QueueNotFound,
    QueuePermissionDenied,
)
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.records import TRANSMISSION_HEADER_SIZE

__all__ = [
    "Access",
    "AccessStatus",
    "InvalidQueueKey",
    "IpcLimits",
    "LocalQueue",
    "QueueEmpty",
    "QueueStat",
    "check_key",
    "format_key",
    "kernel_limits",
    "max_payload",
    "may_write",
    "may_write_every_queue",
    "mode_permits",
    "write_access",
]

_PROC = "/proc/sys/kernel"
_POLL_FIRST = 0.001  # first wait of a timed get/put, seconds
_POLL_CAP = 0.050  # the wait doubles up to this cap
_CAP_IPC_OWNER = 15  # linux/capability.h
_S_IWUSR = 0o200
_WRITE = 0o2  # the "w" bit of one rwx triplet

T = TypeVar("T")


class Interrupted(QueueError):
    """A blocking :meth:`LocalQueue.get` was interrupted by a signal and its ``stop()`` said so.

    A thread blocked in ``msgrcv`` is woken by ``signal.pthread_kill`` (with a handler that does
    not raise); no message is taken when that happens.
    """


class QueueEmpty(QueueError):
    """No message (of the requested type) arrived before the deadline / without blocking."""


class InvalidQueueKey(QueueError, ValueError):
    """The key cannot name a System V queue: 0 (IPC_PRIVATE) or outside 1..2**32-1."""


# --------------------------------------------------------------------------------------------
# Keys and limits
# --------------------------------------------------------------------------------------------


def format_key(key: int) -> str:
    """``0x52510001``: 8 hex digits (more for a key that does not fit a key_t)."""
    if key < 0:  # a signed key_t as sysv_ipc reports it
        key &= KEY_T_MAX
    return f"0x{key:08x}"


def check_key(key: int) -> int:
    """Return ``key`` if it can name a queue, else raise :class:`InvalidQueueKey`."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidQueueKey(f"queue key must be an int, got {key!r}")
    problem = queue_key_problem(key)
    if problem:
        raise InvalidQueueKey(problem, queue_key=key)
    return key


@dataclass(frozen=True)
class IpcLimits:
    """The System V message limits of this IPC namespace."""

    msgmax: int  # largest message, bytes
    msgmnb: int  # default msg_qbytes of a new queue, bytes
    msgmni: int  # most queues


def _read_proc_int(name: str) -> int:
    with open(os.path.join(_PROC, name), "rb") as f:
        return int(f.read().split()[0])


def kernel_limits() -> IpcLimits:
    """Read ``msgmax``, ``msgmnb``, ``msgmni`` from /proc/sys/kernel (fresh on every call)."""
    return IpcLimits(_read_proc_int("msgmax"), _read_proc_int("msgmnb"), _read_proc_int("msgmni"))


def max_payload(limits: IpcLimits | None = None) -> int:
    """The largest application payload that fits one transmission record."""
    limits = limits or kernel_limits()
    return limits.msgmax - TRANSMISSION_HEADER_SIZE


def _too_big(size: int, limit: int, what: str, key: int) -> MessageTooBig:
    if what == "msgmax":
        hint = f"raise it with `sysctl -w kernel.msgmax={size}` (and kernel.msgmnb)"
        where = "the kernel's msgmax"
    else:
        hint = "raise the queue's msg_qbytes (IPC_SET, up to kernel.msgmnb unless privileged)"
        where = "the queue's max_size (msg_qbytes)"
    return MessageTooBig(
        f"queue {format_key(key)}: message of {size} bytes is larger than {where} of "
        f"{limit} bytes; {hint}",
        size=size,
        limit=limit,
    )


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _is_eintr(exc: BaseException) -> bool:
    # sysv_ipc reports EINTR as a plain sysv_ipc.Error (no errno attribute).
    return type(exc) is sysv_ipc.Error and "signal" in str(exc).lower()


def _map_error(exc: BaseException, key: int, doing: str) -> QueueError:
    """A sysv_ipc / OS error as an rqp.protocol.errors exception naming the queue."""
    name = f"queue {format_key(key)}"
    if isinstance(exc, sysv_ipc.ExistentialError):
        return QueueNotFound(f"{name} does not exist (or was removed) while {doing}", queue_key=key)
    if isinstance(exc, sysv_ipc.PermissionsError):
        return QueuePermissionDenied(
            f"{name}: permission denied while {doing} (euid {os.geteuid()}, egid {os.getegid()})",
            queue_key=key,
        )
    if isinstance(exc, OSError) and exc.errno == errno.EIDRM:
        return QueueNotFound(f"{name} was removed while {doing}", queue_key=key)
    if isinstance(exc, OSError) and exc.errno == errno.EACCES:
        return QueuePermissionDenied(
            f"{name}: permission denied while {doing} (euid {os.geteuid()}, egid {os.getegid()})",
            queue_key=key,
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return QueueError(
            f"{name}: system limit reached while {doing} (kernel.msgmni queues or msgmnb)",
            queue_key=key,
        )
    if isinstance(exc, OSError) and exc.errno is not None:
        return QueueError(
            f"{name}: errno {exc.errno} ({os.strerror(exc.errno)}) while {doing}", queue_key=key
        )
    return QueueError(f"{name}: {exc} while {doing}", queue_key=key)


# --------------------------------------------------------------------------------------------
# LocalQueue
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueStat:
    """What IPC_STAT says about a queue (needs read permission)."""

    uid: int
    gid: int
    cuid: int
    cgid: int
    mode: int  # the 9 permission bits
    current_messages: int
    max_size: int  # msg_qbytes


def _stat(mq: sysv_ipc.MessageQueue) -> QueueStat:
    return QueueStat(
        uid=mq.uid,
        gid=mq.gid,
        cuid=mq.cuid,
        cgid=mq.cgid,
        mode=mq.mode & 0o777,
        current_messages=mq.current_messages,
        max_size=mq.max_size,
    )


def _backoff_waits(timeout: float) -> Iterator[float]:
    """Waits of a timed poll: 1 ms doubling to 50 ms, never past the deadline; ends there."""
    deadline = time.monotonic() + timeout
    wait = _POLL_FIRST
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        yield min(wait, left)
        wait = min(wait * 2, _POLL_CAP)


class LocalQueue:
    """One System V message queue of this host.

    Get one with :meth:`open` (must exist) or :meth:`create` (open or create). The object keeps
    the queue's id: if the queue is removed and created again under the same key, the old
    object raises :class:`QueueNotFound` and must be opened again.

    Timeouts: ``sysv_ipc`` cannot put a deadline on a blocking ``msgsnd``/``msgrcv`` (and a
    blocked call can only be woken by a signal, which a library must not send itself), so
    ``put``/``get`` with a ``timeout`` poll with non-blocking calls, waiting 1 ms, 2 ms, 4 ms...
    capped at 50 ms between tries. A message therefore waits at most ~50 ms longer than with a
    blocking call. ``timeout=None`` with ``block=True`` is a true blocking call (no polling).
    """

    __slots__ = ("_mq", "_key", "_msgmax", "_copy_buffer", "_copy_type", "_copy_text",
                 "_peek_size")

    def __init__(self, mq: sysv_ipc.MessageQueue, key: int, msgmax: int):
        self._mq = mq
        self._key = key
        self._msgmax = msgmax
        self._copy_buffer = None
        self._peek_size = min(PEEK_SIZE_MIN, msgmax)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def open(cls, key: int) -> "LocalQueue":
        """Open an existing queue; :class:`QueueNotFound` if there is none with that key."""
        key = check_key(key)
        msgmax = kernel_limits().msgmax
        try:
            mq = sysv_ipc.MessageQueue(key, 0, mode=0, max_message_size=msgmax)
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, key, "opening it") from None
        return cls(mq, key, msgmax)

    @classmethod
    def create(cls, key: int, mode: int = 0o660) -> "LocalQueue":
        """Open the queue, creating it with ``mode`` if it does not exist (existing mode kept)."""
        key = check_key(key)
        msgmax = kernel_limits().msgmax
        for _ in range(10):
            try:
                mq = sysv_ipc.MessageQueue(
                    key, sysv_ipc.IPC_CREX, mode=mode, max_message_size=msgmax
                )
                return cls(mq, key, msgmax)
            except sysv_ipc.ExistentialError:
                pass  # it exists: open it without asking for any access
            except (sysv_ipc.Error, OSError) as exc:
                raise _map_error(exc, key, "creating it") from None
            try:
                return cls.open(key)
            except QueueNotFound:
                continue  # removed between the two calls: try again
        raise QueueError(f"queue {format_key(key)} keeps appearing and vanishing", queue_key=key)

    @staticmethod
    def exists(key: int) -> bool:
        """Whether a queue with this key exists (whatever its permissions)."""
        key = check_key(key)
        try:
            sysv_ipc.MessageQueue(key, 0, mode=0)
        except sysv_ipc.ExistentialError:
            return False
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, key, "looking it up") from None
        return True

    # -- attributes ----------------------------------------------------------------------

    @property
    def key(self) -> int:
        return self._key

    @property
    def id(self) -> int:
        return self._mq.id

    @property
    def msgmax(self) -> int:
        """The receive buffer: the kernel's msgmax when the queue was opened, re-read when a
        message exceeds it (larger than msgmax for a message put before msgmax was lowered)."""
        return self._msgmax

    def __repr__(self) -> str:
        return f"<LocalQueue {format_key(self._key)} id={self._mq.id}>"

    def _call(self, doing: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, self._key, doing) from None

    def stat(self) -> QueueStat:
        """IPC_STAT: owner, mode, depth, max_size. Needs read permission on the queue."""
        return self._call("reading its status", lambda: _stat(self._mq))

    def _usage(self) -> tuple[int, int, int]:
        """``msg_qbytes``, and the bytes and messages in the queue now (``/proc/sysvipc/msg``):
        what the kernel checks a put against."""
        qbytes = self._call("reading the size of", lambda: self._mq.max_size)
        info = next((q for q in list_queues() if q.id == self.id), None)
        return (qbytes, *((info.bytes, info.messages) if info is not None else (0, 0)))

    def room(self) -> int:
        """Bytes that may be put on it now (``msg_qbytes`` minus the bytes in it)."""
        qbytes, used, _ = self._usage()
        return qbytes - used

    def fits(self, nbytes: int, count: int = 1) -> bool:
        """Whether ``count`` messages of ``nbytes`` bytes together may be put now, by both of
        the kernel's checks: the bytes in the queue, and the number of messages in it, stay
        within ``msg_qbytes`` (a queue of empty messages fills by their number: a trial's
        atomic batch met it half-way, its bytes having room)."""
        qbytes, used, held = self._usage()
        return used + nbytes <= qbytes and held + count <= qbytes

    @property
    def depth(self) -> int:
        """Number of messages on the queue (IPC_STAT: needs read permission)."""
        return self._call("reading its depth", lambda: self._mq.current_messages)

    def remove(self) -> None:
        """IPC_RMID. Blocked readers and writers wake up with :class:`QueueNotFound`."""
        self._call("removing it", self._mq.remove)

    def _reopen(self, msgmax: int) -> None:
        """Re-open by key with a new receive buffer size, only if it is still the same queue."""
        mq = self._call(
            "re-opening it",
            lambda: sysv_ipc.MessageQueue(self._key, 0, mode=0, max_message_size=msgmax),
        )
        if mq.id != self._mq.id:
            raise QueueNotFound(
                f"queue {format_key(self._key)} was removed and created again", queue_key=self._key
            )
        self._mq, self._msgmax, self._copy_buffer = mq, msgmax, None
        self._peek_size = min(PEEK_SIZE_MIN, msgmax)

    # -- put -----------------------------------------------------------------------------

    def _check_msgmax(self, size: int) -> None:
        if size > self._msgmax:
            msgmax = kernel_limits().msgmax  # it may have been raised since we opened
            if size > msgmax:
                raise _too_big(size, msgmax, "msgmax", self._key)
            self._reopen(msgmax)

    def _check_size(self, size: int) -> None:
        """msgmax, and the queue's max_size (one msgctl): a message larger than that would wait
        for room for ever, the kernel does not refuse it."""
        self._check_msgmax(size)
        try:
            max_size = self._mq.max_size
        except sysv_ipc.PermissionsError:
            return  # write-only access: IPC_STAT refused, the kernel will judge
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, self._key, "checking its size limit") from None
        if size > max_size:
            raise _too_big(size, max_size, "max_size", self._key)

    def put(self, data: bytes, *, mtype: int = DEFAULT_MTYPE, block: bool = True,
            timeout: float | None = None) -> None:
        """Put one message.

        ``block=False``: :class:`QueueFull` at once if there is no room. ``block=True`` with a
        ``timeout``: :class:`QueueFull` if still no room after ``timeout`` seconds (polling,
        see the class doc). Raises :class:`MessageTooBig` (instead of waiting) if ``data`` is
        larger than msgmax or the queue's max_size, :class:`QueueNotFound` if the queue was removed,
        :class:`QueuePermissionDenied` without write permission.
        """
        if type(data) is not bytes:
            data = bytes(data)
        if mtype < 1:
            raise ValueError(f"mtype must be >= 1, got {mtype}")
        if len(data) > self._msgmax:
            self._check_msgmax(len(data))  # (raised since we opened, or too big: it says)
        if self._send(data, mtype, False):  # the common case: it fits, no msgctl needed
            return
        self._check_size(len(data))  # full now, or never room enough? (max_size: a msgctl)
        if block and timeout is None:
            self._retry_eintr("putting a message", lambda: self._send(data, mtype, True))
            return
        if block:
            for wait in _backoff_waits(timeout):
                time.sleep(wait)
                if self._send(data, mtype, False):
                    return
            raise QueueFull(
                f"queue {format_key(self._key)} still full after {timeout:g} s", queue_key=self._key
            )
        raise QueueFull(f"queue {format_key(self._key)} is full", queue_key=self._key)

    def _send(self, data: bytes, mtype: int, block: bool) -> bool:
        """One msgsnd. False if non-blocking and full."""
        if mtype > _SYSV_IPC_TYPE_MAX:
            return self._send_long(data, mtype, block)
        try:
            self._mq.send(data, block, mtype)  # (positional: keywords cost 0.3 us a call)
            return True
        except sysv_ipc.BusyError:
            return False
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise self._diagnose_einval(len(data)) from None
            raise _map_error(exc, self._key, "putting a message") from None
        except ValueError:  # the library's own max_message_size check
            raise _too_big(len(data), self._msgmax, "msgmax", self._key) from None
        except sysv_ipc.Error as exc:
            if _is_eintr(exc):
                raise
            raise _map_error(exc, self._key, "putting a message") from None

    def _send_long(self, data: bytes, mtype: int, block: bool) -> bool:
        """One msgsnd of a message whose mtype sysv_ipc cannot take (it takes a C int; System V
        a long): through libc. A trial's MESSAGE_EX with mtype 2^31 stopped a receiving MCA
        (OverflowError), and again at each start while its sender sent it again."""
        size = len(data)
        buf = ctypes.create_string_buffer(_LONG_SIZE + size)
        ctypes.c_long.from_buffer(buf).value = mtype
        ctypes.memmove(ctypes.addressof(buf) + _LONG_SIZE, data, size)
        while _libc.msgsnd(self._mq.id, buf, size, 0 if block else _IPC_NOWAIT) != 0:
            err = ctypes.get_errno()
            if err == errno.EAGAIN:
                return False
            if err == errno.EINTR:  # (a handler that raises has raised by now)
                continue
            if err == errno.EINVAL:
                raise self._diagnose_einval(size) from None
            raise _map_error(OSError(err, os.strerror(err)), self._key,
                             "putting a message") from None
        return True

    def _diagnose_einval(self, size: int) -> QueueError | MessageTooBig:
        """msgsnd said EINVAL: the queue id is gone, or msgmax was lowered meanwhile."""
        try:
            self._mq.current_messages
        except sysv_ipc.ExistentialError:
            return QueueNotFound(
                f"queue {format_key(self._key)} was removed while putting a message",
                queue_key=self._key,
            )
        except (sysv_ipc.Error, OSError):
            pass
        msgmax = kernel_limits().msgmax
        if size > msgmax:
            return _too_big(size, msgmax, "msgmax", self._key)
        return QueueError(
            f"queue {format_key(self._key)}: errno {errno.EINVAL} ({os.strerror(errno.EINVAL)}) "
            f"while putting a message of {size} bytes",
            queue_key=self._key,
        )

    def _retry_eintr(self, doing: str, fn: Callable[[], T],
                     stop: Callable[[], bool] | None = None) -> T:
        while True:
            try:
                return fn()
            except sysv_ipc.Error as exc:
                # Any raising signal handler has already run here and propagated.
                if not _is_eintr(exc):
                    raise _map_error(exc, self._key, doing) from None
                if stop is not None and stop():
                    raise Interrupted(f"queue {format_key(self._key)}: {doing} interrupted",
                                      queue_key=self._key) from None

    # -- get -----------------------------------------------------------------------------

    def get(self, *, block: bool = True, timeout: float | None = None, mtype: int = 0,
            stop: Callable[[], bool] | None = None, with_type: bool = False):
        """Take one message and return its bytes (``with_type``: ``(bytes, mtype)``).

        ``mtype`` is msgrcv's ``msgtyp``: 0 = the first message of any type, > 0 = the first
        of that type, < 0 = the first of the lowest type <= -mtype. ``block=False``:
        :class:`QueueEmpty` at once if there is none; with a ``timeout``: :class:`QueueEmpty`
        after that many seconds (polling, see the class doc); ``block=True`` and no timeout:
        wait as long as it takes.
        """
        got = self._get(block, timeout, mtype, stop)
        return got if with_type else got[0]

    def _get(self, block: bool, timeout: float | None, mtype: int,
             stop: Callable[[], bool] | None) -> tuple[bytes, int]:
        if block and timeout is None:
            return self._retry_eintr("getting a message", lambda: self._receive(mtype, True), stop)
        got = self._receive(mtype, False)
        if got is not None:
            return got
        which = "" if mtype == 0 else f" of type {mtype}" if mtype > 0 else \
            f" of type {-mtype} or lower"
        if block:
            for wait in _backoff_waits(timeout):
                time.sleep(wait)
                got = self._receive(mtype, False)
                if got is not None:
                    return got
            raise QueueEmpty(
                f"queue {format_key(self._key)}: no message{which} after {timeout:g} s",
                queue_key=self._key,
            )
        raise QueueEmpty(f"queue {format_key(self._key)} " + (
            f"has no message{which}" if which else "is empty"), queue_key=self._key)

    def peek(self, index: int = 0) -> tuple[bytes, int] | None:
        """A copy of the message at ``index`` (0 = the next one ``get`` would take) and its
        mtype, without taking it; None if the queue has fewer messages.

        Linux's ``msgrcv(..., MSG_COPY | IPC_NOWAIT)`` (kernel 3.8+, CONFIG_CHECKPOINT_RESTORE).
        This is what lets the sending MCA journal a record before it takes it off the queue.
        Raises :class:`QueueError` where the kernel does not support it (see
        :func:`peek_supported`), :class:`MessageTooBig` for a message longer than the kernel's
        msgmax (put before it was lowered: :meth:`get` takes it).
        """
        buf = self._copy_buffer or self._buffer()
        # The kernel copies the whole msgsz from user space before it even looks at the
        # message (prepare_copy): ask for about what the last ones needed, not msgmax
        # (1.9 us against 3.0 a peek of a 140-byte message here), and for msgmax when
        # that was too little.
        size = self._peek_size
        n = _libc.msgrcv(self._mq.id, buf, size, index, _MSG_COPY | _IPC_NOWAIT)
        if n < 0 and size < self._msgmax and ctypes.get_errno() == errno.E2BIG:
            size = self._msgmax
            n = _libc.msgrcv(self._mq.id, buf, size, index, _MSG_COPY | _IPC_NOWAIT)
        if n >= 0:  # (only the n bytes copied are read: not the whole msgmax buffer)
            self._peek_size = self._next_peek_size(n, size)
            return ctypes.string_at(self._copy_text, n), self._copy_type.value
        err = ctypes.get_errno()
        if err == errno.ENOMSG:
            return None
        msgmax = kernel_limits().msgmax
        if err == errno.E2BIG and msgmax > self._msgmax:  # raised since we opened
            self._reopen(msgmax)
            return self.peek(index)
        if err == errno.E2BIG or (err == errno.EINVAL and not self._removed()):
            # Put before msgmax was lowered: the kernel copies at most msgmax bytes, and says
            # E2BIG for a buffer shorter than the message, EINVAL for a longer one (copy_msg;
            # what else EINVAL means here, a queue removed, is ruled out): only a get reads it.
            raise MessageTooBig(
                f"queue {format_key(self._key)}: message {index} is longer than kernel.msgmax "
                f"({msgmax} bytes; lowered since it was put): it can be taken, not copied",
                size=msgmax + 1, limit=msgmax)
        raise self._msgrcv_error(err, "msgrcv(MSG_COPY)")

    def _next_peek_size(self, n: int, size: int) -> int:
        """What the next peek asks for after one of ``n`` bytes that asked for ``size``: room
        for twice this one, shrinking slowly after a large one."""
        return min(self._msgmax, max(PEEK_SIZE_MIN, 2 * n, size - size // 16))

    def copy_head(self, limit: int) -> tuple[list[bytes], MessageTooBig | None]:
        """Copies (:meth:`peek`) of up to ``limit`` messages from the head, and None; or the
        copies up to a message longer than the kernel's msgmax (put before it was lowered:
        it cannot be copied), and the :class:`MessageTooBig` that says so."""
        batch: list[bytes] = []
        # The sending MCA's hot path: the plain copies in a tight loop (a peek's own upkeep cost
        # more than its msgrcv); anything else -- the end of the queue, a buffer too short,
        # an error -- is left to peek, which says what it means.
        buf = self._copy_buffer or self._buffer()
        receive, queue_id, text, flags = _libc.msgrcv, self._mq.id, self._copy_text, \
            _MSG_COPY | _IPC_NOWAIT
        size = self._peek_size
        longest = 0
        try:
            while len(batch) < limit:
                n = receive(queue_id, buf, size, len(batch), flags)
                if n >= 0:
                    batch.append(ctypes.string_at(text, n))
                    longest = max(longest, n)
                    continue
                item = self.peek(len(batch))
                if item is None:
                    break
                batch.append(item[0])
                buf, text, size = self._copy_buffer, self._copy_text, self._peek_size
                queue_id = self._mq.id  # (peek may have opened it again: msgmax raised)
        except MessageTooBig as exc:
            return batch, exc
        finally:
            if longest:
                self._peek_size = self._next_peek_size(longest, self._peek_size)
        return batch, None

    def take_head(self, n: int) -> list[bytes]:
        """Take the next ``n`` messages, without waiting: their bytes, in order. Raises as
        ``get(block=False)`` does (:class:`QueueEmpty` if fewer are there; those taken before
        the error are gone with it). For a reader that copied them first, so knows they are
        there (:meth:`copy_or_take_head`): a tight loop, the sending MCA's hot path; anything
        but a plain take is left to :meth:`get`, which says what it means."""
        out: list[bytes] = []
        receive = self._mq.receive
        while len(out) < n:
            try:
                out.append(receive(False)[0])
            except (sysv_ipc.Error, OSError):
                out.append(self.get(block=False))
                receive = self._mq.receive  # (get may have opened it again, with more room)
        return out

    def copy_or_take_head(self, limit: int) -> tuple[list[bytes], MessageTooBig | None]:
        """:meth:`copy_head`, for a reader that copies, makes them safe (a journal, an
        archive), then takes them off. A message too long to copy would stop that reader for
        good: as the first one it is taken off instead (:meth:`get`), returned alone with the
        :class:`MessageTooBig` that says so, and is the reader's to keep safe; further on,
        the copies stop before it (None)."""
        batch, too_long = self.copy_head(limit)
        if too_long is not None and not batch:
            return [self.get(block=False)], too_long
        return batch, None

    def wait(self) -> tuple[bytes, int] | None:
        """Block until the queue holds a message, without taking it; None then, or at once
        if one is there already, or when a signal interrupts the wait (``pthread_kill``).

        ``msgrcv`` with a zero-byte buffer: the kernel leaves a longer message where it is and
        says ``E2BIG`` (also when a ``msgsnd`` hands it straight to this waiting reader), so a
        process that only puts a record wakes the waiting reader, with nothing else to do
        (no semaphore). The one message such a buffer can take is a zero-byte one: that is
        taken, and returned as ``(b"", mtype)``. Raises :class:`QueueNotFound` if the queue is
        removed, before or during the wait."""
        buf = self._copy_buffer or self._buffer()
        n = _libc.msgrcv(self._mq.id, buf, 0, 0, 0)  # (ctypes: the GIL is released)
        if n == 0:
            return b"", self._copy_type.value
        err = ctypes.get_errno()
        if err in (errno.E2BIG, errno.EINTR):
            return None
        raise self._msgrcv_error(err, "msgrcv (waiting for a message)")

    def _msgrcv_error(self, err: int, what: str) -> QueueError:
        """The error to raise for a ``msgrcv`` of :meth:`peek` or :meth:`wait` that failed.
        The queue of this object is gone (EIDRM, or EINVAL with no queue under its key, or
        another one made since): :class:`QueueNotFound`, so that the caller opens the key
        again, whether a new queue has it or not."""
        if err == errno.EIDRM or (err == errno.EINVAL and self._removed()):
            return QueueNotFound(f"queue {format_key(self._key)} was removed",
                                 queue_key=self._key)
        if err == errno.EACCES:
            return QueuePermissionDenied(f"queue {format_key(self._key)}: no read permission",
                                         queue_key=self._key)
        return QueueError(f"queue {format_key(self._key)}: {what} failed: {os.strerror(err)}",
                          queue_key=self._key)

    def _removed(self) -> bool:
        """Whether this object's queue is gone: no queue has its key, or another one does."""
        try:
            return sysv_ipc.MessageQueue(self._key, 0, mode=0).id != self._mq.id
        except sysv_ipc.ExistentialError:
            return True
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, self._key, "looking it up") from None

    def _buffer(self) -> ctypes.Array:
        """The buffer of :meth:`peek` and :meth:`wait`: a long (the mtype), then msgmax bytes."""
        buf = self._copy_buffer = ctypes.create_string_buffer(_LONG_SIZE + self._msgmax)
        self._copy_type = ctypes.c_long.from_buffer(buf)
        self._copy_text = ctypes.addressof(buf) + _LONG_SIZE
        return buf

    def _receive(self, mtype: int, block: bool) -> tuple[bytes, int] | None:
        """One msgrcv: (bytes, mtype). None if non-blocking and there is no message."""
        if not -_SYSV_IPC_TYPE_MAX - 1 <= mtype <= _SYSV_IPC_TYPE_MAX:
            return self._receive_long(mtype, block)
        while True:
            try:
                return self._mq.receive(block, mtype)  # (positional, as in _send)
            except sysv_ipc.BusyError:
                return None
            except OSError as exc:
                if exc.errno != errno.E2BIG:
                    raise _map_error(exc, self._key, "getting a message") from None
                self._reopen(self._longer_buffer())  # and the message is still there
            except sysv_ipc.Error as exc:
                if _is_eintr(exc):
                    raise
                raise _map_error(exc, self._key, "getting a message") from None

    def _receive_long(self, mtype: int, block: bool) -> tuple[bytes, int] | None:
        """:meth:`_receive` with a msgtyp sysv_ipc cannot take (beyond a C int): through libc,
        into the buffer of :meth:`peek` (msgmax bytes: a longer message is
        :class:`MessageTooBig`, left where it is)."""
        buf = self._copy_buffer or self._buffer()
        n = _libc.msgrcv(self._mq.id, buf, self._msgmax, mtype, 0 if block else _IPC_NOWAIT)
        if n >= 0:
            return ctypes.string_at(self._copy_text, n), self._copy_type.value
        err = ctypes.get_errno()
        if err == errno.ENOMSG:
            return None
        if err == errno.EINTR:  # (as sysv_ipc says it: what _retry_eintr looks for)
            raise sysv_ipc.Error("msgrcv was interrupted by a signal")
        if err == errno.E2BIG:
            raise MessageTooBig(f"queue {format_key(self._key)}: a message of type "
                                f"{mtype} is longer than {self._msgmax} bytes (msgmax)",
                                size=self._msgmax + 1, limit=self._msgmax)
        raise self._msgrcv_error(err, "msgrcv")

    def _longer_buffer(self) -> int:
        """The receive buffer to try after a message did not fit this one (``E2BIG``, the
        message left where it is): the kernel's msgmax if it was raised since, else twice
        this one. A message longer than msgmax is one put before msgmax was lowered: it is
        read all the same, or it would stop every reader of its queue (the sending MCA's of
        the transmission queue) for good. Raises :class:`MessageTooBig` past 2 GiB (a message
        the kernel cannot hold: never)."""
        msgmax = kernel_limits().msgmax
        size = msgmax if msgmax > self._msgmax else 2 * self._msgmax
        if size > _BUFFER_MAX:
            raise MessageTooBig(
                f"queue {format_key(self._key)}: a message is longer than "
                f"{self._msgmax} bytes, the largest receive buffer", size=self._msgmax + 1,
                limit=self._msgmax)
        return size


_libc = ctypes.CDLL(None, use_errno=True)
_libc.msgrcv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long,
                         ctypes.c_int)
_libc.msgrcv.restype = ctypes.c_ssize_t
_libc.msgsnd.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.msgsnd.restype = ctypes.c_int
#: The largest mtype sysv_ipc takes (a C int); System V's is a long: beyond it, libc's own.
_SYSV_IPC_TYPE_MAX = (1 << 31) - 1
_MSG_COPY = 0o40000  # linux/msg.h
#: The smallest msgsz a peek asks for (see LocalQueue.peek).
PEEK_SIZE_MIN = 1024
_IPC_NOWAIT = 0o4000
#: The largest receive buffer :meth:`LocalQueue._longer_buffer` gives (msgsz is a C int).
_BUFFER_MAX = 1 << 31
_LONG_SIZE = ctypes.sizeof(ctypes.c_long)


def peek_supported() -> bool:
    """Whether this kernel has ``MSG_COPY`` (needs a scratch queue to find out)."""
    mq = sysv_ipc.MessageQueue(None, sysv_ipc.IPC_CREX, mode=0o600)
    try:
        buf = ctypes.create_string_buffer(_LONG_SIZE + 16)
        n = _libc.msgrcv(mq.id, buf, 16, 0, _MSG_COPY | _IPC_NOWAIT)
        return n >= 0 or ctypes.get_errno() == errno.ENOMSG
    finally:
        mq.remove()


# --------------------------------------------------------------------------------------------
# Write permission
# --------------------------------------------------------------------------------------------


class AccessStatus(enum.Enum):
    EXISTS_WRITABLE = "exists and is writable"
    NOT_FOUND = "does not exist"
    NO_PERMISSION = "exists but is not writable"


@dataclass(frozen=True)
class Access:
    """The answer of :func:`write_access`: a status and the reason for it."""

    status: AccessStatus
    reason: str

    @property
    def writable(self) -> bool:
        return self.status is AccessStatus.EXISTS_WRITABLE

    def __bool__(self) -> bool:
        return self.writable


def mode_permits(stat: QueueStat, *, euid: int, egid: int, groups: tuple[int, ...] | list[int],
                 want: int = _WRITE) -> tuple[bool, str]:
    """The kernel's ``ipcperms`` rule, without the capability override.

    Owner bits if ``euid`` is the queue's uid or cuid, else group bits if ``egid`` or a
    supplementary group is its gid or cgid, else the "other" bits. ``want`` is an rwx triplet
    (2 = write). Returns (permitted, which bits were used and why).
    """
    if euid in (stat.uid, stat.cuid):
        bits, cls = (stat.mode >> 6) & 7, f"owner bits (euid {euid} owns it)"
    elif egid in (stat.gid, stat.cgid) or any(g in (stat.gid, stat.cgid) for g in groups):
        bits, cls = (stat.mode >> 3) & 7, f"group bits (group {stat.gid}/{stat.cgid})"
    else:
        bits, cls = stat.mode & 7, "other bits"
    ok = (want & ~bits & 7) == 0
    return ok, f"mode {stat.mode:03o}, {cls}: {'permits' if ok else 'denies'} writing"


def may_write_every_queue() -> bool:
    """Whether this process has CAP_IPC_OWNER (root normally does)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_OWNER & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def write_access(key: int, *, euid: int | None = None, egid: int | None = None,
                 groups: list[int] | tuple[int, ...] | None = None) -> Access:
    """May a process put messages on the queue ``key``?

    With no identity given, the answer is for this process and comes from the kernel itself:
    ``msgget(key, S_IWUSR)`` (``sysv_ipc.MessageQueue(key, 0, mode=0o200)``) succeeds exactly
    when the kernel's ``ipcperms`` grants write access: the owner/group/other rule, plus
    CAP_IPC_OWNER and any LSM. This also works when IPC_STAT is refused (a write-only queue,
    e.g. mode 0o622 for "other"). When IPC_STAT is allowed, the mode rule
    (:func:`mode_permits`) supplies the reason string.

    With ``euid``/``egid``/``groups`` given (missing ones default to this process's), the
    answer is computed from IPC_STAT with :func:`mode_permits`; euid 0 is treated as
    privileged (CAP_IPC_OWNER). If IPC_STAT is refused to this process the answer is
    NO_PERMISSION, since the permissions cannot be read.
    """
    key = check_key(key)
    name = f"queue {format_key(key)}"
    for_self = euid is None and egid is None and groups is None
    try:
        mq = sysv_ipc.MessageQueue(key, 0, mode=0)
    except sysv_ipc.ExistentialError:
        return Access(AccessStatus.NOT_FOUND, f"{name} does not exist")
    except (sysv_ipc.Error, OSError) as exc:
        raise _map_error(exc, key, "looking it up") from None
    euid = os.geteuid() if euid is None else euid
    egid = os.getegid() if egid is None else egid
    groups = tuple(os.getgroups() if groups is None else groups)
    try:
        st = _stat(mq)
    except sysv_ipc.ExistentialError:
        return Access(AccessStatus.NOT_FOUND, f"{name} was removed")
    except sysv_ipc.PermissionsError:
        st = None
    if not for_self:
        if euid == 0:
            return Access(AccessStatus.EXISTS_WRITABLE, f"{name}: euid 0 (CAP_IPC_OWNER)")
        if st is None:
            return Access(
                AccessStatus.NO_PERMISSION,
                f"{name}: its permissions cannot be read (IPC_STAT refused to euid "
                f"{os.geteuid()}), so write access for euid {euid} cannot be confirmed",
            )
        ok, why = mode_permits(st, euid=euid, egid=egid, groups=groups)
        status = AccessStatus.EXISTS_WRITABLE if ok else AccessStatus.NO_PERMISSION
        return Access(status, f"{name}: uid {st.uid} gid {st.gid}, {why} for euid {euid}")
    # This process: ask the kernel.
    try:
        sysv_ipc.MessageQueue(key, 0, mode=_S_IWUSR)
        granted = True
    except sysv_ipc.PermissionsError:
        granted = False
    except sysv_ipc.ExistentialError:
        return Access(AccessStatus.NOT_FOUND, f"{name} was removed")
    except (sysv_ipc.Error, OSError) as exc:
        raise _map_error(exc, key, "checking write access") from None
    if st is None:
        why = (f"{name}: IPC_STAT refused (no read permission); msgget(key, 0200) "
               f"{'granted' if granted else 'refused'} write access to euid {euid}")
    elif granted and may_write_every_queue():
        why = f"{name}: CAP_IPC_OWNER (euid {euid})"
    else:
        ok, rule = mode_permits(st, euid=euid, egid=egid, groups=groups)
        why = f"{name}: uid {st.uid} gid {st.gid}, {rule} for euid {euid}"
        if ok and not granted:
            why += ", but the kernel refused it (security module?)"
    status = AccessStatus.EXISTS_WRITABLE if granted else AccessStatus.NO_PERMISSION
    return Access(status, why)


def may_write(key: int, *, euid: int | None = None, egid: int | None = None,
              groups: list[int] | tuple[int, ...] | None = None) -> bool:
    """True if the queue exists and the identity (default: this process) may write to it.

    For this process it is :func:`write_access`'s answer without its reason: the one
    ``msgget(key, S_IWUSR)`` that decides it there (0.4 us against 25 for the whole of
    write_access, which also reads the queue's permissions and this process's capabilities to
    say why). A receiving MCA asks it for every QUEUE_ASK and every queue it lists."""
    if euid is None and egid is None and groups is None:
        try:
            sysv_ipc.MessageQueue(check_key(key), 0, mode=_S_IWUSR)
            return True
        except (sysv_ipc.PermissionsError, sysv_ipc.ExistentialError):
            return False
        except (sysv_ipc.Error, OSError) as exc:
            raise _map_error(exc, key, "checking write access") from None
    return write_access(key, euid=euid, egid=egid, groups=groups).writable


@dataclass(frozen=True)
class QueueInfo:
    """One line of ``/proc/sysvipc/msg``: a queue of this IPC namespace."""

    key: int
    id: int
    mode: int
    bytes: int
    messages: int
    uid: int
    gid: int


def list_queues(proc: str = "/proc/sysvipc/msg") -> list[QueueInfo]:
    """Every System V message queue of this IPC namespace (what ``ipcs -q`` shows)."""
    out = []
    with open(proc) as f:
        header = f.readline().split()
        col = {name: i for i, name in enumerate(header)}
        for line in f:
            v = line.split()
            if len(v) < len(header):
                continue
            out.append(QueueInfo(key=int(v[col["key"]]) & 0xFFFFFFFF, id=int(v[col["msqid"]]),
                                 mode=int(v[col["perms"]], 8) & 0o777,
                                 bytes=int(v[col["cbytes"]]), messages=int(v[col["qnum"]]),
                                 uid=int(v[col["uid"]]), gid=int(v[col["gid"]])))
    return sorted(out, key=lambda q: q.key)
