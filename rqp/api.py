"""The application API, C style: ``openConnection`` / ``sendMessage`` / ``closeConnection``.

An application's message goes onto the local transmission queue as a transmission record
(:mod:`rqp.protocol.records`); the sending MCA takes it from there. The first ``openConnection`` on a
host starts a sending MCA if none serves the transmission queue yet (spec 2).

A local consumer needs nothing of ours: a message arrives in the destination System V queue as
the application's bytes, with the ``mtype`` given to :func:`sendMessage` (default 1), so
``msgrcv(id, buf, size, type, 0)`` in C reads it. :func:`receiveMessage` is that, in Python.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from rqp.config import SenderConfig, find_rqprc, load_sender_config
from rqp.protocol.constants import (
    DEFAULT_PRIORITY, INT64_MAX, MAX_BATCH,
    SURE_MSG, UNSURE_MSG, MessageType,
)
from rqp.protocol.errors import MessageTooBig, QueueFull, QueueNotFound, RQPError
from rqp.protocol.records import (
    BATCH_MEMBER_HEADER_SIZE, TRANSMISSION_HEADER_SIZE, TransmissionFlags, TransmissionRecord,
    check_extras, check_mtype, encode_batch, encode_transmission,
)
from rqp.system.queues import LocalQueue, QueueEmpty, format_key, max_payload
from rqp.system.service import (
    SENDER_UNIT, SpawnBusy, sender_serving, sender_unit, spawn_lock,
)

__all__ = ["openConnection", "sendMessage", "closeConnection", "receiveMessage",
           "beginBatch", "commitBatch", "rollbackBatch", "batch", "Batch",
           "ensure_sender", "Producer", "HandleError", "AgentStartError", "DataTypeError",
           "QueueEmpty"]

#: An ``expires_at`` this big (in seconds: the year 5138) is surely milliseconds by mistake.
EXPIRES_AT_MS_LOOKALIKE = 100_000_000_000

#: How long openConnection waits for a sending MCA it started to take its queue.
START_TIMEOUT = 15.0
#: How often (seconds) a handle that may start a sending MCA checks, when it puts, that one
#: still serves its transmission queue (one semaphore read): a trial's sender was killed and
#: every later sendMessage put its record there without a word, for good.
SENDER_CHECK_INTERVAL = 1.0
#: The longest wait between two checks after starts that failed.
SENDER_CHECK_MAX = 60.0
#: Periods without a put waiting after which a producer's watcher thread ends.
WATCH_IDLE = 10


class HandleError(RQPError):
    """A handle that openConnection did not give, or that was closed."""


class AgentStartError(RQPError):
    """No sending MCA serves the transmission queue and none could be started."""


class DataTypeError(RQPError, TypeError):
    """A message's data that is no bytes-like object (a ``str``: encode it first)."""


def _payload_size(data) -> int:
    """The size in bytes of a message, checked before :func:`_payload` copies it (a buffer
    of a gigabyte is refused as too big without a copy of it first): ``bytes``, or any other
    buffer (``bytearray``, ``memoryview``, ``array``, a ctypes array) whatever its item size
    (a trial's array of 2,100 ints passed the size check as 2,100 bytes: it is 8,400)."""
    if isinstance(data, bytes):
        return len(data)
    if isinstance(data, str):
        raise DataTypeError("data must be bytes, got str (encode it: text.encode())")
    try:
        with memoryview(data) as view:
            return view.nbytes
    except TypeError:
        raise DataTypeError(f"data must be bytes (or bytearray, memoryview, another buffer), "
                            f"got {type(data).__name__}") from None
    except ValueError as exc:  # (a released memoryview: a re-check's ValueError)
        raise DataTypeError(f"data cannot be read: {exc}") from None


def _payload(data) -> bytes:
    """The bytes of a message whose :func:`_payload_size` was taken: ``bytes`` as they are,
    any other buffer copied byte for byte."""
    if isinstance(data, bytes):
        return data
    with memoryview(data) as view:
        return view.tobytes()


