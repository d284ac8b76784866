"""rqp-receiver: the receiving MCA.

Listens for sending MCAs, answers ``QUEUE_ASK`` with the local queues it may write to and puts
each ``MESSAGE`` in the local System V queue with that key, or in ``DEAD.LETTER.Q`` with the
reason. The protocol lives in :mod:`rqp.protocol.receiver`; this module is the I/O around it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

from rqp import SURE_MSG, RQPError
from rqp.cli import add_log_level, add_version, listen_address
from rqp.config import ReceiverConfig, is_loopback, load_receiver_config, parse_host
from rqp.protocol.access import Allowance, Peer
from rqp.protocol.errors import LocalProtocolError, QueueError
from rqp.protocol.events import MessageEx, OversizedMessage
from rqp.protocol.frames import ANSWER_SIZE, CLOSED, NEED_DATA
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.constants import KNOWN_EXTENSIONS
from rqp.protocol.receiver import Ask, Batch, Put, ReceiverConnection, Refuse
from rqp.protocol.records import AgentKind, DeadLetterFlags, DeadLetterRecord
from rqp.storage.deadletters import RECEIVER_SHARE, DeadLetterWriter
from rqp.storage.dedup import DedupError, DedupWindow, scoped_key, window_path
from rqp.system.control import default_socket
from rqp.system.files import write_file_atomically
from rqp.system.queues import format_key, kernel_limits
from rqp.system.service import (
    config_changes, counts, host_name, make_state_dir, setup_logging, wall_ms,
)
from rqp_agents import telemetry
from rqp_agents.daemon import Daemon, RateLimitedLog, check_only, run_daemon
from rqp_agents.delivery import NO_WAITING, LocalDelivery
from rqp_agents.gate import EVICT_IDLE, Gate
from rqp_agents.links import keepalive

log = logging.getLogger("rqp.receiver")

READ_SIZE = 1 << 16
#: Answers are sent in batches of at most this many requests (and at the end of each read),
#: each batch once the de-duplication window holds its SURE keys durably (one fsync per
#: commit, in a writer thread). Half the default window: one batch is committed while the
#: next fills. 128 took 15 % off the receiving MCA's CPU a SURE message against 64 (fewer
#: commits and answer writes; the sending MCA then sends in larger runs too), msg/s and a
#: single message's latency unchanged (README, Performance).
ANSWER_BATCH = 128
#: Answers of one connection waiting for their commit, at most (a connection reads no more
#: while another full batch would go beyond it). A receiving MCA killed between putting
#: messages and committing their keys puts them again when they are re-sent: at most this many
#: frames per connection, and never more than the sender's window (frames it sent and has no
#: answer for). Counted in frames, not batches: a batch also ends with each read, which holds
#: 16 frames of 4 KiB (a bound of 2 batches let only 32 of those wait). An atomic batch's
#: answers come together: one of up to MAX_BATCH messages can go beyond this.
UNCOMMITTED_MAX = 2 * ANSWER_BATCH
#: Seconds a stop waits for connections to end once they were cancelled.
STOP_GRACE = 2.0
#: Seconds a connection this side closes in order (idle_timeout, closed to make
#: room, a stop) waits for its peer's end after its own: a frame the peer sent before it saw
#: the close is still read and taken (Receiver._linger). A sending MCA ends its side as soon
#: as it reads the close, a round trip later.
LINGER = 1.0
#: Of the connections closed to make room for new ones, at most one in this many of
#: max_connections lingers at once (each holds a socket beyond max_connections meanwhile):
#: more are closed at once.
ROOM_LINGERING = 8
#: Seconds a TLS connection's close waits for the peer's close_notify before its socket is
#: let go anyway (asyncio waits 30 s: a trial's flood of peers that read nothing took the
#: receiving MCA to its 4,096 descriptors with closed connections, and it stopped accepting).
#: A peer that reads answers it within a round trip.
TLS_CLOSE_GRACE = 1.0
#: The kernel's send buffer of a connection (SO_SNDBUF; Linux doubles it): answers are 2
#: octets, so this holds tens of thousands, and it bounds the answers a peer that reads none
#: leaves in this host's memory (the kernel's autotuning let it grow to 4 MiB: a trial had 2
#: million messages put for a client that read no answer). Such a peer is closed after
#: idle_timeout without reading any.
ANSWER_SEND_BUFFER = 64 * 1024
#: Lines about connections opening, closing and failing: at most this many of each kind per
#: interval (a peer reconnecting in a loop must not fill the journal).
CONNECTION_LOG_INTERVAL = 10.0
CONNECTION_LOG_BURST = 20
#: SURE message keys already dead-lettered (spec 5.10: one notice per key), most recent kept.
NOTICE_MEMORY = 100_000
#: Peers remembered for rqpctl trace (a key is looked up in the window once per peer).
PEER_MEMORY = 1024
#: Where they are kept (JSON strings, one a line, the most recent last), so that trace finds
#: the keys a restart kept in the window (a trial: "knows nothing" of a key it had, until its
#: peer came again); written at most once per PEERS_SAVE_INTERVAL seconds, and at a stop.
PEERS_FILE = "peers.seen"
PEERS_SAVE_INTERVAL = 10.0


#: In state_dir: the Unix time of the last dead letter DEAD.LETTER.Q had no room for (a third
#: trial: a restart made rqpctl status exit 0 and ended the alert at once), written at most
#: once per NO_ROOM_SAVE_INTERVAL seconds.
NO_ROOM_FILE = "no-room.last"
NO_ROOM_SAVE_INTERVAL = 1.0


def _read_time(path: Path) -> float | None:
    """The Unix time kept in ``path``; None if there is none (or none that makes sense)."""
    try:
        at = float(path.read_text())
    except (OSError, ValueError):
        return None
    return at if 0 < at <= time.time() else None


#: The longest peer label kept in PEERS_FILE (an address, or a certificate's name), and so
#: the most of it read (a re-check's 400 MB line was read whole, and kept).
PEER_LABEL_MOST = 1024


def _read_peers(path: Path) -> dict[str, None]:
    """The peer labels kept in ``path`` (:data:`PEERS_FILE`), the most recent last; none if
    it cannot be read, and any line that is not a JSON string of a label skipped."""
    labels: dict[str, None] = {}
    most = PEER_MEMORY * (PEER_LABEL_MOST * 6 + 3)  # (a label's JSON: \u escapes at worst)
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - most, 0))
            lines = f.read(most).decode("utf-8", errors="replace").splitlines()
    except OSError:
        return labels
    for line in lines[-PEER_MEMORY:]:
        try:
            label = json.loads(line)
        except ValueError:
            continue
        if isinstance(label, str) and len(label) <= PEER_LABEL_MOST:
            labels.pop(label, None)
            labels[label] = None
    return labels


#: What a put without waiting did (Receiver._put_at_once).
_PUT, _REPEAT = "put", "repeat"
#: Indexes of telemetry.QueueFigures.OUTCOMES.
_PUT_FIGURE, _REPEAT_FIGURE, _DEAD_LETTERED_FIGURE = 0, 1, 2


class GroupCommit:
    """The de-duplication window's commits, off the event loop, in one writer thread.

    ``durable()`` gives a future that is done when every key recorded so far is on disk. One
    commit runs at a time; keys recorded meanwhile go into the next, which starts when it
    ends and takes all of them: the busier the receiver, the more keys per fsync (group
    commit), with no commit waiting longer than one fsync to start.

    The thread takes jobs from a queue and hands each outcome back with one
    ``call_soon_threadsafe`` (no executor, no futures chained across threads: at ~400
    commits a second their locks and wake-ups were a tenth of the receiver's CPU). It is a
    daemon thread: a commit cut short by the end of the process was not answered for, and a
    compaction replaces the file atomically."""

    def __init__(self, window: DedupWindow, broken) -> None:
        """``broken(exc)`` is called (on the loop) when an fsync of the window failed: no
        commit can succeed any more in this process."""
        self.window = window
        self._broken = broken
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running: asyncio.Future | None = None  # the commit being written
        self._next: asyncio.Future | None = None  # done with the commit after it

    def durable(self) -> asyncio.Future | None:
        """None if every recorded key is durable already; else a future done when they are
        (its exception, a DedupError, if they may not be). Raises DedupError when no commit
        can succeed (an earlier fsync failed)."""
        if self._next is not None:
            return self._next
        running = self._running
        if running is None or running.done():
            entries = self.window.begin_commit()
            if entries is None:
                return None
            return self._start(entries)
        if self.window.pending:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieved)  # (its waiters may all be gone)
            return self._next
        return running

    async def drain(self) -> None:
        """Wait for the commits begun, then stop the writer thread."""
        while (waiting := self._next or self._running) is not None and not waiting.done():
            await asyncio.wait([waiting])
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()  # (after a compaction it may still be writing)
            self._thread = None

    def _run(self, func, arg) -> asyncio.Future:
        """``func(arg)`` in the writer thread, after the jobs before it; a future of the loop
        with its outcome."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="rqp-dedup", daemon=True)
            self._thread.start()
        self._jobs.put((loop, future, func, arg))
        return future

    def _write(self) -> None:
        """The writer thread: each job in turn, until None."""
        while (job := self._jobs.get()) is not None:
            loop, future, func, arg = job
            try:
                func(arg)
                failure = None
            except BaseException as exc:  # noqa: BLE001 - the loop decides what it means
                failure = exc
            try:
                loop.call_soon_threadsafe(_settle_with, future, failure)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass

    def _start(self, entries) -> asyncio.Future:
        self._running = future = self._run(self.window.finish_commit, entries)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, done: asyncio.Future) -> None:
        if self._running is done:
            self._running = None
        failed = done.cancelled() or done.exception() is not None
        if failed and self.window.broken:
            self._broken(done.exception())
        if not failed and self.window.compaction_due():  # (when the file has grown)
            snapshot = self.window.begin_compact()
            if snapshot is not None:
                self._run(self.window.finish_compact, snapshot).add_done_callback(
                    _log_compaction)
        after, self._next = self._next, None
        if after is None:
            return
        try:
            entries = self.window.begin_commit()
        except DedupError as exc:
            after.set_exception(exc)
            return
        if entries is None:
            after.set_result(None)
        else:
            self._start(entries).add_done_callback(lambda done: _settle(after, done))


