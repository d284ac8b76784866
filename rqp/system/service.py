"""What the agents share with the operating system: state files, the "who serves this
transmission queue" semaphore, systemd notification, logging. Adapters only; no protocol here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import json
import errno
import gc
import logging
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from rqp.protocol.errors import RQPError
from rqp.system.files import write_file_atomically
from rqp.system.queues import format_key

__all__ = [
    "AgentSemaphores", "ServingLock", "sender_serving", "serving_pid", "spawn_lock", "KeySource", "write_file_atomically",
    "sender_unit",
    "notify", "setup_logging", "host_name", "EVENT_LOOP_VARIABLE", "release_free_memory",
    "tune_collector", "GC_YOUNG_THRESHOLD",
]

log = logging.getLogger("rqp")


def host_name() -> str:
    return socket.gethostname()


def setup_logging(level: str = "INFO", name: str = "rqp", log_format: str = "text") -> None:
    """One line per event on stderr: readable text (the journal adds its own time stamps
    under systemd), or ``json``: one object a line, see :class:`JsonLogFormatter`."""
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("INVOCATION_ID") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt,
                        stream=sys.stderr, force=True)
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLogFormatter())


#: What every LogRecord has: the rest of its attributes came with ``extra=`` (the event's
#: fields: message_key, queue_key, peer, event, reason, ...).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


class JsonLogFormatter(logging.Formatter):
    """``{"time": ISO 8601 UTC, "level", "logger", "message", <the event's fields>,
    "exception"?}``, one object a line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        for field, value in vars(record).items():
            if field not in _RECORD_ATTRIBUTES and not field.startswith("_"):
                out[field] = value if isinstance(value, (str, int, float, bool)) or \
                    value is None else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


#: The environment variable naming the event loop the agents run on: ``asyncio`` (the standard
#: library's, the default) or ``uvloop`` (``scripts/bench --uvloop`` measures it; needs
#: ``pip install uvloop``).
EVENT_LOOP_VARIABLE = "RQP_EVENT_LOOP"


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
        self._lock = threading.Lock()
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
        return self.block(1)

    def block(self, n: int) -> int:
        """The first of ``n`` consecutive unused keys (a batch's messages: key, key + 1, ...)."""
        if not 1 <= n <= 0xFFFF:
            raise ValueError(f"a block of 1..65535 keys, not {n}")
        with self._lock:  # the reader thread and the event loop both take keys
            if self._counter + n > 0xFFFFFFFF:
                self._advance()
            first = self._counter + 1
            self._counter += n
            return self.incarnation << 32 | first


# --- who serves a transmission queue -------------------------------------------------------
#
# One System V semaphore set per transmission queue, with the queue's key (semaphore and
# message queue keys are separate name spaces), three semaphores, all starting at 0 (so there
# is no initialisation race between processes that create it at the same moment):
#
#   0  serving   1 while a sending MCA serves the queue. Taken with SEM_UNDO, so when the
#                process ends, however it ends, the kernel gives it back: "is a sending MCA
#                serving this queue?" is answered by the kernel, in the queue's IPC namespace.
#   1  spawning  1 while a process is starting a sending MCA, so that two applications calling
#                openConnection at the same moment start exactly one (also SEM_UNDO).
#   2  doorbell  no longer used: producers of earlier versions add 1 after a put (up to its
#                maximum, then their add fails, which they ignore); nobody waits on it.
#                An idle sending MCA waits in msgrcv on its queue (LocalQueue.wait).
#
# sysv_ipc handles only one-semaphore sets and may be built without semtimedop (its timeouts
# are then silently ignored), so this talks to libc directly.

_libc = ctypes.CDLL(None, use_errno=True)
_libc.semget.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
_libc.semctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
_IPC_CREAT, _IPC_NOWAIT, _SEM_UNDO = 0o1000, 0o4000, 0x1000
_GETPID, _GETVAL = 11, 12
SERVING, SPAWNING = 0, 1  # (2: the doorbell, unused)