class Producer:
    """Puts transmission records on one transmission queue (its sending MCA, waiting in
    ``msgrcv``, wakes when one arrives): what :func:`sendMessage` does for an application's
    handle, and ``rqpctl dlq replay`` for the records it puts back. The queue is created if
    missing, so that producers can go on putting while the sending MCA restarts."""

    def __init__(self, config: SenderConfig, keep_sender: _Keeper | None = None) -> None:
        self.config = config
        self.transmission_queue = LocalQueue.create(config.transmission_queue)
        #: The largest payload: kernel msgmax minus the transmission header.
        self.limit = max_payload()
        #: Starts a sending MCA again if none serves the queue, checked after a put when due,
        #: and while a put waits for room (None: the caller starts none, as replay).
        self.keep_sender = keep_sender
    def put(self, record: TransmissionRecord, *, timeout: float | None = None,
            sync: bool = False, sync_timeout: float = 30.0) -> None:
        """Put ``record`` (waiting up to ``timeout`` for room, None: as long as it takes);
        with ``sync``, wait until the sending MCA has journaled it."""
        self.put_raw(record.to_bytes(), timeout=timeout, sync=sync, sync_timeout=sync_timeout)

    def put_raw(self, raw: bytes, *, timeout: float | None = None, sync: bool = False,
                sync_timeout: float = 30.0) -> None:
        """:meth:`put` of a record already encoded. A transmission queue removed since the
        last put (``ipcrm``, a reboot of the IPC namespace) is opened again by its key (made
        again if need be), as the sending MCA does: the handle goes on working."""
        try:
            try:
                self._put(raw, timeout)
            except QueueNotFound:
                self.transmission_queue = LocalQueue.create(self.config.transmission_queue)
                self._put(raw, timeout)
        except QueueFull:  # (a put that gave up, too: a re-check's producer with a 0.5 s
            self._keep()   # timeout, backing off and trying again, never had it restarted)
            raise
        self._keep()  # (after the put: the record is there whatever the check does)
        if sync:
            self.wait_taken(raw, sync_timeout)

    def _keep(self) -> None:
        if self.keep_sender is not None and self.keep_sender.due():
            self.keep_sender()

    def _put(self, raw: bytes, timeout: float | None) -> None:
        queue = self.transmission_queue
        if self.keep_sender is None:
            queue.put(raw, block=True, timeout=timeout)
            return
        try:
            queue.put(raw, block=False)
            return
        except QueueFull:
            pass
        # Full: the put waits in msgsnd, and only a sending MCA taking records ends that. A
        # re-check's producer, blocked there when the sending MCA was killed, waited for good:
        # the process's watcher thread looks meanwhile, and starts one again.
        waiting = (self, object())  # (one entry per put that waits: threads share handles)
        _waiting[waiting] = time.monotonic()  # (before _watch: see _watching)
        try:
            _watch()
            queue.put(raw, block=True, timeout=timeout)
        finally:
            _waiting.pop(waiting, None)

    def wait_taken(self, raw: bytes, timeout: float) -> None:
        """Wait until ``raw`` has left the transmission queue (see sendMessage's sync)."""
        queue = self.transmission_queue
        deadline = time.monotonic() + timeout
        wait = 0.0005
        while True:
            index, found = 0, False
            while (item := _copy(queue, index, raw)) is not None:  # FIFO: ours is at or before
                if item == raw:  # the end
                    found = True
                    break
                index += 1
            if not found:
                return
            if time.monotonic() > deadline:
                raise RQPError(
                    f"sync: the sending MCA has not journaled the message within {timeout:g}s; "
                    f"it is still in transmission queue "
                    f"{format_key(self.config.transmission_queue)} at position {index + 1} (is a "
                    "sending MCA running?)")
            time.sleep(wait)  # waiting on another process, with a deadline
            wait = min(wait * 2, 0.01)


#: The puts that wait for room in a full transmission queue: (producer, a token) -> since.
_waiting: dict[tuple[Producer, object], float] = {}
_watch_lock = threading.Lock()
#: The process whose watcher thread runs (None: none runs).
_watcher_pid: int | None = None


def _watch() -> None:
    """Start this process's watcher thread, if it runs no longer (or in a forked child)."""
    global _watcher_pid
    with _watch_lock:
        if _watcher_pid != os.getpid():
            _watcher_pid = os.getpid()
            try:
                threading.Thread(target=_watching, name="rqp-sender-watch",
                                 daemon=True).start()
            except RuntimeError as exc:  # (no thread to be had: the put waits unwatched,
                _watcher_pid = None      # and the next one tries again; a re-check's put
                log.warning("cannot start the thread that watches puts waiting for room: "
                            "%s; this put is not watched", exc)  # raised, and none was again)


