"""The receiving MCA's protocol core (spec sections 2, 3 and 5): no I/O.

A :class:`ReceiverConnection` is fed the bytes of one connection and hands out requests, one at
a time and in order; the daemon decides each one (is the queue offered? did the put work?) and
gets back the bytes of the answer. The states and transitions are :data:`TRANSITIONS`, the
seed's diagram for the receiving MCA::

    Waiting for message --Queue_ask, offered--------> Sending queue_yes ----answer sent--> Waiting
    Waiting for message --Queue_ask, not offered----> Sending queue_no -----answer sent--> Waiting
    Waiting for message --Message, put--------------> Sending delivered_yes -answer sent--> Waiting
    Waiting for message --Message, not delivered----> Sending delivered error and putting
                                                      message to DEAD.LETTER.Q --sent--> Waiting

Extensions (spec section 6): a connection made with ``extensions=EXT_MESSAGE`` answers the
first ``QUEUE_ASK`` with the bits both ends have (the same on every later answer) and, once it
has answered with ``EXT_MESSAGE``, accepts ``MESSAGE_EX`` frames. A run of them with
``BATCH_MORE`` set, ended by one without, comes out as one :class:`Batch` request, answered
all at once (every message ``DELIVERED_YES``, or every one ``DELIVERED_ERROR``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from rqp.protocol.constants import (
    BATCH_MORE, EXT_MESSAGE, HARD_MESSAGE_CAP, KNOWN_EXTENSIONS, MAX_BATCH, SURE_MSG, MessageCode,
    StateEnum,
)
from rqp.protocol.errors import LocalProtocolError, RemoteProtocolError
from rqp.protocol.events import (
    REQUESTS, REQUESTS_EX, DeliveredError, DeliveredYes, Message, MessageEx, OversizedMessage,
    QueueAsk, QueueNo, QueueYes,
)
from rqp.protocol.frames import CLOSED, NEED_DATA, FrameDecoder, encode
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.reasons import ReasonCode

__all__ = [
    "State", "Outcome", "TRANSITIONS", "ANSWERS", "ReceiverConnection", "Ask", "Put", "Refuse",
    "Batch",
]


class State(StateEnum):
    WAITING_FOR_MESSAGE = "Waiting for message"
    SENDING_DELIVERED_YES = "Sending delivered_yes"
    SENDING_QUEUE_YES = "Sending queue_yes"
    SENDING_QUEUE_NO = "Sending queue_no"
    SENDING_DELIVERED_ERROR = "Sending delivered error and putting message to DEAD.LETTER.Q"


class Outcome(StateEnum):
    """What the daemon found out about a request (the seed's events, split by their result)."""

    QUEUE_ASK_OFFERED = "Queue_ask, queue offered"
    QUEUE_ASK_NOT_OFFERED = "Queue_ask, queue not offered"
    MESSAGE_PUT = "Message, put in the local queue"
    MESSAGE_NOT_DELIVERED = "Message, cannot be delivered"
    ANSWER_SENT = "answer sent"


W = State.WAITING_FOR_MESSAGE
TRANSITIONS: dict[State, dict[Outcome, State]] = {
    W: {
        Outcome.QUEUE_ASK_OFFERED: State.SENDING_QUEUE_YES,
        Outcome.QUEUE_ASK_NOT_OFFERED: State.SENDING_QUEUE_NO,
        Outcome.MESSAGE_PUT: State.SENDING_DELIVERED_YES,
        Outcome.MESSAGE_NOT_DELIVERED: State.SENDING_DELIVERED_ERROR,
    },
    State.SENDING_QUEUE_YES: {Outcome.ANSWER_SENT: W},
    State.SENDING_QUEUE_NO: {Outcome.ANSWER_SENT: W},
    State.SENDING_DELIVERED_YES: {Outcome.ANSWER_SENT: W},
    State.SENDING_DELIVERED_ERROR: {Outcome.ANSWER_SENT: W},
}
#: The frame sent in each answering state.
ANSWERS = {
    State.SENDING_QUEUE_YES: QueueYes(), State.SENDING_QUEUE_NO: QueueNo(),
    State.SENDING_DELIVERED_YES: DeliveredYes(), State.SENDING_DELIVERED_ERROR: DeliveredError(),
}
_ENCODED = {state: encode(answer) for state, answer in ANSWERS.items()}  # (with data 0)


@dataclass(frozen=True, slots=True)
class Ask:
    """A ``QUEUE_ASK``: answer with :meth:`ReceiverConnection.answer_ask`. ``data`` holds the
    extension bits the sender can send (spec section 6)."""

    queue_key: int
    data: int = 0


@dataclass(frozen=True, slots=True)
class Put:
    """A ``MESSAGE`` to put in the local queue: answer with :meth:`ReceiverConnection.answer_put`."""

    message: Message


@dataclass(frozen=True, slots=True)
class Refuse:
    """A ``MESSAGE`` the core already knows cannot be delivered.

    The daemon dead-letters it (when ``dead_letter`` is true) with ``reason`` and ``detail``, and
    answers with :meth:`ReceiverConnection.answer_put` ``(self, False)``. ``message`` is a
    :class:`Message` or, for a body too big to read, an :class:`OversizedMessage`.
    """

    message: Message | OversizedMessage
    reason: ReasonCode
    detail: str
    dead_letter: bool = True


@dataclass(frozen=True, slots=True)
class Batch:
    """A whole batch of ``MESSAGE_EX`` frames (spec section 6), in order: put every message or
    none, then answer with :meth:`ReceiverConnection.answer_batch`. ``refused`` is the first
    message the core already knows cannot be delivered (then the batch cannot be, and none is
    put), with its reason and detail; else None."""

    messages: tuple[MessageEx | OversizedMessage, ...]
    refused: Refuse | None = None


class ReceiverConnection:
    """One connection of a receiving MCA, from the bytes in to the answers out.

    Requests come out in order and must be answered in that order, one at a time: answers carry
    no key, so the sender matches them by order (spec 5.2).

    Order (decision, see README): once a SURE ``MESSAGE`` for a queue key is answered
    ``DELIVERED_ERROR``, later messages for that key on this connection are refused without
    being put until the sender asks for that queue again with ``QUEUE_ASK``, which it does
    before re-sending (spec 2): SURE ones without a dead letter (the sender still holds them),
    UNSURE ones dead-lettered (the sender does not send them again). So a message the sender
    will retry is never overtaken by the ones it had pipelined behind it (spec 5.8).
    """

    def __init__(self, *, max_message_size: int, hard_cap: int = HARD_MESSAGE_CAP,
                 extensions: int = 0, clock_ms: Callable[[], int] | None = None) -> None:
        """``clock_ms``: the wall clock in Unix milliseconds; a ``MESSAGE_EX`` whose
        ``expires_at_ms`` it has reached is refused ``EXPIRED`` (spec section 6)."""
        self._clock_ms = clock_ms
        self.decoder = FrameDecoder(accept=REQUESTS, max_message_size=max_message_size,
                                    hard_cap=hard_cap)
        self.state = State.WAITING_FOR_MESSAGE
        #: What this side accepts (spec section 6 bits); what both ends have is
        #: :attr:`agreed`, fixed by the first answer to a QUEUE_ASK (None before).
        self.extensions = extensions & KNOWN_EXTENSIONS
        self.agreed: int | None = None
        self._current: Ask | Put | Refuse | Batch | None = None
        self._held_keys: set[int] = set()
        self._batch: list[MessageEx | OversizedMessage] = []
        #: The most octets of message data one request may bring: a message's, or an atomic
        #: batch's messages' together (a batch is one System V message at its sender).
        self.max_message_size = max_message_size
        self._batch_octets = 0  # the batch's message data held so far

    def receive_data(self, data: bytes) -> None:
        self.decoder.receive_data(data)

    @property
    def mid_request(self) -> bool:
        """Whether part of a request has come and not the rest: a frame's first octets, an
        oversized message's body still to be skipped, an atomic batch's first frames."""
        return bool(self.decoder.buffered or self.decoder.skipping or self._batch)

    def next_request(self):
        """The next :class:`Ask`, :class:`Put` or :class:`Refuse`; or NEED_DATA / CLOSED.

        Raises :class:`rqp.RemoteProtocolError` for a bad stream: close the connection.
        """
        if self._current is not None:
            raise LocalProtocolError("the previous request has not been answered yet")
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                return event
            if event is CLOSED:
                if self._batch:
                    raise RemoteProtocolError(f"stream closed inside a batch of "
                                              f"{len(self._batch)} MESSAGE_EX frame(s)")
                return event
            if self._batch or (type(event) is not Message and _batch_more(event)):
                request = self._batched(event)
                if request is None:
                    continue  # more of the batch to come: nothing to answer yet
            else:
                request = self._request_for(event)
            self._current = request
            return request

    def _batched(self, event) -> Batch | None:
        """Collect ``event`` into the batch being received; the whole :class:`Batch` once its
        last frame is in (spec section 6: nothing of a batch is answered before)."""
        if not isinstance(event, (MessageEx, OversizedMessage)) or (
                isinstance(event, OversizedMessage) and event.extras is None):
            raise RemoteProtocolError(f"a {MessageCode(event.code).name} frame inside a batch "
                                      f"of MESSAGE_EX frames (BATCH_MORE was set on the one "
                                      f"before)")
        self._batch.append(event)
        if len(self._batch) > MAX_BATCH:
            raise RemoteProtocolError(f"a batch of more than {MAX_BATCH} MESSAGE_EX frames")
        if isinstance(event, MessageEx):
            self._batch_octets += len(event.message)
        if _batch_more(event):
            # What the rest may bring: over it, a frame's body is not kept (an oversized
            # message), so an unfinished batch holds at most max_message_size octets.
            self.decoder.max_message_size = max(0, self.max_message_size - self._batch_octets)
            return None
        self.decoder.max_message_size = self.max_message_size
        self._batch_octets = 0
        messages, self._batch = tuple(self._batch), []
        refused = None
        for message in messages:
            request = self._request_for(message)
            if isinstance(request, Refuse):
                refused = request
                break
        return Batch(messages, refused)

    def _request_for(self, event) -> Ask | Put | Refuse:
        if isinstance(event, QueueAsk):
            self._held_keys.discard(event.queue_key)
            return Ask(event.queue_key, event.data)
        if isinstance(event, OversizedMessage):
            if event.limit < self.max_message_size:  # (the limit left for a batch's rest)
                return Refuse(event, ReasonCode.MESSAGE_TOO_BIG,
                              f"message_length {event.message_length} takes its batch over "
                              f"this receiver's max_message_size {self.max_message_size} "
                              f"octets for the messages of a batch together "
                              f"({self.max_message_size - event.limit} before it)")
            return Refuse(event, ReasonCode.MESSAGE_TOO_BIG,
                          f"message_length {event.message_length} is over this receiver's "
                          f"max_message_size {event.limit}")
        problem = queue_key_problem(event.queue_key)
        if problem:
            return Refuse(event, ReasonCode.INVALID_QUEUE_KEY, problem)
        expires = getattr(event, "expires_at_ms", 0)
        if expires and self._clock_ms is not None and (now := self._clock_ms()) >= expires:
            return Refuse(event, ReasonCode.EXPIRED,
                          f"expired on arrival, {(now - expires) / 1000:.3f}s ago by this "
                          f"host's clock (expires_at_ms {expires})")
        if event.queue_key in self._held_keys:
            if event.message_type == SURE_MSG:  # the sender keeps it and sends it again
                return Refuse(event, ReasonCode.PUT_FAILED,
                              "held back: an earlier SURE message for this queue was refused "
                              "and the sender has not asked for the queue again",
                              dead_letter=False)
            # An UNSURE one is not sent again: it is dead-lettered, not silently dropped.
            return Refuse(event, ReasonCode.PUT_FAILED,
                          "held back to keep the order: an earlier SURE message for this queue "
                          "was refused on this connection and not sent again yet; putting this "
                          "one would overtake it")
        return _new_put(event)

    def _fire(self, outcome: Outcome) -> None:
        try:
            self.state = TRANSITIONS[self.state][outcome]
        except KeyError:
            raise LocalProtocolError(
                f"cannot go from {self.state.value!r} on {outcome.value!r}") from None

    def _answer(self, request, outcome: Outcome, bits: int = 0) -> bytes:
        if request is not self._current:
            raise LocalProtocolError(f"{request!r} is not the request being answered")
        self._fire(outcome)
        data = encode(dataclasses.replace(ANSWERS[self.state], data=bits)) if bits else \
            _ENCODED[self.state]
        self._fire(Outcome.ANSWER_SENT)
        self._current = None
        return data

    def answer_ask(self, request: Ask, offered: bool) -> bytes:
        """QUEUE_YES exactly when the queue exists, may be written and is offered; its data
        octet carries the extension bits of the connection (spec section 6)."""
        if not isinstance(request, Ask):
            raise LocalProtocolError(f"answer_ask() given {request!r}")
        offered = offered and queue_key_problem(request.queue_key) is None
        if self.agreed is None:  # the first answer fixes the bits for the whole connection
            self.agreed = request.data & self.extensions
            if self.agreed & EXT_MESSAGE:
                self.decoder.accept = REQUESTS_EX
        return self._answer(request, Outcome.QUEUE_ASK_OFFERED if offered
                            else Outcome.QUEUE_ASK_NOT_OFFERED, self.agreed)

    def answer_put(self, request: Put | Refuse, delivered: bool) -> bytes:
        """DELIVERED_YES if the message is in the local queue, else DELIVERED_ERROR.

        Call it for a failed put only once the dead-letter record is written (or, for a
        :class:`Refuse` with ``dead_letter=False``, at once). If even the dead-letter record
        cannot be written, do not answer: close the connection (spec 5.10).
        """
        if not isinstance(request, (Put, Refuse)):
            raise LocalProtocolError(f"answer_put() given {request!r}")
        if isinstance(request, Refuse) and delivered:
            raise LocalProtocolError("a refused message cannot have been delivered")
        if not delivered and request.message.message_type == SURE_MSG:
            self._held_keys.add(request.message.queue_key)
        return self._answer(request, Outcome.MESSAGE_PUT if delivered
                            else Outcome.MESSAGE_NOT_DELIVERED)

    def answer_batch(self, request: Batch, delivered: bool) -> bytes:
        """One answer per message of the batch, in order: all ``DELIVERED_YES`` if every
        message was put, else all ``DELIVERED_ERROR`` (and none may have been put)."""
        if not isinstance(request, Batch):
            raise LocalProtocolError(f"answer_batch() given {request!r}")
        if request.refused is not None and delivered:
            raise LocalProtocolError("a batch with a refused message cannot have been delivered")
        if request is not self._current:
            raise LocalProtocolError(f"{request!r} is not the request being answered")
        outcome = Outcome.MESSAGE_PUT if delivered else Outcome.MESSAGE_NOT_DELIVERED
        self._fire(outcome)
        answer = _ENCODED[self.state]
        self._fire(Outcome.ANSWER_SENT)
        self._current = None
        if not delivered:
            self._held_keys.update(m.queue_key for m in request.messages
                                   if m.message_type == SURE_MSG)
        return answer * len(request.messages)


_SET_PUT_MESSAGE = Put.message.__set__


def _new_put(message) -> Put:
    """``Put(message)`` without the frozen dataclass' ``__init__`` (one a message)."""
    put = object.__new__(Put)
    _SET_PUT_MESSAGE(put, message)
    return put


def _batch_more(event) -> bool:
    if isinstance(event, MessageEx):
        return bool(event.flags & BATCH_MORE)
    return isinstance(event, OversizedMessage) and event.extras is not None and \
        bool(event.extras[2] & BATCH_MORE)
