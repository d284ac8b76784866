"""Who may use which queue (spec section 7): the receiving MCA's ``peers:`` rules. No I/O.

A :class:`Peer` is what the receiver knows of the other end of a connection: its source
address and, over TLS, the names its verified certificate carries (DNS subject-alternative
names, else the common name). :func:`grant_for` finds the first rule that matches it (first
match wins) and returns a :class:`Grant`: which queues that peer may be told ``QUEUE_YES`` for
and put into. Whether a queue is offered at all is the config's and the host's decision
(:meth:`rqp.config.ReceiverConfig.offers`); a grant only ever narrows it.
"""

from __future__ import annotations

import enum
import fnmatch
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Peer", "QueueSet", "PeerRule", "Grant", "grant_for", "identity_pattern_problem",
           "EVERYTHING", "PATTERN_CHARS", "DeadLetterBudget", "Allowance"]

#: A queue list entry with one of these is a pattern over configured queue names.
PATTERN_CHARS = frozenset("*?[")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Peer:
    """The other end of one connection."""

    address: str
    #: The verified certificate's DNS SANs, else its CN; empty for plaintext.
    names: tuple[str, ...] = ()

    @property
    def identity(self) -> str | None:
        return self.names[0] if self.names else None

    @property
    def label(self) -> str:
        """What logs, counters and the de-duplication scope call this peer: its TLS identity,
        else its source address."""
        return self.names[0] if self.names else self.address


def identity_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot name a TLS identity, or None."""
    if not pattern or any(c.isspace() or ord(c) < 32 for c in pattern):
        return "expected a DNS name or common name, '*' matching any characters but '.'"
    return None


def _identity_regex(pattern: str) -> re.Pattern[str]:
    if pattern == "*":  # every authenticated peer
        return re.compile(r".+", re.DOTALL)
    # As in certificate wildcards, '*' stays within one DNS label: '*.prod.example' matches
    # 'a.prod.example' and not 'a.b.prod.example'; 'sender-*' matches 'sender-7'.
    parts = (re.escape(part) for part in pattern.split("*"))
    return re.compile(r"[^.]*".join(parts), re.IGNORECASE)


def _network_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:10.0.0.1 is 10.0.0.1
    return mapped or ip


@dataclass(frozen=True)
class QueueSet:
    """Queues named in a config list (``offer.allow``, a rule's ``queues``): by key, or by a
    configured name matching a pattern (``*`` alone: every queue)."""

    keys: frozenset[int] = frozenset()
    patterns: tuple[str, ...] = ()

    def includes(self, key: int, names: Iterable[str] = ()) -> bool:
        if key in self.keys or "*" in self.patterns:
            return True
        return any(fnmatch.fnmatchcase(name, p) for name in names for p in self.patterns)

    def describe(self) -> str:
        return ", ".join([*self.patterns, *(f"0x{k:08x}" for k in sorted(self.keys))]) \
            or "nothing"


@dataclass(frozen=True)
class PeerRule:
    """One ``peers:`` rule. A peer matches when it has one of ``identities`` (if any are
    given) and comes from one of ``networks`` (if any are given); it may then use
    ``queues``."""

    identities: tuple[str, ...] = ()
    networks: tuple[Network, ...] = ()
    queues: QueueSet = QueueSet()
    #: Where the rule is, for messages: "peers[2]".
    where: str = "peers"
    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regexes", tuple(map(_identity_regex, self.identities)))

    def matches(self, peer: Peer) -> bool:
        if self.identities and not any(r.fullmatch(name) for r in self._regexes
                                       for name in peer.names):
            return False
        if self.networks:
            ip = _network_of(peer.address)
            if ip is None or not any(ip in net for net in self.networks
                                     if net.version == ip.version):
                return False
        return True

    def describe(self) -> str:
        who = [f"identity {', '.join(self.identities)}"] if self.identities else []
        who += [f"network {', '.join(map(str, self.networks))}"] if self.networks else []
        return f"{self.where} ({' from '.join(who) or 'anyone'}): {self.queues.describe()}"


@dataclass(frozen=True)
class Grant:
    """What one peer may use: the rule that matched, or everything offered, or nothing."""

    rule: PeerRule | None
    everything: bool = False

    def allows(self, key: int, names: Iterable[str] = ()) -> bool:
        if self.everything:
            return True
        return self.rule is not None and self.rule.queues.includes(key, names)

    def describe(self) -> str:
        if self.everything:
            return "every offered queue (no peers rules)"
        if self.rule is None:
            return "nothing: no peers rule matches"
        return self.rule.describe()


EVERYTHING = Grant(None, everything=True)
_NOTHING = Grant(None)


def grant_for(rules: tuple[PeerRule, ...] | None, peer: Peer) -> Grant:
    """The first rule matching ``peer`` (first match wins), or nothing. With no rules
    configured (None: ``peers`` unset), every peer the transport let in may use every offered
    queue: over TLS the CA is the trust. An empty list is rules none of which matches: nothing
    (a trial's ``peers: []`` let every peer use every queue)."""
    if rules is None:
        return EVERYTHING
    for rule in rules:
        if rule.matches(peer):
            return Grant(rule)
    return _NOTHING


class Allowance(enum.Enum):
    """What of one dead letter may be written for a peer now."""

    FULL = "full"
    HEADER_ONLY = "header_only"  # the record without its payload
    NONE = "none"  # nothing: only counted


class DeadLetterBudget:
    """Dead letters per peer, so that no peer can fill ``DEAD.LETTER.Q`` (or the disk, with
    spill files) for the others: a token bucket per peer of ``burst`` tokens refilled at
    ``rate`` per second. A dead letter takes a token; with none left it is written header-only
    while the peer's debt is under ``burst``, and not at all beyond. A flood thus costs the
    queue ``burst`` full records, ``burst`` header-only ones, then ``rate`` header-only ones
    a second. Peers are remembered up to ``memory`` at once (the least recent forgotten)."""

    def __init__(self, rate: float, burst: int, memory: int = 4096) -> None:
        self.rate, self.burst, self.memory = rate, burst, memory
        self._buckets: dict[str, tuple[float, float]] = {}  # label -> (tokens, when)

    def take(self, label: str, now: float) -> Allowance:
        tokens, when = self._buckets.pop(label, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.rate)
        if tokens >= 1:
            allowance = Allowance.FULL
        elif tokens > -self.burst:
            allowance = Allowance.HEADER_ONLY
        else:
            allowance = Allowance.NONE
        if allowance is not Allowance.NONE:
            tokens -= 1
        self._buckets[label] = (tokens, now)  # most recent last
        if len(self._buckets) > self.memory:
            del self._buckets[next(iter(self._buckets))]
        return allowance

    def refund(self, label: str) -> None:
        """Give back the token of a dead letter :meth:`take` allowed that could not be
        written (``DEAD.LETTER.Q`` had no room): only what is written spends the budget, else
        a peer's SURE messages retried into a full queue used it up, and once the queue had
        room their dead letters came without payload."""
        if (bucket := self._buckets.get(label)) is not None:
            tokens, when = bucket
            self._buckets[label] = (min(float(self.burst), tokens + 1), when)
