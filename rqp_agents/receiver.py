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
import logging
import os
import sys
import time
from pathlib import Path

from rqp import SURE_MSG, RQPError
from rqp.cli import add_log_level, listen_address
from rqp.config import ReceiverConfig, load_receiver_config, parse_host
from rqp.protocol.constants import DEFAULT_MTYPE
from rqp.protocol.errors import (
    LocalProtocolError, MessageTooBig, QueueError, QueueFull, QueueNotFound,
)
from rqp.protocol.events import OversizedMessage
from rqp.protocol.frames import CLOSED, NEED_DATA
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.receiver import Ask, ReceiverConnection, Refuse
from rqp.protocol.records import AgentKind, DeadLetterFlags, DeadLetterRecord
from rqp.storage.deadletters import DeadLetterWriter
from rqp.storage.dedup import DedupWindow, window_path
from rqp.system.control import Metric, default_socket, render
from rqp.system.queues import LocalQueue, format_key, kernel_limits, list_queues, write_access
from rqp.system.service import host_name, setup_logging
from rqp_agents.daemon import Daemon, run_daemon

log = logging.getLogger("rqp.receiver")

READ_SIZE = 1 << 16
#: Answers are written (and the de-duplication window committed, one fsync) at least every
#: this many requests. It bounds the duplicate window: a receiving MCA killed between putting
#: messages and committing their keys puts at most this many per connection again.
ANSWER_BATCH = 64
#: SURE message keys already dead-lettered (spec 5.10: one notice per key), most recent kept.
NOTICE_MEMORY = 100_000


class DeadLetterUnavailable(RQPError):
    """Even DEAD.LETTER.Q cannot take the record: the message must stay with its sender."""