class _Sembuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short),
                ("sem_flg", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _SemaphoreSet:
    """Operations on a System V semaphore set (``id``) of queue ``key``."""

    id: int
    key: int

    def _op(self, ops: list[tuple[int, int, int]], timeout: float | None) -> bool:
        """Do ``ops`` (sem_num, sem_op, flags) atomically; False on EAGAIN or EINTR."""
        buf = (_Sembuf * len(ops))(*[_Sembuf(n, o, f) for n, o, f in ops])
        ts = None
        if timeout is not None:
            whole = int(timeout)
            ts = ctypes.byref(_Timespec(whole, int((timeout - whole) * 1e9)))
        if _libc.semtimedop(self.id, buf, len(ops), ts) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EINTR):
            return False
        raise RQPError(f"semaphores of queue {format_key(self.key)}: semtimedop: "
                       f"{os.strerror(err)}")

    def value(self, num: int) -> int:
        return _libc.semctl(self.id, num, _GETVAL)

    def last_pid(self, num: int) -> int:
        return _libc.semctl(self.id, num, _GETPID)

    def take(self, num: int, timeout: float | None) -> bool:
        """Wait until semaphore ``num`` is 0 and make it 1, atomically, with SEM_UNDO."""
        flags = _SEM_UNDO | (_IPC_NOWAIT if timeout == 0 else 0)
        return self._op([(num, 0, flags), (num, 1, flags)], None if timeout == 0 else timeout)

    def give(self, num: int) -> None:
        self._op([(num, -1, _SEM_UNDO)], None)


class AgentSemaphores(_SemaphoreSet):
    """The semaphore set of one transmission queue (see above)."""

    def __init__(self, transmission_queue: int) -> None:
        self.key = transmission_queue
        key_t = _key_t(transmission_queue)
        # 0660, as the queues: users outside the group could otherwise hold SERVING (and keep
        # the sending MCA from starting).
        self.id = _libc.semget(key_t, 3, _IPC_CREAT | 0o660)
        if self.id < 0:
            err = ctypes.get_errno()
            hint = (" (a semaphore set with that key and another size exists: remove it with "
                    f"ipcrm -S {format_key(transmission_queue)})") if err == errno.EINVAL else \
                (" (it is mode 0660, as the queues: be in the group of its owner, the agents' "
                 "group, e.g. rqp; ipcs -s -i ID shows them)") if err == errno.EACCES else ""
            raise RQPError(f"semaphores of transmission queue {format_key(transmission_queue)}:"
                           f" semget: {os.strerror(err)}{hint}")


def _key_t(key: int) -> int:
    """A queue key as System V's key_t, which is signed."""
    return ctypes.c_int(key & 0xFFFFFFFF).value


def is_agent_queue(key: int) -> bool:
    """Whether queue ``key`` is a sending MCA's transmission queue (its agent semaphores, made
    by the first openConnection or sending MCA for it) or DEAD.LETTER.Q (its marker) on this
    host: a receiving MCA never offers those."""
    return _libc.semget(_key_t(key), 0, 0) >= 0


def _existing(transmission_queue: int) -> AgentSemaphores | None:
    if not is_agent_queue(transmission_queue):
        return None
    return AgentSemaphores(transmission_queue)


#: The agents' system user (scripts/install and config/rqp.sysusers.conf make it; the units
#: run as it).
AGENTS_USER = "rqp"


#: The sending MCA's systemd unit, and where systemd looks for system units.
SENDER_UNIT = "rqp-sender.service"
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
             "/usr/lib/systemd/system", "/lib/systemd/system")


def sender_unit(env=None) -> str | None:
    """The path of the rqp-sender.service installed on this host, or None. Where there is one,
    the sending MCA is the service's: applications do not start their own, which would keep
    its journal (SURE messages not yet delivered) in another state_dir, owned by another
    user, where the service never looks. ``$SYSTEMD_UNIT_PATH`` replaces the directories, as
    for systemd (a trailing ``:`` adds them after its own)."""
    env = os.environ if env is None else env
    dirs = list(UNIT_DIRS)
    if env.get("SYSTEMD_UNIT_PATH") is not None:
        given = env["SYSTEMD_UNIT_PATH"].split(":")
        dirs = given[:-1] + dirs if given[-1] == "" else given
    for directory in dirs:
        path = os.path.join(directory, SENDER_UNIT)
        if directory and os.path.isfile(path):
            return path
    return None


