"""The sending MCA's core under random interleavings (hypothesis.stateful).

Hypothesis drives a :class:`rqp.protocol.sender.SenderCore` through any order of: messages taken
(SURE and UNSURE, several queue keys, an invalid key now and then), connections that succeed or
are refused, receiving MCAs that answer, stay silent, hang up or misbehave, time passing, and
``.rqprc`` reloads. The receiving ends are the real receiver core
(:class:`rqp.protocol.receiver.ReceiverConnection`) plus a local queue that keeps the first copy of
each key, as the receiving MCA's de-duplication does; a misbehaving peer adds answers before
their question, answers of the wrong kind, or garbage, always so that a correct sender can tell.

After every step:

* **nothing is stuck**: a message the core holds is waiting for a connection the test has been
  asked to make, or for a deadline the core reports (an answer due, a back-off ending);
* **nothing SURE is lost**: a message is reported delivered only if a receiving end put it, a
  SURE message is never reported lost, and is dead-lettered only when its record is unusable or
  its retry budget is spent; every message ends exactly once;
* **no UNSURE message is sent twice**;
* **order per queue key**: the first copies in the destination queues of the messages of one
  queue key arrive in the order they were taken (spec 5.8), SURE and UNSURE alike;
* the core's count of held messages matches the test's own, and each connection's count of
  the routes it carries the routes;

The ``heal`` step then mends every host (reachable, offering every queue, putting) and plays
the network until the core holds nothing, within a bounded time: every SURE message taken has
then arrived (or was dead-lettered by its budget, or handed back by a graceful stop).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.events import DeliveredError, DeliveredYes, Message, QueueNo, QueueYes
from rqp.protocol.frames import FrameDecoder, encode
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.receiver import Ask, Put, ReceiverConnection, Refuse
from rqp.protocol.sender import (
    Close, Connect, DeadLetter, Delivered, Lost, Note, Send, SenderCore, Settings,
)

HOSTS = ("a", "b", "c")
QUEUES = (0x52510001, 0x52510002, 0x52510003)
BAD_KEY = 0  # IPC_PRIVATE: names no queue, dead-lettered at once
ANSWER_FRAMES = [encode(e) for e in (QueueYes(), QueueNo(), DeliveredYes(), DeliveredError())]
#: How far the heal step may move the clock before the core must hold nothing.
HEAL_BOUND = 400.0


@dataclass(eq=False)
class Peer:
    """A receiving host: what it does now, and its connection from the sender (if any)."""

    name: str
    reachable: bool = True
    offers: set = field(default_factory=lambda: set(QUEUES))
    puts: bool = True
    conn: ReceiverConnection | None = None
    to_sender: bytearray = field(default_factory=bytearray)  # answers not delivered yet
    requests: int = 0  # frames received on this connection
    answered: int = 0  # of them answered (the answers are in to_sender or delivered)


@dataclass(eq=False)
class Taken:
    """A message the test handed to the core, and how it ended."""

    seq: int
    message_type: int
    queue_key: int
    payload: bytes
    end: str | None = None


class SenderMachine(RuleBasedStateMachine):

    @initialize(hosts=st.sampled_from([HOSTS[:1], HOSTS[:2], HOSTS]),
                window=st.sampled_from([1, 2, 4]), error_limit=st.sampled_from([0, 1, 3]),
                max_attempts=st.sampled_from([None, None, 3]),
                backoff_max=st.sampled_from([2.0, 30.0]))
    def start(self, hosts, window, error_limit, max_attempts, backoff_max):
        self.settings = Settings(hosts=hosts, ask_timeout=2.0, confirm_timeout=5.0,
                                 error_limit=error_limit, window=window, backoff_initial=0.5,
                                 backoff_max=backoff_max, max_attempts=max_attempts)
        keys = itertools.count(0x100000001)
        self.core = SenderCore(self.settings, lambda: next(keys))
        self.now = 1000.0
        self.peers = {h: Peer(h) for h in HOSTS}
        self.connecting: set[str] = set()
        self.taken: dict[int, Taken] = {}  # by the core's seq
        self.by_payload: dict[bytes, Taken] = {}
        self.unsure_sent: set[bytes] = set()
        self.arrived: dict[int, list[Taken]] = {q: [] for q in QUEUES}  # first copies, in order
        self.arrived_keys: set[int] = set()  # the RQP keys put somewhere (de-duplicated)
        self.put_keys: dict[str, set[int]] = {h: set() for h in HOSTS}
        self.closed: list[str] = []
        self._returned: set[bytes] = set()  # handed back by a graceful stop

    # --- carrying out what the core decides ------------------------------------------------

    def _act(self) -> None:
        for act in self.core.take_actions():
            kind = type(act)
            if kind is Send:
                peer = self.peers[act.host]
                assert peer.conn is not None, f"frame sent to {act.host}, which is not connected"
                for frame in FrameDecoder().events(act.data):
                    if isinstance(frame, Message) and frame.message_type == UNSURE_MSG:
                        assert frame.message not in self.unsure_sent, \
                            f"UNSURE message {frame.message!r} sent twice"
                        self.unsure_sent.add(frame.message)
                    peer.requests += 1
                peer.conn.receive_data(act.data)
            elif kind is Connect:
                assert act.host not in self.connecting and self.peers[act.host].conn is None, \
                    f"connect to {act.host}, which is connecting or connected"
                self.connecting.add(act.host)
            elif kind is Close:
                self._hang_up(self.peers[act.host])
                self.closed.append(act.host)
            elif kind is Delivered:
                assert act.message.key in self.put_keys[act.host], \
                    f"{act.message} reported delivered, but {act.host} never put key " \
                    f"{act.message.key:#x}"
                self._end(act.message, "delivered")
                event("a message delivered")
            elif kind is Lost:
                assert act.message.message_type == UNSURE_MSG, f"SURE message lost: {act}"
                self._end(act.message, "lost")
            elif kind is DeadLetter:
                if act.message.message_type == SURE_MSG and act.message.queue_key != BAD_KEY:
                    assert act.reason is ReasonCode.RETRY_BUDGET_EXHAUSTED, \
                        f"SURE message dead-lettered: {act}"
                    assert self.settings.max_attempts is not None
                self._end(act.message, "dead letter")
            else:
                assert kind is Note, act

    def _end(self, msg, how: str) -> None:
        taken = self.taken[msg.seq]
        assert taken.end is None, f"{taken} ended twice: {taken.end}, then {how}"
        taken.end = how

    def _hang_up(self, peer: Peer) -> None:
        peer.conn = None
        peer.to_sender.clear()
        peer.requests = peer.answered = 0

    def _serve(self, peer: Peer, limit: int) -> int:
        """The receiving end answers up to ``limit`` requests, in order."""
        done = 0
        while done < limit and peer.conn is not None:
            request = peer.conn.next_request()
            if not isinstance(request, (Ask, Put, Refuse)):
                break
            if isinstance(request, Ask):
                answer = peer.conn.answer_ask(request, request.queue_key in peer.offers)
            elif isinstance(request, Put) and peer.puts:
                self._put(peer, request.message)
                answer = peer.conn.answer_put(request, True)
            else:
                answer = peer.conn.answer_put(request, False)
            peer.to_sender += answer
            peer.answered += 1
            done += 1
        return done

    def _put(self, peer: Peer, message: Message) -> None:
        self.put_keys[peer.name].add(message.key)
        if message.key in self.arrived_keys:
            return  # a repeat: the receiving MCA's window recognises it
        self.arrived_keys.add(message.key)
        self.arrived[message.queue_key].append(self.by_payload[bytes(message.message)])

    def _deliver(self, peer: Peer, data: bytes) -> None:
        self.core.data_received(peer.name, bytes(data), self.now)
        self._act()

    # --- what happens ------------------------------------------------------------------------

    @rule(queue=st.sampled_from(QUEUES + (BAD_KEY,)), sure=st.booleans(),
          count=st.integers(1, 3))
    def take(self, queue, sure, count):
        for _ in range(count):
            payload = b"m%d" % (len(self.taken) + 1)
            kind = SURE_MSG if sure else UNSURE_MSG
            msg = self.core.submit(kind, queue, payload, self.now)
            self.taken[msg.seq] = self.by_payload[payload] = Taken(msg.seq, kind, queue, payload)
            self._act()

    @precondition(lambda self: self.connecting)
    @rule(data=st.data(), succeed=st.booleans())
    def connect_done(self, data, succeed):
        host = data.draw(st.sampled_from(sorted(self.connecting)))
        self.connecting.discard(host)
        peer = self.peers[host]
        if succeed and peer.reachable:
            peer.conn = ReceiverConnection(max_message_size=8192)
            self.core.connected(host, self.now)
        else:
            self.core.connect_failed(host, "Connection refused", self.now)
        self._act()

    @rule(host=st.sampled_from(HOSTS), reachable=st.booleans(),
          offers=st.sets(st.sampled_from(QUEUES)), puts=st.booleans())
    def change_host(self, host, reachable, offers, puts):
        peer = self.peers[host]
        peer.reachable, peer.offers, peer.puts = reachable, offers, puts

    @rule(host=st.sampled_from(HOSTS), limit=st.integers(1, 5))
    def receiver_answers(self, host, limit):
        self._serve(self.peers[host], limit)

    @rule(connect=st.booleans())
    def network_round(self, connect):
        """One round of everything the network does (so that progress does not hang on the
        finer rules above all being drawn): connects, answers, their delivery."""
        for host in sorted(self.connecting):
            if connect:
                self.connecting.discard(host)
                self.peers[host].conn = ReceiverConnection(max_message_size=8192)
                self.core.connected(host, self.now)
                self._act()
        for peer in self.peers.values():
            self._serve(peer, 1 << 30)
            if peer.conn is not None and peer.to_sender:
                chunk = bytes(peer.to_sender)
                peer.to_sender.clear()
                self._deliver(peer, chunk)

    def _connected(self) -> list[str]:
        return [h for h in HOSTS if self.peers[h].conn is not None]

    @precondition(lambda self: any(p.to_sender for p in self.peers.values()))
    @rule(data=st.data())
    def answers_arrive(self, data):
        """Some of the answers written reach the sender: any cut, even inside a frame."""
        peer = self.peers[data.draw(st.sampled_from(
            [h for h in HOSTS if self.peers[h].to_sender]), label="host")]
        cut = data.draw(st.integers(1, len(peer.to_sender)))
        chunk = bytes(peer.to_sender[:cut])
        del peer.to_sender[:cut]
        self._deliver(peer, chunk)

    @precondition(lambda self: self._connected())
    @rule(data=st.data(), how=st.sampled_from(["early", "twice", "wrong kind", "garbage"]),
          extra=st.sampled_from(ANSWER_FRAMES))
    def receiver_misbehaves(self, data, how, extra):
        """Answers a correct sender can tell are wrong, sent with every answer still due."""
        host = data.draw(st.sampled_from(self._connected()), label="host")
        peer = self.peers[host]
        if how in ("early", "twice"):
            # Every frame received is answered, so one more answers nothing (an answer before
            # its question, or a second answer to the last one).
            self._serve(peer, peer.requests)
            if peer.answered < peer.requests:
                return  # a frame still being read (cannot happen with whole Send frames)
            if how == "twice" and not peer.answered:
                return
        elif how == "wrong kind":
            request = peer.conn.next_request()
            if not isinstance(request, (Ask, Put, Refuse)):
                return
            extra = encode(DeliveredYes() if isinstance(request, Ask) else QueueYes())
        else:
            extra = b"\x09\x00garbage"
        closes = len(self.closed)
        self._deliver(peer, bytes(peer.to_sender) + extra)
        assert self.closed[closes:] == [host], f"{how} answer from {host} not refused"
        event(f"a receiver misbehaved ({how}): refused")

    @precondition(lambda self: self._connected())
    @rule(data=st.data(), eof=st.booleans())
    def receiver_hangs_up(self, data, eof):
        host = data.draw(st.sampled_from(self._connected()), label="host")
        peer = self.peers[host]
        if eof:  # what was written arrives, then the end of the stream
            self._deliver(peer, bytes(peer.to_sender))
            if peer.conn is not None:
                self._deliver(peer, b"")
                assert peer.conn is None, "end of stream did not end the connection"
        else:  # reset: what was not delivered is gone
            self._hang_up(peer)
            self.core.connection_lost(host, "Connection reset by peer", self.now)
            self._act()

    @rule(seconds=st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 16.0, 31.0]))
    def time_passes(self, seconds):
        self.now += seconds
        self.core.tick(self.now)
        self._act()

    @rule()
    def until_next_deadline(self):
        deadline = self.core.next_deadline()
        if deadline is not None:
            self.now = max(self.now, deadline)
            self.core.tick(self.now)
            self._act()

    @rule(hosts=st.lists(st.sampled_from(HOSTS), min_size=1, max_size=3, unique=True))
    def reload(self, hosts):
        self.settings = dataclasses.replace(self.settings, hosts=tuple(hosts))
        self.core.update_settings(self.settings, self.now)
        self._act()

    @rule()
    def heal(self):
        """Every host mended: the core must finish every message in bounded time."""
        for peer in self.peers.values():
            peer.reachable, peer.offers, peer.puts = True, set(QUEUES), True
        start = self.now
        if self.core.held:
            event("healed with messages held")
        for _ in range(10_000):
            if not self.core.held:
                break
            moved = False
            for host in sorted(self.connecting):
                self.connecting.discard(host)
                self.peers[host].conn = ReceiverConnection(max_message_size=8192)
                self.core.connected(host, self.now)
                self._act()
                moved = True
            for peer in self.peers.values():
                if self._serve(peer, 1 << 30):
                    moved = True
                if peer.conn is not None and peer.to_sender:
                    chunk = bytes(peer.to_sender)
                    peer.to_sender.clear()
                    self._deliver(peer, chunk)
                    moved = True
            if not moved:
                deadline = self.core.next_deadline()
                assert deadline is not None, "messages held and nothing will move them"
                self.now = max(self.now, deadline)
                assert self.now - start <= HEAL_BOUND, \
                    f"still {self.core.held} message(s) held {self.now - start:g}s after healing"
                self.core.tick(self.now)
                self._act()
        assert self.core.held == 0
        for taken in self.taken.values():
            assert taken.end is not None or taken.payload in self._returned, taken
            if taken.message_type == SURE_MSG and taken.queue_key != BAD_KEY \
                    and taken.end != "dead letter" and taken.payload not in self._returned:
                assert taken in self.arrived[taken.queue_key], f"SURE {taken} never arrived"

    @rule()
    def graceful_stop(self):
        """What a SIGTERM does to the core: the messages not in flight are handed back."""
        for msg in self.core.drain_pending():
            self._end(msg, "handed back")
            self._returned.add(msg.payload)
        self._act()

    # --- after every step ---------------------------------------------------------------------

    @invariant()
    def nothing_is_stuck(self):
        if self.core.held:
            assert self.connecting or self.core.next_deadline() is not None, \
                f"{self.core.held} message(s) held and nothing will move them"

    @invariant()
    def no_lane_waits_for_a_link_with_room(self):  # (what SenderCore._stranded nets)
        for host, link in self.core._links.items():
            assert not self.core._stranded(link), \
                f"{len(link.waiting)} lane(s) wait for {host}, which is up and has room"

    @invariant()
    def the_lanes_without_a_route_are_known(self):  # (what waiting_for_route counts)
        core = self.core
        assert core._unrouted == {lane for lane in core._lanes.values()
                                  if lane.id not in core.routes}

    @invariant()
    def held_as_counted(self):
        assert self.core.held == sum(1 for t in self.taken.values() if t.end is None)

    @invariant()
    def each_link_counts_its_routes(self):  # (what heartbeats are scheduled by)
        for host, link in self.core._links.items():
            assert link.routed == sum(1 for h in self.core.routes.values() if h == host)

    @invariant()
    def order_per_queue_key(self):
        for queue, arrived in self.arrived.items():
            seqs = [t.seq for t in arrived]
            assert seqs == sorted(seqs), f"messages of {queue:#x} arrived out of order"


#: The suite runs 300 sequences; a longer campaign: RQP_STATEFUL_EXAMPLES=20000 pytest this file.
EXAMPLES = int(os.environ.get("RQP_STATEFUL_EXAMPLES", "300"))
SenderMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestSenderMachine = SenderMachine.TestCase