def _watching() -> None:
    """One thread a process (a re-check: one a handle piled up to 296): once a period, the
    keeper of each producer whose put has waited that long. After WATCH_IDLE periods with
    none waiting it ends, deciding so under the lock _watch takes; a put enters _waiting
    before it calls _watch, so either this thread sees it, or _watch starts another."""
    global _watcher_pid
    idle = 0
    while True:
        time.sleep(SENDER_CHECK_INTERVAL)  # (a timer: it looks once a period)
        now = time.monotonic()
        waits = list(_waiting.items())
        if not waits:
            idle += 1
            with _watch_lock:
                if idle >= WATCH_IDLE and not _waiting:
                    _watcher_pid = None
                    return
            continue
        idle = 0
        for producer in {p for (p, _), since in waits if now - since >= SENDER_CHECK_INTERVAL}:
            try:
                if producer.keep_sender.due():
                    producer.keep_sender()
            except Exception:  # noqa: BLE001 - a bug there must not end the watching
                log.exception("checking the sending MCA of transmission queue %s failed",
                              format_key(producer.config.transmission_queue))


@dataclass(frozen=True)
class _Connection:
    queue_key: int
    producer: Producer


class Batch:
    """The messages of an atomic batch being built on a handle (:func:`batch`,
    :func:`beginBatch`): they enter the channel together at commit, or not at all."""

    def __init__(self, handle: int, msg_type: int, priority: int, expires_at_ms: int) -> None:
        self.handle = handle
        self.msg_type = msg_type
        self.priority = priority
        self.expires_at_ms = expires_at_ms
        self.members: list[tuple[int, bytes]] = []
        self.size = 0  # the payload of the batch record so far
        #: The thread (of this process) that began it: sendMessage, commitBatch and
        #: rollbackBatch on the handle act on it there only (a trial: another thread's plain
        #: message joined it and was rolled back with it; a forked child committed it again).
        self.owner = _owner()
        #: How it ended (committed, rolled back, ...); None while open.
        self.ended: str | None = None

    def send(self, data: bytes, mtype: int = 1) -> None:
        """Add a message (put with ``mtype`` at the destination) to the batch."""
        if self.ended is not None:  # (a trial's send after commit returned, and went nowhere)
            raise RQPError(f"this batch was {self.ended}: nothing more can be added to it "
                           "(begin another)")
        self.check_process()
        length = _payload_size(data)
        try:
            check_mtype(mtype)
        except ValueError as exc:
            raise RQPError(str(exc)) from None
        if len(self.members) >= MAX_BATCH:
            raise RQPError(f"a batch holds at most {MAX_BATCH} messages (spec section 6); "
                           "commit this one and begin another")
        limit = _connection(self.handle).producer.limit
        size = self.size + BATCH_MEMBER_HEADER_SIZE + length
        if size > limit:
            raise MessageTooBig(
                f"the batch would be {size} bytes with this {length}-byte message (each "
                f"message takes {BATCH_MEMBER_HEADER_SIZE} bytes more), over the {limit}-byte "
                f"limit of one System V message (kernel msgmax {limit + TRANSMISSION_HEADER_SIZE}"
                f" minus the {TRANSMISSION_HEADER_SIZE}-byte header): a batch is one record, so "
                "that its commit is atomic; commit a smaller one, or raise kernel.msgmax (see "
                "the README)", size=size, limit=limit)
        self.members.append((mtype, _payload(data)))
        self.size = size

    def check_process(self) -> None:
        """RQPError in a child forked with this batch open: it is the parent's to commit."""
        if self.owner[0] != _PID.pid:
            raise RQPError(f"this batch was begun by process {self.owner[0]}, before a fork: "
                           "it is that process's to commit")

    def __len__(self) -> int:
        return len(self.members)


