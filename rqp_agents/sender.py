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
import dataclasses
import logging
import ssl
import sys
import time
from pathlib import Path

from rqp import SURE_MSG, RQPError
from rqp.cli import add_log_level, add_version
from rqp.config import ConfigError, SenderConfig, load_sender_config, parse_host
from rqp.protocol.constants import DEFAULT_PORT, KNOWN_EXTENSIONS
from rqp.protocol.errors import RecordError
from rqp.protocol.events import ANSWERS, QueueAsk, QueueNo, QueueYes
from rqp.protocol.frames import FrameDecoder, encode
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import (
    REPLAYED_NOTE, UNKNOWN_MESSAGE_TYPE, AgentKind, DeadLetterRecord,
)
from rqp.protocol.sender import (
    QUEUE_MEMORY, WAITING_FOR_ROUTE_MAX, Close, Connect, DeadLetter, Declined, Delivered,
    FanoutEnded, Lost, Note, NoteKind, Send, SenderCore, Settings,
)
from rqp.storage.deadletters import DeadLetterWriter
from rqp.system.control import default_socket
from rqp.system.files import SpaceReserve
from rqp.system.queues import format_key, kernel_limits
from rqp.system.service import (
    KeySource, ServingLock, config_changes, counts, host_name, make_state_dir,
    mark_dead_letter_queue, setup_logging, wall_ms,
)
from rqp.system.tls import (
    CLOSED_IN_HANDSHAKE, TLSFileError, check_files, client_context, handshake_problem,
)
from rqp_agents import telemetry
from rqp_agents.daemon import Daemon, RateLimitedLog, check_only, run_daemon
from rqp_agents.intake import (
    NO_ROOM_WAIT, Intake, Taken, budget_size, messages_in, start_reserve_size,
)
from rqp_agents.links import REFUSED_AFTER_HANDSHAKE, Links

log = logging.getLogger("rqp.sender")
#: At most NOTE_BURST lines of each kind of note that every retry repeats, per NOTE_INTERVAL
#: seconds; the next one logged says how many were held back.
NOTE_INTERVAL, NOTE_BURST = 10.0, 20

#: A graceful stop waits at most this long for the answers of frames in flight.
STOP_GRACE = 10.0
#: While DEAD.LETTER.Q is full, the dead letters held are tried again (one timer) after
#: DEAD_LETTER_AGAIN when the last try wrote some (it is being drained), twice as long after
#: each try that wrote none, up to DEAD_LETTER_RETRY.
DEAD_LETTER_RETRY, DEAD_LETTER_AGAIN = 0.5, 0.001
#: Dead letters held in memory (DEAD.LETTER.Q full) beyond this many keep their place in the
#: reader's budget until written: the reader then stops, and records wait in the kernel queue
#: (producers wait when it is full), instead of memory growing with a flood of bad records.
DEAD_LETTERS_HELD_MAX = 4096
#: The line that WAITING_FOR_ROUTE_MAX messages wait for a route comes at most once in this
#: many seconds (a trial saw it once per retry round, each round taking them out of waiting
#: and putting them back: 6 in 16 s; rqpctl status says it all along). A minute, not more: a
#: second episode soon after the first is said too.
WAITING_FULL_REPEAT = 60.0


def _tls_contexts(config: SenderConfig) -> dict:
    """A client TLS context per distinct ``tls:`` block of ``config``, its files checked
    (warnings logged); raises TLSFileError naming the file and the problem."""
    contexts = {}
    for files in {config.tls, *config.host_tls.values()} - {None}:
        for warning in check_files(files):
            log.warning("%s", warning)
        contexts[files] = client_context(files)
    return contexts


#: Why the connections end at a stop (not a failure: logged at INFO).
STOPPING = "sending MCA stopping"


def _ping_problem(exc: BaseException, handshaking: bool) -> str:
    """Why rqpctl ping got no answer, in words (``handshaking``: over TLS, not connected yet).
    A trial: a receiver at its max_connections closes at once, the handshake then failed
    with a ConnectionResetError that says nothing, and ping printed "(TLS): "."""
    if handshaking and isinstance(exc, (ssl.SSLError, ConnectionError)):
        why = handshake_problem(exc)
        if not isinstance(exc, ssl.SSLError):
            why += CLOSED_IN_HANDSHAKE
        return why
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
        str(exc) or exc.__class__.__name__
    if isinstance(exc, ConnectionResetError):  # (plaintext: what a receiver at a limit does)
        why += (" (the receiver closed the connection: at its max_connections or "
                "max_connections_per_source, or not an RQP receiver?)")
    return why