def sender_serving(transmission_queue: int) -> bool:
    """Whether a sending MCA holds the transmission queue ``transmission_queue`` now."""
    sems = _existing(transmission_queue)
    return sems is not None and sems.value(SERVING) > 0


def config_changes(old, new, skip: tuple[str, ...] = ("source",), replaced: str = "") -> str:
    """What a reload changed, in words: ``window 128 -> 256, hosts`` (long values by name
    only), with ``replaced`` (files whose contents changed, in words), or ``nothing
    changed``."""
    changed = []
    for f in dataclasses.fields(old):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if f.name in skip or before == after:
            continue
        short = all(isinstance(v, (int, float, str, bool, type(None))) and len(str(v)) <= 40
                    for v in (before, after))
        shown = ["unset" if v is None else v for v in (before, after)]
        changed.append(f"{f.name} {shown[0]} -> {shown[1]}" if short else f.name)
    return ", ".join(changed + [replaced] * bool(replaced)) or "nothing changed"


def counts(stats: dict) -> str:
    """``taken=6 delivered=3``: a stats dict for a log line."""
    return " ".join(f"{k}={v}" for k, v in stats.items()) or "nothing"


def make_state_dir(path: Path) -> None:
    """Create an agent's ``state_dir`` (and its parents) if missing; RQPError naming it if
    that fails (a file in the way, no permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a file of that name is in the way" if path.exists() and not path.is_dir() \
            else exc.strerror or str(exc)
        raise RQPError(f"state_dir {path}: cannot create it: {why}") from None


def mark_dead_letter_queue(key: int) -> None:
    """Mark queue ``key`` as a sending MCA's DEAD.LETTER.Q on this host: a semaphore set of
    one with that key (as a transmission queue has its agent semaphores), so that a receiving
    MCA here never offers it to the network, whatever its offer list says. A set with that key
    already there: nothing to do."""
    if is_agent_queue(key):
        return
    if _libc.semget(_key_t(key), 1, _IPC_CREAT | 0o660) < 0:
        raise RQPError(f"DEAD.LETTER.Q {format_key(key)}: cannot make its marker semaphore "
                       f"(semget: {os.strerror(ctypes.get_errno())})")


class DrainRuns(RQPError):
    """Another drain holds the queue (see :func:`drain_lock`)."""


#: The exit status of rqp-dlq-drain when another drain holds the queue or the archive (its
#: unit counts it as success: the other one drains), and of rqpctl when another replay or
#: resubmit holds the archive: sysexits' EX_TEMPFAIL, "try again later", not "failed".
EXIT_ANOTHER_RUNS = 75


#: The semaphore of a DEAD.LETTER.Q's marker set that its drain holds.
DRAINING = 0


@contextlib.contextmanager
def drain_lock(key: int, *, mark: bool):
    """Hold queue ``key`` for one drain, whatever its archive (a trial: two drains into two
    directories both ran, and 1,935 records went into both): the semaphore of its marker
    set, with SEM_UNDO (let go when the drain ends, ``kill -9`` too), per IPC namespace as the
    queue is. ``mark``: the queue is a configured DEAD.LETTER.Q, marked here if it was not
    yet; another queue is held only if it is marked already (marking an application's queue,
    drained by mistake, would keep the receiving MCA from ever offering it again). Raises
    :class:`DrainRuns` naming the other drain's pid."""
    if _libc.semget(_key_t(key), 3, 0) >= 0:  # (three semaphores: a transmission queue's)
        raise RQPError(f"queue {format_key(key)} is a sending MCA's transmission queue, not a "
                       "DEAD.LETTER.Q: not drained")
    if mark:
        mark_dead_letter_queue(key)
    sem_id = _libc.semget(_key_t(key), 1, 0)
    if sem_id < 0:
        yield  # (not marked: the archive's own lock only)
        return
    sems = _SemaphoreSet()
    sems.id, sems.key = sem_id, key
    try:
        taken = sems.take(DRAINING, timeout=0)
    except RQPError as exc:  # (a re-check: a marker root made, 0660 root:root, stopped every
        # later drain run as rqp, exit 1, until ipcrm: it drains without it)
        logging.getLogger("rqp.drain").warning(
            "queue %s: its marker semaphore cannot be held (%s; ipcs -s shows its owner): "
            "drained without it, a second drain into another archive is not kept out",
            format_key(key), exc)
        yield
        return
    if not taken:
        raise DrainRuns(f"another rqp-dlq-drain (pid {sems.last_pid(DRAINING)}) drains queue "
                        f"{format_key(key)} (perhaps into another archive)")
    try:
        yield
    finally:
        sems.give(DRAINING)


