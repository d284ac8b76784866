"""rqp-sender: the sending MCA.

Takes records from the local transmission queue, finds which receiving MCA serves each queue
key by asking the hosts of ``.rqprc``, sends the messages and waits for their confirmations.
The protocol lives in :mod:`rqp.protocol.sender`; this module is the I/O around it: a thread that
blocks on the transmission queue, an asyncio loop for the connections and the clock.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from rqp import SURE_MSG, RQPError
from rqp.cli import add_log_level
from rqp.config import SenderConfig, load_sender_config
from rqp.protocol.errors import QueueError, QueueFull, QueueNotFound, RecordError
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import (
    UNKNOWN_MESSAGE_TYPE, AgentKind, DeadLetterRecord, TransmissionFlags, TransmissionRecord,
)
from rqp.protocol.sender import (
    ROUTE_STATES, Close, Connect, DeadLetter, Delivered, Lost, Note, NoteKind, Send, SenderCore,
    Settings,
)
from rqp.storage.deadletters import DeadLetterWriter
from rqp.storage.journal import Journal
from rqp.system.control import Metric, default_socket, render
from rqp.system.queues import LocalQueue, format_key, kernel_limits
from rqp.system.service import (
    Doorbell, KeySource, ServingLock, host_name, setup_logging, write_file_atomically,
)
from rqp_agents.daemon import Daemon, run_daemon

log = logging.getLogger("rqp.sender")

#: Messages held in memory per frame the window lets be in flight; the rest wait in the
#: transmission queue (where, unlike in memory, UNSURE ones survive a crash of the sender).
HELD_PER_WINDOW_FRAME = 16
MIN_HELD = 256
#: Records taken in one go by the reader thread once the first one has arrived.
READ_BATCH = 256
#: A graceful stop waits at most this long for the answers of frames in flight.
STOP_GRACE = 10.0
#: An idle sending MCA looks at its transmission queue at least this often, for producers
#: that do not ring the doorbell (C programs writing records themselves).
IDLE_POLL = 0.05


class _Taken:
    """What the core's ``origin`` of a message holds: its record and its journal seq."""

    __slots__ = ("record", "seq")

    def __init__(self, record: TransmissionRecord, seq: int | None) -> None:
        self.record = record
        self.seq = seq