class _Pid:
    """This process's pid, kept (``os.getpid`` costs a syscall per message) and renewed in a
    forked child."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self.pid = os.getpid()


_PID = _Pid()
_lock = threading.Lock()
_handles: dict[int, _Connection] = {}
#: Transmission queues this process said it does not start a sending MCA for (a service's).
_service_said: set[int] = set()
log = logging.getLogger("rqp.api")
#: The open batches, by handle and owner (:func:`_owner`): a batch is its thread's.
_batches: dict[tuple[int, int, int], Batch] = {}


class _ThreadToken:
    """A number for one thread, never given again (a thread's ident is: a re-check's new
    threads, with the idents of threads that had ended with a batch open, sent their plain
    messages into those batches). When the thread ends, its batches are dropped."""

    def __init__(self) -> None:
        self.number = next(_tokens)
        weakref.finalize(self, _drop_thread_batches, self.number)


_tokens = itertools.count(1)
_thread = threading.local()


#: The tokens of threads that ended: their batches are dropped at the next beginBatch. (Not
#: at once: a thread's local data is also freed in a forked child, inside fork, before the
#: child's lock is made anew; taking the lock there hung 32 of 51 children, a re-check.)
_ended_threads: list[int] = []


def _drop_thread_batches(number: int) -> None:
    _ended_threads.append(number)  # (atomic: no lock)


def _reap_ended_threads() -> None:
    """Drop the batches of threads that ended (with _lock held)."""
    while _ended_threads:
        number = _ended_threads.pop()
        for key in [key for key in _batches if key[2] == number]:
            _batches.pop(key).ended = "dropped: the thread that began it ended"


def _owner() -> tuple[int, int]:
    """This process and thread."""
    token = getattr(_thread, "token", None)
    if token is None:
        token = _thread.token = _ThreadToken()
    return (_PID.pid, token.number)


def _new_lock_in_child() -> None:
    """A lock another thread held at a fork stays held in the child for good (a re-check: 14
    of 300 children hung in beginBatch): the child starts with new ones, no watcher thread
    (it did not come along) and no puts waiting (those were other threads')."""
    global _lock, _watch_lock, _watcher_pid
    _lock = threading.Lock()
    _watch_lock = threading.Lock()
    _watcher_pid = None
    _waiting.clear()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _open_batch(handle: int) -> Batch | None:
    """The batch this thread has open on ``handle``, if any."""
    return _batches.get((handle, *_owner())) if _batches else None


def _end_batch(opened: Batch, how: str) -> None:
    with _lock:
        if _batches.get((opened.handle, *opened.owner)) is opened:
            del _batches[(opened.handle, *opened.owner)]
        opened.ended = how


_next_handle = itertools.count(1)
_sequence = itertools.count(1)


def ensure_sender(config: SenderConfig, rqprc: Path | None = None, *,
                  force: bool = False, say: bool = True, lock_timeout: float = 30.0) -> bool:
    """Start a sending MCA for ``config``'s transmission queue unless one serves it already,
    or this host runs it as a systemd service (:func:`~rqp.system.service.sender_unit`; a
    line says so, once a process, and the records wait on the transmission queue until the
    service takes them; ``say=False``: no line, the caller says it), unless ``force``.

    Returns True if this call started one. Two processes calling at the same moment start
    exactly one: starting is serialised by a semaphore (see :mod:`rqp.system.service`).
    """
    xmit = config.transmission_queue
    if sender_serving(xmit):
        return False
    unit = None if force else sender_unit()
    if unit is not None:
        if say and xmit not in _service_said:
            _service_said.add(xmit)
            log.warning("no sending MCA serves transmission queue %s, and none is started from "
                        "here: this host runs it as a service (%s), so that SURE messages are "
                        "journaled in one place; records wait on the queue until it runs "
                        "(systemctl start %s)", format_key(xmit), unit, SENDER_UNIT)
        return False
    with spawn_lock(xmit, timeout=lock_timeout):
        if sender_serving(xmit):
            return False
        state_dir = Path(config.state_dir)
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            log_path = config.log_path
            log_file = open(log_path, "ab")
        except OSError as exc:
            raise AgentStartError(f"cannot start a sending MCA: state_dir {state_dir}: "
                                  f"{exc.strerror or exc}") from exc
        argv = [sys.executable, "-m", "rqp_agents.sender"]
        if rqprc is not None:
            argv += ["--rqprc", str(rqprc)]
        with log_file:
            try:
                child = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log_file,
                                         start_new_session=True, close_fds=True,
                                         cwd=str(state_dir))
            except OSError as exc:
                raise AgentStartError(f"cannot start a sending MCA ({' '.join(argv)}): "
                                      f"{exc}") from exc
        deadline = time.monotonic() + START_TIMEOUT
        wait = 0.005
        while not sender_serving(xmit):
            if child.poll() is not None:
                raise AgentStartError(
                    f"the sending MCA started for transmission queue {format_key(xmit)} exited "
                    f"with status {child.returncode}; its log {log_path} ends:\n"
                    + _tail(log_path))
            if time.monotonic() > deadline:
                raise AgentStartError(
                    f"the sending MCA (pid {child.pid}) did not take transmission queue "
                    f"{format_key(xmit)} within {START_TIMEOUT:g}s; see {log_path}")
            time.sleep(wait)  # waiting on another process's start-up, with a deadline
            wait = min(wait * 2, 0.1)
        return True


