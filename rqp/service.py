"""What the agents share with the operating system: state files, the "who serves this
transmission queue" semaphore, systemd notification, logging. Adapters only; no protocol here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

import sysv_ipc

from .errors import RQPError
from .queues import format_key

__all__ = [
    "ServingLock", "sender_serving", "serving_pid", "Doorbell", "spawn_lock", "KeySource", "write_file_atomically",
    "notify", "setup_logging", "host_name",
]

log = logging.getLogger("rqp")


def host_name() -> str:
    return socket.gethostname()


def setup_logging(level: str = "INFO", name: str = "rqp") -> None:
    """One line per event on stderr (the journal adds its own time stamps under systemd)."""
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("INVOCATION_ID") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt,
                        stream=sys.stderr, force=True)


def write_file_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write elsewhere, fsync, rename into place, fsync the directory: a reader sees the old
    file or the whole new one, never half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class KeySource:
    """Unique RQP message keys (spec 5.6): ``incarnation << 32 | counter``.

    The incarnation is kept in ``state_dir``: drawn at random the first time (so that two
    sending MCAs are very unlikely to share key ranges), then increased by one at every start,
    written durably before the first key is handed out. The counter starts at 1 and, if it ever
    reaches 2**32, a new incarnation is taken. So keys never repeat across restarts of one
    sending MCA, whatever happens to the process.
    """

    def __init__(self, state_dir: Path, name: str) -> None:
        self.path = Path(state_dir) / f"{name}.incarnation"
        self.incarnation = 0
        self._counter = 0
        self._advance()

    def _advance(self) -> None:
        try:
            previous = int(self.path.read_text().strip(), 16)
        except FileNotFoundError:
            previous = secrets.randbits(32)
        except (OSError, ValueError) as exc:
            raise RQPError(f"cannot read the key incarnation file {self.path}: {exc}") from exc
        self.incarnation = (previous + 1) & 0xFFFFFFFF or 1
        write_file_atomically(self.path, f"{self.incarnation:08x}\n".encode())
        self._counter = 0

    def __call__(self) -> int:
        self._counter += 1
        if self._counter > 0xFFFFFFFF:
            self._advance()
            self._counter = 1
        return self.incarnation << 32 | self._counter


# --- who serves a transmission queue -------------------------------------------------------
#
# A sending MCA holds a System V semaphore whose key is the transmission queue's key (semaphore
# and message queue keys are separate name spaces), taken with SEM_UNDO: when the process ends,
# however it ends, the kernel gives it back. So "is a sending MCA serving this transmission
# queue?" is answered by the kernel, in the same IPC namespace as the queue itself. A second
# semaphore, key + 1, serialises starting one, so that two applications calling openConnection
# at the same moment start exactly one.

# sysv_ipc may be built without semtimedop (SEMAPHORE_TIMEOUT_SUPPORTED False: a timeout is then
# silently ignored and the wait is forever), so timed waits call libc's semtimedop directly.
_libc = ctypes.CDLL(None, use_errno=True)


class _Sembuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short),
                ("sem_flg", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SEM_UNDO = 0x1000


def _semop(sem: sysv_ipc.Semaphore, delta: int, timeout: float | None, undo: bool) -> bool:
    """Add ``delta`` (negative: wait until possible) within ``timeout`` seconds.

    True if done; False on time-out or when interrupted by a signal (EINTR)."""
    op = _Sembuf(0, delta, _SEM_UNDO if undo else 0)
    ts = None
    if timeout is not None:
        whole = int(timeout)
        ts = ctypes.byref(_Timespec(whole, int((timeout - whole) * 1e9)))
    if _libc.semtimedop(sem.id, ctypes.byref(op), 1, ts) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EINTR):
        return False
    raise RQPError(f"semaphore {sem.key:#x}: semtimedop: {os.strerror(err)}")


def _semaphore(key: int) -> sysv_ipc.Semaphore:
    try:
        return sysv_ipc.Semaphore(key, sysv_ipc.IPC_CREX, mode=0o666, initial_value=1)
    except sysv_ipc.ExistentialError:
        return sysv_ipc.Semaphore(key)


def sender_serving(transmission_queue: int) -> bool:
    """Whether a sending MCA holds the transmission queue ``transmission_queue`` now."""
    try:
        return sysv_ipc.Semaphore(transmission_queue).value == 0
    except sysv_ipc.ExistentialError:
        return False


def serving_pid(transmission_queue: int) -> int | None:
    """The pid of the sending MCA serving ``transmission_queue``, or None if none does."""
    try:
        sem = sysv_ipc.Semaphore(transmission_queue)
        return sem.last_pid if sem.value == 0 else None
    except sysv_ipc.ExistentialError:
        return None


class ServingLock:
    """Held by the sending MCA for as long as it serves its transmission queue."""

    def __init__(self, transmission_queue: int) -> None:
        self.key = transmission_queue
        self._sem = _semaphore(transmission_queue)
        self._sem.undo = True
        self._sem.block = False  # (sysv_ipc treats timeout=0 as "wait forever")
        try:
            self._sem.acquire()
        except sysv_ipc.BusyError:
            raise RQPError(
                f"another sending MCA (pid {self._sem.last_pid}) already serves transmission "
                f"queue {format_key(transmission_queue)}") from None

    def release(self) -> None:
        with contextlib.suppress(sysv_ipc.Error):
            self._sem.release()


@contextlib.contextmanager
def spawn_lock(transmission_queue: int, timeout: float = 30.0):
    sem = _semaphore((transmission_queue + 1) & 0xFFFFFFFF)
    deadline = time.monotonic() + timeout
    while not _semop(sem, -1, max(deadline - time.monotonic(), 0.0), undo=True):
        if time.monotonic() >= deadline:
            raise RQPError(f"timed out after {timeout:g}s waiting for another process that is "
                           f"starting the sending MCA of {format_key(transmission_queue)}")
    try:
        yield
    finally:
        _semop(sem, 1, None, undo=True)


class Doorbell:
    """Producers ring it after putting a record; the sending MCA waits on it when its
    transmission queue is empty. A System V semaphore (key = transmission queue + 2) used as a
    counter. A producer that does not ring (a C program) is still served: the sending MCA
    looks at the queue every ``poll`` seconds anyway.
    """

    def __init__(self, transmission_queue: int) -> None:
        key = (transmission_queue + 2) & 0xFFFFFFFF
        try:
            self._sem = sysv_ipc.Semaphore(key, sysv_ipc.IPC_CREX, mode=0o666, initial_value=0)
        except sysv_ipc.ExistentialError:
            self._sem = sysv_ipc.Semaphore(key)

    def ring(self) -> None:
        try:
            self._sem.release()
        except (sysv_ipc.Error, ValueError, OSError):
            pass  # at the semaphore's maximum (or removed): the sender looks anyway

    def wait(self, timeout: float) -> bool:
        """Wait until rung (True) or ``timeout`` seconds pass or a signal comes (False);
        absorbs every ring so far."""
        if not _semop(self._sem, -1, timeout, undo=False):
            return False
        try:
            extra = self._sem.value
            if extra:
                _semop(self._sem, -extra, 0, undo=False)
        except sysv_ipc.Error:
            pass
        return True


# --- systemd --------------------------------------------------------------------------------

def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to ``$NOTIFY_SOCKET``; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval() -> float | None:
    """Half of ``WatchdogSec=`` when systemd asks this process for keep-alive pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


def monotonic() -> float:
    return time.monotonic()
