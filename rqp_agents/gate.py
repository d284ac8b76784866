"""The receiving MCA's door (spec section 7): who gets a connection, who they are, what they
may use.

A connection is let in when the limits leave room for it (``max_connections`` in all,
``max_connections_per_source`` from one address; when all are taken, the receiving MCA may
close one that waits for its peer, first of an address holding more); on a TLS port it must then finish a TLS
handshake within ``handshake_timeout``, with a client certificate from the configured CA and
ALPN ``rqp/1``. What the peer may use is the first ``peers:`` rule matching it
(:func:`rqp.protocol.access.grant_for`). Every refusal is counted, and logged at most once per
interval: the network must not be able to fill the log.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import Callable

from rqp.config import ReceiverConfig
from rqp.protocol.access import Allowance, DeadLetterBudget, Grant, Peer, grant_for
from rqp.protocol.errors import RQPError
from rqp.system.service import release_free_memory
from rqp.system.tls import ALPN, TLSFileError, bound_read_buffers, check_files, \
    handshake_problem, peer_names, server_context
from rqp_agents.daemon import KeyedRateLimitedLog, RateLimitedLog

__all__ = ["Gate"]

log = logging.getLogger("rqp.receiver")

#: Refusals of each kind are logged at most once per this many seconds.
REFUSAL_LOG_INTERVAL = 10.0
#: Grants remembered per peer (recomputed after a reload); cleared beyond this many.
GRANT_MEMORY = 4096
#: Distinct labels (peers, handshake failure reasons) counted apart; more go under "other",
#: so that a flood from many addresses cannot grow the counters or the metrics without bound.
COUNTER_LABELS = 256
#: Once this many connections were open at once and three quarters of them are gone, the
#: memory they held is given back to the system TRIM_DELAY seconds later (their transports
#: closed by then).
TRIM_AFTER = 64
TRIM_DELAY = 1.0
#: When every connection slot is taken, a new connection is let in by closing one that waits
#: for its peer (for bytes with nothing in flight, or for its answers to be read): from an
#: address holding more connections than the newcomer's would, or else one that has waited
#: this long or longer (the receiving MCA's ``_make_room``).
EVICT_IDLE = 1.0


def _count(counter: collections.Counter, label: str) -> None:
    if label not in counter and len(counter) >= COUNTER_LABELS:
        label = "other"
    counter[label] += 1


class Gate:
    """Connection limits, the TLS handshake and authorisation of one receiving MCA."""

    def __init__(self, config: ReceiverConfig) -> None:
        self.config = config
        self.context = self._context(config)
        self.by_source: collections.Counter[str] = collections.Counter()  # open, per address
        self.open = 0
        self._most = 0  # the most open at once since the last trim of the heap
        self._trim: asyncio.TimerHandle | None = None
        #: Connections closed at once by a limit, handshakes failed (by reason), and requests
        #: refused because the peer may not use the queue (by peer label).
        self.refused_connections = 0
        self.handshake_failures: collections.Counter[str] = collections.Counter()
        self.denied: collections.Counter[str] = collections.Counter()
        #: Dead letters written header-only, and not written, for being over the peer's budget.
        self.header_only: collections.Counter[str] = collections.Counter()
        self.suppressed: collections.Counter[str] = collections.Counter()
        self._budget = DeadLetterBudget(config.dead_letter_rate, config.dead_letter_burst)
        # (per peer, and per reason: one peer's or one reason's flood hides no other's)
        self._budget_log = KeyedRateLimitedLog(
            log, REFUSAL_LOG_INTERVAL, what="dead letters of this peer over dead_letter_rate",
            others="dead letters of other peers over dead_letter_rate")
        self._grants: dict[Peer, Grant] = {}
        self._limit_log = RateLimitedLog(log, REFUSAL_LOG_INTERVAL,
                                         what="connections refused by limits")
        self._handshake_log = KeyedRateLimitedLog(
            log, REFUSAL_LOG_INTERVAL, what="failed handshakes for this reason",
            others="failed handshakes for other reasons")
        self._denied_log = KeyedRateLimitedLog(
            log, REFUSAL_LOG_INTERVAL, what="requests of this peer denied by peers rules",
            others="requests of other peers denied by peers rules")

    @staticmethod
    def _context(config: ReceiverConfig) -> ssl.SSLContext | None:
        """The TLS context of ``config`` (its files checked first, warnings logged)."""
        if config.tls is None:
            return None
        bound_read_buffers()  # (each connection's, from its handshake on)
        for warning in check_files(config.tls):
            log.warning("%s", warning)
        return server_context(config.tls)

    def reload(self, config: ReceiverConfig) -> None:
        """Take a new config: new certificates and rules apply to what comes next; connections
        open keep their session. Raises RQPError (and keeps the old) if the files are bad."""
        if (config.tls is None) != (self.config.tls is None):
            raise RQPError("tls cannot be turned on or off while running (a port is either "
                           "TLS or plaintext): restart the receiving MCA for that")
        try:
            context = self._context(config)
        except TLSFileError as exc:
            raise RQPError(f"certificates not reloaded: {exc}") from None
        self.config, self.context = config, context
        self._grants.clear()
        self._budget.rate, self._budget.burst = config.dead_letter_rate, config.dead_letter_burst

    # --- limits ---------------------------------------------------------------------------

    def enter(self, source: str, make_room: Callable[[str], bool] | None = None) -> bool:
        """Count a new connection from ``source`` in, or refuse it (False) when a limit is
        reached; each one let in must :meth:`leave`. When only ``max_connections`` stands in
        the way, ``make_room(source)`` may close an idle connection for it (True): the new one
        is let in at once, the one closed leaves within a turn of the loop."""
        why = None
        if self.by_source[source] >= self.config.max_connections_per_source:
            why = (f"{self.by_source[source]} open from {source}, max_connections_per_source "
                   f"{self.config.max_connections_per_source}")
        elif self.open >= self.config.max_connections and (make_room is None or
                                                            not make_room(source)):
            most = self.config.max_connections
            why = (f"{most} open" + (f" ({self.open - most} more closing)"
                                     if self.open > most else "")
                   + f", max_connections {most}" + (
                       f"; none to close for it (each busy, or from an address holding no "
                       f"more than {source}'s would, and idle less than {EVICT_IDLE:g}s)"
                       if make_room else ""))
        if why:
            self.refused_connections += 1
            self._limit_log.report(f"refusing connections: {why}")
            return False
        self.open += 1
        self.by_source[source] += 1
        self._most = max(self._most, self.open)
        return True

    def leave(self, source: str) -> None:
        self.open -= 1
        self.by_source[source] -= 1
        if not self.by_source[source]:
            del self.by_source[source]
        if self._most >= TRIM_AFTER and self.open <= self._most // 4 and self._trim is None:
            # many connections gone (a flood): what they held goes back to the system, once
            # their transports are closed too
            self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        self._most = self.open
        release_free_memory()

    # --- who it is --------------------------------------------------------------------------

    async def identify(self, writer: asyncio.StreamWriter, source: str,
                       where: str) -> Peer | None:
        """The peer at the other end: over TLS, after a handshake that must succeed within
        ``handshake_timeout`` (None, counted and logged, if it does not)."""
        context = self.context
        if context is None:
            return Peer(source)
        try:
            await writer.start_tls(context, ssl_handshake_timeout=self.config.handshake_timeout)
        except (ssl.SSLError, OSError, asyncio.TimeoutError, EOFError) as exc:
            self._refuse_handshake(where, _timeout_aware(exc, self.config.handshake_timeout))
            return None
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object.selected_alpn_protocol() != ALPN:
            self._refuse_handshake(where, f"the peer did not negotiate ALPN {ALPN} (not an "
                                          f"RQP sender?)")
            return None
        return Peer(source, peer_names(ssl_object))

    def _refuse_handshake(self, where: str, why: str) -> None:
        _count(self.handshake_failures, why)
        self._handshake_log.report(why, f"refusing the connection from {where}: {why}")

    # --- what it may use --------------------------------------------------------------------

    def grant(self, peer: Peer) -> Grant:
        grant = self._grants.get(peer)
        if grant is None:
            if len(self._grants) >= GRANT_MEMORY:
                self._grants.clear()
            grant = self._grants[peer] = grant_for(self.config.peers, peer)
        return grant

    def allows(self, peer: Peer, queue_key: int) -> bool:
        grant = self.grant(peer)
        return grant.everything or grant.allows(queue_key, self.config.queue_names(queue_key))

    def deny(self, peer: Peer, what: str) -> None:
        """Count and (rate-limited) log a request refused because ``peer`` may not use the
        queue: nothing else of it is kept anywhere."""
        _count(self.denied, peer.label)
        self._denied_log.report(peer.label, f"refused {what} from {peer.label} "
                                            f"({peer.address}): {self.grant(peer).describe()}")


    # --- what its dead letters may cost --------------------------------------------------------

    def dead_letter_allowance(self, peer: Peer, what: str) -> Allowance:
        """How much of a dead letter for ``peer`` may be written now; none is counted, and
        logged at most once per interval, here; header-only is when it was written
        (:meth:`written_header_only`: a trial's status counted 102 "written without their
        payload" that DEAD.LETTER.Q, full, never took)."""
        allowance = self._budget.take(peer.label, time.monotonic())
        if allowance is Allowance.NONE:
            self._over_budget(self.suppressed, peer, what,
                              "not written (answered DELIVERED_ERROR)")
        return allowance

    def not_written(self, peer: Peer) -> None:
        """A dead letter :meth:`dead_letter_allowance` allowed found no room: it costs
        ``peer`` nothing."""
        self._budget.refund(peer.label)

    def written_header_only(self, peer: Peer, what: str) -> None:
        """A dead letter of ``peer`` over its budget was written without its payload."""
        self._over_budget(self.header_only, peer, what, "written without its payload")

    def _over_budget(self, counter: collections.Counter, peer: Peer, what: str,
                     done: str) -> None:
        _count(counter, peer.label)
        self._budget_log.report(
            peer.label,
            f"dead letters from {peer.label} over dead_letter_rate "
            f"{self.config.dead_letter_rate:g}/s (dead_letter_burst "
            f"{self.config.dead_letter_burst}): {what} {done}")


def _timeout_aware(exc: BaseException, timeout: float) -> str:
    # (asyncio says "SSL handshake is taking longer than N seconds" with ConnectionAbortedError)
    if isinstance(exc, (asyncio.TimeoutError, ConnectionAbortedError)) or "timed out" in str(exc):
        return f"TLS handshake not finished within {timeout:g}s (handshake_timeout)"
    if isinstance(exc, (EOFError, ConnectionResetError, BrokenPipeError)) or (
            isinstance(exc, ssl.SSLError) and "EOF" in str(exc)):
        return "the peer closed the connection during the TLS handshake"
    return handshake_problem(exc)