class _Keeper:
    """A handle's check that its sending MCA still runs: started again (as openConnection
    would) if it stopped or was killed, and said; on a host that runs it as a service, the one
    warning ensure_sender gives. Due every SENDER_CHECK_INTERVAL; after a start that failed,
    twice as long each time up to a minute (a re-check: a broken .rqprc gave an ERROR and a
    start each second). Never raises: the record is put whatever it finds."""

    def __init__(self, config: SenderConfig, rqprc: Path, force: bool) -> None:
        self.config, self.rqprc, self.force = config, rqprc, force
        self.wait = SENDER_CHECK_INTERVAL
        self.next_at = time.monotonic() + self.wait
        #: The process in which a check runs now (a pid, not a lock: a lock held at a fork
        #: would stay held in the child, and its checks never run).
        self._running: int | None = None

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def __call__(self) -> None:
        if self._running == os.getpid():
            return  # (the watcher thread or the producer is at it)
        self._running = os.getpid()
        xmit = self.config.transmission_queue
        try:
            self.next_at = time.monotonic() + self.wait
            try:  # (another process starting one holds the lock: let it, no wait of 30 s)
                if sender_serving(xmit):
                    self.wait = SENDER_CHECK_INTERVAL
                    return
                started = ensure_sender(self.config, self.rqprc, force=self.force,
                                        lock_timeout=SENDER_CHECK_INTERVAL)
            except SpawnBusy:
                return  # (it is starting one: looked at again when due)
            except Exception as exc:  # noqa: BLE001 - never out of sendMessage once its
                # record is put (a re-check: a foreign semaphore set made sender_serving raise
                # there, and an application that retried would have sent it twice)
                self.wait = min(self.wait * 2, SENDER_CHECK_MAX)
                self.next_at = time.monotonic() + self.wait
                log.error("no sending MCA serves transmission queue %s any more, or it cannot "
                          "be told, and none could be started again (tried again in %gs); "
                          "records wait there: %s", format_key(xmit), self.wait, exc,
                          exc_info=not isinstance(exc, RQPError))
                return
            self.wait = SENDER_CHECK_INTERVAL
            if started:
                log.warning("no sending MCA served transmission queue %s any more (it "
                            "stopped, or was killed): this process started another, which "
                            "sends what waits there", format_key(xmit))
        finally:
            self._running = None


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(unreadable)"


def openConnection(queue, *, rqprc: str | os.PathLike | None = None,
                   start_sender: bool | None = None) -> int:
    """A handle for sending to ``queue`` (a System V key, or a name from ``.rqprc``).

    ``start_sender``: None, start a sending MCA if none serves the transmission queue, but not
    on a host that runs it as a systemd service (see :func:`ensure_sender`); True, start one
    all the same; False, never."""
    path = find_rqprc(rqprc)
    config = load_sender_config(path)
    queue_key = config.resolve_queue(queue)
    if (own := config.agent_queue(queue_key)) is not None:
        named = f"{queue!r} ({format_key(queue_key)})" if isinstance(queue, str) else \
            format_key(queue_key)  # (a key by number: in hex, as everywhere, not in decimal)
        raise RQPError(f"queue {named} is {own} of the agents, not a destination "
                       f"(no receiving MCA offers it)")
    keep = None
    if start_sender is not False:
        ensure_sender(config, path.resolve(), force=bool(start_sender))
        keep = _Keeper(config, path.resolve(), bool(start_sender))
    producer = Producer(config, keep)
    with _lock:
        handle = next(_next_handle)
        _handles[handle] = _Connection(queue_key, producer)
    return handle


def _connection(handle: int) -> _Connection:
    conn = _handles.get(handle)
    if conn is None:
        raise HandleError(f"handle {handle!r} is not open (never opened, or closed already)")
    return conn