class _Budget:
    """How many more messages may be held in memory (the rest wait in the kernel queue)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._cond = threading.Condition()

    def take(self, want: int, timeout: float) -> int:
        with self._cond:
            if self._free <= 0:
                self._cond.wait(timeout)
            got = max(0, min(self._free, want))
            self._free -= got
            return got

    def force(self, n: int) -> None:  # replayed messages are held whatever the budget
        with self._cond:
            self._free -= n

    def give(self, n: int) -> None:
        with self._cond:
            self._free += n
            self._cond.notify()


class _Link(asyncio.Protocol):
    """One TCP connection to a receiving MCA; it only passes bytes and endings on."""

    def __init__(self, sender: "Sender", host) -> None:
        self.sender = sender
        self.host = host
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    # asyncio drops an OSError raised here without a word: guarded() stops the agent instead.
    def data_received(self, data: bytes) -> None:
        self.sender.guarded(f"the connection to {self.host}", self.sender.on_data, self, data)

    def eof_received(self):
        self.sender.guarded(f"the connection to {self.host}", self.sender.on_data, self, b"")
        return False

    def connection_lost(self, exc) -> None:
        self.sender.guarded(f"the connection to {self.host}", self.sender.on_lost, self, exc)


class Sender(Daemon):
    stop_note = f"taking no new records; waiting up to {STOP_GRACE:g}s for answers in flight"

    def __init__(self, config: SenderConfig) -> None:
        super().__init__(log)
        self.config = config
        self.host = host_name()
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.msgmax = kernel_limits().msgmax
        # The spec's start: DEAD.LETTER.Q and the transmission queue exist before anything else.
        self.dead_letters = DeadLetterWriter(config.dead_letter_queue,
                                             self.state_dir / "spill", msgmax=self.msgmax)
        self.transmission_queue = LocalQueue.create(config.transmission_queue)
        self.lock = ServingLock(config.transmission_queue)
        self.name = config.agent_name
        self.keys = KeySource(self.state_dir, self.name)
        self.pid_file = self.state_dir / f"{self.name}.pid"
        write_file_atomically(self.pid_file, f"{os.getpid()}\n".encode())
        self.core = SenderCore(Settings.from_config(config), self.keys)
        self.doorbell = Doorbell(config.transmission_queue)
        # SURE records are journaled before they are taken off the transmission queue and
        # released once delivered or dead-lettered here (spec 5.7).
        self.journal = Journal(self.state_dir, self.name)
        for problem in self.journal.problems:
            log.error("journal %s: %s", self.state_dir / f"{self.name}.journal", problem)
        self._releases: list[int] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._links: dict[object, _Link] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._budget = _Budget(max(MIN_HELD, HELD_PER_WINDOW_FRAME * config.window
                                   * len(config.hosts)))
        self._stop_reading = threading.Event()
        self._reader: threading.Thread | None = None
        self._dead_letter_backlog: collections.deque = collections.deque()
        self.stats = collections.Counter()
        self.started = time.time()
        self.control_path = Path(config.control_socket) if config.control_socket else \
            default_socket(self.state_dir, self.name)

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.start_service(self.control_path, self.config.metrics_listen)
        signal.signal(signal.SIGUSR1, lambda *_: None)  # wakes the reader thread, nothing else
        self._replay()
        self._reader = threading.Thread(target=self._read, name="xmit-reader", daemon=True)
        self._reader.start()
        log.info("serving transmission queue %s (DEAD.LETTER.Q %s); hosts %s; keys from "
                 "incarnation %08x", format_key(self.config.transmission_queue),
                 format_key(self.config.dead_letter_queue),
                 ", ".join(map(str, self.config.hosts)), self.keys.incarnation)
        self.ready("serving")
        await self.wait_for_stop()
        if self.failed:
            await self._abort()
        else:
            await self._stop()

    # --- reload, status, metrics ---------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: read .rqprc again; new hosts and timeouts apply from now on, connections
        and frames in flight are kept. A bad file is refused and the running config kept."""
        new = load_sender_config(self.config.source)
        fixed = [k for k in ("transmission_queue", "dead_letter_queue", "state_dir")
                 if getattr(new, k) != getattr(self.config, k)]
        if fixed:
            raise RQPError(f"{', '.join(fixed)} cannot change while running: restart the "
                           "sending MCA for that")
        self.core.update_settings(Settings.from_config(new), self.loop.time())
        self.config = new
        log.info("reloaded %s: hosts %s", new.source, ", ".join(map(str, new.hosts)))
        self._run_actions()

    def _depth(self, queue: LocalQueue) -> int | None:
        try:
            return queue.depth
        except RQPError:
            return None

    def status(self) -> dict:
        routes = self.core.route_status()
        to_wall = time.time() - self.loop.time()  # the core's times are the loop's clock
        for route in routes:
            route["queue"] = format_key(route["queue_key"])
            route["name"] = self.config.queue_name(route["queue_key"])
            for field in ("since", "last_error_at", "last_message_at"):
                if route[field] is not None:
                    route[field] += to_wall
        return {
            "agent": "sender", "pid": os.getpid(), "host": self.host,
            "started_at": self.started, "uptime": time.time() - self.started,
            "source": self.config.source,
            "transmission_queue": format_key(self.config.transmission_queue),
            "transmission_queue_depth": self._depth(self.transmission_queue),
            "dead_letter_queue": format_key(self.config.dead_letter_queue),
            "dead_letter_queue_depth": self._depth(self.dead_letters.queue),
            "journal_depth": self.journal.live_count, "held": self.core.held,
            "in_flight": self.core.in_flight, "incarnation": f"{self.keys.incarnation:08x}",
            "hosts": [{"host": str(h), "connection": self.core.link_state(h).value}
                      for h in self.config.hosts],
            "routes": routes, "stats": dict(self.stats),
            "dead_letters": dict(self.dead_letters.by_reason), "now": time.time(),
        }

    def metrics(self) -> str:
        routes = self.core.route_status()
        m = {name: Metric(name, kind, text) for name, kind, text in (
            ("rqp_sender_messages_total", "counter", "MESSAGE frames sent, by queue"),
            ("rqp_sender_bytes_total", "counter", "payload bytes sent, by queue"),
            ("rqp_sender_outcomes_total", "counter", "messages finished, by queue and outcome"),
            ("rqp_sender_errors_total", "counter", "unconfirmed attempts, by queue"),
            ("rqp_sender_route_changes_total", "counter", "routes found or dropped, by queue"),
            ("rqp_sender_error_counter", "gauge", "the UNSURE error counter of the route"),
            ("rqp_sender_in_flight", "gauge", "messages sent and not answered, by queue"),
            ("rqp_sender_route_state", "gauge", "1 for the state each route is in, else 0"),
            ("rqp_dead_letters_total", "counter", "dead letters written here, by reason"),
            ("rqp_journal_depth", "gauge", "SURE messages in the journal"),
            ("rqp_dead_letter_queue_depth", "gauge", "records on DEAD.LETTER.Q"),
            ("rqp_transmission_queue_depth", "gauge", "records on the transmission queue"),
            ("rqp_up_seconds", "gauge", "seconds since the agent started"))}
        for r in routes:
            q = {"queue": format_key(r["queue_key"]), "name": self.config.queue_name(
                r["queue_key"]) or "", "peer": r["peer"] or ""}
            m["rqp_sender_messages_total"].add(r["sent"], **q)
            m["rqp_sender_bytes_total"].add(r["sent_bytes"], **q)
            for outcome in ("delivered", "lost", "dead_lettered"):
                m["rqp_sender_outcomes_total"].add(r[outcome], outcome=outcome, **q)
            m["rqp_sender_errors_total"].add(r["errors"], **q)
            m["rqp_sender_route_changes_total"].add(r["route_changes"], **q)
            m["rqp_sender_error_counter"].add(r["error_counter"], **q)
            m["rqp_sender_in_flight"].add(r["in_flight"], **q)
            for state in ROUTE_STATES:  # every route in every state, not only the healthy ones
                m["rqp_sender_route_state"].add(int(r["state"] == state), state=state, **q)
        for reason, count in sorted(self.dead_letters.by_reason.items()):
            m["rqp_dead_letters_total"].add(count, reason=reason)
        m["rqp_journal_depth"].add(self.journal.live_count)
        for name, queue in (("rqp_dead_letter_queue_depth", self.dead_letters.queue),
                            ("rqp_transmission_queue_depth", self.transmission_queue)):
            depth = self._depth(queue)
            if depth is not None:
                m[name].add(depth)
        m["rqp_up_seconds"].add(round(time.time() - self.started, 3))
        return render(list(m.values()))

    async def _stop_reader(self) -> None:
        self._stop_reading.set()
        while self._reader is not None and self._reader.is_alive():
            signal.pthread_kill(self._reader.ident, signal.SIGUSR1)  # EINTR for its waits
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        await self._stop_reader()
        waited = 0.0
        while self.core.in_flight and waited < STOP_GRACE:
            await asyncio.sleep(0.05)
            waited += 0.05
        # Still unanswered after the grace: the connections end, which the core treats as
        # "not confirmed" (SURE ones go back to pending, UNSURE ones are counted lost).
        for host in list(self._links):
            link = self._links.pop(host)
            link.transport.abort()
            self.core.connection_lost(host, "sending MCA stopping", self.loop.time())
        self._run_actions()
        # SURE messages not confirmed stay in the journal: the next start sends them first, in
        # order, with their keys. UNSURE ones not sent yet go back to the transmission queue.
        back = [m for m in self.core.drain_pending() if m.message_type != SURE_MSG]
        if back:
            await self._put_back(back, deadline=self.loop.time() + STOP_GRACE)
        self.stop_service()
        self._flush_dead_letters()  # (releases what reaches DEAD.LETTER.Q)
        self._release_journaled()
        self.journal.close()
        self.pid_file.unlink(missing_ok=True)
        log.info("stopped: %s", dict(self.stats))

    async def _abort(self) -> None:
        """After an unexpected error: nothing the core holds is trusted. SURE messages stay in
        the journal (sent again at the next start); UNSURE ones held in memory are lost."""
        await self._stop_reader()
        for link in self._links.values():
            link.transport.abort()
        self._links.clear()
        self.stop_service()
        self.journal.close()
        self.pid_file.unlink(missing_ok=True)
        log.error("stopped after an unexpected error: %d message(s) held, %d SURE in the "
                  "journal", self.core.held, self.journal.live_count)

    async def _put_back(self, messages: list, deadline: float) -> None:
        """Messages not sent yet go back on the transmission queue (at its end), without
        blocking the loop (a second SIGTERM must still work) and for a bounded time."""
        done = 0
        for msg in messages:
            while True:
                try:
                    self.transmission_queue.put(msg.origin.record.to_bytes(), block=False)
                    done += 1
                    break
                except QueueFull:
                    if self.loop.time() >= deadline:
                        break
                    await asyncio.sleep(0.05)
                except RQPError as exc:
                    log.error("cannot put message key=%#018x back on the transmission queue: "
                              "%s", msg.key, exc)
                    break
        log.info("%d message(s) not sent yet put back on the transmission queue", done)
        if done < len(messages):
            log.error("%d message(s) could not be put back (transmission queue %s full for "
                      "%gs) and are lost", len(messages) - done,
                      format_key(self.config.transmission_queue), STOP_GRACE)

    # --- the transmission queue ---------------------------------------------------------------

    def _replay(self) -> None:
        """Journaled SURE messages first, in order, with their keys (before any new record)."""
        entries = self.journal.recovered
        if not entries:
            return
        # A kill between journaling a batch and taking all of it off the queue leaves some of
        # its records in both. They are within the first READ_BATCH records of the queue, maybe
        # mixed with UNSURE ones of the same batch (never journaled, never handed on): take
        # the batch off; the journaled ones are sent from the journal, the others as new.
        journaled = {entry.record for entry in entries}
        head = self._copy_batch(READ_BATCH)
        last = max((i for i, data in enumerate(head) if data in journaled), default=-1)
        leftovers = [data for data in head[:last + 1] if data not in journaled]
        if last >= 0:
            self._take_off(head[:last + 1])
        now = self.loop.time()
        self._budget.force(len(entries) + len(leftovers))
        for entry in entries:
            record = TransmissionRecord.from_bytes(entry.record)
            self.core.submit(record.message_type, record.queue_key, record.payload, now,
                             origin=_Taken(record, entry.seq), key=entry.key)
        log.info("journal: %d SURE message(s) to send again first%s", len(entries),
                 f" ({last + 1 - len(leftovers)} of them also still on the transmission queue, "
                 "taken off)" if last >= 0 else "")
        if leftovers:
            self._on_records(self._journal(leftovers))
        self._run_actions()

    def _read(self) -> None:
        """Reader thread: copy records off the transmission queue, journal the SURE ones with
        one fsync for the batch, then take them off the queue and hand them to the loop.

        Nothing is taken before it is journaled, so a kill -9 at any moment loses no SURE
        record (what was journaled and not yet taken is recognised at the next start)."""
        try:
            self._read_records()
        except Exception as exc:  # noqa: BLE001 - unexpected: the agent stops
            self.fatal("the transmission-queue reader thread", exc)

    def _read_records(self) -> None:
        stop = self._stop_reading.is_set
        while not stop():
            room = self._budget.take(READ_BATCH, timeout=0.2)
            if not room:
                continue
            try:
                batch = self._copy_batch(room)
            except QueueError as exc:
                self._budget.give(room)
                self._queue_trouble(exc)
                continue
            if len(batch) < room:
                self._budget.give(room - len(batch))
            if not batch:
                self.doorbell.wait(IDLE_POLL)
                continue
            try:
                items = self._journal_and_take(batch)
            except RQPError as exc:
                self._budget.give(len(batch))
                log.critical("cannot journal SURE records: %s -- stopping, records stay on "
                             "the transmission queue", exc)
                self.loop.call_soon_threadsafe(self._stopping.set)
                return
            self.loop.call_soon_threadsafe(self._on_records, items)

    def _copy_batch(self, limit: int) -> list[bytes]:
        queue = self.transmission_queue
        batch = []
        while len(batch) < limit and (item := queue.peek(len(batch))) is not None:
            batch.append(item[0])
        return batch

    def _journal(self, batch: list[bytes]) -> list[list]:
        """Parse, give keys, journal the SURE records (one fsync): [data, record, key, seq]."""
        items, sure = [], []
        for data in batch:
            try:
                record = TransmissionRecord.from_bytes(data)
            except RecordError as exc:
                items.append([data, exc, 0, None])
                continue
            key = self.keys()
            if record.flags & TransmissionFlags.REPLAY_KEY and record.sequence:
                key = record.sequence  # a replayed dead letter keeps its original key
            if record.message_type == SURE_MSG and not queue_key_problem(record.queue_key):
                sure.append(len(items))
            items.append([data, record, key, None])
        seqs = self.journal.append([(items[i][2], items[i][0]) for i in sure])
        for i, seq in zip(sure, seqs):
            items[i][3] = seq
        return items

    def _take_off(self, batch: list[bytes]) -> None:
        queue = self.transmission_queue
        for data in batch:  # nobody else takes from it, so these are the records copied
            if queue.get(block=False) != data:
                log.error("the transmission queue %s has another reader: a record taken off "
                          "it was not the one copied", format_key(queue.key))

    def _journal_and_take(self, batch: list[bytes]) -> list[list]:
        items = self._journal(batch)
        self._take_off(batch)  # now, and only now, off the queue
        return items

    def _queue_trouble(self, exc: QueueError) -> None:
        if isinstance(exc, QueueNotFound):
            log.error("transmission queue %s was removed: creating it again",
                      format_key(self.config.transmission_queue))
            self.transmission_queue = LocalQueue.create(self.config.transmission_queue)
        else:
            log.error("cannot read the transmission queue: %s", exc)
            self._stop_reading.wait(1.0)

    def _on_records(self, items: list) -> None:
        now = self.loop.time()
        for data, record, key, seq in items:
            self.stats["taken"] += 1
            if isinstance(record, RecordError):
                self._dead_letter_raw(data, record)
                self._budget.give(1)
                continue
            self.core.submit(record.message_type, record.queue_key, record.payload, now,
                             origin=_Taken(record, seq), key=key)
        self._run_actions()

    # --- connections --------------------------------------------------------------------------

    async def _connect(self, host) -> None:
        try:
            _, link = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Link(self, host), host.host, host.port),
                self.config.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            # (asyncio's own text, "Connect call failed (addr)", hides the reason)
            why = "timed out" if isinstance(exc, asyncio.TimeoutError) else (
                os.strerror(exc.errno) if exc.errno else str(exc))
            self.core.connect_failed(host, why, self.loop.time())
            self._run_actions()
            return
        link.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._links[host] = link
        self.core.connected(host, self.loop.time())
        self._run_actions()

    def on_data(self, link: _Link, data: bytes) -> None:
        if self._links.get(link.host) is link:
            self.core.data_received(link.host, data, self.loop.time())
            self._run_actions()

    def on_lost(self, link: _Link, exc) -> None:
        if self._links.get(link.host) is link:
            del self._links[link.host]
            self.core.connection_lost(link.host, str(exc) if exc else "closed",
                                      self.loop.time())
            self._run_actions()

    # --- carrying out the core's decisions ---------------------------------------------------

    def _run_actions(self) -> None:
        out: dict[object, list[bytes]] = {}  # frames per host, written once per batch
        finished = delivered = 0  # messages whose slot in memory is free again
        for act in self.core.take_actions():
            kind = type(act)
            if kind is Send:
                frames = out.get(act.host)
                if frames is None:
                    out[act.host] = frames = []
                frames.append(act.data)
            elif kind is Delivered:
                delivered += 1
                if act.message.origin.seq is not None:
                    self._releases.append(act.message.origin.seq)
            elif kind is Connect:
                self.spawn(self._connect(act.host), f"connecting to {act.host}")
            elif kind is Close:
                out.pop(act.host, None)  # frames for a connection being given up
                link = self._links.pop(act.host, None)
                log.warning("closing connection to %s: %s", act.host, act.reason)
                if link is not None:
                    link.transport.abort()
            elif kind is Lost:
                self.stats["lost"] += 1
                finished += 1
                log.warning("UNSURE message key=%#018x for queue %s not confirmed by %s: %s",
                            act.message.key, format_key(act.message.queue_key), act.host,
                            act.detail)
            elif kind is DeadLetter:
                self._dead_letter(act)
                finished += 1
            elif kind is Note:
                self._log_note(act)
        for host, frames in out.items():
            link = self._links.get(host)
            if link is not None:
                link.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))
        if finished or delivered:
            self.stats["delivered"] += delivered
            self._budget.give(finished + delivered)
        if self._releases:
            self._release_journaled()
        self._schedule()

    def _release_journaled(self) -> None:
        """Journal RELEASE entries (no fsync of their own: a lost release only means a re-send
        after a crash, which the receiver recognises by its key)."""
        if self._releases:
            self.journal.release(self._releases)
            self._releases = []
            if self.journal.maybe_compact():
                log.info("journal compacted: %d live message(s), %d bytes",
                         self.journal.live_count, self.journal.file_bytes)

    def _schedule(self) -> None:
        deadline = self.core.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = None if deadline is None else self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self.core.tick(self.loop.time())
        self._run_actions()

    def _log_note(self, note: Note) -> None:
        level = logging.INFO if note.kind in (NoteKind.ROUTE_FOUND, NoteKind.CONNECTED) \
            else logging.WARNING
        fields = []
        if note.queue_key is not None:
            name = self.config.queue_name(note.queue_key)
            fields.append(f"queue={format_key(note.queue_key)}" + (f"({name})" if name else ""))
        if note.host is not None:
            fields.append(f"peer={note.host}")
        if note.key:
            fields.append(f"key={note.key:#018x}")
        log.log(level, "%s %s%s", note.kind.value, " ".join(fields),
                f": {note.detail}" if note.detail else "")

    # --- dead letters -------------------------------------------------------------------------

    def _dead_letter(self, act: DeadLetter) -> None:
        msg = act.message
        record = DeadLetterRecord.from_transmission(
            msg.origin.record, reason=act.reason, agent=AgentKind.SENDER, message_key=msg.key,
            attempts=msg.attempts, host=self.host, source_host=self.host,
            destination_host=str(msg.host or ""), detail=act.detail)
        log.warning("dead letter reason=%s queue=%s key=%#018x: %s", act.reason.name,
                    format_key(msg.queue_key), msg.key, act.detail)
        self._put_dead_letter(record, msg.origin.seq)

    def _dead_letter_raw(self, data: bytes, exc: RecordError) -> None:
        record = DeadLetterRecord(
            reason=ReasonCode.MALFORMED_RECORD, message_type=UNKNOWN_MESSAGE_TYPE,
            agent=AgentKind.SENDER, host=self.host, source_host=self.host, detail=str(exc),
            payload=data)
        log.warning("dead letter reason=MALFORMED_RECORD: %s", exc)
        self._put_dead_letter(record)

    def _put_dead_letter(self, record: DeadLetterRecord, seq: int | None = None) -> None:
        """Onto DEAD.LETTER.Q; a journaled message is released once the record is there."""
        self.stats["dead_lettered"] += 1
        self._dead_letter_backlog.append((self.dead_letters.encode(record), seq))
        self._flush_dead_letters()

    def _flush_dead_letters(self) -> None:
        while self._dead_letter_backlog:
            data, seq = self._dead_letter_backlog[0]
            if not self.dead_letters.try_put(data):
                log.error("DEAD.LETTER.Q %s is full: %d dead letter(s) held in memory, "
                          "retrying", format_key(self.config.dead_letter_queue),
                          len(self._dead_letter_backlog))
                self.loop.call_later(0.5, self._flush_dead_letters)
                return
            self._dead_letter_backlog.popleft()
            if seq is not None:
                self._releases.append(seq)
        self._release_journaled()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rqp-sender", description=__doc__.splitlines()[0])
    parser.add_argument("--rqprc", metavar="FILE",
                        help="the .rqprc to use (default: $RQPRC, ./.rqprc, ~/.rqprc, "
                        "/etc/rqp/rqprc)")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return run_daemon(log, lambda: Sender(load_sender_config(args.rqprc)))

if __name__ == "__main__":
    sys.exit(main())
