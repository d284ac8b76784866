"""The receiving MCA's side of the local queues: whether a queue is offered (the config's one
decision, plus: it exists, this process may write it and it is no transmission queue), and
putting a message there with a bounded retry while it is full. An error that stops a put
carries its dead-letter reason."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable

from rqp.config import ReceiverConfig
from rqp.protocol.constants import DEFAULT_MTYPE
from rqp.protocol.errors import MessageTooBig, QueueError, QueueFull, QueueNotFound
from rqp.protocol.reasons import ReasonCode
from rqp.system.queues import (
    AccessStatus, LocalQueue, format_key, list_queues, may_write, may_write_every_queue,
    write_access,
)
from rqp.system.service import is_agent_queue
from rqp_agents.daemon import RateLimitedLog

__all__ = ["LocalDelivery", "NO_WAITING"]

#: True in a task whose requests may not wait for room (Receiver._linger: what came after
#: the receiving MCA ended its side of a connection, which must not be put after what its
#: sender sent next): a full queue is QUEUE_FULL at once, for a put, a batch's room and a
#: dead letter alike (every wait for room is :meth:`LocalDelivery.retrying`).
NO_WAITING: contextvars.ContextVar[bool] = contextvars.ContextVar("rqp_no_waiting",
                                                                  default=False)
#: Why, in a dead letter's detail.
NOT_WAITED = ("not waited for: it came after the receiving MCA had closed the connection, and "
              "could not wait for room without coming after later messages")

#: Queue keys whose decision (offered or not) is remembered, for a second each; beyond, all
#: are forgotten. With 4,096, messages spread over 5,000 keys were decided again each one
#: (the keys cycle beyond the bound) and the receiving MCA spent 32.5 µs a message against
#: 20.9 (``scripts/bench --scale --sweeps keys --keys 5000``). About 2.5 MB when full.
ALLOWED_MEMORY = 16384

log = logging.getLogger("rqp.receiver")


class LocalDelivery:
    """Puts messages in this host's queues for a receiving MCA configured by ``config``
    (replace :attr:`config` on reload: the retry settings are read at each put)."""

    def __init__(self, config: ReceiverConfig, log_limit: tuple[float, int]) -> None:
        """``log_limit``: (interval, burst) of the "full: retrying" lines, which a peer
        sending to a full queue causes one a message."""
        self._full_log = RateLimitedLog(log, *log_limit, what="waits for a full queue")
        self._allowed_keys: dict[int, tuple[bool, float]] = {}  # key -> (allowed, until)
        self.config = config
        #: False when this process may write into every queue of the host (root,
        #: CAP_IPC_OWNER): then only what offer.allow lists is offered, never "every writable
        #: queue".
        self.privileged = may_write_every_queue()
        self._queues: dict[int, LocalQueue] = {}

    @property
    def config(self) -> ReceiverConfig:
        return self._config

    @config.setter
    def config(self, config: ReceiverConfig) -> None:  # (a reload: decide every key again)
        self._config = config
        self._allowed_keys.clear()

    def _allowed(self, queue_key: int) -> bool:
        """The config offers it, and it is no sending MCA's transmission queue or
        DEAD.LETTER.Q on this host: a record put in the one from the network would be relayed
        by the local sending MCA as its own, in the other archived and replayed as a dead
        letter (decided at most once a second per key; at once again after a reload)."""
        now = time.monotonic()
        known = self._allowed_keys.get(queue_key)
        if known is not None and now < known[1]:
            return known[0]
        allowed = self.offer_default and self.config.offers(queue_key) and \
            not is_agent_queue(queue_key)
        if len(self._allowed_keys) > ALLOWED_MEMORY:
            self._allowed_keys.clear()
        self._allowed_keys[queue_key] = (allowed, now + 1.0)
        return allowed

    @property
    def offer_default(self) -> bool:
        """Whether, with no offer.allow, every writable queue is offered (not so as root)."""
        return not self.privileged or self.config.offer_allow is not None

    @property
    def put_budget(self) -> float:
        return self.config.put_retry_count * self.config.put_retry_interval

    def offers(self, queue_key: int) -> bool:
        """QUEUE_YES exactly when the config offers the queue, and it exists and may be
        written."""
        if not self._allowed(queue_key):
            return False
        try:
            return may_write(queue_key)
        except QueueError as exc:
            log.warning("queue %s: cannot tell whether it is writable: %s",
                        format_key(queue_key), exc)
            return False

    def why_not_offered(self, queue_key: int, info=None) -> tuple[str, bool]:
        """Why :meth:`offers` says no, and whether it is the queue's permissions (what an
        operator must mend: the queue exists, and this agent may not write it). ``info``:
        the queue's line of /proc/sysvipc/msg, if read already (a status lists them all)."""
        if is_agent_queue(queue_key) or queue_key == self.config.dead_letter_queue:
            return "an agents' own queue (transmission queue, DEAD.LETTER.Q): never offered", \
                False
        if not self.offer_default:
            return "not in offer.allow (as root only the queues it names are offered)", False
        if not self._allowed(queue_key):
            return "not offered by the config (offer)", False
        try:
            access = write_access(queue_key)
        except QueueError as exc:
            return f"cannot tell whether it is writable: {exc}", False
        if access.status is AccessStatus.NOT_FOUND:
            return "it does not exist (the program that reads it creates it)", False
        owner = next((f"; /proc/sysvipc/msg: uid {q.uid} gid {q.gid}, mode {q.mode:03o}"
                      for q in ([info] if info is not None else list_queues())
                      if q.key == queue_key), "")
        return f"this agent may not write it ({access.reason}{owner})", \
            access.status is AccessStatus.NO_PERMISSION

    def _queue(self, key: int) -> LocalQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = LocalQueue.open(key)
        return queue

    async def retrying(self, attempt: Callable[[], bool], budget: float, what: str) -> None:
        """Put without blocking the loop: ``attempt()`` puts without waiting and says whether it
        did; while the queue is full, try again (waits doubling from 5 ms up to
        ``put_retry_interval``) until ``budget`` seconds have passed, then raise QueueFull
        (at once under NO_WAITING)."""
        if NO_WAITING.get():
            budget = 0.0
        deadline = None
        wait = 0.005
        while not attempt():
            now = time.monotonic()
            if deadline is None:
                deadline = now + budget
                if budget > 0:
                    self._full_log.report("%s full: retrying for up to %gs", logging.INFO,
                                          what, budget)
            if now >= deadline:
                raise QueueFull(f"{what} is full")
            await asyncio.sleep(min(wait, deadline - now))
            wait = min(wait * 2, self.config.put_retry_interval)

    async def reserve(self, needs: dict[int, tuple[int, int]], expires_at_ms: int = 0
                      ) -> tuple[ReasonCode, str, int | None] | None:
        """Wait (as a put waits for a full queue) until each queue key of ``needs`` has room
        for that many (bytes, messages), so that a batch is put whole; None, or why not and
        for which key. ``expires_at_ms``: the batch's first expiry (0: none); reached while
        it waits, the batch is EXPIRED (key None). (Another writer may still fill a queue
        between this and the puts.)"""
        for key, (need, count) in needs.items():
            name = f"queue {format_key(key)}"
            try:
                queue = self._queue(key)
                holds = queue.stat().max_size
                if need > holds or count > holds:
                    return (ReasonCode.MESSAGE_TOO_BIG,
                            f"the batch needs {need} bytes of {name}, which holds at most "
                            f"{holds} (msg_qbytes)" if need > holds else
                            f"the batch's {count} messages are more than {name} holds at "
                            f"most: {holds} (msg_qbytes, which the kernel counts messages "
                            "against too)", key)
                await self.retrying(_unexpired(lambda: queue.fits(need, count), expires_at_ms),
                                    self.put_budget,
                                    f"{name} (room for a batch of {need} bytes)")
            except Expired as exc:
                return ReasonCode.EXPIRED, f"{exc} while the batch waited for room in {name}", \
                    None
            except QueueFull:
                return (ReasonCode.QUEUE_FULL, f"{name} had no room for the batch's {need} "
                        f"bytes and {count} message{'' if count == 1 else 's'} "
                        + (f"({NOT_WAITED})" if NO_WAITING.get() else
                           f"within {self.put_budget:g}s"), key)
            except (QueueError, MessageTooBig) as exc:
                self._queues.pop(key, None)
                return exc.reason, str(exc), key
        return None

    def put_at_once(self, message) -> bool:
        """The common case, without waiting: True when the message is in its queue now (one
        msgsnd on a queue opened before). False when :meth:`put` must decide: the queue not
        opened yet, full, gone, not offered; then nothing was put."""
        key = message.queue_key
        queue = self._queues.get(key)
        if queue is None or not self._allowed(key):
            return False
        try:
            queue.put(message.message, mtype=getattr(message, "mtype", DEFAULT_MTYPE),
                      block=False)
        except (QueueError, MessageTooBig):
            return False  # full, gone, ...: put() tries again and says what to do
        return True

    async def put(self, message) -> tuple[ReasonCode | None, str]:
        """Put the message in its queue; (None, "") or why not."""
        if self.put_at_once(message):
            return None, ""
        key = message.queue_key
        name = f"queue {format_key(key)}"
        if not self._allowed(key):
            return ReasonCode.QUEUE_NOT_OFFERED, f"{name} is not offered here"
        for fresh in (key not in self._queues, True):
            try:
                await self.retrying(_unexpired(_putter(self._queue(key), message.message,
                                                       getattr(message, "mtype", DEFAULT_MTYPE)),
                                               getattr(message, "expires_at_ms", 0)),
                                    self.put_budget, f"{name} (key={message.key:#018x})")
                return None, ""
            except Expired as exc:
                return ReasonCode.EXPIRED, f"{exc} while it waited for room in {name}"
            except QueueNotFound as exc:
                self._queues.pop(key, None)
                if fresh:  # not a stale handle of a queue removed and created again
                    return exc.reason, str(exc)
            except QueueFull as exc:
                return exc.reason, (
                    f"{name} still full after {self.put_budget:g}s "
                    f"({self.config.put_retry_count} x {self.config.put_retry_interval:g}s)"
                    if not NO_WAITING.get() else f"{name} full ({NOT_WAITED})")
            except (QueueError, MessageTooBig) as exc:  # each error carries its reason
                if isinstance(exc, QueueError):
                    self._queues.pop(key, None)
                return exc.reason, str(exc)
        raise AssertionError("unreachable")  # pragma: no cover


