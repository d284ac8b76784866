"""The receiving MCA's connection core under random interleavings (hypothesis.stateful).

Hypothesis writes a stream of requests (asks, SURE and UNSURE messages, messages over the size
limit, messages for keys that name no queue), cuts it anywhere while it is delivered, takes
requests and answers them (offered or not, put or not), misuses the API now and then, and ends
some streams with garbage or a close. A model written from the spec says, after every step, what
the core must have handed out:

* requests come out exactly when their bytes are in, in the order sent, one at a time;
* each is answered exactly once, in order, with the frame the spec says (QUEUE_YES only for an
  offered valid key; DELIVERED_YES only for a message put);
* after a SURE message is refused, later messages for that queue key are held back (not put;
  SURE ones not dead-lettered, UNSURE ones dead-lettered) until the sender asks for the queue
  again;
* misuse (a second request before the answer, the wrong answer method) is refused without
  changing anything; garbage is a protocol error, and the connection stays failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.errors import LocalProtocolError, RemoteProtocolError
from rqp.protocol.events import DeliveredError, DeliveredYes, QueueAsk, QueueNo, QueueYes
from rqp.protocol.frames import CLOSED, NEED_DATA, encode, encode_message
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.receiver import Ask, Put, ReceiverConnection, Refuse, State

LIMIT = 64  # the receiver's max_message_size
QUEUES = (0x52510001, 0x52510002)  # few keys, so that holding one back is met often
BAD_KEYS = (0, 1 << 32)  # IPC_PRIVATE, and a value that does not fit a key_t
HEADER = len(encode_message(SURE_MSG, 1, 1, b""))
ANSWER = {QueueYes: encode(QueueYes()), QueueNo: encode(QueueNo()),
          DeliveredYes: encode(DeliveredYes()), DeliveredError: encode(DeliveredError())}


@dataclass
class Sent:
    """One request frame written to the stream, and where its event becomes available."""

    kind: str  # "ask" or "message"
    queue_key: int
    message_type: int = SURE_MSG
    key: int = 0
    length: int = 0
    ready_at: int = 0  # stream offset at which the decoder can report it


frames = st.one_of(
    st.builds(lambda q: ("ask", q, 0, 0, 0), st.sampled_from(QUEUES + BAD_KEYS)),
    st.builds(lambda q, t, k, n: ("message", q, t, k, n), st.sampled_from(QUEUES + BAD_KEYS),
              st.sampled_from([SURE_MSG, UNSURE_MSG]), st.integers(1, 2**64 - 1),
              st.sampled_from([0, 1, 5, LIMIT, LIMIT + 1, 300])),
)


class ReceiverMachine(RuleBasedStateMachine):

    @initialize()
    def start(self):
        self.connections = 0
        self.new_connection()

    @precondition(lambda self: self.ended)
    @rule()
    def next_connection(self):
        """The sender connects again: a new connection, with nothing held over."""
        self.new_connection()

    def new_connection(self):
        self.connections += 1
        self.conn = ReceiverConnection(max_message_size=LIMIT)
        self.stream = bytearray()  # everything written by the sender
        self.delivered = 0  # of it, fed to the core
        self.sent: list[Sent] = []
        self.taken = 0  # requests handed out
        self.current = None  # the request handed out and not answered
        self.held: set[int] = set()
        self.answers = 0
        self.ended = False  # garbage or end of stream written: nothing more may be written
        self.broken = False  # the core reported a protocol error

    @precondition(lambda self: not self.ended)
    @rule(batch=st.lists(frames, min_size=1, max_size=6), data=st.data())
    def sender_writes(self, batch, data):
        for kind, queue_key, message_type, key, length in batch:
            start = len(self.stream)
            if kind == "ask":
                self.stream += encode(QueueAsk(queue_key=queue_key))
                ready = len(self.stream)
            else:
                self.stream += encode_message(message_type, key, queue_key, b"p" * length)
                ready = start + HEADER if length > LIMIT else len(self.stream)
            self.sent.append(Sent(kind, queue_key, message_type, key, length, ready))
        while data.draw(st.booleans(), label="and some of it arrives"):
            self.bytes_arrive(data)

    @precondition(lambda self: not self.ended)
    @rule(garbage=st.sampled_from([b"\x09\x00", b"\xff" * 8, ANSWER[DeliveredYes]]))
    def sender_writes_garbage(self, garbage):
        """An unknown code, or an answer sent to the receiver: wrong from its first byte."""
        self.garbage_at = len(self.stream)
        self.stream += garbage
        self.ended = "garbage"

    @precondition(lambda self: not self.ended)
    @rule()
    def sender_closes(self):
        self.ended = "closed"

    @precondition(lambda self: not self.broken)
    @rule(data=st.data())
    def some_bytes_arrive(self, data):
        self.bytes_arrive(data)

    def bytes_arrive(self, data):
        rest = len(self.stream) - self.delivered
        if rest > 0:
            cut = data.draw(st.one_of(st.just(rest), st.integers(1, rest)))
            self.conn.receive_data(bytes(self.stream[self.delivered:self.delivered + cut]))
            self.delivered += cut
        elif self.ended == "closed" and self.delivered == len(self.stream):
            self.conn.receive_data(b"")
            self.delivered += 1  # (the end of the stream, once)

    def _expected(self):
        """What next_request() must return now, by the model."""
        if self.taken < len(self.sent):
            nxt = self.sent[self.taken]
            return nxt if self.delivered >= nxt.ready_at else NEED_DATA
        if self.ended == "garbage" and self.delivered > self.garbage_at:
            return RemoteProtocolError
        if self.ended == "closed" and self.delivered > len(self.stream):
            return CLOSED
        return NEED_DATA

    @precondition(lambda self: self.current is None and not self.broken)
    @rule()
    def take_request(self):
        expected = self._expected()
        if expected is RemoteProtocolError:
            with pytest.raises(RemoteProtocolError):
                self.conn.next_request()
            with pytest.raises(RemoteProtocolError):  # and the stream stays failed
                self.conn.next_request()
            self.broken = True
            return
        got = self.conn.next_request()
        if not isinstance(expected, Sent):
            assert got is expected, f"expected {expected}, got {got!r}"
            return
        self.taken += 1
        self.current = (expected, got)
        event(f"request: {type(got).__name__}")
        if expected.kind == "ask":
            assert got == Ask(expected.queue_key)
            return
        valid = expected.queue_key in QUEUES
        if expected.length > LIMIT:
            assert isinstance(got, Refuse) and got.reason is ReasonCode.MESSAGE_TOO_BIG
            assert got.dead_letter and got.message.message_length == expected.length
        elif not valid:
            assert isinstance(got, Refuse) and got.reason is ReasonCode.INVALID_QUEUE_KEY
            assert got.dead_letter
        elif expected.queue_key in self.held:  # SURE: the sender keeps it; UNSURE: dead letter
            assert isinstance(got, Refuse) and got.reason is ReasonCode.PUT_FAILED, got
            assert got.dead_letter == (expected.message_type == UNSURE_MSG), got
        else:
            assert isinstance(got, Put), got
            assert got.message.message == b"p" * expected.length
        assert (got.message.key, got.message.queue_key, got.message.message_type) == \
            (expected.key, expected.queue_key, expected.message_type)

    @precondition(lambda self: self.current is None and not self.broken)
    @rule(answers=st.lists(st.booleans(), min_size=1, max_size=8))
    def take_and_answer(self, answers):
        """The usual path: the agent takes requests and answers them, one by one."""
        for yes in answers:
            self.take_request()
            if self.current is None:
                return
            self.answer(yes)

    @precondition(lambda self: self.current is not None)
    @rule(yes=st.booleans())
    def answer(self, yes):
        sent, request = self.current
        if isinstance(request, Ask):
            data = self.conn.answer_ask(request, yes)
            want = QueueYes if yes and sent.queue_key in QUEUES else QueueNo
            self.held.discard(sent.queue_key)
        else:
            put = yes and isinstance(request, Put)
            data = self.conn.answer_put(request, put)
            want = DeliveredYes if put else DeliveredError
            if not put and sent.message_type == SURE_MSG:
                self.held.add(sent.queue_key)
        assert data == ANSWER[want], (sent, request, data)
        self.current = None
        self.answers += 1

    @precondition(lambda self: self.current is not None)
    @rule(how=st.sampled_from(["take again", "wrong method", "not the current one"]))
    def misuse(self, how):
        """Refused without changing anything: the request is still there to be answered."""
        sent, request = self.current
        with pytest.raises(LocalProtocolError):
            if how == "take again":
                self.conn.next_request()
            elif how == "wrong method" and isinstance(request, Ask):
                self.conn.answer_put(request, True)
            elif how == "wrong method" and isinstance(request, Refuse):
                self.conn.answer_put(request, True)  # a refused message cannot be put
            elif how == "wrong method":
                self.conn.answer_ask(request, True)
            else:
                self.conn.answer_ask(Ask(sent.queue_key), True)  # an equal, other request

    @invariant()
    def one_answer_per_request_in_order(self):
        if hasattr(self, "conn"):
            assert self.answers == self.taken - (self.current is not None)
            assert self.conn.state is State.WAITING_FOR_MESSAGE


EXAMPLES = int(os.environ.get("RQP_STATEFUL_EXAMPLES", "300"))
ReceiverMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestReceiverMachine = ReceiverMachine.TestCase