def sendMessage(handle: int, data: bytes, msg_type: int | None = None, *,
                timeout: float | None = None, sync: bool = False, mtype: int = 1,
                priority: int | None = None, ttl: float | None = None,
                expires_at: float | None = None) -> None:
    """Put ``data`` on the transmission queue for the handle's queue.

    ``msg_type``: SURE_MSG (the default) or UNSURE_MSG. Between :func:`beginBatch` and
    :func:`commitBatch` the message goes into the batch, whose type it takes (given here, it
    must be the batch's).

    Returns once the record is in the kernel's transmission queue; if that queue is full, waits
    (at most ``timeout`` seconds, if given) for the sending MCA to make room.

    ``mtype``: the System V message type it is put with at the destination (1 or more), so a
    consumer can select it with ``msgrcv``'s ``msgtyp``. ``priority`` 0..9 (None: 4, or the
    batch's in a batch, where no other is taken): waiting
    messages of higher priority are sent first; the order within one priority is kept.
    ``ttl`` (seconds from now) or ``expires_at`` (Unix time, seconds): after it the message is
    never delivered but dead-lettered ``EXPIRED``. A host that speaks plain RQP/1 carries
    priority and expiry on the sender's side only and cannot carry another ``mtype`` than 1
    (the README has the table).

    ``sync=True`` (SURE messages): returns only once the sending MCA has the message in its
    journal on disk, so that nothing is lost even if the host's kernel queues are lost right
    after the call (a reboot). The sending MCA journals a SURE record before it takes it off
    the transmission queue, so "no longer in the queue" means "in the journal"; this waits for
    that (at most ``timeout`` seconds, default 30). Without ``sync``, a message is in the
    kernel's memory only until the sending MCA takes it: a reboot in between loses it.
    """
    conn = _connection(handle)
    open_batch = _open_batch(handle)
    if msg_type is None:
        msg_type = SURE_MSG if open_batch is None else open_batch.msg_type
    msg_type = _msg_type(msg_type)
    if timeout is not None:
        _check_timeout(timeout)
    if open_batch is not None:  # between beginBatch and commitBatch: into the batch
        given = [name for name, value, default in (
            ("ttl", ttl, None), ("expires_at", expires_at, None), ("timeout", timeout, None),
            ("sync", sync, False)) if value != default]
        if priority is not None and priority != open_batch.priority:  # (its own: no other)
            given.insert(0, f"priority {priority} (the batch's is {open_batch.priority})")
        if given or msg_type != open_batch.msg_type:
            raise RQPError(
                "a batch has one message type, priority and expiry, given to beginBatch, and "
                "is put by commitBatch (which takes timeout and sync): "
                + (f"{', '.join(given)} given to sendMessage" if given else
                   f"msg_type {MessageType(msg_type).name}_MSG here, "
                   f"{MessageType(open_batch.msg_type).name}_MSG for the batch"))
        open_batch.send(data, mtype)
        return
    if sync and msg_type != SURE_MSG:
        raise RQPError("sync=True is for SURE messages: UNSURE ones are never journaled")
    if priority is None:
        priority = DEFAULT_PRIORITY
    length = _payload_size(data)
    limit = conn.producer.limit
    if length > limit:
        raise MessageTooBig(
            f"message of {length} bytes is over the {limit}-byte limit of one System V "
            f"message (kernel msgmax {limit + TRANSMISSION_HEADER_SIZE} minus the "
            f"{TRANSMISSION_HEADER_SIZE}-byte transmission header); "
            "split it, or raise kernel.msgmax on every host (see the README)",
            size=length, limit=limit)
    data = _payload(data)
    now_ns = time.time_ns()
    try:  # in words that name them
        check_extras(mtype, priority)
    except ValueError as exc:
        raise RQPError(str(exc)) from None
    expires_at_ms = 0 if ttl is None and expires_at is None else \
        expiry_ms(ttl, expires_at, now_ns)
    # The bytes straight from the checked values (the hot path: no record object).
    raw = encode_transmission(msg_type, conn.queue_key, data, 0, _PID.pid,
                              next(_sequence), now_ns, mtype, priority, expires_at_ms)
    conn.producer.put_raw(raw, timeout=timeout, sync=sync,
                          sync_timeout=30.0 if timeout is None else timeout)


def _check_timeout(timeout) -> None:
    """A trial's ``timeout=-1`` was taken without a word."""
    if timeout is not None and (isinstance(timeout, bool) or
                                not isinstance(timeout, (int, float)) or not timeout >= 0):
        raise RQPError(f"timeout must be a number of seconds >= 0 (None: as long as it takes), "
                       f"got {timeout!r}")


def _msg_type(msg_type) -> int:
    """``msg_type`` checked, as an int: SURE_MSG or UNSURE_MSG, or any integer of those values
    (an application's own IntEnum, a numpy integer), but not True/False, nor 1.0 (a trial's
    True, meant as "sure", sent UNSURE_MSG, 1)."""
    value = msg_type
    if type(msg_type) not in (int, MessageType):
        try:
            value = -1 if isinstance(msg_type, bool) else operator.index(msg_type)
        except TypeError:
            value = -1
    if value not in (SURE_MSG, UNSURE_MSG):
        raise RQPError(f"msg_type must be SURE_MSG ({SURE_MSG}) or UNSURE_MSG ({UNSURE_MSG}), "
                       f"got {msg_type!r}")
    return value