class Sender(Daemon):
    stop_note = f"taking no new records; waiting up to {STOP_GRACE:g}s for answers in flight"

    def __init__(self, config: SenderConfig) -> None:
        super().__init__(log)
        problem = config.transport_problem()
        if problem:
            raise RQPError(problem)
        self.config = config
        self.tls = _tls_contexts(config)  # before anything is created: bad files stop here
        self.files_replaced(self.tls)
        self.host = host_name()
        self.state_dir = Path(config.state_dir)
        make_state_dir(self.state_dir)
        self.msgmax = kernel_limits().msgmax
        # The spec's start: DEAD.LETTER.Q exists before anything else (the transmission
        # queue is opened, or created, by the intake below).
        self.dead_letters = DeadLetterWriter(config.dead_letter_queue,
                                             self.state_dir / "spill", msgmax=self.msgmax)
        mark_dead_letter_queue(config.dead_letter_queue)  # never offered by a receiver here
        self.lock = ServingLock(config.transmission_queue)
        self.name = config.agent_name
        # Freed before the start's own writes, made again once they are done (Intake): a
        # sending MCA killed while its journal filled the disk could not start (trial 10).
        self.reserve = SpaceReserve(self.state_dir / f"{self.name}.reserve",
                                    start_reserve_size(self.msgmax))
        self.reserve.free()
        (self.state_dir / f"{self.name}.pid").unlink(missing_ok=True)  # (no longer written)
        self.keys = KeySource(self.state_dir, self.name)
        self.core = SenderCore(Settings.from_config(config), self.keys, clock_ms=wall_ms)
        # SURE records are journaled before they are taken off the transmission queue and
        # released once delivered or dead-lettered here (spec 5.7).
        self.intake = Intake(config.transmission_queue, self.state_dir, self.name, self.keys,
                             budget_size(config.window, len(config.hosts)), self.reserve)
        self.intake.keep_reserve(at_start=True)
        self.intake.fanout = (config.broadcast_keys, config.hosts)
        #: Messages waiting for a route whose places in the budget were given back (up to
        #: WAITING_FOR_ROUTE_MAX): they do not hold up the queues that have one.
        self._waiting_given = 0
        #: When the line saying that WAITING_FOR_ROUTE_MAX messages wait was last written (at
        #: most once per WAITING_FULL_REPEAT).
        self._waiting_full_said: float | None = None
        #: Notes that come again at every retry of every waiting message: at most
        #: NOTE_BURST of each kind per NOTE_INTERVAL (a trial: 4,352 messages waiting for a
        #: route logged 290 lines a second; rqpctl status shows every route anyway).
        self._repeated_notes = {kind: RateLimitedLog(log, NOTE_INTERVAL, NOTE_BURST,
                                                     what=f"lines \"{kind.value}\"")
                                for kind in (NoteKind.NO_ROUTE, NoteKind.RETRY_SCHEDULED,
                                             NoteKind.COPIES_WAIT)}
        #: A line per dead letter, as many per NOTE_INTERVAL (a trial: 16,000 bad records
        #: made 5,200 lines a second); every one is counted, and is on DEAD.LETTER.Q.
        self._dead_letters_log = RateLimitedLog(log, NOTE_INTERVAL, NOTE_BURST,
                                                what="dead letters")
        self._releases: list[int] = []
        self._copies_done: list[tuple[int, int]] = []  # (journal seq, copy key)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.links = Links(on_connected=self._connected, on_failed=self._connect_failed,
                           on_data=self._data, on_lost=self._lost, guard=self.guarded,
                           tls_for=lambda host: self.tls.get(self.config.tls_for(host)))
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._dead_letter_backlog: collections.deque = collections.deque()
        self._dead_letter_retry: asyncio.TimerHandle | None = None
        self._dead_letter_delay = DEAD_LETTER_AGAIN  # (the next retry's, while none goes)
        self._dead_letters_full_since: float | None = None  # (loop time)
        self._dead_letters_full_why = "full"  # (or DeadLetterWriter.unmade, when it began)
        #: Why the next dead letter's spill file cannot be written (its directory full or
        #: broken), while that holds the dead letters; None: DEAD.LETTER.Q full, if any held.
        self._spill_trouble: str | None = None
        self._dead_letters_capped = False  # (said so, this time DEAD.LETTER.Q is full)
        self.stats = collections.Counter()
        self.started = time.time()
        self.control_path = Path(config.control_socket) if config.control_socket else \
            default_socket(self.state_dir, self.name)

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.start_service(self.control_path, self.config.metrics_listen)
        self._replay()
        self.intake.start(self.loop, self._on_records, self.stop_failing, self.fatal)
        log.info("serving transmission queue %s (DEAD.LETTER.Q %s); hosts %s; window %d; "
                 "keys from incarnation %08x", format_key(self.config.transmission_queue),
                 format_key(self.config.dead_letter_queue),
                 ", ".join(map(str, self.config.hosts)), self.config.window,
                 self.keys.incarnation)
        self._say_plaintext(self.config.hosts)
        self.ready("serving")
        reserve = asyncio.create_task(self._keep_reserve())
        await self.wait_for_stop()
        reserve.cancel()
        if self.failed:
            await self._abort()
        else:
            await self._stop()

    async def _keep_reserve(self) -> None:
        """While the start reserve is missing (or was removed: a trial), try to make it again
        every second (in a thread: it writes and fsyncs its bytes, and may cut the journal
        back)."""
        while True:
            await asyncio.sleep(NO_ROOM_WAIT)
            if self.reserve.missing is not None or not self.reserve.there():
                await asyncio.to_thread(self.intake.keep_reserve)

    # --- reload, status, metrics ---------------------------------------------------------------

    def status(self) -> dict:
        return telemetry.sender_status(self)

    commands = ("route", "ping")

    async def command(self, command: str, request: dict) -> dict | None:
        if command == "route":
            return self._route_command(request)
        if command == "ping":
            return await self._ping(request)
        return None

    def _route_command(self, request: dict) -> dict:
        """``{"action": "retry" | "stop" | "start", "queue": KEY}``: end the back-off of that
        queue's route now; stop sending its messages (they wait); send them again."""
        key, action = request.get("queue"), request.get("action")
        if type(key) is not int or queue_key_problem(key):
            return {"error": f"route: a queue key, got {key!r}"}
        actions = {"retry": self.core.retry_now, "stop": self.core.stop_route,
                   "start": self.core.start_route}
        if not isinstance(action, str) or action not in actions:
            return {"error": f"route: unknown action {action!r} ({', '.join(actions)})"}
        if key in (self.config.transmission_queue, self.config.dead_letter_queue):
            return {"error": f"route: {format_key(key)} is this sending MCA's own "
                             "transmission queue or DEAD.LETTER.Q, not a route"}
        if key not in self.core.info and key not in self.core.routes and \
                key not in self.config.queues.values():
            return {"error": f"route: no route for queue {format_key(key)}: this sending MCA "
                             "has sent nothing for it lately (it remembers the "
                             f"{QUEUE_MEMORY} queues most recently busy) and .rqprc does not "
                             "name it"}
        if action == "retry" and key in self.core.stopped:
            return {"error": f"route: queue {format_key(key)} is stopped: rqpctl route start "
                             "it first"}
        if action == "stop" and key in self.core.stopped:
            return {"error": f"route: queue {format_key(key)} is already stopped (rqpctl route "
                             "start it to resume)"}
        if action == "start" and key not in self.core.stopped:
            return {"error": f"route: queue {format_key(key)} is not stopped: nothing to start "
                             "(rqpctl route retry ends a back-off)"}
        held = actions[action](key, self.loop.time())
        self._run_actions()
        log.info("route %s: %s, asked by rqpctl (%d message(s) waiting%s)",
                 self._queue_text(key), {"retry": "retry now", "stop": "stopped",
                                         "start": "started again"}[action], held,
                 " or in flight" if action == "retry" else "",
                 extra={"event": f"route_{action}", "queue_key": format_key(key)})
        # (its own route only: the whole status was 24 ms of the loop at 3,000 queues)
        routes = telemetry.sender_routes(self, only=key)
        return {"queue": format_key(key), "held": held, "route": routes[0] if routes else None}

    async def _ping(self, request: dict) -> dict:
        """Connect to ``host`` as this sending MCA does (its TLS files for that host), send a
        QUEUE_ASK for ``queue`` and time the answer: {"answer", "connect_ms", "rtt_ms", ...},
        or {"problem": why}."""
        given = request.get("host")
        if not isinstance(given, str):  # (a re-check: null pinged a host named "none")
            return {"error": f"ping: a host, got {given!r}"}
        try:
            host = parse_host(given, DEFAULT_PORT)
        except ConfigError as exc:
            return {"error": f"ping: {exc}"}
        key = request.get("queue")
        if type(key) is not int or queue_key_problem(key):
            return {"error": f"ping: a queue key, got {key!r}"}
        context = self.tls.get(self.config.tls_for(host))
        out = {"host": str(host), "tls": context is not None, "queue": format_key(key)}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host.host, host.port, ssl=context,
                server_hostname=host.host if context is not None else None),
                self.config.connect_timeout)
            t1 = loop.time()
            writer.write(encode(QueueAsk(queue_key=key, data=KNOWN_EXTENSIONS)))
            data = await asyncio.wait_for(reader.readexactly(2), self.config.ask_timeout)
            t2 = loop.time()
            [answer] = FrameDecoder(accept=ANSWERS).events(data)
            if not isinstance(answer, (QueueYes, QueueNo)):  # (a re-check: DELIVERED_YES to
                return {**out, "problem": f"answered QUEUE_ASK with {type(answer).__name__}, "
                        "not QUEUE_YES or QUEUE_NO (not an RQP receiver?)"}  # it said QUEUE_NO)
            return {**out, "answer": "QUEUE_YES" if isinstance(answer, QueueYes) else "QUEUE_NO",
                    "extensions": answer.data,
                    "connect_ms": round((t1 - t0) * 1000, 3), "rtt_ms": round((t2 - t1) * 1000, 3)}
        except asyncio.TimeoutError:
            return {**out, "problem": f"connected, but no answer to QUEUE_ASK within "
                    f"{self.config.ask_timeout:g}s (ask_timeout: a slow or lossy link, a busy "
                    "receiver, or not an RQP receiver)"
                    if writer is not None else f"cannot connect within "
                    f"{self.config.connect_timeout:g}s (connect_timeout)"}
        except asyncio.IncompleteReadError as exc:
            return {**out, "problem": REFUSED_AFTER_HANDSHAKE if context is not None and not
                    exc.partial else "the connection was closed before an answer (refused "
                    "by the receiver's rules or limits, or not an RQP receiver?)"}
        except ConnectionRefusedError:
            return {**out, "problem": "connection refused (no receiving MCA listens there)"}
        except UnicodeError as exc:  # (a host name IDNA cannot take: a label over 63 octets)
            return {**out, "problem": f"cannot resolve the host name: {exc}"}
        except (OSError, RQPError) as exc:  # (ssl.SSLError among them)
            if context is not None and writer is not None and isinstance(exc, ConnectionError):
                # over TLS, after the handshake, nothing heard: a reset is the refusal an end
                # is (the ask went first; a trial: 3 times of 37 it said only "reset")
                return {**out, "problem": REFUSED_AFTER_HANDSHAKE}
            return {**out, "problem": _ping_problem(exc, context is not None and writer is None)}
        finally:
            if writer is not None:
                writer.close()

    def trace(self, key: int) -> dict | None:
        """What this sending MCA knows of the message with RQP key ``key`` (times: Unix)."""
        found = self.core.trace(key, self.loop.time())
        if found is None:
            return None
        to_wall = time.time() - self.loop.time()
        for field in ("taken_at", "answer_due", "retry_at", "at"):
            if found.get(field) is not None:
                found[field] += to_wall
        found["queue"] = format_key(found["queue_key"])
        found["name"] = self.config.queue_name(found["queue_key"])
        if found["state"].startswith("dead-lettered") and any(
                held[0].message_key == key for held in self._dead_letter_backlog):
            # (not on DEAD.LETTER.Q yet: a trial's trace said "dead-lettered" of it)
            found["held_in_memory"] = self.dead_letters_held_why
        return found

    def metrics(self) -> list:
        return telemetry.sender_metrics(self)

    def reload(self) -> None:
        """SIGHUP: read .rqprc again; new hosts and timeouts apply from now on, connections
        and frames in flight are kept. A bad file is refused and the running config kept."""
        new = load_sender_config(self.config.source)
        new = self.refuse_fixed(new, ("transmission_queue", "dead_letter_queue", "state_dir",
                                      "control_socket", "metrics_listen"), "sending MCA")
        # A host's transport is fixed at start, as a receiver's port is: a trial's reload that
        # took the tls: block out was taken, and every new connection went out in plaintext.
        turned = [f"{h} {'TLS' if was else 'plaintext'} -> {'TLS' if now else 'plaintext'}"
                  for h in new.hosts if h in self.config.hosts
                  for was, now in [(self.config.tls_for(h) is not None,
                                    new.tls_for(h) is not None)] if was != now]
        if turned:
            raise RQPError(f"tls turned on or off for {', '.join(turned)}: cannot change while "
                           "running, restart the sending MCA for that")
        problem = new.transport_problem()  # (a host added in plaintext without saying so)
        if problem:
            raise RQPError(problem)
        try:
            tls = _tls_contexts(new)  # new connections use the new certificates
        except TLSFileError as exc:
            raise RQPError(f"certificates not reloaded: {exc}") from None
        self.tls = tls
        self.core.update_settings(Settings.from_config(new), self.loop.time())
        self.intake.fanout = (new.broadcast_keys, new.hosts)
        self.intake.budget.resize(budget_size(new.window, len(new.hosts)))
        changes = config_changes(self.config, new, replaced=self.files_replaced(tls))
        added = [h for h in new.hosts if h not in self.config.hosts]
        self.config = new
        log.info("reloaded %s: %s; hosts %s", new.source, changes,
                 ", ".join(map(str, new.hosts)))
        self._say_plaintext(added)
        self._run_actions()

    def _say_plaintext(self, hosts) -> None:
        """Log the hosts among ``hosts`` that RQP goes to in plaintext over a network."""
        plain = self.config.plaintext_hosts(hosts)
        for said, these in (("'tls: false' on their entries", [
                h for h in plain if h in self.config.host_tls]), ("'plaintext: true'", [
                h for h in plain if h not in self.config.host_tls])):
            if these:  # (a trial: "no tls: block for them" of a host given tls: false)
                log.info("plaintext RQP/1 to %s, as %s says (%s)", ", ".join(map(str, these)),
                         self.config.source, said)

    async def _stop(self) -> None:
        await self.intake.stop()
        waited = 0.0
        while self.core.in_flight and waited < STOP_GRACE:
            await asyncio.sleep(0.05)
            waited += 0.05
        # Still unanswered after the grace: the connections end, which the core treats as
        # "not confirmed" (SURE ones go back to pending, UNSURE ones are counted lost).
        unanswered = bool(self.core.in_flight)  # (reset: never to arrive later; else FIN)
        for host in self.links:
            self.links.close(host, reset=unanswered)
            self.core.connection_lost(host, STOPPING, self.loop.time(), clean=True)
        self._run_actions()
        # SURE messages not confirmed stay in the journal: the next start sends them first, in
        # order, with their keys. UNSURE ones not sent yet go back to the transmission queue.
        back = [m for m in self.core.drain_pending() if m.message_type != SURE_MSG]
        self._run_actions()  # (UNSURE broadcast copies that cannot go back: counted lost)
        if back:
            await self.intake.put_back(back, self.loop.time() + STOP_GRACE, STOP_GRACE)
        self.stop_service()
        self._flush_dead_letters()  # (releases what reaches DEAD.LETTER.Q)
        if self._dead_letter_backlog:
            self.stats["dead_letters_lost"] = len(self._dead_letter_backlog)
            for _record, _seq, data in self._dead_letter_backlog:  # (and its spill file)
                if data is not None:
                    self.dead_letters.discard(data)
            log.error("%d dead letter(s) held in memory are lost: %s (the SURE messages "
                      "among them stay journaled: sent again at the next start)",
                      len(self._dead_letter_backlog), self._spill_trouble or
                      self.dead_letters.unmade or
                      f"DEAD.LETTER.Q {format_key(self.config.dead_letter_queue)} is still full")
        self._release_journaled()
        self.intake.journal.close()
        log.info("stopped: %s", counts(self.stats))

    async def _abort(self) -> None:
        """After an unexpected error: nothing the core holds is trusted. SURE messages stay in
        the journal (sent again at the next start); UNSURE ones held in memory are lost."""
        await self.intake.stop()
        self.links.close_all(reset=True)
        self.stop_service()
        self.intake.journal.close()
        log.error("stopped after an unexpected error: %d message(s) held, %d SURE in the "
                  "journal", self.core.held, self.intake.journal.live_count)

    # --- the transmission queue ---------------------------------------------------------------

    def _replay(self) -> None:
        """Journaled SURE messages first, in order, with their keys (before any new record)."""
        first, leftovers = self.intake.recover()
        now, wall_ns = self.loop.time(), time.time_ns()
        for data, record, key, seq, copies in first:
            # (taken before a restart: not counted in taken; a batch, its messages)
            self.stats["from_journal"] += messages_in(record)
            # its retry_max_age goes on counting: from when it was put (the journal does not
            # keep when it was taken, a little later)
            waited = (wall_ns - record.enqueued_ns) / 1e9 if record.enqueued_ns else 0.0
            self._submit(record, now, Taken(record, seq), key, copies,
                         taken_at=now - waited if waited > 0 else None, resumed=True)
        if leftovers:
            self._on_records(leftovers)
        self._run_actions()

    def _on_records(self, items: list) -> None:
        now = self.loop.time()
        for data, record, key, seq, copies in items:
            self.stats["taken"] += messages_in(record)  # (every count is of messages)
            if isinstance(record, RecordError):
                self._dead_letter_raw(data, record)
                self.intake.budget.give(1)
                continue
            self._submit(record, now, Taken(record, seq), key, copies)
        self._run_actions()

    def _submit(self, record, now: float, origin: Taken, key: int, copies,
                taken_at: float | None = None, resumed: bool = False) -> None:
        self.core.submit(record.message_type, record.queue_key, record.payload, now,
                         origin=origin, key=key, mtype=record.mtype, priority=record.priority,
                         expires_at_ms=record.expires_at_ms, copies=copies,
                         members=record.members() if record.is_batch else None,
                         taken_at=taken_at, resumed=resumed)

    # --- connections --------------------------------------------------------------------------

    def _connected(self, host) -> None:
        self.core.connected(host, self.loop.time())
        self._run_actions()

    def _connect_failed(self, host, why: str) -> None:
        self.core.connect_failed(host, why, self.loop.time())
        self._run_actions()

    def _data(self, host, data: bytes) -> None:
        self.core.data_received(host, data, self.loop.time())
        self._run_actions()

    def _lost(self, host, why: str, clean: bool) -> None:
        self.core.connection_lost(host, why, self.loop.time(), clean=clean)
        self._run_actions()

    # --- carrying out the core's decisions ---------------------------------------------------

    def _run_actions(self) -> None:
        out: dict[object, list[bytes]] = {}  # frames per host, written once per batch
        finished = delivered = 0  # messages whose slot in memory is free again
        delivered_messages = 0  # (a batch: its messages)
        for act in self.core.take_actions():
            kind = type(act)
            if kind is Send:
                frames = out.get(act.host)
                if frames is None:
                    out[act.host] = frames = []
                frames.append(act.data)
            elif kind is Delivered:
                msg = act.message
                if msg.fanout is not None:  # a broadcast copy: its message may go on
                    self._copy_done(msg)
                    self.stats["delivered"] += 1  # (a message delivered to one destination)
                    self.stats["copies_delivered"] += 1
                    continue
                delivered += 1
                delivered_messages += msg.count
                if msg.origin.seq is not None:
                    self._releases.append(msg.origin.seq)
            elif kind is Connect:
                self.spawn(self.links.connect(act.host, self.config.connect_timeout),
                           f"connecting to {act.host}")
            elif kind is Close:
                out.pop(act.host, None)  # frames for a connection being given up
                log.log(logging.DEBUG if act.orderly else logging.WARNING,
                        "closing connection to %s: %s", act.host, act.reason,
                        extra={"event": "connection_closing", "peer": str(act.host),
                               "reason": act.reason})
                self.links.close(act.host, reset=not act.orderly)
            elif kind is Lost:
                self.stats["unconfirmed_at_close" if act.likely_put else "lost"] += \
                    act.message.count
                finished += act.message.fanout is None
                log.log(logging.INFO if act.likely_put else logging.WARNING,
                        "UNSURE message key=%#018x for queue %s not confirmed by %s: %s",
                        act.message.key, format_key(act.message.queue_key), act.host,
                        act.detail)
            elif kind is DeadLetter:
                self._dead_letter(act)
                finished += act.message.fanout is None
            elif kind is Declined:
                self._copy_done(act.message)
                log.info("broadcast queue %s: no copy for %s (key=%#018x): %s",
                         self._queue_text(act.message.queue_key), act.host, act.message.key,
                         act.detail)
            elif kind is FanoutEnded:
                finished += 1  # the message's place in memory (its copies were one message)
                self.stats["broadcasts_finished"] += 1  # every copy delivered or declined
            elif kind is Note:
                self._log_note(act)
        for host, frames in out.items():
            self.links.write(host, frames)
        if finished or delivered:
            self.stats["delivered"] += delivered_messages
            self.intake.budget.give(finished + delivered)
        self._hold_waiting_beyond_budget()
        if self._releases or self._copies_done:
            self._release_journaled()
        self._schedule()

    def _hold_waiting_beyond_budget(self) -> None:
        """Messages waiting for a route, or in a route an operator stopped, do not count
        against the budget (up to WAITING_FOR_ROUTE_MAX): their places are given back while
        they wait, taken back when a route is found or the route started (or they end: then
        the 'finished' above gave theirs again)."""
        waiting = self.core.held_aside()
        now = min(waiting, WAITING_FOR_ROUTE_MAX)
        if now == self._waiting_given:
            return
        if now > self._waiting_given:
            self.intake.budget.give(now - self._waiting_given)
        else:
            self.intake.budget.force(self._waiting_given - now)
        said = self._waiting_full_said
        if waiting >= WAITING_FOR_ROUTE_MAX > self._waiting_given and \
                (said is None or time.monotonic() - said >= WAITING_FULL_REPEAT):
            self._waiting_full_said = time.monotonic()
            log.warning("%d messages wait for a route (no host offers their queues, their "
                        "host is down, or it refused one and they wait for its retry: rqpctl "
                        "status says which) or in stopped routes: no more are held beside "
                        "them; the transmission queue waits until some go",
                        waiting,
                        extra={"event": "waiting_for_route_full"})
        self._waiting_given = now

    def _copy_done(self, msg) -> None:
        """A journaled broadcast copy is done (the journal releases the message with its last)."""
        if msg.origin.seq is not None:
            self._copies_done.append((msg.origin.seq, msg.key))

    def _release_journaled(self) -> None:
        """Journal RELEASE and COPY_DONE entries (no fsync of their own: a lost one only means
        a re-send after a crash, which the receiver recognises by its key)."""
        if self._copies_done:
            self.intake.journal.copy_done(self._copies_done)
            self._copies_done = []
        if self._releases:
            self.intake.release(self._releases)
            self._releases = []

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

    def _queue_text(self, key: int) -> str:
        name = self.config.queue_name(key)
        return format_key(key) + (f"({name})" if name else "")

    def _log_note(self, note: Note) -> None:
        level = logging.INFO if note.kind in (NoteKind.ROUTE_FOUND, NoteKind.CONNECTED,
                                              NoteKind.CONNECTION_CLOSED) \
            or self._stopping.is_set() and note.detail.endswith(STOPPING) else logging.WARNING
        limited = self._repeated_notes.get(note.kind)
        fields, extra = [], {"event": note.kind.name.lower()}
        if note.queue_key is not None:
            fields.append(f"queue={self._queue_text(note.queue_key)}")
            extra["queue_key"] = format_key(note.queue_key)
        if note.host is not None:
            fields.append(f"peer={note.host}")
            extra["peer"] = str(note.host)
        if note.key:
            fields.append(f"key={note.key:#018x}")
            extra["message_key"] = f"{note.key:#018x}"
        text = "%s %s%s" % (note.kind.value, " ".join(fields),
                             f": {note.detail}" if note.detail else "")
        if limited is not None:
            limited.report(text, level, extra=extra)
        else:
            log.log(level, "%s", text, extra=extra)

    # --- dead letters -------------------------------------------------------------------------

    def _dead_letter(self, act: DeadLetter) -> None:
        """One dead-letter record (a batch: one per message of it, with its key and mtype;
        the journal entry is released with the last)."""
        msg = act.message
        common = dict(reason=act.reason, agent=AgentKind.SENDER, attempts=msg.attempts,
                      host=self.host, source_host=self.host,
                      destination_host="" if act.whole else str(msg.host or msg.target or ""))
        record = msg.origin.record
        if msg.members is None:
            detail = act.detail
            if record.replays_key and record.sequence == msg.key:  # (the wire carries no mark)
                detail += f" [{REPLAYED_NOTE}]"
            records = [DeadLetterRecord.from_transmission(record, message_key=msg.key,
                                                          detail=detail, **common)]
        else:
            n = len(msg.members)
            records = [dataclasses.replace(DeadLetterRecord.from_transmission(
                record, message_key=msg.key + i, detail=f"{act.detail} (message {i + 1} of a "
                f"batch of {n}, mtype {mtype}; none of it was delivered)", **common),
                payload=data, original_length=len(data), mtype=mtype) for i, (mtype, data) in
                enumerate(msg.members)]
        self._dead_letters_log.report(
            "dead letter reason=%s queue=%s key=%#018x%s: %s", logging.WARNING,
            act.reason.name, format_key(msg.queue_key), msg.key,
            f" (a batch of {msg.count})" if msg.members is not None else "", act.detail,
            extra={"event": "dead_letter", "reason": act.reason.name,
                   "queue_key": format_key(msg.queue_key), "message_key": f"{msg.key:#018x}"})
        seq = msg.origin.seq
        done = seq if msg.fanout is None or seq is None else (seq, msg.key)
        for i, one in enumerate(records):
            self._put_dead_letter(one, done if i == len(records) - 1 else None)

    def _dead_letter_raw(self, data: bytes, exc: RecordError) -> None:
        record = DeadLetterRecord(
            reason=ReasonCode.MALFORMED_RECORD, message_type=UNKNOWN_MESSAGE_TYPE,
            agent=AgentKind.SENDER, host=self.host, source_host=self.host, detail=str(exc),
            payload=data)
        self._dead_letters_log.report("dead letter reason=MALFORMED_RECORD: %s", logging.WARNING,
                                      exc, extra={"event": "dead_letter",
                                                  "reason": "MALFORMED_RECORD"})
        self._put_dead_letter(record)

    @property
    def dead_letters_held(self) -> int:
        """Dead letters written to memory only: DEAD.LETTER.Q was full (or see below)."""
        return len(self._dead_letter_backlog)

    @property
    def dead_letters_held_why(self) -> str | None:
        """Why dead letters are held in memory (status), None if none is."""
        if not self._dead_letter_backlog:
            return None
        return self._spill_trouble or self.dead_letters.unmade or "it was full"

    def _put_dead_letter(self, record: DeadLetterRecord, seq=None) -> None:
        """Onto DEAD.LETTER.Q; a journaled message is released once the record is there
        (``seq``; a broadcast copy: ``(seq, copy key)``, marked done)."""
        self._dead_letter_backlog.append([record, seq, None])  # (encoded when its turn comes)
        self._flush_dead_letters()  # (those held first: in order)
        if len(self._dead_letter_backlog) > DEAD_LETTERS_HELD_MAX:  # (keeps its place)
            self.intake.budget.force(1)
            if not self._dead_letters_capped:  # (once while DEAD.LETTER.Q stays full)
                self._dead_letters_capped = True
                log.error("%d dead letters held in memory: the sending MCA takes at most %d "
                          "more records (its budget) and then leaves the rest on the "
                          "transmission queue until DEAD.LETTER.Q %s takes some",
                          DEAD_LETTERS_HELD_MAX, self.intake.budget.size,
                          format_key(self.config.dead_letter_queue),
                          extra={"event": "dead_letters_held_max"})

    def _flush_dead_letters(self) -> None:
        """Write the dead letters held, in order. While DEAD.LETTER.Q is full: one retry
        timer for all of them (a trial's flood of 13,000 empty records made one timer and one
        line per dead letter: 25,000 lines a second), soon again while it is being drained
        (every 0.5 s, the queue's room each time, was 4 dead letters of 8 KiB a second,
        every 10 ms 234: the next trials), a line when it fills and one when it takes them
        again."""
        wrote = 0
        while self._dead_letter_backlog:
            held = self._dead_letter_backlog[0]
            record, seq, data = held
            if data is None:
                # Encoded (its payload spilled, if need be) only now that it is next, so
                # that of those held only this one has a spill file: a kill -9 while
                # DEAD.LETTER.Q is full leaves at most one behind, not one per record held.
                try:
                    data = held[2] = self.dead_letters.encode(record)
                except OSError as exc:  # (it stopped the agent, exit 70, and lost the record)
                    self._cannot_spill(exc)
                    return
                if self._spill_trouble is not None:
                    self._spill_trouble = None
                    log.warning("spill files of dead letters can be written again in %s",
                                self.dead_letters.spill_dir)
            if not self.dead_letters.try_put(data):
                if self._dead_letters_full_since is None:
                    self._dead_letters_full_since = self.loop.time()
                    self._dead_letters_full_why = self.dead_letters.unmade or "full"
                    log.error("DEAD.LETTER.Q %s is %s: dead letters are held in memory "
                              "until it takes them (rqpctl status counts them), tried again "
                              "at least every %gs", format_key(self.config.dead_letter_queue),
                              "full" if self.dead_letters.unmade is None else
                              "gone (" + self.dead_letters.unmade + ")",
                              DEAD_LETTER_RETRY, extra={"event": "dead_letter_queue_full"})
                if wrote:
                    self._dead_letter_delay = DEAD_LETTER_AGAIN
                self._retry_dead_letters(self._dead_letter_delay)
                return
            wrote += 1
            self.stats["dead_lettered"] += 1  # (written: those lost at a stop are not)
            if len(self._dead_letter_backlog) > DEAD_LETTERS_HELD_MAX:  # (its place given back)
                self.intake.budget.give(1)
            self._dead_letter_backlog.popleft()
            if isinstance(seq, tuple):
                self._copies_done.append(seq)
            elif seq is not None:
                self._releases.append(seq)
        if self._dead_letters_full_since is not None:
            log.warning("DEAD.LETTER.Q %s takes dead letters again: every one held is written "
                        "(it was %s for %.1fs)", format_key(self.config.dead_letter_queue),
                        "full" if self._dead_letters_full_why == "full" else
                        "gone, and could not be made again",  # (a re-check: "full", of that)
                        self.loop.time() - self._dead_letters_full_since)
            self._dead_letters_full_since = None
            self._dead_letters_capped = False
        if self._dead_letter_retry is not None:
            self._dead_letter_retry.cancel()
            self._dead_letter_retry = None
        self._dead_letter_delay = DEAD_LETTER_AGAIN
        self._release_journaled()

    def _cannot_spill(self, exc: OSError) -> None:
        """The next dead letter held needs a spill file (its record is larger than one
        System V message) and it cannot be written: it and those behind it stay held, in
        order, tried again as while DEAD.LETTER.Q is full (a SURE message among them stays
        journaled until its record is written)."""
        why = f"cannot write a spill file in {self.dead_letters.spill_dir}: " + (
            exc.strerror or str(exc))
        if self._spill_trouble != why:
            self._spill_trouble = why
            log.error("%s -- dead letters are held in memory until it can (rqpctl status "
                      "counts them), tried again at least every %gs", why, DEAD_LETTER_RETRY,
                      extra={"event": "dead_letter_spill_failed"})
        self._retry_dead_letters(self._dead_letter_delay)

    def _retry_dead_letters(self, delay: float) -> None:
        """One timer for every dead letter held: made, or made sooner."""
        when = self.loop.time() + delay
        timer = self._dead_letter_retry
        if timer is not None and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._dead_letter_retry = self.loop.call_at(when, self._retry_fired)

    def _retry_fired(self) -> None:
        self._dead_letter_retry = None
        # twice as long if none goes this time (a try that writes some starts again short)
        self._dead_letter_delay = min(self._dead_letter_delay * 2, DEAD_LETTER_RETRY)
        self._flush_dead_letters()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rqp-sender", description=__doc__.splitlines()[0])
    add_version(parser)
    parser.add_argument("--rqprc", metavar="FILE",
                        help="the .rqprc to use (default: $RQPRC, ./.rqprc, ~/.rqprc, "
                        "/etc/rqp/rqprc)")
    parser.add_argument("--check", action="store_true",
                        help="read the .rqprc and its TLS files as a start would, say what would "
                        "run (exit 0) or why it would not (exit 1), and start nothing")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, log_format=args.log_format)
    if args.check:
        return check_only(log, lambda: _check(load_sender_config(args.rqprc)))
    return run_daemon(log, lambda: Sender(load_sender_config(args.rqprc)))


def _check(config: SenderConfig) -> str:
    """What Sender() refuses before it makes anything, and what would run."""
    problem = config.transport_problem()
    if problem:
        raise RQPError(problem)
    _tls_contexts(config)  # (the files read and checked: their warnings logged)
    hosts = [f"{h} ({'TLS' if config.tls_for(h) is not None else 'plaintext'})"
             for h in config.hosts]
    return (f"{config.source}: a sending MCA for transmission queue "
            f"{format_key(config.transmission_queue)} would send to {', '.join(hosts)}; "
            f"state_dir {config.state_dir}")

if __name__ == "__main__":
    sys.exit(main())