class Receiver(Daemon):
    """The receiving MCA: one asyncio server, one task per connection."""

    stop_note = "no new connections; answering what is in flight"

    def __init__(self, config: ReceiverConfig) -> None:
        super().__init__(log)
        self.config = config
        self.host = config.host_name or host_name()
        self.msgmax = kernel_limits().msgmax
        self.max_message_size = config.max_message_size or self.msgmax
        self.dead_letters = DeadLetterWriter(config.dead_letter_queue,
                                             Path(config.state_dir) / "spill", msgmax=self.msgmax)
        state = Path(config.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        # SURE repeats (same key) are answered without a second put, within this window.
        self.dedup = DedupWindow(window_path(state), max_keys=config.dedup_window_keys,
                                 max_age=config.dedup_window_age)
        for problem in self.dedup.problems:
            log.warning("de-duplication window %s: %s", window_path(state), problem)
        self._putting: dict[int, asyncio.Event] = {}  # SURE keys being put right now
        self._queues: dict[int, LocalQueue] = {}
        self._noticed: dict[int, None] = {}
        self._connections: set[asyncio.Task] = set()
        self._idle: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self.put_budget = config.put_retry_count * config.put_retry_interval
        self.started = time.time()
        self.control_path = Path(config.control_socket) if config.control_socket else \
            default_socket(state, "receiver")
        self._peers: dict[asyncio.Task, dict] = {}  # per connection: peer, since, counts
        self.by_queue: dict[tuple[int, str], int] = collections.Counter()
        self.bytes_by_queue: dict[int, int] = collections.Counter()
        self.stats = {"connections": 0, "messages": 0, "asks": 0, "repeats": 0}

    # --- serving ------------------------------------------------------------------------------

    async def run(self) -> None:
        listen = self.config.listen
        self._server = await asyncio.start_server(
            self._serve, listen.host, listen.port, reuse_address=True, limit=READ_SIZE)
        where = ", ".join(str(s.getsockname()[:2]) for s in self._server.sockets)
        log.info("listening on %s; DEAD.LETTER.Q %s; max_message_size %d; host %s", where,
                 format_key(self.config.dead_letter_queue), self.max_message_size, self.host)
        await self.start_service(self.control_path, self.config.metrics_listen)
        self.ready("listening")
        expiry = asyncio.create_task(self._expire_dedup())
        await self.wait_for_stop()
        self._server.close()
        await self._server.wait_closed()
        for task in list(self._idle):  # nothing in flight on these
            task.cancel()
        busy = self._connections - self._idle
        if busy and not self.failed:  # answer what was already received, then close
            await asyncio.wait(busy, timeout=self.put_budget + 5)
        for task in list(self._connections):
            task.cancel()
        expiry.cancel()
        self.stop_service()
        self.dedup.close()
        log.info("stopped: %s", {**self.stats, "dead_letters": self.dead_letters.written})

    # --- reload, status, metrics ---------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: read the config again (offered queues, retries, sizes); connections stay.
        A bad file is refused and the running config kept."""
        if self.config.source is None:
            raise RQPError("started without --config: nothing to reload")
        new = load_receiver_config(self.config.source)
        new = dataclasses.replace(new, listen=self.config.listen,
                                  state_dir=self.config.state_dir)  # command-line values
        if new.dead_letter_queue != self.config.dead_letter_queue:
            raise RQPError("dead_letter_queue cannot change while running: restart the "
                           "receiving MCA for that")
        self.config = new
        self.max_message_size = new.max_message_size or self.msgmax
        self.put_budget = new.put_retry_count * new.put_retry_interval
        log.info("reloaded %s", new.source)

    def offered_queues(self) -> list[dict]:
        out = []
        for q in list_queues():
            if q.key == self.config.dead_letter_queue:
                continue
            out.append({"queue": format_key(q.key), "queue_key": q.key,
                        "name": self.config.queue_name(q.key), "depth": q.messages,
                        "bytes": q.bytes, "mode": f"{q.mode:03o}",
                        "offered": self.offers(q.key)})
        return out

    def _dlq_depth(self) -> int | None:
        try:
            return self.dead_letters.queue.depth
        except RQPError:
            return None

    def status(self) -> dict:
        return {
            "agent": "receiver", "pid": os.getpid(), "host": self.host,
            "started_at": self.started, "uptime": time.time() - self.started,
            "source": self.config.source, "listen": str(self.config.listen),
            "max_message_size": self.max_message_size,
            "dead_letter_queue": format_key(self.config.dead_letter_queue),
            "dead_letter_queue_depth": self._dlq_depth(),
            "dedup_window_keys": len(self.dedup),
            "connections": sorted(self._peers.values(), key=lambda p: p["since"]),
            "queues": self.offered_queues(),
            "stats": {**self.stats, "dead_letters": self.dead_letters.written},
            "dead_letters": dict(self.dead_letters.by_reason), "now": time.time(),
        }

    def metrics(self) -> str:
        m = {name: Metric(name, kind, text) for name, kind, text in (
            ("rqp_receiver_messages_total", "counter", "MESSAGE frames, by queue and outcome"),
            ("rqp_receiver_bytes_total", "counter", "payload bytes put, by queue"),
            ("rqp_receiver_asks_total", "counter", "QUEUE_ASK frames answered"),
            ("rqp_receiver_connections", "gauge", "connections from sending MCAs"),
            ("rqp_receiver_connections_total", "counter", "connections accepted"),
            ("rqp_dead_letters_total", "counter", "dead letters written here, by reason"),
            ("rqp_dead_letter_queue_depth", "gauge", "records on DEAD.LETTER.Q"),
            ("rqp_receiver_queue_depth", "gauge", "messages waiting in each local queue"),
            ("rqp_receiver_queue_offered", "gauge", "1 if the queue is offered to askers"),
            ("rqp_up_seconds", "gauge", "seconds since the agent started"))}
        for (key, outcome), count in sorted(self.by_queue.items()):
            m["rqp_receiver_messages_total"].add(count, queue=format_key(key), outcome=outcome)
        for key, count in sorted(self.bytes_by_queue.items()):
            m["rqp_receiver_bytes_total"].add(count, queue=format_key(key))
        m["rqp_receiver_asks_total"].add(self.stats["asks"])
        m["rqp_receiver_connections"].add(len(self._peers))
        m["rqp_receiver_connections_total"].add(self.stats["connections"])
        for reason, count in sorted(self.dead_letters.by_reason.items()):
            m["rqp_dead_letters_total"].add(count, reason=reason)
        depth = self._dlq_depth()
        if depth is not None:
            m["rqp_dead_letter_queue_depth"].add(depth)
        for q in self.offered_queues():
            m["rqp_receiver_queue_depth"].add(q["depth"], queue=q["queue"])
            m["rqp_receiver_queue_offered"].add(int(q["offered"]), queue=q["queue"])
        m["rqp_up_seconds"].add(round(time.time() - self.started, 3))
        return render(list(m.values()))

    async def _expire_dedup(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.dedup.expire()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        peer_host = peer[0] if peer else "?"
        self.stats["connections"] += 1
        self._peers[task] = info = {"peer": _peer(peer), "since": time.time(), "messages": 0,
                                    "dead_letters": 0, "asks": 0}
        log.info("connection from %s", _peer(peer))
        conn = ReceiverConnection(max_message_size=self.max_message_size)
        try:
            while True:
                self._idle.add(task)  # waiting for bytes: nothing in flight
                try:
                    data = await reader.read(READ_SIZE)
                finally:
                    self._idle.discard(task)
                conn.receive_data(data)
                answers = []
                try:
                    while (request := conn.next_request()) not in (NEED_DATA, CLOSED):
                        answers.append(await self._handle(conn, request, peer_host, info))
                        if len(answers) >= ANSWER_BATCH:
                            self._answer(writer, answers)
                            answers = []
                finally:  # whatever happens next, what was answered is sent, in order
                    if answers:
                        self._answer(writer, answers)
                await writer.drain()
                if request is CLOSED:
                    log.info("connection from %s closed", _peer(peer))
                    break
                if self._stopping.is_set():  # what was in flight is answered: done
                    log.info("closing connection from %s: stopping", _peer(peer))
                    break
        except asyncio.CancelledError:  # stopping while it waited for bytes: nothing in flight
            log.info("closing connection from %s: stopping", _peer(peer))
        except LocalProtocolError as exc:  # this agent misused its own core: a bug
            self.fatal(f"the connection from {_peer(peer)}", exc)
        except RQPError as exc:
            log.warning("closing connection from %s: %s", _peer(peer), exc)
        except (ConnectionError, OSError) as exc:
            log.info("connection from %s lost: %s", _peer(peer), exc)
        except Exception as exc:  # noqa: BLE001 - anything else is unexpected: stop
            self.fatal(f"the connection from {_peer(peer)}", exc)
        finally:
            writer.close()
            self._connections.discard(task)
            self._peers.pop(task, None)

    def _answer(self, writer: asyncio.StreamWriter, answers: list[bytes]) -> None:
        """Write a batch of answers once the SURE keys it confirms are durable (one fsync)."""
        self.dedup.commit()
        writer.write(b"".join(answers))

    async def _handle(self, conn: ReceiverConnection, request, peer: str, info: dict) -> bytes:
        if isinstance(request, Ask):
            self.stats["asks"] += 1
            info["asks"] += 1
            offered = self.offers(request.queue_key)
            log.debug("QUEUE_ASK queue=%s from=%s: %s", format_key(request.queue_key), peer,
                      "QUEUE_YES" if offered else "QUEUE_NO")
            return conn.answer_ask(request, offered)
        if isinstance(request, Refuse):
            if request.dead_letter:
                await self._dead_letter(request.message, request.reason, request.detail, peer)
                info["dead_letters"] += 1
            return conn.answer_put(request, False)
        message = request.message
        if message.message_type != SURE_MSG:
            reason, detail = await self._put(message)
        else:
            key = message.key
            while key in self._putting:  # the same message on another connection, just now
                await self._putting[key].wait()
            if self.dedup.seen(key):
                self.stats["repeats"] += 1
                self.by_queue[(message.queue_key, "repeat")] += 1
                log.info("repeat of SURE message key=%#018x for queue %s from %s: answered "
                         "without putting it again", key, format_key(message.queue_key), peer)
                return conn.answer_put(request, True)
            self._putting[key] = done = asyncio.Event()
            try:
                reason, detail = await self._put(message)
                if reason is None:
                    self.dedup.record(key)  # made durable before the answer is written
            finally:
                del self._putting[key]
                done.set()
        if reason is None:
            self.stats["messages"] += 1
            info["messages"] += 1
            self.by_queue[(message.queue_key, "put")] += 1
            self.bytes_by_queue[message.queue_key] += len(message.message)
            return conn.answer_put(request, True)
        await self._dead_letter(message, reason, detail, peer)
        info["dead_letters"] += 1
        self.by_queue[(message.queue_key, "dead_lettered")] += 1
        return conn.answer_put(request, False)

    # --- decisions that need the system -------------------------------------------------------

    def offers(self, queue_key: int) -> bool:
        """QUEUE_YES exactly when the queue exists, may be written, and the config allows it."""
        if not self.config.offers(queue_key):
            return False
        try:
            return write_access(queue_key).writable
        except QueueError as exc:
            log.warning("queue %s: cannot tell whether it is writable: %s",
                        format_key(queue_key), exc)
            return False

    def _queue(self, key: int) -> LocalQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = LocalQueue.open(key)
        return queue

    async def _put_retrying(self, attempt, budget: float, what: str) -> None:
        """Put without blocking the loop: ``attempt()`` puts without waiting and says whether it
        did; while the queue is full, try again (waits doubling from 5 ms up to
        ``put_retry_interval``) until ``budget`` seconds have passed, then raise QueueFull."""
        deadline = None
        wait = 0.005
        while not attempt():
            now = time.monotonic()
            if deadline is None:
                deadline = now + budget
                log.info("%s full: retrying for up to %gs", what, budget)
            if now >= deadline:
                raise QueueFull(f"{what} is full")
            await asyncio.sleep(min(wait, deadline - now))
            wait = min(wait * 2, self.config.put_retry_interval)

    async def _put(self, message) -> tuple[ReasonCode | None, str]:
        """Put the message in its queue; (None, "") or why not."""
        key = message.queue_key
        name = f"queue {format_key(key)}"
        if not self.config.offers(key):
            return ReasonCode.QUEUE_NOT_OFFERED, f"{name} is not offered here"
        for fresh in (key not in self._queues, True):
            try:
                await self._put_retrying(_putter(self._queue(key), message.message),
                                         self.put_budget, f"{name} (key={message.key:#018x})")
                return None, ""
            except QueueNotFound as exc:
                self._queues.pop(key, None)
                if fresh:  # not a stale handle of a queue removed and created again
                    return exc.reason, str(exc)
            except QueueFull as exc:
                return exc.reason, (
                    f"{name} still full after {self.put_budget:g}s "
                    f"({self.config.put_retry_count} x {self.config.put_retry_interval:g}s)")
            except (QueueError, MessageTooBig) as exc:  # each error carries its reason
                if isinstance(exc, QueueError):
                    self._queues.pop(key, None)
                return exc.reason, str(exc)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _dead_letter(self, message, reason: ReasonCode, detail: str, peer: str) -> None:
        sure = message.message_type == SURE_MSG
        if sure and message.key in self._noticed:
            log.info("dead letter (repeat, not written again) reason=%s queue=%s key=%#018x "
                     "from=%s", reason.name, format_key(message.queue_key), message.key, peer)
            return
        header_only = isinstance(message, OversizedMessage)
        record = DeadLetterRecord(
            reason=reason, message_type=message.message_type, agent=AgentKind.RECEIVER,
            flags=DeadLetterFlags.HEADER_ONLY if header_only else 0,
            queue_key=message.queue_key, message_key=message.key, attempts=1,
            original_length=message.message_length, host=self.host, source_host=peer,
            destination_host=self.host, detail=detail,
            payload=b"" if header_only else message.message)
        try:
            data = self.dead_letters.encode(record)
            await self._put_retrying(lambda: self.dead_letters.try_put(data), 1.0,
                                     "DEAD.LETTER.Q")
        except (RQPError, OSError) as exc:
            log.error("DEAD.LETTER.Q %s cannot take the dead letter of key=%#018x "
                      "(queue %s, reason %s): %s -- closing the connection unanswered so the "
                      "sender keeps the message", format_key(self.config.dead_letter_queue),
                      message.key, format_key(message.queue_key), reason.name, exc)
            raise DeadLetterUnavailable(str(exc)) from exc
        if sure:
            self._noticed[message.key] = None
            if len(self._noticed) > NOTICE_MEMORY:
                del self._noticed[next(iter(self._noticed))]
        log.warning("dead letter reason=%s queue=%s key=%#018x type=%s from=%s: %s", reason.name,
                    format_key(message.queue_key), message.key,
                    "SURE" if sure else "UNSURE", peer, detail)


def _putter(queue: LocalQueue, data: bytes):
    """An attempt for :meth:`Receiver._put_retrying`: put ``data`` on ``queue`` now, or say it
    is full."""
    def attempt() -> bool:
        try:
            queue.put(data, mtype=DEFAULT_MTYPE, block=False)
        except QueueFull:
            return False
        return True
    return attempt


def _peer(peer) -> str:
    if not peer:
        return "?"
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rqp-receiver", description=__doc__.splitlines()[0])
    parser.add_argument("--config", metavar="FILE", help="receiver YAML config (default: none; "
                        "documented defaults)")
    parser.add_argument("--listen", metavar="HOST:PORT", type=listen_address,
                        help="overrides the config's listen (':PORT': every address)")
    parser.add_argument("--state-dir", metavar="DIR", help="overrides the config's state_dir")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    def build() -> Receiver:
        config = load_receiver_config(args.config)
        changes = {}
        if args.listen:
            changes["listen"] = parse_host(args.listen, config.listen.port)
        if args.state_dir:
            changes["state_dir"] = args.state_dir
        return Receiver(dataclasses.replace(config, **changes))

    return run_daemon(log, build)

if __name__ == "__main__":
    sys.exit(main())