def beginBatch(handle: int, msg_type: int = SURE_MSG, *, priority: int | None = None,
               ttl: float | None = None, expires_at: float | None = None) -> Batch:
    """Start an atomic batch on ``handle``: the next ``sendMessage`` calls on it (or
    ``Batch.send``) add to it, :func:`commitBatch` puts them all at once, :func:`rollbackBatch`
    (or ``closeConnection``, or the process ending) drops them. Every message of it enters the
    channel or none does; the consumer never sees part of it (spec section 6). One message
    type, priority (None: 4) and expiry for the whole batch; each message has its own
    ``mtype``. The batch is this thread's: another thread's ``sendMessage`` on the same
    handle is sent on its own, and a child forked meanwhile cannot commit it."""
    _connection(handle)
    msg_type = _msg_type(msg_type)
    if priority is None:
        priority = DEFAULT_PRIORITY
    try:
        check_extras(1, priority)
    except ValueError as exc:
        raise RQPError(str(exc)) from None
    expires_at_ms = expiry_ms(ttl, expires_at, time.time_ns())
    opened = Batch(handle, msg_type, priority, expires_at_ms)
    with _lock:
        _reap_ended_threads()
        if (handle, *opened.owner) in _batches:
            raise RQPError(f"handle {handle} has a batch open already in this thread: commit "
                           "or roll it back first")
        _batches[(handle, *opened.owner)] = opened
    return opened


def commitBatch(handle: int, *, timeout: float | None = None, sync: bool = False) -> int:
    """Put the open batch of ``handle`` on the transmission queue as one record (one
    ``msgsnd``: all of it or nothing) and close it. Returns how many messages it held (an
    empty batch puts nothing). ``timeout`` and ``sync`` as for :func:`sendMessage`. If the
    put fails, the batch stays open (commit again, or roll it back)."""
    _check_timeout(timeout)
    open_batch = _open_batch(handle)
    if open_batch is None:
        _connection(handle)
        raise RQPError(f"handle {handle} has no batch open in this thread (beginBatch first)")
    return _commit(open_batch, timeout, sync)


def _commit(open_batch: Batch, timeout: float | None, sync: bool) -> int:
    conn = _connection(open_batch.handle)
    if open_batch.ended is not None:
        raise RQPError(f"this batch was {open_batch.ended} already")
    open_batch.check_process()  # (a with block left in a child forked inside it)
    if sync and open_batch.msg_type != SURE_MSG:
        raise RQPError("sync=True is for SURE messages: UNSURE ones are never journaled")
    now_ns = time.time_ns()
    if open_batch.expires_at_ms and open_batch.expires_at_ms <= now_ns // 1_000_000:
        raise RQPError("the batch's expiry passed before its commit: it would be dead-lettered "
                       "EXPIRED at once (roll it back; begin it again with a later expiry)")
    raw = None
    if open_batch.members:
        raw = TransmissionRecord(
            message_type=open_batch.msg_type, queue_key=conn.queue_key,
            payload=encode_batch(open_batch.members), flags=TransmissionFlags.BATCH,
            producer_pid=os.getpid(), sequence=next(_sequence), enqueued_ns=now_ns,
            priority=open_batch.priority, expires_at_ms=open_batch.expires_at_ms).to_bytes()
        conn.producer.put_raw(raw, timeout=timeout)
    # Put: committed, whatever the sync wait below says (a re-check: a sync that timed out
    # left the batch open, a second commit put it again, and it was delivered twice)
    _end_batch(open_batch, "committed")
    if sync and raw is not None:
        conn.producer.wait_taken(raw, 30.0 if timeout is None else timeout)
    return len(open_batch.members)


def rollbackBatch(handle: int) -> int:
    """Drop this thread's open batch of ``handle`` (nothing of it was put). Returns how many
    messages it held."""
    _connection(handle)
    open_batch = _open_batch(handle)
    if open_batch is None:
        raise RQPError(f"handle {handle} has no batch open in this thread (beginBatch first)")
    _end_batch(open_batch, "rolled back")
    return len(open_batch.members)


@contextlib.contextmanager
def batch(handle: int, msg_type: int = SURE_MSG, *, priority: int | None = None,
          ttl: float | None = None, expires_at: float | None = None,
          timeout: float | None = None, sync: bool = False):
    """``with rqp.batch(h) as b: b.send(data, mtype=5) ...``: committed when the block ends,
    rolled back if it raises (see :func:`beginBatch`)."""
    opened = beginBatch(handle, msg_type, priority=priority, ttl=ttl, expires_at=expires_at)
    try:
        yield opened
    except BaseException:
        _end_batch(opened, "rolled back (its with block raised)")
        raise
    try:
        _commit(opened, timeout, sync)
    finally:
        if opened.ended is None:
            _end_batch(opened, "rolled back (its commit failed)")