def serving_pid(transmission_queue: int) -> int | None:
    """The pid of the sending MCA serving ``transmission_queue``, or None if none does."""
    sems = _existing(transmission_queue)
    if sems is None or sems.value(SERVING) == 0:
        return None
    return sems.last_pid(SERVING)


class ServingLock:
    """Held by the sending MCA for as long as it serves its transmission queue."""

    def __init__(self, transmission_queue: int) -> None:
        self.key = transmission_queue
        self._sems = AgentSemaphores(transmission_queue)
        if not self._sems.take(SERVING, timeout=0):
            raise RQPError(
                f"another sending MCA (pid {self._sems.last_pid(SERVING)}) already serves "
                f"transmission queue {format_key(transmission_queue)}")

    def release(self) -> None:
        self._sems.give(SERVING)


class SpawnBusy(RQPError):
    """Another process held the spawn lock longer than we would wait: it starts the MCA."""


@contextlib.contextmanager
def spawn_lock(transmission_queue: int, timeout: float = 30.0):
    sems = AgentSemaphores(transmission_queue)
    deadline = time.monotonic() + timeout
    while not sems.take(SPAWNING, max(deadline - time.monotonic(), 0.001)):
        if time.monotonic() >= deadline:
            raise SpawnBusy(f"timed out after {timeout:g}s waiting for another process that "
                            f"is starting the sending MCA of {format_key(transmission_queue)}")
    try:
        yield
    finally:
        sems.give(SPAWNING)


#: An agent's young-generation threshold for the cyclic garbage collector: a collection every
#: 10,000 allocations of container objects, not Python's 700. The sending MCA's hot path makes
#: a few such objects a message, nearly all freed by their reference counts, so at 700 it
#: collected every 200 messages or so, with next to nothing to collect. Three bench runs of
#: 60,000 SURE and 60,000 UNSURE messages: 595-611 young collections took 51-59 ms and six full
#: ones 83-97 ms (14-16 ms each, the event loop stopped meanwhile), 144-169 ms in all; with
#: :func:`tune_collector`, 72 young and two full ones, 26-33 ms (about 1 µs a message less).
GC_YOUNG_THRESHOLD = 10_000


def tune_collector() -> None:
    """For a long-running agent, once it is built: what it made to start (modules, classes,
    configuration: about 30,000 objects) leaves the collector's sight (``gc.freeze``: a full
    collection no longer walks it), and the young generation is collected every
    :data:`GC_YOUNG_THRESHOLD` allocations (a higher threshold already set is kept). Cyclic
    garbage is still collected, later; :func:`release_free_memory` still collects at once."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)


def release_free_memory() -> bool:
    """Collect Python's cyclic garbage, then give the C heap's free memory back to the system
    (glibc's ``malloc_trim``). After a burst of connections both stay the process's for long:
    a connection whose TLS handshake failed leaves a cycle (its exception's traceback holds
    its transport and buffers) that only a full collection frees, and memory freed amid live
    blocks stays in the heap. A trial's receiving MCA kept 539 MB after a flood of such
    connections; 500 of them, gone, kept 55 MB, and 4 MB after this. False where there is no
    ``malloc_trim`` (another C library): the garbage is collected all the same."""
    gc.collect()
    trim = getattr(_libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def wall_ms() -> int:
    """The wall clock in Unix milliseconds: what expiry times (spec section 6) are compared
    with, by both agents."""
    return time.time_ns() // 1_000_000


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