def _settle_with(future: asyncio.Future, failure: BaseException | None) -> None:
    """On the loop: the outcome of a job of the writer thread."""
    if future.cancelled():
        return
    if failure is None:
        future.set_result(None)
    else:
        future.set_exception(failure)


def _settle(future: asyncio.Future, done: asyncio.Future) -> None:
    """Give ``future`` the outcome of ``done``."""
    if done.cancelled():
        future.cancel()
    elif done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(None)


def _retrieved(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


def _log_compaction(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("%s", done.exception())


class PeerNotReading(RQPError):
    """The peer left its answers unread (the socket's buffer full) for idle_timeout: the
    connection is given up."""


class _Answers:
    """One connection's answers, sent in order, each batch once its SURE keys are durable.

    ``send`` writes a batch at once when nothing it needs is still being committed, else
    queues it; a commit's done-callback writes the batches at the head of the queue whose
    commits are done, in order (no task per batch). ``room`` waits until another full batch
    may wait within UNCOMMITTED_MAX answers, and for the socket's buffer (``drain``, at most
    ``patience`` seconds: then PeerNotReading); ``flush`` waits for all of them.
    A failed commit fails the batch that needed it and every one after it, for good: the
    connection is closed with them unanswered (the sender keeps those messages), the failure
    is raised once (by the next call) and nothing is written after it, not even a batch whose
    own commit would succeed: its answers would reach the peer as answers to other frames."""

    def __init__(self, writer: asyncio.StreamWriter, commits: GroupCommit,
                 patience: float | None = None) -> None:
        self._writer = writer
        self._commits = commits
        self._patience = patience  # seconds the peer may leave the socket's buffer full
        self._stuck = False  # it did: nothing more is waited for
        #: Since when (loop time) it waits for the peer to read its answers; None: it does not.
        self.blocked_since: float | None = None
        #: (the commit it waits for or None, the answers, how many), in order
        self._waiting: collections.deque[tuple[asyncio.Future | None, bytes, int]] = \
            collections.deque()
        self._answers_waiting = 0  # the sum of their counts
        self._failure: BaseException | None = None  # a failed commit's, raised once
        self._failed = False  # a commit failed: closed, nothing is written any more
        self._moved: asyncio.Future | None = None  # done when batches are written (or fail)

    def send(self, batch: list[bytes], sure: bool) -> None:
        """Send ``batch`` (answers, in order) once what it confirms is durable: with ``sure``
        (it answers SURE messages), once the window holds every key recorded so far; else as
        soon as the batches before it are sent. After a failed commit: dropped."""
        if self._failed:
            self._raise_failure()
            return
        durable = self._commits.durable() if sure else None  # (raises if none can succeed)
        data = b"".join(batch)
        if durable is None and not self._waiting:
            self._writer.write(data)
            return
        count = len(data) // ANSWER_SIZE  # (an atomic batch: one answer per message)
        self._waiting.append((durable, data, count))
        self._answers_waiting += count
        if durable is not None:
            durable.add_done_callback(self._release)

    def _release(self, _done: asyncio.Future | None = None) -> None:
        """Write the batches at the head whose commits are done, in order; at a failed one,
        close the connection with it and every batch after it unwritten."""
        waiting = self._waiting
        while waiting:
            durable, data, count = waiting[0]
            if durable is not None:
                if not durable.done():
                    break
                failure = asyncio.CancelledError() if durable.cancelled() else \
                    durable.exception()
                if failure is not None:
                    for later, _, _ in waiting:  # same failure: seen here, not logged as lost
                        if later is not None:
                            later.add_done_callback(_retrieved)
                    waiting.clear()
                    self._answers_waiting = 0
                    self._failure, self._failed = failure, True
                    self._writer.close()  # at once, the connection may be waiting for bytes
                    break
            waiting.popleft()
            self._answers_waiting -= count
            self._writer.write(data)
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)

    def _raise_failure(self) -> None:
        """Raise the failure of a commit, once (the batches after it are dropped)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    async def _wait_moved(self) -> None:
        if self._moved is None or self._moved.done():
            self._moved = asyncio.get_running_loop().create_future()
        await self._moved
        self._raise_failure()

    async def room(self) -> None:
        """Wait until a full batch more may wait for its commit (within UNCOMMITTED_MAX
        answers) and the socket drained."""
        self._raise_failure()
        while self._answers_waiting > UNCOMMITTED_MAX - ANSWER_BATCH:
            await self._wait_moved()
        await self._drain()

    async def flush(self) -> None:
        """Wait until every batch is written (or raise the failure that stops them); at once
        if the peer was found not reading."""
        if self._stuck:
            return
        self._raise_failure()
        while self._waiting:
            await self._wait_moved()
        await self._drain()

    async def _drain(self) -> None:
        """The socket's buffer drained, within ``patience``."""
        self.blocked_since = asyncio.get_running_loop().time()  # (seen by others only if
        # it waits: a socket's buffer drained returns at once)
        try:
            async with asyncio.timeout(self._patience):
                await self._writer.drain()
        except TimeoutError as exc:
            if exc.errno is not None:  # (ETIMEDOUT: the kernel gave the peer up, not us)
                raise
            self._stuck = True
            raise PeerNotReading(f"it left its answers unread for {self._patience:g}s "
                                 "(idle_timeout)") from None
        finally:
            self.blocked_since = None

    def abandon(self) -> None:
        """The connection is closed under it: nothing more is written or waited for."""
        self._stuck = True


@dataclasses.dataclass(slots=True)
class _Open:
    """One open connection: its peer's address; once its handshake is done, its protocol
    state and its answers."""

    source: str
    protocol: ReceiverConnection | None = None
    answers: _Answers | None = None


class Receiver(Daemon):
    """The receiving MCA: one asyncio server, one task per connection."""

    stop_note = "no new connections; answering what is in flight"

    def __init__(self, config: ReceiverConfig, overrides: frozenset[str] = frozenset()) -> None:
        super().__init__(log)
        problem = config.transport_problem()
        if problem:
            raise RQPError(problem)
        self.config = config
        #: Settings given on the command line, which a reload of the file keeps.
        self.overrides = overrides
        self.gate = Gate(config)
        self.files_replaced((config.tls,))
        self.host = config.host_name or host_name()
        self.msgmax = kernel_limits().msgmax
        self.max_message_size = config.max_message_size or self.msgmax
        _say_max_over_msgmax(config, self.msgmax)
        self.dead_letters = DeadLetterWriter(config.dead_letter_queue,
                                             Path(config.state_dir) / "spill", msgmax=self.msgmax,
                                             spill_limit=config.spill_limit,
                                             cut_unspillable=True)
        #: The last failure to write the de-duplication window (its text, time.time()), and
        #: how many connections it closed: for status and metrics (a trial: exit 0 and no
        #: metric while every connection was closed for a full state_dir).
        self.dedup_trouble: tuple[str, float] | None = None
        self.dedup_failures = 0
        state = Path(config.state_dir)
        make_state_dir(state)
        # SURE repeats (same key) are answered without a second put, within this window.
        self.dedup = DedupWindow(window_path(state), max_keys=config.dedup_window_keys,
                                 max_age=config.dedup_window_age)
        for problem in self.dedup.problems:
            log.warning("de-duplication window: %s", problem)  # (each names the file)
        self.commits = GroupCommit(self.dedup, lambda exc: self.fatal(
            "the de-duplication window (an fsync failed; a restart reopens it)", exc))
        self._putting: dict[int, asyncio.Event | None] = {}  # SURE keys being put right now
        # Each connection's comings and goings, the protocol errors that end them, and every
        # other line a peer causes: at most CONNECTION_LOG_BURST lines of each per interval,
        # whatever a peer does.
        limit = (CONNECTION_LOG_INTERVAL, CONNECTION_LOG_BURST)
        self.delivery = LocalDelivery(config, limit)
        self._noticed: dict[tuple[str, int], None] = {}
        self._connections: set[asyncio.Task] = set()
        #: Connections waiting for bytes with nothing in flight, and since when (loop time).
        self._idle: dict[asyncio.Task, float] = {}
        self._open: dict[asyncio.Task, _Open] = {}  # per connection: what _make_room weighs
        #: Connections being closed to make room for a new one: its address, how long the
        #: connection waited, and whether for its answers to be read (else for bytes).
        self._evicted: dict[asyncio.Task, tuple[str, float, bool]] = {}
        #: Connections a stop closes while they wait for bytes (they linger, see _linger).
        self._stop_idle: set[asyncio.Task] = set()
        #: Connections that ended their side and wait for their peer's end (_linger), and
        #: their peers' addresses.
        self._lingering: dict[asyncio.Task, str] = {}
        self._server: asyncio.base_events.Server | None = None
        self.started = time.time()
        self.control_path = Path(config.control_socket) if config.control_socket else \
            default_socket(state, "receiver")
        self._peers: dict[asyncio.Task, dict] = {}  # per connection: peer, since, counts
        self._who: dict[asyncio.Task, Peer] = {}  # per connection: who it is
        #: Every peer label served, most recent last (rqpctl trace); kept in state_dir.
        self._peers_file = Path(config.state_dir) / PEERS_FILE
        self._peer_labels: dict[str, None] = _read_peers(self._peers_file)
        self._peers_save: asyncio.TimerHandle | None = None
        self._peers_trouble = RateLimitedLog(log, 3600.0, what="failures to keep the peers")
        self._comings = RateLimitedLog(log, *limit, what="connections opened")
        self._goings = RateLimitedLog(log, *limit, what="connections closed, lost or timed out")
        self._errors = RateLimitedLog(log, *limit, what="connections closed for errors")
        self._repeats = RateLimitedLog(log, *limit, what="repeats")
        self._late_log = RateLimitedLog(log, *limit, what="frames come after a close")
        self._repeated_dead_letters = RateLimitedLog(log, *limit,
                                                     what="repeated dead letters")
        self._dead_letters_log = RateLimitedLog(log, *limit, what="dead letters")
        self._queue_no_log = RateLimitedLog(log, *limit, what="QUEUE_NO answers")
        self._no_room_log = RateLimitedLog(log, *limit,
                                           what="dead letters DEAD.LETTER.Q could not take")
        #: Dead letters not written for want of room in DEAD.LETTER.Q, per peer, and when
        #: the last was (time.time(); rqpctl status calls the receiver unhealthy a while, and
        #: the alert fires): kept in state_dir, so that a restart does not hide it.
        self.no_room: collections.Counter[str] = collections.Counter()
        self._no_room_file = Path(config.state_dir) / NO_ROOM_FILE
        self.no_room_at: float | None = _read_time(self._no_room_file)
        #: Why the last dead letter not written was not (DeadLetterWriter.unmade), or None:
        #: DEAD.LETTER.Q had no room (a re-check's status gave the drain advice for both).
        self.no_room_why: str | None = None
        self._no_room_saved = 0.0
        logging.getLogger("asyncio").addFilter(_no_ssl_half_close_warning)
        self.figures = telemetry.QueueFigures()  # per queue key, for the metrics
        self.stats = {"connections": 0, "messages": 0, "asks": 0, "repeats": 0, "batches": 0,
                      "timed_out_connections": 0, "evicted_connections": 0, "late_frames": 0,
                      "protocol_errors": 0}

    # --- serving ------------------------------------------------------------------------------

    async def run(self) -> None:
        listen = self.config.listen
        self._server = await asyncio.start_server(
            self._serve, listen.host, listen.port, reuse_address=True, limit=READ_SIZE)
        where = ", ".join(str(s.getsockname()[:2]) for s in self._server.sockets)
        if is_loopback(listen.host):
            log.info("listening on %s only: no other host can reach this receiver (to accept "
                     "them, set listen: \":%d\" in its config%s)", listen.host, listen.port,
                     "" if self.config.plaintext or self.config.tls else
                     " with a tls: block -- README, Security -- or plaintext: true")
        tls = self.config.tls
        log.info("listening on %s (%s); DEAD.LETTER.Q %s; max_message_size %d; host %s", where,
                 f"TLS, client certificates from {tls.ca}" if tls else "plaintext RQP/1",
                 format_key(self.config.dead_letter_queue), self.max_message_size, self.host)
        window = self.dedup.state()
        log.info("de-duplication window: %s", "off (dedup_window_keys is 0): a SURE message "
                 "sent again is put again" if not window["max_keys"] else
                 f"{window['keys']} key(s) kept from before the start, in {self.dedup.path} "
                 f"(at most {window['max_keys']}, each kept "
                 + ("until pushed out" if window["max_age"] is None
                    else f"{window['max_age']:g}s") + ")")
        if self.config.peers is None:
            log.info("no peers rules: %s", "every peer with a certificate from the CA may use "
                     "every offered queue" if tls else "every peer may use every offered queue")
        if not self.delivery.offer_default:
            log.warning("running with CAP_IPC_OWNER (as root?) and no offer.allow in the "
                        "config: no queue is offered (this process could write into every "
                        "queue of the host); list the queues remote senders may use in "
                        "offer.allow")
        self._warn_of(self.config)
        await self.start_service(self.control_path, self.config.metrics_listen)
        self.ready("listening")
        expiry = asyncio.create_task(self._expire_dedup())
        window_retry = asyncio.create_task(self._retry_window())
        await self.wait_for_stop()
        self._server.close()  # no new connections
        self._stop_idle.update(self._idle)
        for task in self._stop_idle:  # nothing in flight on these: closed (each lingers)
            task.cancel()
        busy = self._connections - self._stop_idle - self._lingering.keys()
        if busy and not self.failed:  # answer what was already received, then close
            wait = self.delivery.put_budget + 5
            log.info("stopping: waiting up to %gs for %d connection(s) to answer what they "
                     "hold (a put waits up to put_retry_count x put_retry_interval for a full "
                     "queue; a second SIGTERM exits at once)", wait, len(busy))
            _, still = await asyncio.wait(busy, timeout=wait)
            if still:
                log.warning("stopping: %d connection(s) still busy after %gs, closed now: what "
                            "they had sent and not had answered stays with their senders "
                            "(SURE, sent again) or is lost (UNSURE)", len(still), wait)
        if not self.failed:  # (the idle ones closed: their peers' frames on the way come in)
            lingering = [task for task in self._connections
                         if task in self._stop_idle or task in self._lingering]
            if lingering:
                await asyncio.wait(lingering, timeout=LINGER + 1.0)  # (each ends by LINGER,
                # but a refusal's dead letter may wait for room a second more)
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=STOP_GRACE)
        # Only now: since Python 3.12.1 wait_closed() also waits for every connection to end
        # (a trial's idle peer held a stop for 33 s, a silent one would for idle_timeout),
        # and a peer that reads nothing keeps its connection open while answers wait for it.
        try:
            await asyncio.wait_for(self._server.wait_closed(), STOP_GRACE)
        except TimeoutError:
            log.debug("stopping: connections still closing after %gs", STOP_GRACE)
        expiry.cancel()
        window_retry.cancel()
        if self._peers_save is not None:
            self._peers_save.cancel()
            self._save_peers()
        self.stop_service()
        await self.commits.drain()
        self.dedup.close(commit=not self.dedup.broken)
        log.info("stopped: %s", counts({**self.stats, "dead_letters": self.dead_letters.written}))

    def _save_peers(self) -> None:
        self._peers_save = None
        data = "".join(json.dumps(label) + "\n" for label in self._peer_labels
                       if len(label) <= PEER_LABEL_MOST)
        try:
            write_file_atomically(self._peers_file, data.encode(), 0o640)
        except OSError as exc:  # (trace finds their keys after a restart only: no more; a
            self._peers_trouble.report(  # re-check saw it at DEBUG only)
                "cannot keep the peers served in %s (rqpctl trace after a restart finds "
                "their keys only once they connect again): %s", logging.WARNING,
                self._peers_file, exc)

    # --- reload, status, metrics ---------------------------------------------------------------

    def status(self) -> dict:
        return telemetry.receiver_status(self)

    def trace(self, key: int) -> dict | None:
        """Whether a SURE message with RQP key ``key`` was put here, from which peer and when
        (its key in the de-duplication window, for each peer this receiver has served, as
        kept in ``peers.seen`` across restarts); None if no peer's window holds it (an UNSURE
        message leaves no trace).
        Keys are each peer's own: where more than one peer used the key, the latest is the
        answer and the others are under ``also`` (a trial: a hostile peer's put of another
        peer's coming key was the only one named)."""
        found = []
        for peer in reversed(self._peer_labels):
            scoped = scoped_key(peer, key)
            if scoped in self._putting:
                found.append({"state": "being put", "peer": peer})
                continue
            at = self.dedup.recorded_at(scoped)
            if at is not None:
                found.append({"state": "put (SURE; its key is in the de-duplication window)",
                              "peer": peer, "at": at})
        if not found:
            return None
        found.sort(key=lambda t: t.get("at", math.inf), reverse=True)  # (being put: first)
        return {**found[0], "also": found[1:]} if len(found) > 1 else found[0]

    def metrics(self) -> list:
        return telemetry.receiver_metrics(self)

    def reload(self) -> None:
        """SIGHUP: read the config again (offered queues, retries, sizes); connections stay.
        A bad file is refused and the running config kept."""
        if self.config.source is None:
            raise RQPError("started without --config: nothing to reload")
        new = load_receiver_config(self.config.source)
        new = dataclasses.replace(new, **{name: getattr(self.config, name)  # command line
                                          for name in self.overrides})
        new = self.refuse_fixed(new, ("listen", "state_dir", "dead_letter_queue",
                                      "control_socket", "metrics_listen"), "receiving MCA")
        problem = new.transport_problem()
        if problem:
            raise RQPError(problem)
        self.gate.reload(new)  # certificates and rules (raises, keeping the old, if bad)
        try:
            self.dedup.resize(new.dedup_window_keys, new.dedup_window_age)
        except ValueError as exc:
            raise RQPError(f"dedup_window_keys/dedup_window_age: {exc}") from None
        changes = config_changes(self.config, new, replaced=self.files_replaced((new.tls,)))
        self.config = self.delivery.config = new
        # (kernel.msgmax read again: a trial raised it and reloaded, and the old limit held
        # until a restart, where max_message_size's default says "msgmax at run time")
        msgmax = kernel_limits().msgmax
        if msgmax != self.msgmax:  # (said in the reloaded line: not "nothing changed")
            said = f"kernel.msgmax {self.msgmax} -> {msgmax}" + (
                "" if new.max_message_size else " (so is max_message_size, for the "
                "connections made from now on)")
            changes = said if changes == "nothing changed" else f"{changes}, {said}"
        self.msgmax = self.dead_letters.msgmax = msgmax
        _say_max_over_msgmax(new, msgmax)
        self.max_message_size = new.max_message_size or self.msgmax
        self.dead_letters.spill_limit = new.spill_limit
        log.info("reloaded %s: %s%s", new.source, changes,
                 f" ({', '.join(sorted(self.overrides))} from the command line: the file's "
                 "are not used)" if self.overrides else "")
        self._warn_of(new)

    @staticmethod
    def _warn_of(config: ReceiverConfig) -> None:
        """What of ``config`` an operator most likely did not mean (at a start and a reload):
        offer.allow listing the receiver's own DEAD.LETTER.Q, never offered whatever the list
        says (a trial: accepted without a word); peers: [], which lets no peer use anything."""
        if config.peers == ():
            log.warning("peers lists no rule: no peer may use any queue (every QUEUE_ASK is "
                        "answered QUEUE_NO, every MESSAGE DELIVERED_ERROR); leave peers out "
                        "for every peer to use every offered queue, or list rules")
        if config.offer_allow is not None and config.dead_letter_queue in config.offer_allow.keys:
            log.warning("offer.allow lists %s, this receiver's DEAD.LETTER.Q: never offered (an "
                        "agent's own queues never are); take it out of the list",
                        format_key(config.dead_letter_queue))

    async def _expire_dedup(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.dedup.expire()

    async def _retry_window(self) -> None:
        """While the de-duplication window's last write failed, write it again every second
        (what was not written: no new SURE message is put meanwhile), until it succeeds."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._window_writable()
            except DedupError as exc:
                self.dedup_trouble = (str(exc), time.time())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        address = writer.get_extra_info("peername")
        peer_host = address[0] if address else "?"
        tcp = writer.transport  # (under TLS's, once the handshake replaced it: see the end)
        if not self.gate.enter(peer_host, self._make_room):
            writer.close()
            return
        self._connections.add(task)
        self._open[task] = _Open(peer_host)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ANSWER_SEND_BUFFER)
                # a sender gone without a word: a trial's stayed listed, a dead connection
                # holding frames its sender had given up, until they came 108 s later; and
                # answers it does not acknowledge (or read: its window shut) past idle_timeout
                # (a margin after it: the agent's own "answers unread" says it first)
                keepalive(sock, unacknowledged=self.config.idle_timeout + KERNEL_MARGIN)
            except OSError:
                pass  # (the kernel's defaults, then)
        try:
            self._idle[task] = asyncio.get_running_loop().time()  # (a handshake: nothing
            who = await self.gate.identify(writer, peer_host, _peer(address))  # in flight)
            if who is not None:
                await self._converse(reader, writer, who, _peer(address))
        except asyncio.CancelledError:  # stopping, or making room, during the handshake
            self._closed_for_room(task, writer, _peer(address), peer_host)
        finally:
            writer.close()
            if writer.transport is not tcp:  # TLS: the close waits for the peer's close_notify
                asyncio.get_running_loop().call_later(TLS_CLOSE_GRACE, tcp.abort)
            self._idle.pop(task, None)
            self._open.pop(task, None)
            self._evicted.pop(task, None)
            self._stop_idle.discard(task)
            self._connections.discard(task)
            self._peers.pop(task, None)
            self._who.pop(task, None)
            self.gate.leave(peer_host)

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        who: Peer, peer: str) -> None:
        """Frames in, answers out, until the peer closes, a time-out or a stop."""
        task = asyncio.current_task()
        self.stats["connections"] += 1
        self._peers[task] = info = {
            "peer": peer, "identity": who.identity, "since": time.time(), "frames": 0,
            "messages": 0, "dead_letters": 0, "asks": 0, "refused": 0, "repeats": 0}
        self._who[task] = who  # (what it may use is read at each status: a reload changes it)
        known = self._peer_labels.pop(who.label, 0) is None
        self._peer_labels[who.label] = None
        if len(self._peer_labels) > PEER_MEMORY:
            del self._peer_labels[next(iter(self._peer_labels))]
        if not known and self._peers_save is None:
            self._peers_save = asyncio.get_running_loop().call_later(
                PEERS_SAVE_INTERVAL, self._save_peers)
        self._comings.report("connection from %s%s", logging.INFO, peer,
                             f" ({who.identity})" if who.identity else "",
                             extra={"event": "connection_opened", "peer": who.label,
                                    "address": peer, "identity": who.identity or ""})
        conn = ReceiverConnection(max_message_size=self.max_message_size,
                                  extensions=KNOWN_EXTENSIONS, clock_ms=wall_ms)
        answers = _Answers(writer, self.commits, self.config.idle_timeout)
        opened = self._open.get(task)  # (None: called without _serve, as tests do)
        if opened is not None:
            opened.protocol, opened.answers = conn, answers
        framed = False  # a complete frame has come
        # The first frame is due by then, however its bytes come (a trial kept a connection
        # open for 30 s past a 10 s first_frame_timeout, sending a byte every 3 s); after it,
        # idle_timeout counts from the last bytes.
        loop = asyncio.get_running_loop()
        linger = False  # closed in order by this side: wait a moment for the peer's end
        try:
            before = [other for other, address in self._lingering.items()
                      if address == who.address]
            if before:  # (what its sender sent there before it saw the close is taken first:
                # else a frame of it could come after this one's; not idle meanwhile, so
                # neither a stop nor a newcomer closes it before: a trial's did, and it
                # lingered, taking its frames at once)
                self._idle.pop(task, None)
                await asyncio.wait(before)
            first_due = loop.time() + self.config.first_frame_timeout
            while True:
                await answers.room()  # (raises if a commit failed: close, unanswered)
                self._idle[task] = loop.time()  # waiting for bytes: nothing in flight
                wait = self.config.idle_timeout if framed else self.config.first_frame_timeout
                try:  # (asyncio.timeout, not wait_for: a task per read, 3x dearer)
                    async with (asyncio.timeout(wait) if framed else
                                asyncio.timeout_at(first_due)):
                        data = await reader.read(READ_SIZE)
                except TimeoutError as exc:
                    if exc.errno is not None:  # ETIMEDOUT, an OSError: the kernel gave the
                        raise  # peer up (keepalive, TCP_USER_TIMEOUT): lost, not idle (a
                        # re-check's log said "idle for 600s" 91 s into a dark link)
                    self.stats["timed_out_connections"] += 1
                    self._goings.report("closing connection from %s: %s", logging.INFO, peer,
                                        f"idle for {wait:g}s (idle_timeout)" if framed else
                                        f"no complete frame within {wait:g}s "
                                        "(first_frame_timeout)",
                                        extra=dict(event="connection_timed_out", peer=who.label,
                                                   address=peer))
                    linger = framed
                    break
                finally:
                    self._idle.pop(task, None)
                conn.receive_data(data)
                batch, sure, octets = [], False, 0
                try:
                    while (request := conn.next_request()) not in (NEED_DATA, CLOSED):
                        framed = True
                        info["frames"] += 1
                        sure = sure or _answers_sure(request)
                        answer = self._handle_at_once(conn, request, who, info)
                        if answer is None:
                            if batch:  # (it may wait for a full queue: what is decided goes
                                # now, or the sender's confirm_timeout ran out on an answer
                                # held back behind it, and took the connection down)
                                answers.send(batch, sure)
                                batch, sure, octets = [], _answers_sure(request), 0
                            answer = await self._handle(conn, request, who, info)
                        batch.append(answer)
                        octets += len(answer)  # (an atomic batch: one answer per message)
                        if octets >= ANSWER_BATCH * ANSWER_SIZE:
                            full, batch, octets = batch, [], 0  # (first: sent once)
                            answers.send(full, sure)
                            sure = False
                            await answers.room()
                finally:  # whatever happens next, what was answered is sent, in order
                    if batch:
                        answers.send(batch, sure)
                if request is CLOSED:
                    await answers.flush()  # (a failed commit closes it too: say that first)
                    self._goings.report("connection from %s closed", logging.INFO, peer,
                                        extra=dict(event="connection_closed", peer=who.label,
                                                   address=peer))
                    break
                if self._stopping.is_set():  # what was in flight is answered: done
                    self._goings.report("closing connection from %s: stopping", logging.INFO,
                                        peer)
                    linger = True
                    break
        except asyncio.CancelledError:  # stopping, or making room, while it waited for bytes
            linger = self._closed_for_room(task, writer, peer, who.label)  # (or to be read)
            if linger is None:
                self._goings.report("closing connection from %s: stopping", logging.INFO, peer)
                linger = task in self._stop_idle  # (not the last cancel of a busy one)
            if linger:
                task.uncancel()  # (and a second cancel ends the lingering)
        except LocalProtocolError as exc:  # this agent misused its own core: a bug
            self.fatal(f"the connection from {peer}", exc)
        except DedupError as exc:
            self._unrecorded(peer, exc, who.label)
        except PeerNotReading as exc:
            self._not_reading(writer, peer, who, exc)
        except RQPError as exc:  # a protocol error (a bad frame): this connection ends
            self._protocol_error(peer, who, exc)
        except (ConnectionError, OSError) as exc:
            self._goings.report("connection from %s lost: %s", logging.INFO, peer, exc,
                                extra=dict(event="connection_lost", peer=who.label,
                                           address=peer))
        except Exception as exc:  # noqa: BLE001 - anything else is unexpected: stop
            self.fatal(f"the connection from {peer}", exc)
        finally:  # the answers already decided go out (each after its commit), then close
            try:
                await answers.flush()
            except DedupError as exc:
                self._unrecorded(peer, exc, who.label)
                linger = False
            except PeerNotReading as exc:  # (first found here: after a bad frame, a stop)
                self._not_reading(writer, peer, who, exc)
                linger = False
            except RQPError as exc:
                self._errors.report("closing connection from %s without answering what it "
                                    "sent last: %s", logging.WARNING, peer, exc)
                linger = False
            except (ConnectionError, OSError):
                linger = False
            if linger:
                await self._linger(reader, writer, conn, who, info, peer)

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn: ReceiverConnection, who: Peer, info: dict, peer: str) -> None:
        """Close a connection in order in two steps, once its answers are out: this side's
        end first, then, at the peer's end or after LINGER seconds without it, the rest.

        A frame the peer sent before it read this side's end crosses it; a close at once
        would have the kernel answer it with a reset, unread (a trial under a crowd: one SURE
        message in about 180 sent again; an UNSURE one is lost). Here it is still read and
        taken: its message put (or dead-lettered), but not answered, this side being ended.
        The sender counts it unanswered: a SURE one it sends again is answered as a repeat;
        an UNSURE one it reports not confirmed, though it arrived.

        In order with what its sender sends next: a new connection from the same address
        waits until this one ended (:meth:`_converse`), and nothing here waits (NO_WAITING;
        trials: a message that waited for room, for the same SURE message being put from
        another connection, or for room in DEAD.LETTER.Q held the lingering past LINGER and
        was put after the one sent after it). A message for a full queue, or a batch without
        room, is dead-lettered QUEUE_FULL at once (a SURE one's notice: it is sent again).
        A SURE message beyond UNCOMMITTED_MAX is left unread with what comes after it, as a
        close at once would leave them: each read's keys are committed as answers' are, and
        no more of them wait for it than of answers (a receiving MCA killed meanwhile puts
        those again when they are sent again; a sending MCA has no more in flight than its
        window, 256 by default)."""
        if writer.transport.is_closing() or not _end_writing(writer):
            return
        task = asyncio.current_task()
        self._lingering[task] = who.address
        no_waiting = NO_WAITING.set(True)
        late = sure = 0
        left = None  # the first frame not taken
        loop = asyncio.get_running_loop()
        due = loop.time() + LINGER
        try:
            while left is None and loop.time() < due:  # (a read with data waiting does not
                try:  # wait, so it would not time out: a trial's flood went on past LINGER)
                    async with asyncio.timeout_at(due):
                        data = await reader.read(READ_SIZE)
                except TimeoutError:
                    break
                if not data:
                    break
                conn.receive_data(data)
                read_sure = 0
                while (request := conn.next_request()) not in (NEED_DATA, CLOSED):
                    if sure + read_sure >= UNCOMMITTED_MAX and _answers_sure(request):
                        left = request
                        break
                    if self._handle_at_once(conn, request, who, info) is None:
                        await self._handle(conn, request, who, info)  # (NO_WAITING)
                    late += 1
                    info["frames"] += 1
                    read_sure += _answers_sure(request)
                if read_sure:  # (recorded in the window: durable now, as answered ones are)
                    self._commit()
                    sure += read_sure
        except asyncio.CancelledError:
            pass  # (a stop's last cancel)
        except DedupError as exc:
            self._unrecorded(peer, exc, who.label)
        except LocalProtocolError as exc:  # this agent misused its own core: a bug
            self.fatal(f"the connection from {peer}", exc)
        except RQPError as exc:  # a bad frame: nothing after it can be read
            self._protocol_error(peer, who, exc)
        except (ConnectionError, OSError):
            pass
        finally:
            NO_WAITING.reset(no_waiting)
            del self._lingering[task]
        if late or left is not None:
            self.stats["late_frames"] += late
            self._late_log.report(
                "%d frame(s) from %s came after this side closed the connection: taken (put "
                "or dead-lettered), unanswered (a SURE message is answered when sent again)%s",
                logging.INFO,
                late, peer, "" if left is None else
                f"; the next one was not taken: {sure} SURE messages taken already (no more "
                "wait for their commit, as for answers: UNCOMMITTED_MAX), left with those "
                "after it",
                extra=dict(event="late_frames", peer=who.label, address=peer))

    def _commit(self) -> None:
        """Start making every recorded key durable, not waiting for it (a failure is dealt
        with where it is seen: the next answer's commit, or the writer thread's)."""
        try:
            durable = self.commits.durable()
        except DedupError:
            return
        if durable is not None:
            durable.add_done_callback(_retrieved)

    def _protocol_error(self, peer: str, who: Peer, exc: RQPError) -> None:
        """A bad frame ends the connection: counted and (rate-limited) logged."""
        self.stats["protocol_errors"] += 1
        self._errors.report("closing connection from %s: %s", logging.WARNING, peer, exc,
                            extra=dict(event="connection_refused", peer=who.label,
                                       address=peer))

    def _make_room(self, newcomer: str) -> bool:
        """Every connection slot is taken and ``newcomer`` asks for one: close one that waits
        for its peer, for bytes (nothing in flight) or to have its answers read (False if none
        may go).

        An address that holds more connections than the newcomer's would then gives one up,
        however short its wait (a crowd from a few addresses cannot keep a sending MCA out:
        a trial's eight addresses, holding every slot with connections that sent one
        QUEUE_ASK, did for idle_timeout; a second trial's, opening new ones every second,
        took every slot idle a second; a third's read none of their answers); of those, the
        address that holds the most. Otherwise, one that has waited EVICT_IDLE seconds or
        more. Of these, one idle goes first, its peer's connection waiting longest; one with
        part of a request come (a big frame from a slow peer: lost if closed, a SURE one sent
        again) or whose answers are unread (they are dropped) only after. A sender whose
        idle connection is closed connects again for its next frame."""
        now = asyncio.get_running_loop().time()
        opened = self._open
        # what each address holds, those already closing (lingering up to LINGER) left out:
        # else one address's closing ones would make it give up more than its share
        counts = self.gate.by_source.copy()
        counts.subtract(opened[task].source for task in self._evicted)
        mine = counts[newcomer] + 1  # (what the newcomer's address would hold)
        blocked = [(task, o.answers.blocked_since) for task, o in opened.items()
                   if o.answers is not None and o.answers.blocked_since is not None]
        victim, best = None, None
        for task, since in itertools.chain(self._idle.items(), blocked):
            o = opened[task]
            holds = counts[o.source]
            over = holds > mine
            if (not over and now - since < EVICT_IDLE) or task in self._evicted:
                continue
            cheap = task in self._idle and (o.protocol is None or not o.protocol.mid_request)
            rank = (over, cheap, holds, now - since)
            if best is None or rank > best:
                victim, best = task, rank
        if victim is None:
            return False
        self._evicted[victim] = (newcomer, best[3], victim not in self._idle)
        victim.cancel()
        return True

    def _closed_for_room(self, task: asyncio.Task, writer: asyncio.StreamWriter, peer: str,
                         label: str) -> bool | None:
        """If ``task`` was closed to make room (else None): count and (rate-limited) log it,
        and if its peer left its answers unread, drop them and the connection at once (a close
        would wait for the peer to read them). Whether it may linger (see _linger): not
        then, nor beyond one in ROOM_LINGERING of max_connections."""
        evicted = self._evicted.get(task)
        if evicted is None:
            return None
        newcomer, waited, unread = evicted
        if unread:
            self._open[task].answers.abandon()  # (only a framed connection has answers unread)
            writer.transport.abort()
        self.stats["evicted_connections"] += 1
        self._goings.report("closing connection from %s: %s for %.1fs, its slot given to a "
                            "new connection from %s (max_connections %d reached)", logging.INFO,
                            peer, "its answers unread" if unread else "idle", waited, newcomer,
                            self.config.max_connections,
                            extra=dict(event="connection_evicted", peer=label, address=peer))
        # (one lingering holds a socket beyond max_connections: a trial's crowd had the
        # default 512 take all 1,024 descriptors of the process)
        return not unread and \
            len(self._evicted) <= max(1, self.config.max_connections // ROOM_LINGERING)

    def _not_reading(self, writer: asyncio.StreamWriter, peer: str, who: Peer,
                     exc: PeerNotReading) -> None:
        writer.transport.abort()  # (a close would wait for the peer to read its answers)
        self.stats["timed_out_connections"] += 1
        self._errors.report("closing connection from %s: %s", logging.WARNING, peer, exc,
                            extra=dict(event="connection_timed_out", peer=who.label,
                                       address=peer))

    def _unrecorded(self, peer: str, exc: DedupError, label: str) -> None:
        self.dedup_trouble = (str(exc), time.time())
        self.dedup_failures += 1
        self._errors.report("closing connection from %s without answering its last SURE "
                            "messages: the de-duplication window cannot record them (the sender "
                            "keeps them and sends them again): %s", logging.ERROR, peer, exc,
                            extra={"event": "dedup_unrecorded", "peer": label, "address": peer})

    def _handle_at_once(self, conn: ReceiverConnection, request, who: Peer,
                        info: dict) -> bytes | None:
        """The common request answered without waiting: a Put this peer may make, whose
        message goes into its queue at once (or is a repeat). None when :meth:`_handle` must
        answer it: then nothing of it was done."""
        if type(request) is not Put or not self.gate.allows(who, request.message.queue_key):
            return None
        done = self._put_at_once(request.message, who.label)
        if done is None:
            return None
        if done is _REPEAT:
            info["repeats"] += 1
            return conn.answer_put(request, True)
        return self._delivered(conn, request, info)

    async def _handle(self, conn: ReceiverConnection, request, who: Peer, info: dict) -> bytes:
        peer = who.label
        if isinstance(request, Ask):
            self.stats["asks"] += 1
            info["asks"] += 1
            allowed = self.gate.allows(who, request.queue_key)
            offered = allowed and self.delivery.offers(request.queue_key)
            if not allowed:
                info["refused"] += 1
                self.gate.deny(who, f"QUEUE_ASK for queue {format_key(request.queue_key)}")
            if allowed and not offered:  # (a trial: the README said this log says which)
                why, mend = self.delivery.why_not_offered(request.queue_key)
                self._queue_no_log.report(
                    "QUEUE_NO for queue %s to %s: %s", logging.WARNING if mend else logging.INFO,
                    format_key(request.queue_key), peer, why,
                    extra={"event": "queue_not_offered", "peer": who.label,
                           "queue_key": format_key(request.queue_key)})
            else:
                log.debug("QUEUE_ASK queue=%s from=%s: %s", format_key(request.queue_key),
                          peer, "QUEUE_YES" if offered else "QUEUE_NO")
            return conn.answer_ask(request, offered)
        if isinstance(request, Batch):
            return await self._handle_batch(conn, request, who, info)
        if not self.gate.allows(who, request.message.queue_key):
            # Not this peer's to use: answered DELIVERED_ERROR, and nothing of it is kept,
            # not even a dead letter (a counter and a rate-limited line only).
            info["refused"] += 1
            self.gate.deny(who, f"a MESSAGE for queue {format_key(request.message.queue_key)}")
            return conn.answer_put(request, False)
        if isinstance(request, Refuse):
            if request.dead_letter:
                self._count_dead_letter(request.message, await self._dead_letter(
                    request.message, request.reason, request.detail, who), info)
            return conn.answer_put(request, False)
        reason, detail, repeat = await self._put(request.message, peer)
        if repeat:
            info["repeats"] += 1
            return conn.answer_put(request, True)
        return await self._answered(conn, request, reason, detail, who, info)

    async def _handle_batch(self, conn: ReceiverConnection, batch: Batch, who: Peer,
                            info: dict) -> bytes:
        """A spec section 6 batch: refused whole if one message of it is (each dead-lettered
        with that one's reason, none put), else put in order and answered together. A put
        that fails part-way (a queue still full after the retry budget) cannot take back the
        ones before it: the batch is answered DELIVERED_ERROR, the rest dead-lettered; a SURE
        batch sent again is then completed without duplicates (the put ones are in the dedup
        window)."""
        peer = who.label
        info["frames"] += len(batch.messages) - 1  # (counted as one request by the caller)
        refused = batch.refused
        if refused is None:
            for message in batch.messages:
                if not self.gate.allows(who, message.queue_key):
                    info["refused"] += 1
                    self.gate.deny(who, f"a MESSAGE_EX for queue {format_key(message.queue_key)}"
                                   " in a batch")
                    refused = Refuse(message, ReasonCode.QUEUE_NOT_OFFERED,
                                     "not allowed for this peer", dead_letter=False)
                    break
                if not self.delivery.offers(message.queue_key):
                    refused = Refuse(message, ReasonCode.QUEUE_NOT_OFFERED,
                                     f"queue {format_key(message.queue_key)} is not offered here")
                    break
        if refused is None:  # room for all of it first: a full queue must not split it
            # (what is left to put: a SURE batch sent again after a part of it was put needs
            # no room for that part, which is answered as a repeat)
            todo = [m for m in batch.messages if m.message_type != SURE_MSG
                    or not self.dedup.seen(scoped_key(peer, m.key))]
            needs: dict[int, tuple[int, int]] = {}
            for message in todo:
                need, count = needs.get(message.queue_key, (0, 0))
                needs[message.queue_key] = (need + len(message.message), count + 1)
            expiry = min(filter(None, (getattr(m, "expires_at_ms", 0) for m in todo)),
                         default=0)
            short = await self.delivery.reserve(needs, expiry)
            if short is not None:
                reason, detail, key = short  # (key None: expired, the one expiring first)
                refused = Refuse(next(m for m in todo if m.queue_key == key or (
                    key is None and getattr(m, "expires_at_ms", 0) == expiry)), reason, detail)
        if refused is None and batch.messages[0].message_type == SURE_MSG:
            await self._window_writable()  # (before the first put: not a part of it)
        failed = refused
        if failed is None:
            for i, message in enumerate(batch.messages):
                reason, detail, repeat = await self._put(message, peer)
                if repeat:
                    info["repeats"] += 1
                    continue
                if reason is not None:  # filled by another writer since the room was there
                    failed = Refuse(message, reason, f"{detail} (message {i + 1} of a batch of "
                                    f"{len(batch.messages)}; {i} put before it: the queue "
                                    "filled up meanwhile)")
                    break
                self.stats["messages"] += 1
                info["messages"] += 1
                self.figures.count(message.queue_key, _PUT_FIGURE, len(message.message))
        self.stats["batches"] += 1
        log.debug("MESSAGE_EX batch of %d for queue %s from=%s: %s", len(batch.messages),
                  format_key(batch.messages[0].queue_key), peer,
                  "put" if failed is None else f"refused whole ({failed.reason.name})")
        if failed is None:
            return conn.answer_batch(batch, True)
        if failed.dead_letter:
            cause = next(i for i, m in enumerate(batch.messages) if m is failed.message)
            for i, message in enumerate(batch.messages):
                if refused is None and i < cause:
                    continue  # put already
                detail = failed.detail if i == cause else (
                    f"batch of {len(batch.messages)} refused whole: message {cause + 1} "
                    f"{failed.reason.name}: {failed.detail}" if refused is not None else
                    f"batch of {len(batch.messages)}: message {cause + 1} {failed.reason.name} "
                    f"after {cause} of it were put; this one was not: {failed.detail}")
                # (each with the batch's reason, so that a rule for it treats every message
                # of the batch alike; replay still puts each back on its own)
                self._count_dead_letter(message, await self._dead_letter(
                    message, failed.reason, detail, who), info)
        return conn.answer_batch(batch, False)

    def _put_at_once(self, message, peer: str):
        """A put that needs no waiting, the common case: _PUT, or _REPEAT for a SURE message
        put before (not put again). None when :meth:`_put` must wait: the same message is
        being put from another connection just now, or its queue is full, not opened yet...;
        then nothing was done."""
        if message.message_type != SURE_MSG:
            return _PUT if self.delivery.put_at_once(message) else None
        key = scoped_key(peer, message.key)  # a peer's keys never hide another's
        if key in self._putting:
            return None
        if self.dedup.seen(key):
            self._repeat(message, peer)
            return _REPEAT
        if self.dedup.unwritten or not self.delivery.put_at_once(message):
            return None  # (the window first: see _window_writable)
        self.dedup.record(key)  # made durable before the answer is written
        return _PUT

    async def _window_writable(self) -> None:
        """A new SURE message is not put while the de-duplication window cannot be written
        (its last write failed: a full disk): its key would not survive a restart, and the
        sender's next try after it would put it again (a trial: 364 duplicates of 2,000, over
        a restart while the disk was full). So the write is tried again first; DedupError if
        it fails again: the connection is closed unanswered, the sender sends again later
        (:meth:`_retry_window` also tries every second)."""
        if not self.dedup.unwritten:
            return
        if NO_WAITING.get():
            raise DedupError(f"the de-duplication window {self.dedup.path} cannot be written: "
                             "no new SURE message is put until it can be")
        try:
            waiting = self.commits.durable()
            if waiting is not None:
                await waiting
        except DedupError as exc:
            raise DedupError(f"{exc}; no new SURE message is put until it can be written") \
                from exc
        log.warning("the de-duplication window %s can be written again: SURE messages are put "
                    "again", self.dedup.path)

    def _repeat(self, message, peer: str) -> None:
        self.stats["repeats"] += 1
        self.figures.count(message.queue_key, _REPEAT_FIGURE)
        self._repeats.report("repeat of SURE message key=%#018x for queue %s from %s: "
                             "answered without putting it again", logging.INFO,
                             message.key, format_key(message.queue_key), peer,
                             extra={"event": "repeat", "peer": peer,
                                    "queue_key": format_key(message.queue_key),
                                    "message_key": f"{message.key:#018x}"})

    async def _put(self, message, peer: str) -> tuple[ReasonCode | None, str, bool]:
        """Put one message: (None, "", False), or why not; a SURE one once per key: a repeat
        is not put again, (None, "", True). Under NO_WAITING, nothing is waited for: a
        full queue is QUEUE_FULL at once, and the same message being put from another
        connection just now is taken for a repeat (that put decides)."""
        done = self._put_at_once(message, peer)
        if done is not None:
            return None, "", done is _REPEAT
        if message.message_type != SURE_MSG:
            reason, detail = await self.delivery.put(message)
        else:
            key = scoped_key(peer, message.key)
            if key in self._putting and NO_WAITING.get():
                return None, "", True
            while key in self._putting:  # the same message on another connection, just now
                busy = self._putting[key]
                if busy is None:
                    busy = self._putting[key] = asyncio.Event()
                await busy.wait()
            if self.dedup.seen(key):
                self._repeat(message, peer)
                return None, "", True
            await self._window_writable()
            if key in self._putting or self.dedup.seen(key):  # (meanwhile, from another)
                return await self._put(message, peer)
            self._putting[key] = None  # (an Event only if another connection waits for it)
            try:
                reason, detail = await self.delivery.put(message)
                if reason is None:
                    self.dedup.record(key)  # made durable before the answer is written
            finally:
                waiting = self._putting.pop(key)
                if waiting is not None:
                    waiting.set()
        return reason, detail, False

    async def _answered(self, conn: ReceiverConnection, request, reason, detail: str,
                        who: Peer, info: dict) -> bytes:
        if reason is None:
            return self._delivered(conn, request, info)
        message = request.message
        self._count_dead_letter(message, await self._dead_letter(message, reason, detail, who),
                                info)
        return conn.answer_put(request, False)

    def _count_dead_letter(self, message, written: bool, info: dict) -> None:
        """A message dead-lettered (outcome="dead_lettered"), if its dead letter was written
        (one not written is counted by why: dead_letters_limited)."""
        if written:
            info["dead_letters"] += 1
            self.figures.count(message.queue_key, _DEAD_LETTERED_FIGURE)

    def _delivered(self, conn: ReceiverConnection, request, info: dict) -> bytes:
        """Count a message put and answer DELIVERED_YES."""
        message = request.message
        self.stats["messages"] += 1
        info["messages"] += 1
        self.figures.count(message.queue_key, _PUT_FIGURE, len(message.message))
        return conn.answer_put(request, True)

    def _put_dead_letter(self, data: bytes) -> bool:
        """One try to put a dead letter (False: DEAD.LETTER.Q full); a DEAD.LETTER.Q that
        cannot be made raises at once (a re-check's waited 1 s for it as for a full queue,
        and the log said "full" beside "cannot be made again")."""
        if self.dead_letters.try_put(data):
            return True
        if self.dead_letters.unmade is not None:
            raise QueueError(self.dead_letters.unmade)
        return False

    async def _dead_letter(self, message, reason: ReasonCode, detail: str, who: Peer) -> bool:
        """Write the dead letter of ``message`` (within ``who``'s dead-letter budget, and
        within this agent's share of DEAD.LETTER.Q): whether one was written (not for a SURE
        message's repeat, nor beyond the budget, nor when the queue has no room for it: the
        message is answered DELIVERED_ERROR all the same, so a SURE one stays with its sender,
        and the connection, with the other messages in flight on it, goes on)."""
        sure, peer = message.message_type == SURE_MSG, who.label
        noticed = (peer, message.key)
        if sure and noticed in self._noticed:  # (a peer can send these as fast as it likes)
            self._repeated_dead_letters.report(
                "dead letter (repeat, not written again) reason=%s queue=%s key=%#018x from=%s",
                logging.INFO, reason.name, format_key(message.queue_key), message.key, peer)
            return False
        what = f"key={message.key:#018x} queue {format_key(message.queue_key)}"
        allowance = self.gate.dead_letter_allowance(who, what)
        if allowance is Allowance.NONE:
            return False
        header_only = isinstance(message, OversizedMessage) or \
            allowance is Allowance.HEADER_ONLY
        if allowance is Allowance.HEADER_ONLY:
            detail = f"{detail}; payload not kept: {peer} over dead_letter_rate"
        record = DeadLetterRecord(
            reason=reason, message_type=message.message_type, agent=AgentKind.RECEIVER,
            flags=DeadLetterFlags.HEADER_ONLY if header_only else 0,
            queue_key=message.queue_key, message_key=message.key, attempts=1,
            original_length=message.message_length, host=self.host, source_host=peer,
            destination_host=self.host, detail=detail,
            payload=b"" if header_only else message.message, **_extras(message))
        data = None
        try:
            data = self.dead_letters.encode(record, share=RECEIVER_SHARE)
            await self.delivery.retrying(lambda: self._put_dead_letter(data), 1.0,
                                         "DEAD.LETTER.Q")
        except (RQPError, OSError) as exc:
            if data is not None:
                self.dead_letters.discard(data)  # no spill file that no record names
            self.gate.not_written(who)
            self.no_room[peer] += 1
            self.no_room_at = time.time()
            self.no_room_why = self.dead_letters.unmade  # (None: it was full)
            if self.no_room_at - self._no_room_saved >= NO_ROOM_SAVE_INTERVAL:
                self._no_room_saved = self.no_room_at
                try:
                    write_file_atomically(self._no_room_file, b"%.3f\n" % self.no_room_at)
                except OSError as save:
                    log.debug("cannot keep the time of the last dead letter not written in "
                              "%s: %s", self._no_room_file, save)
            self._no_room_log.report(
                "DEAD.LETTER.Q %s cannot take the dead letter of key=%#018x from %s (queue %s, "
                "reason %s): %s -- answered DELIVERED_ERROR: %s", logging.ERROR,
                format_key(self.config.dead_letter_queue), message.key, peer,
                format_key(message.queue_key), reason.name, self.dead_letters.unmade or exc,
                "the SURE message stays with its sender" if sure else
                "the UNSURE message is lost",
                extra={"event": "dead_letter_not_written", "peer": peer,
                       "reason": reason.name, "queue_key": format_key(message.queue_key),
                       "message_key": f"{message.key:#018x}"})
            return False
        if allowance is Allowance.HEADER_ONLY:
            self.gate.written_header_only(who, what)
        if sure:
            self._noticed[noticed] = None
            if len(self._noticed) > NOTICE_MEMORY:
                del self._noticed[next(iter(self._noticed))]
        self._dead_letters_log.report(
            "dead letter reason=%s queue=%s key=%#018x type=%s from=%s: %s", logging.WARNING,
            reason.name, format_key(message.queue_key), message.key,
            "SURE" if sure else "UNSURE", peer, detail,
            extra={"event": "dead_letter", "reason": reason.name, "peer": peer,
                   "queue_key": format_key(message.queue_key),
                   "message_key": f"{message.key:#018x}"})
        return True


#: How long after idle_timeout the kernel gives up a connection whose answers stay
#: unacknowledged (TCP_USER_TIMEOUT), seconds.
KERNEL_MARGIN = 30.0


def _end_writing(writer: asyncio.StreamWriter) -> bool:
    """End this side of the connection, once what was written has left: TCP's FIN, the
    other side still open. False if it cannot be done: the connection is then closed at once.

    asyncio's TLS cannot end one side alone (its close sends close_notify and reads nothing
    more), so over TLS the TCP stream under it is ended, without close_notify: a sending MCA
    takes that end as any other (frames are self-delimiting: an end cut short by a third
    party costs no more than its reset would). Only when nothing waits in the TLS layer or
    under it, else what waits would never leave (its private transport looked up with care:
    when it cannot be found, a close at once, as before)."""
    if writer.can_write_eof():
        writer.write_eof()
        return True
    tcp = getattr(getattr(writer.transport, "_ssl_protocol", None), "_transport", None)
    sock = writer.get_extra_info("socket")
    if (tcp is None or sock is None or writer.transport.get_write_buffer_size()
            or tcp.get_write_buffer_size()):
        return False
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True


def _answers_sure(request) -> bool:
    """Whether answering ``request`` confirms a SURE message (whose key must be durable
    first): a put or batch with a SURE message in it."""
    if isinstance(request, Batch):
        return any(m.message_type == SURE_MSG for m in request.messages)
    return not isinstance(request, (Ask, Refuse)) and request.message.message_type == SURE_MSG


def _no_ssl_half_close_warning(record: logging.LogRecord) -> bool:
    """asyncio warns at each TLS peer that ends its side of the stream first ("returning true
    from eof_received() has no effect when using ssl"): nothing is wrong, and a peer could
    fill the log with it."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def _peer(peer) -> str:
    if not peer:
        return "?"
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _extras(message) -> dict:
    """A MESSAGE_EX's mtype, priority and expiry for its dead letter (a MESSAGE: the defaults)."""
    extras = getattr(message, "extras", None)  # an oversized MESSAGE_EX
    if extras is not None:
        mtype, priority, _flags, expires_at_ms = extras
    elif isinstance(message, MessageEx):
        mtype, priority, expires_at_ms = message.mtype, message.priority, message.expires_at_ms
    else:
        return {}
    return {"mtype": mtype, "priority": priority, "expires_at_ms": expires_at_ms}


def _say_max_over_msgmax(config: ReceiverConfig, msgmax: int) -> None:
    """A max_message_size over this host's msgmax takes messages no queue here can hold (a
    trial: accepted without a word; each was dead-lettered at its put)."""
    if config.max_message_size and config.max_message_size > msgmax:
        log.warning("%s: max_message_size %d is over this host's kernel.msgmax %d: a message "
                    "between the two is read in full and then dead-lettered MESSAGE_TOO_BIG "
                    "(raise kernel.msgmax, see 60-rqp-ipc.conf, or lower max_message_size)",
                    config.source or "the config", config.max_message_size, msgmax)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rqp-receiver", description=__doc__.splitlines()[0])
    add_version(parser)
    parser.add_argument("--config", metavar="FILE", help="receiver YAML config (default: none; "
                        "documented defaults)")
    parser.add_argument("--listen", metavar="HOST:PORT", type=listen_address,
                        help="overrides the config's listen (':PORT': every address)")
    parser.add_argument("--state-dir", metavar="DIR", help="overrides the config's state_dir")
    parser.add_argument("--plaintext", action="store_true",
                        help="accept plaintext RQP/1 on a non-loopback --listen (the config's "
                        "'plaintext: true'); without it such a listen needs a tls: block")
    parser.add_argument("--check", action="store_true",
                        help="read the config and its TLS files as a start would, say what "
                        "would run (exit 0) or why it would not (exit 1), and start nothing")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, log_format=args.log_format)

    def configured() -> tuple[ReceiverConfig, frozenset[str]]:
        config = load_receiver_config(args.config)
        changes = {}
        if args.listen:
            changes["listen"] = parse_host(args.listen, config.listen.port)
        if args.state_dir:
            changes["state_dir"] = args.state_dir
        if args.plaintext:
            if config.tls is not None:
                raise RQPError(f"--plaintext: {config.source} has a tls: block, and a port is "
                               f"either TLS or plaintext, never both")
            changes["plaintext"] = True
        return dataclasses.replace(config, **changes), frozenset(changes)

    def check() -> str:  # (what Receiver() refuses before it makes anything)
        config, _ = configured()
        problem = config.transport_problem()
        if problem:
            raise RQPError(problem)
        Gate(config)  # (the TLS files read and checked: their warnings logged)
        _say_max_over_msgmax(config, kernel_limits().msgmax)
        return (f"{config.source or 'no config file (the defaults)'}: a receiving MCA would "
                f"listen on {config.listen} ({'TLS' if config.tls else 'plaintext'}); "
                f"state_dir {config.state_dir}")

    if args.check:
        return check_only(log, check)
    return run_daemon(log, lambda: Receiver(*configured()))

if __name__ == "__main__":
    sys.exit(main())