def expiry_ms(ttl: float | None, expires_at: float | None, now_ns: int) -> int:
    """sendMessage's ``ttl`` (seconds from now) or ``expires_at`` (Unix seconds) as the
    record's ``expires_at_ms`` (0: never), with errors that name the parameter."""
    if ttl is not None and expires_at is not None:
        raise RQPError("give ttl or expires_at, not both")
    for name, value, base in (("ttl", ttl, now_ns), ("expires_at", expires_at, 0)):
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise RQPError(f"{name} must be a number of seconds, got {value!r}")
        if name == "ttl" and not value >= 0.001:  # (a trial's 1e-9 was expired when taken)
            raise RQPError(f"ttl must be at least 0.001 seconds (expiry is kept in "
                           f"milliseconds), got {value!r}")
        if name == "expires_at" and value >= EXPIRES_AT_MS_LOOKALIKE:
            raise RQPError(f"expires_at is a Unix time in seconds (like time.time()); "
                           f"{value!r} is after the year 5000: milliseconds? (rqp.h's "
                           "expires_at_ms is in milliseconds, this is not)")
        if value in (float("inf"), float("-inf")) or abs(value) >= 1 << 64:
            raise RQPError(f"{name} {value!r} is past the year 500 million (no expiry: leave "
                           f"{name} out)")
        if name == "expires_at" and value * 1e9 <= now_ns:  # (rqp.h's 0 means never: a
            # trial's expires_at=0 was dead-lettered EXPIRED at once, without a word)
            raise RQPError(f"expires_at {value!r} is already past (the time is now "
                           f"{now_ns / 1e9:.3f}): the message would be dead-lettered EXPIRED "
                           "at once (no expiry: leave expires_at out)")
        expires_at_ms = max(1, (base + int(value * 1e9)) // 1_000_000)
        if expires_at_ms >= 1 << 64:
            raise RQPError(f"{name} {value!r} is past the year 500 million")
        if name == "expires_at" and expires_at_ms <= now_ns // 1_000_000:  # (kept in ms: a
            # re-check's now + 0.5 ms was this very millisecond, expired when taken)
            raise RQPError(f"expires_at {value!r} is within this millisecond: expiry is kept "
                           "in milliseconds, so it would be dead-lettered EXPIRED at once")
        return expires_at_ms
    return 0


def closeConnection(handle: int) -> None:
    """Close ``handle``; a batch still open on it is dropped (rolled back)."""
    with _lock:
        for key in [key for key in _batches if key[0] == handle]:
            _batches.pop(key).ended = "dropped by closeConnection"
        if _handles.pop(handle, None) is None:
            raise HandleError(f"handle {handle!r} is not open (never opened, or closed already)")


def receiveMessage(queue, timeout: float | None = None, *,
                   rqprc: str | os.PathLike | None = None, mtype: int = 0,
                   with_type: bool = False):
    """Take the next message from a local queue (a key, or a name from ``.rqprc``).

    ``mtype`` selects as System V's ``msgtyp`` does: 0 = the first message, > 0 = the first of
    that type, < 0 = the first of the lowest type up to ``-mtype``. Returns the bytes, or
    ``(bytes, mtype)`` with ``with_type=True``. Blocks until one arrives, or raises
    :class:`rqp.system.queues.QueueEmpty` after ``timeout``.
    """
    if not isinstance(mtype, int) or isinstance(mtype, bool) or not -INT64_MAX <= mtype <= INT64_MAX:
        raise RQPError(f"mtype must be an integer (System V msgtyp), got {mtype!r}")
    _check_timeout(timeout)
    if isinstance(queue, int):
        key = queue
    else:
        key = load_sender_config(find_rqprc(rqprc)).resolve_queue(queue)
    local = LocalQueue.open(key)
    return local.get(block=True, timeout=timeout, mtype=mtype, with_type=with_type)


def _copy(queue, index: int, raw: bytes) -> bytes | None:
    """A copy of message ``index`` of ``queue``, None past the end. A message longer than the
    kernel's msgmax (put before it was lowered) cannot be copied: it is not ``raw`` (b""),
    unless ``raw`` is longer than msgmax too (then it may be: ``raw``)."""
    try:
        item = queue.peek(index)
    except MessageTooBig as exc:
        return raw if len(raw) > exc.limit else b""
    return item and item[0]