class Expired(Exception):
    """A message's expiry (spec section 6) came while it waited for room."""


def _unexpired(attempt: Callable[[], bool], expires_at_ms: int) -> Callable[[], bool]:
    """``attempt``, tried only while ``expires_at_ms`` (Unix ms, by this host's clock; 0:
    never) is not reached, else :class:`Expired`: a message waiting for room in a full queue
    is not put after its expiry (a trial's was put 175 ms after it; with the default retry
    budget it could have been 10 s)."""
    if not expires_at_ms:
        return attempt

    def unexpired() -> bool:
        now = time.time_ns() // 1_000_000
        if now >= expires_at_ms:
            raise Expired(f"expired {(now - expires_at_ms) / 1000:.3f}s ago by this host's "
                          f"clock (expires_at_ms {expires_at_ms})")
        return attempt()
    return unexpired


def _putter(queue: LocalQueue, data: bytes, mtype: int) -> Callable[[], bool]:
    """An attempt for :meth:`LocalDelivery.retrying`: put ``data`` on ``queue`` (with System V
    type ``mtype``: a MESSAGE_EX's, else 1) now, or say it is full."""
    def attempt() -> bool:
        try:
            queue.put(data, mtype=mtype, block=False)
        except QueueFull:
            return False
        return True
    return attempt
