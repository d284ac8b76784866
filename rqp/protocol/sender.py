"""The sending MCA's protocol core (spec sections 2, 3 and 5): no I/O, no clock, no threads.

The daemon feeds it what happened (a record taken from the transmission queue, a connection up
or down, bytes from a receiving MCA, the time) and carries out the actions it returns (connect,
send bytes, close, dead-letter, release). Every rule of the spec lives here:

* a queue key with no route is asked of the hosts of ``.rqprc`` in order; the first
  ``QUEUE_YES`` becomes the route and asking stops (spec 2);
* UNSURE: a ``DELIVERED_ERROR`` or an overdue answer increases the error counter of that
  (route, queue key); over ``error_limit`` the route is deleted. The message is not sent again
  (it may be lost; it is never duplicated). A ``DELIVERED_YES`` resets the counter (decision:
  the counter counts consecutive failures, so a route is not dropped for four errors spread
  over a month);
* SURE: anything but ``DELIVERED_YES`` deletes the route at once and the whole send is repeated
  from asking, after an exponential back-off (spec 5.10);
* no host says yes: UNSURE -> ``DEAD.LETTER.Q`` (NO_ROUTE); SURE waits with back-off, keeping its
  place: it holds back later messages of its own queue key only (spec 5.7, 5.8);
* answers are matched by order; an overdue answer ends the connection (spec 5.2, 5.11);
* one connection per receiving host, several frames in flight (``window``);
* extensions (spec section 6): every ``QUEUE_ASK`` offers ``EXT_MESSAGE``; the first answer on
  a connection says whether that peer takes ``MESSAGE_EX``. A message with extras goes as
  ``MESSAGE_EX`` where it may, as a plain ``MESSAGE`` elsewhere (priority and expiry are
  honoured here anyway); one that needs it (an ``mtype`` other than 1) is never sent to a
  plain peer: the hosts are asked for one that takes it, and if only plain ones offer the
  queue it is dead-lettered ``EXTENSION_UNSUPPORTED``;
* priority: waiting messages of a higher priority go first; within one priority of a queue
  key the order is kept (decision 8 per priority);
* expiry: a message whose ``expires_at_ms`` has passed (by the injected wall clock) is
  dead-lettered ``EXPIRED`` instead of being sent, whenever that happens while it waits;
* broadcast (spec section 6): a message for a broadcast queue key becomes one copy per host of
  ``.rqprc``, each with its own key, in a lane of its own (queue key, host) that asks only its
  host. ``QUEUE_YES``: the copy is sent and assured like any message of its type; ``QUEUE_NO``
  (or, UNSURE, no answer): that host gets none (:class:`Declined`); a SURE copy whose host does
  not answer is asked again with back-off. If no copy was sent anywhere, the last one is
  dead-lettered ``NO_ROUTE`` (a message never vanishes without a word);
* atomic batches (spec section 6): the messages of one batch record are one unit here (one
  place in the lane, one expiry, one retry, one journal entry), sent as consecutive
  ``MESSAGE_EX`` frames with ``BATCH_MORE`` on all but the last, keys ``key``, ``key + 1``, ...;
  the unit is delivered when every frame is answered ``DELIVERED_YES``, else (SURE) sent again
  whole with the same keys. A plain RQP/1 peer cannot carry a batch's all-or-nothing: as for
  an ``mtype`` other than 1;
* memory: what is held per queue key is bounded. Of the idle keys (nothing waiting, in flight
  or asked) only the :data:`QUEUE_MEMORY` most recently busy keep their figures (the rest are
  added up in :attr:`SenderCore.forgotten`), and only the :data:`ROUTE_CACHE` most recently
  routed keep their route and error counters (a key forgotten there asks the hosts again, as
  after a restart).

Each message walks the seed's state diagram, :data:`TRANSITIONS`; the MCA as a whole is in
*Waiting for message* once opened.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from rqp.protocol import constants as C
from rqp.protocol.constants import (
    BATCH_MORE, DEFAULT_PRIORITY, ERROR_LIMIT, EXT_MESSAGE, KNOWN_EXTENSIONS,
    QUIET_BEFORE_IDLE_CLOSE, SURE_MSG, UNSURE_MSG, StateEnum,
)
from rqp.protocol.errors import LocalProtocolError, RemoteProtocolError
from rqp.protocol.events import ANSWERS, DeliveredError, DeliveredYes, QueueAsk, QueueNo, QueueYes
from rqp.protocol.frames import (
    CLOSED, NEED_DATA, FrameDecoder, encode, encode_message, encode_message_ex,
)
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.reasons import ReasonCode

__all__ = [
    "MsgState", "Trigger", "TRANSITIONS", "Settings", "Outgoing", "SenderCore",
    "Connect", "Send", "Close", "DeadLetter", "Delivered", "Lost", "Note", "NoteKind",
    "RouteInfo", "ROUTE_STATES", "Declined", "FanoutEnded", "Fanout", "Forgotten",
    "QUEUE_MEMORY", "ROUTE_CACHE", "WAITING_FOR_ROUTE_MAX", "broadcast_queue",
]


class MsgState(StateEnum):
    """The seed's states of the sending MCA, as seen by one message."""

    WAITING_FOR_MESSAGE = "Waiting for message"
    ASK_FOR_QUEUE = "Ask for queue"
    SENDING_MESSAGE = "Sending message"
    WAITING_FOR_CONFIRMATION = "Waiting for confirmation"
    INCREASE_ERROR_COUNTER = "Increase error counter"
    PUT_TO_DEAD_LETTER_Q = "Put message to DEAD.LETTER.Q"
    # Where a message's walk ends; the MCA itself goes back to Waiting for message.
    DELIVERED = "delivered"
    LOST = "lost (UNSURE, not confirmed)"
    DEAD_LETTERED = "in DEAD.LETTER.Q"
    DECLINED = "not for this host (a broadcast copy its host declined)"


class Trigger(StateEnum):
    """The seed's events, split where the diagram branches on the message type or a count."""

    NEW_MESSAGE_ROUTED = "New message, route known"
    NEW_MESSAGE_UNROUTED = "New message, no route"
    INVALID_MESSAGE = "New message, unusable (no queue key, bad type)"
    QUEUE_YES = "Queue_yes"
    QUEUE_NO_OR_TIMEOUT = "Queue_no or timeout"
    NO_HOST_LEFT_UNSURE = "Queue_no or timeout from every host, UNSURE"
    NO_HOST_LEFT_SURE = "Queue_no or timeout from every host, SURE"
    NO_HOST_CAN_CARRY = "Queue_yes only from plain RQP/1 hosts, message needs MESSAGE_EX"
    EXPIRED = "expiry time passed while waiting"
    NO_HOST_TAKES_COPY = "Queue_no from every host of a broadcast (the last copy)"
    DECLINED = "Queue_no (or, UNSURE, no answer) from a broadcast copy's host"
    SENT = "frame written"
    DELIVERED = "Delivered"
    ERROR_OR_TIMEOUT_UNSURE = "Delivered error or timeout, UNSURE"
    ERROR_OR_TIMEOUT_SURE = "Delivered error or timeout, SURE"
    CLOSED_IN_ORDER_UNSURE = "Connection closed in order before the answer, UNSURE"
    COUNTED = "error counted"
    DEAD_LETTERED = "dead-lettered"
    RETRY_BUDGET_SPENT = "SURE retry budget spent"


S, T = MsgState, Trigger
TRANSITIONS: dict[MsgState, dict[Trigger, MsgState]] = {
    S.WAITING_FOR_MESSAGE: {
        T.NEW_MESSAGE_ROUTED: S.SENDING_MESSAGE,
        T.NEW_MESSAGE_UNROUTED: S.ASK_FOR_QUEUE,
        T.INVALID_MESSAGE: S.PUT_TO_DEAD_LETTER_Q,
        T.RETRY_BUDGET_SPENT: S.PUT_TO_DEAD_LETTER_Q,
        T.EXPIRED: S.PUT_TO_DEAD_LETTER_Q,
    },
    S.ASK_FOR_QUEUE: {
        T.QUEUE_YES: S.SENDING_MESSAGE,
        T.QUEUE_NO_OR_TIMEOUT: S.ASK_FOR_QUEUE,
        T.NO_HOST_LEFT_UNSURE: S.PUT_TO_DEAD_LETTER_Q,
        T.NO_HOST_LEFT_SURE: S.WAITING_FOR_MESSAGE,
        T.NO_HOST_CAN_CARRY: S.PUT_TO_DEAD_LETTER_Q,
        T.EXPIRED: S.PUT_TO_DEAD_LETTER_Q,
        # (a SURE message that failed before, waiting to ask again while every host is in its
        # connection's back-off: it is not sent again, so its retry budget can run out there)
        T.RETRY_BUDGET_SPENT: S.PUT_TO_DEAD_LETTER_Q,
        T.NO_HOST_TAKES_COPY: S.PUT_TO_DEAD_LETTER_Q,
        T.DECLINED: S.DECLINED,
    },
    S.SENDING_MESSAGE: {T.SENT: S.WAITING_FOR_CONFIRMATION},
    S.WAITING_FOR_CONFIRMATION: {
        T.DELIVERED: S.DELIVERED,
        T.ERROR_OR_TIMEOUT_UNSURE: S.INCREASE_ERROR_COUNTER,
        T.ERROR_OR_TIMEOUT_SURE: S.WAITING_FOR_MESSAGE,
        # (not in the seed: no error of the route, see SenderCore._closed_mid_send)
        T.CLOSED_IN_ORDER_UNSURE: S.LOST,
    },
    S.INCREASE_ERROR_COUNTER: {T.COUNTED: S.LOST},
    S.PUT_TO_DEAD_LETTER_Q: {T.DEAD_LETTERED: S.DEAD_LETTERED},
    S.DELIVERED: {}, S.LOST: {}, S.DEAD_LETTERED: {}, S.DECLINED: {},
}


@dataclass(frozen=True, slots=True)
class Settings:
    """What the core needs of ``.rqprc`` (see :class:`rqp.config.SenderConfig`)."""

    hosts: tuple  # of HostAddress (anything hashable with a str())
    ask_timeout: float = C.DEFAULT_ASK_TIMEOUT
    confirm_timeout: float = C.DEFAULT_CONFIRM_TIMEOUT
    error_limit: int = ERROR_LIMIT
    window: int = C.DEFAULT_WINDOW
    backoff_initial: float = C.DEFAULT_RETRY_BACKOFF_INITIAL
    backoff_max: float = C.DEFAULT_RETRY_BACKOFF_MAX
    #: SURE retry budget; None = retry forever (the spec's rule).
    max_attempts: int | None = None
    max_age: float | None = None
    #: The extension bits (spec section 6) offered in every QUEUE_ASK.
    extensions: int = KNOWN_EXTENSIONS
    #: The broadcast queue keys (spec section 6): a copy for every host.
    broadcast: frozenset = frozenset()
    #: A route with messages waiting or in flight and no confirmation for this long is
    #: "stalled" (whatever else it is doing).
    stall_after: float = C.DEFAULT_STALL_AFTER
    #: A connection that carries a route and has had no answer for this long is probed with a
    #: QUEUE_ASK for a key of that route (a heartbeat any RQP/1 receiver answers).
    heartbeat_interval: float = C.DEFAULT_HEARTBEAT_INTERVAL

    @classmethod
    def from_config(cls, config) -> "Settings":
        return cls(hosts=tuple(config.hosts), ask_timeout=config.ask_timeout,
                   confirm_timeout=config.confirm_timeout, error_limit=config.error_limit,
                   window=config.window, backoff_initial=config.retry_backoff_initial,
                   backoff_max=config.retry_backoff_max, max_attempts=config.retry_max_attempts,
                   max_age=config.retry_max_age, broadcast=config.broadcast_keys,
                   stall_after=config.stall_after,
                   heartbeat_interval=config.heartbeat_interval)

    def backoff(self, failures: int) -> float:
        """Wait before attempt ``failures + 1``: the first retry is at once (the spec's "repeat
        all steps"), then ``backoff_initial`` doubling up to ``backoff_max``."""
        if failures <= 1:
            return 0.0
        return min(self.backoff_initial * (2 ** min(failures - 2, 30)), self.backoff_max)

    def reconnect_delay(self, failures: int) -> float:
        """Wait before connecting again after ``failures`` failed connections in a row."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_initial * (2 ** min(failures - 1, 30)), self.backoff_max)


@dataclass(eq=False, slots=True)
class Outgoing:
    """One message in the sending MCA's hands, from the transmission queue to its end."""

    seq: int
    message_type: int
    queue_key: int
    payload: bytes = field(repr=False)
    taken_at: float = 0.0
    origin: object = field(default=None, repr=False)  # the transmission record, for the daemon
    key: int = 0  # the unique RQP key (spec 5.6), given at the first send, kept for retries
    attempts: int = 0  # MESSAGE frames sent
    failures: int = 0  # failed attempts, for the back-off (SURE)
    state: MsgState = MsgState.WAITING_FOR_MESSAGE
    host: object = None  # where it was sent last
    last_error: str = ""
    #: Its last try ended with no answer (a time-out, a connection lost): it may have been put.
    answer_lost: bool = False
    mtype: int = 1  # spec section 6: the System V type it is put with
    priority: int = DEFAULT_PRIORITY
    expires_at_ms: int = 0  # Unix ms; 0 = never
    #: A broadcast copy: the host it is for (None: an ordinary message) and its message's copies.
    target: object = None
    fanout: "Fanout | None" = field(default=None, repr=False)
    #: An atomic batch: its messages ``((mtype, data), ...)``, keys ``key + i``; None: one message.
    members: tuple | None = field(default=None, repr=False)
    unanswered: int = 0  # a batch in flight: frames not answered yet
    batch_error: str = ""  # a batch in flight: why a frame of it was not confirmed

    @property
    def needs_ex(self) -> bool:
        """Only MESSAGE_EX can carry it: a plain RQP/1 peer would put it with mtype 1, or a
        batch's messages one by one."""
        return self.mtype != 1 or self.members is not None

    @property
    def wants_ex(self) -> bool:
        """It has extras a MESSAGE_EX carries (a plain MESSAGE may carry it without them)."""
        return self.mtype != 1 or self.priority != DEFAULT_PRIORITY or self.expires_at_ms != 0 \
            or self.members is not None

    @property
    def count(self) -> int:
        """How many application messages it is (a batch: its members)."""
        return 1 if self.members is None else len(self.members)

    @property
    def why_ex(self) -> str:
        """What only MESSAGE_EX can carry of it, in words."""
        return (f"a batch of {len(self.members)}" if self.members is not None
                else f"mtype {self.mtype}")


@dataclass(eq=False, slots=True)
class Fanout:
    """The copies of one broadcast message: how many have not ended, and what became of them."""

    copies: int
    remaining: int
    #: Copies sent somewhere (delivered, lost after sending, or dead-lettered).
    reached: int = 0
    #: Why each host that declined gave none.
    declined: list = field(default_factory=list)


# --- actions: what the daemon must do --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Connect:
    host: object


@dataclass(frozen=True, slots=True)
class Send:
    host: object
    data: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Close:
    host: object
    reason: str
    #: An orderly end, no failure (already noted as CONNECTION_CLOSED).
    orderly: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetter:
    message: Outgoing
    reason: ReasonCode
    detail: str
    #: A broadcast message that reached no host, dead-lettered once as a whole (its record
    #: names no destination host: put back on its key, it goes to every host, as it should).
    whole: bool = False


@dataclass(frozen=True, slots=True)
class Delivered:
    message: Outgoing
    host: object


@dataclass(frozen=True, slots=True)
class Declined:
    """A broadcast copy its host does not take (``QUEUE_NO``; UNSURE: no answer): it is done."""

    message: Outgoing
    host: object
    detail: str


@dataclass(frozen=True, slots=True)
class FanoutEnded:
    """Every copy of a broadcast message has ended (after the action of the last one)."""

    message: Outgoing  # the last copy
    fanout: Fanout


@dataclass(frozen=True, slots=True)
class Lost:
    """An UNSURE message that was sent but not confirmed: it may or may not have arrived."""

    message: Outgoing
    host: object
    detail: str
    #: Cut off by the receiver's idle time-out (SenderCore._closed_mid_send): most likely put.
    likely_put: bool = False


class NoteKind(enum.Enum):
    ROUTE_FOUND = "route found"
    ROUTE_DROPPED = "route dropped"
    ERROR_COUNTED = "error counter increased"
    NO_ROUTE = "no route for the queue"
    RETRY_SCHEDULED = "SURE message will be retried"
    CONNECTION_FAILED = "connection failed"
    CONNECTION_CLOSED = "connection closed in order"
    CONNECTED = "connected"
    COPIES_WAIT = "a broadcast host does not answer: its SURE copies wait"
    WOKEN_LATE = "queues waiting for a connection with room woken late (a bug: please report)"


@dataclass(frozen=True, slots=True)
class Note:
    """Something an operator would grep for (and a metric would count)."""

    kind: NoteKind
    queue_key: int | None
    host: object
    detail: str = ""
    key: int | None = None


@dataclass(slots=True)
class RouteInfo:
    """What ``rqpctl status`` and the metrics show of one queue key."""

    queue_key: int
    sent: int = 0
    sent_bytes: int = 0
    delivered: int = 0
    lost: int = 0
    #: UNSURE messages a receiver's close in order cut off (SenderCore._closed_mid_send): not
    #: confirmed, and most likely put (a receiving MCA puts what crosses its close); not lost
    unconfirmed_at_close: int = 0
    dead_lettered: int = 0
    declined: int = 0  # broadcast copies the host did not take
    errors: int = 0  # unconfirmed attempts, all time
    route_changes: int = 0
    last_error: str = ""
    last_error_at: float | None = None
    last_message_at: float | None = None
    last_confirmed_at: float | None = None
    resumed_at: float | None = None  # when the last stall ended (a confirmation after one)
    stopped_at: float | None = None  # when an operator last stopped it (rqpctl route stop)
    started_at: float | None = None  # and started it again (progress counts from then)
    last_event: str = "new"
    since: float = 0.0  # when last_event became what it is
    last_event_at: float = 0.0  # when it last happened
    #: Round trips (MESSAGE sent -> its answer, seconds) of the last RTT_SAMPLES answers.
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))


RTT_SAMPLES = 256

#: Every state a route can be in, in words (the metrics export each, 1 for the current one).
#: "stalled": messages wait or are in flight and none was confirmed for ``stall_after``.
#: "stopped": an operator stopped it (rqpctl route stop); its messages wait until started.
#: "finishing": its route was dropped while messages sent on it were in flight; they wait for
#: their answers from the host they went to (the next message asks the hosts again).
ROUTE_STATES = ("running", "connecting", "asking", "retrying", "no route", "idle", "stalled",
                "stopped", "finishing")


# --- internal bookkeeping --------------------------------------------------------------------

class LinkState(StateEnum):
    DOWN = "down"
    CONNECTING = "connecting"
    UP = "up"


class LinkEvent(StateEnum):
    CONNECT = "connect"
    CONNECTED = "connected"
    FAILED = "connect failed"
    LOST = "connection lost or given up"


#: Every legal change of a connection's state: the one place link states are set.
LINK_TRANSITIONS: dict[LinkState, dict[LinkEvent, LinkState]] = {
    LinkState.DOWN: {LinkEvent.CONNECT: LinkState.CONNECTING},
    LinkState.CONNECTING: {LinkEvent.CONNECTED: LinkState.UP, LinkEvent.FAILED: LinkState.DOWN,
                           LinkEvent.LOST: LinkState.DOWN},
    LinkState.UP: {LinkEvent.LOST: LinkState.DOWN},
}


@dataclass(eq=False, slots=True)
class _Frame:
    """A frame waiting for its answer: an ask for ``lane``, or the message ``msg``; a
    heartbeat (no lane, no message): an ask for queue ``probe``."""

    lane: "_Lane | None"
    msg: Outgoing | None
    timeout: float
    deadline: float
    probe: int = 0
    sent_at: float = 0.0


@dataclass(eq=False, slots=True)
class _Link:
    host: object
    state: LinkState = LinkState.DOWN
    outstanding: deque = field(default_factory=deque)
    decoder: FrameDecoder | None = None
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""  # why it went down last
    waiting: dict = field(default_factory=dict)  # lanes waiting for it to be up or have room
    #: Extension bits of this connection: fixed by its first answer to a QUEUE_ASK (None
    #: before, and again after every reconnect).
    agreed: int | None = None
    #: When it was last heard from (connected, or an answer came): heartbeats count from it.
    heard_at: float = 0.0
    #: A heartbeat went unanswered: connect again (with back-off) while it carries routes,
    #: before a message needs it.
    rewarm: bool = False
    routed: int = 0  # routes that go to this host (SenderCore._set_route)
    heartbeats: int = 0  # sent on this link, all time
    heartbeat_failures: int = 0
    heartbeat_failed_at: float | None = None
    #: Failed tries of messages sent here (SenderCore._failed_try), all time: which host a
    #: queue's errors happened at, after its route has moved on.
    failed_tries: int = 0
    failed_at: float = 0.0  # when it last went down
    answered_at: float = 0.0  # when an answer last came
    up_at: float = 0.0  # when it last connected (or answered again after a lost heartbeat)
    #: A reload took its host out of .rqprc: closed once nothing rides on it.
    removed: bool = False
    #: Closes taken for the peer's idle time-out (SenderCore._closed_mid_send) since it last
    #: answered a frame sent after a quiet spell, or closed the connection with nothing in
    #: flight: at error_limit, the next one is a failure.
    free_closes: int = 0


@dataclass(eq=False, slots=True)
class _Lane:
    """Everything the sender holds for one queue key (or one host's copies of a broadcast
    key), in order."""

    queue_key: int
    #: The host whose copies these are (broadcast); None: the lane asks every host.
    target: object = None
    pending: deque = field(default_factory=deque)  # Outgoing not yet sent, by seq
    inflight: int = 0
    asking: object = None  # the host being asked, while asking
    refusals: list = field(default_factory=list)  # why each host of this round said no
    retry_at: float = 0.0
    #: The first host of this round that said QUEUE_YES on a plain RQP/1 connection while the
    #: head needed MESSAGE_EX.
    plain_yes: object = None
    #: The earliest expiry (Unix ms) of a pending message; 0 = none expires.
    next_expiry_ms: int = 0
    #: A copies lane's host said QUEUE_NO in this round.
    declined: bool = False
    #: A host was asked (or connected to) in this round, not only passed over because its
    #: connection was in its back-off.
    contacted: bool = False
    #: A host answered QUEUE_NO in this round (else none answered: down, hung, refused).
    said_no: bool = False
    #: A host asked (or dialled) in this round gave no answer (down, hung, refused): it may
    #: yet carry what a plain RQP/1 host that said QUEUE_YES cannot.
    unanswered: bool = False
    #: When the first host passed over in this round (its connection in its back-off) may be
    #: dialled again; 0: none was. It too may carry what a plain host cannot.
    skipped_until: float = 0.0
    #: A SURE message of it failed a try: one message in flight at a time until one is
    #: confirmed (those sent behind a refused one are refused too, to keep the order, and the
    #: UNSURE ones among them lost).
    probing: bool = False
    #: Its key in the lanes, routes and error counters: the queue key, or (key, host); set
    #: once (it is read for every message).
    id: object = None
    #: Since when it has been busy: when it was made, or taken back from the idle lanes.
    created_at: float = 0.0
    #: A SURE message of it failed a try since it got busy or last had one confirmed: asking
    #: again is "retrying" then, not a route being found (whatever heads it now: one never
    #: tried, of a higher priority or behind an expired head, or after a "retry now").
    failed: bool = False

    def __post_init__(self) -> None:
        self.id = self.queue_key if self.target is None else (self.queue_key, self.target)


def _tries_so_far(msg: Outgoing) -> str:
    """What the dead letter of a copy sent before its host left ``.rqprc`` adds: a try with no
    answer cannot be called back, so that host may have put it (a trial's replay of such a
    copy put it a second time: the replay is a new message, with new keys)."""
    if not msg.attempts:
        return ""
    if msg.answer_lost:
        return (f"; {_frames_sent(msg)} to it, the last with no answer: it may have been put "
                f"there all the same (outcome unknown: look on that host; {_NO_COPY_REPLAY})")
    return f"; {_frames_sent(msg)} to it, the last refused (the receiving MCA's log says why)"


#: Why a broadcast copy's dead letter is not put back as it is (rqp.tools.replay).
_NO_COPY_REPLAY = ("a replay would send it to every host of the broadcast name: forward or "
                   "discard it")


def broadcast_queue(queue_key: int) -> str:
    """How the sending MCA names a broadcast queue in what it says of its copies (dead
    letters, errors): ``rqp.tools.replay`` knows a copy's dead letter by it."""
    return f"broadcast queue {queue_key:#x}"


def _frames_sent(msg: Outgoing) -> str:
    """How many frames carried ``msg`` so far, in words: a batch's each time it was sent."""
    n = msg.attempts
    if msg.members is None:
        return f"{n} MESSAGE frame{'' if n == 1 else 's'} sent"
    return f"sent {n} time{'' if n == 1 else 's'}: {n * msg.count} MESSAGE_EX frames"


def _frame_name(link: _Link, msg: Outgoing) -> str:
    """The frame of ``msg`` whose answer ``link`` waits for next, as a log names it: a
    batch's first unanswered one (a trial's time-out named the batch's first key, answered)."""
    if msg.members is not None:
        i = len(msg.members) - msg.unanswered
        return (f"MESSAGE_EX key={msg.key + i:#018x} (message {i + 1} of a batch of "
                f"{len(msg.members)})")
    ex = msg.wants_ex and (link.agreed or 0) & EXT_MESSAGE
    return f"{'MESSAGE_EX' if ex else 'MESSAGE'} key={msg.key:#018x}"


#: What a DELIVERED_ERROR, which carries no reason (spec 4), leaves to look at.
_REFUSED_WHY = " (refused: the receiving MCA's log says why)"


def _no_host(lane: _Lane, why: str, plain: bool = False) -> str:
    """Why a round of asking found no host for ``lane``'s queue, in words that do not claim
    more than was heard: 'offers' only when a host answered QUEUE_NO; ``plain``: a plain
    RQP/1 host offered it, for a message that needs MESSAGE_EX."""
    verb = "no host that takes MESSAGE_EX answered for" if plain else \
        "no host offers" if lane.said_no else "no host answered for"
    return f"{verb} queue {lane.queue_key:#x} ({why})"


#: Messages held in memory per host beyond what its window lets be in flight: taken and
#: journaled, ready for the window slots the next answers free. What a kill -9 can lose of
#: UNSURE messages is what is held and not yet at the receiver: measured with scripts/chaos
#: --scenarios kill-sender (3 seeds x 8 kills), 16 per window frame lost ~149 UNSURE a kill, 2
#: per frame 3-6; the window and 64 lose no throughput against 2 per frame (issue 14).
HELD_AHEAD = 64


def _messages_in(lanes) -> int:
    """The messages waiting in ``lanes``: a broadcast message once, however many of its copies
    wait there."""
    count, fanouts = 0, set()
    for lane in lanes:
        if lane.target is None:
            count += len(lane.pending)
        else:
            fanouts.update(msg.fanout for msg in lane.pending)
    return count + len(fanouts)


def _let_go(entries: dict, limit: int, kept, gone) -> None:
    """Bring ``entries`` (least recent first) down to ``limit``: the first ones go, each to
    ``gone(key, value)``, but those ``kept(key)`` says to keep, which move to the end (the
    most recent); stops when every entry has been looked at once."""
    excess, looked = len(entries) - limit, 0
    while excess > 0 and looked < len(entries):
        looked += 1
        key = next(iter(entries))
        value = entries.pop(key)
        if kept(key):
            entries[key] = value
            continue
        gone(key, value)
        excess -= 1


def budget_size(window: int, hosts: int) -> int:
    """How many messages a sending MCA holds in memory (taken off its transmission queue, not
    finished) for this window and number of hosts, besides those waiting for a route."""
    return (window + HELD_AHEAD) * max(hosts, 1)


#: Messages waiting for a route (SenderCore.waiting_for_route) are held beyond the budget, up
#: to this many: else SURE messages for queues no host offers (a mistyped key, a queue not made
#: yet) filled the budget and the sending MCA took nothing more, for any queue, until a route
#: came (a trial: 256 of them froze a host's traffic). The rest of them, beyond this, count
#: against the budget again. About 32 MiB of 8 KiB messages.
WAITING_FOR_ROUTE_MAX = 4096


#: How many finished messages the sending MCA remembers by key, for ``rqpctl trace``.
FINISHED_MEMORY = 100_000

#: How many idle lanes (nothing waiting, in flight or asked) the sending MCA keeps for reuse,
#: the most recently busy ones: a message for a queue key that has one takes it back instead
#: of making a lane (about 1 KiB each). With messages spread over many keys, most lanes go
#: idle after every message: making one for each cost this core about 0.5 µs a message at
#: 1,000 keys (``scripts/bench --core``: 8.5-9.3 µs a message, 8.0-8.3 reusing them; 7.2-8.0
#: with one key). Four times QUEUE_MEMORY: with 4,096, messages spread over 5,000 keys made a
#: lane each again (no lane stays idle long enough to be reused when the keys cycle beyond
#: the bound) and the sending MCA spent 41 µs a message against 32 (``scripts/bench --scale
#: --sweeps keys --keys 5000``); at most ~16 MiB, used only by that many keys.
IDLE_LANES = 16384

#: How many queue keys the sending MCA keeps the figures of (``rqpctl status``, the metrics)
#: when idle, the most recently busy ones; the figures of the others are added up in
#: :attr:`SenderCore.forgotten`, and a key busy again starts from zero. A key with messages
#: waiting, in flight or asked for, an operator's stopped key and a broadcast key keep theirs.
#: Without a bound a producer writing to ever new keys grew the agent ~1.5-9 KiB a key, every
#: status and metrics call ~9-16 µs a key (on the event loop) and every scrape ~20 series a
#: key, without end.
QUEUE_MEMORY = C.QUEUE_MEMORY
#: How many routes (queue key -> host, with its error counters) the sending MCA keeps for
#: idle keys, the most recently found ones (~80 bytes each); a key beyond asks the hosts
#: again at its next message (a QUEUE_ASK round trip). Far above QUEUE_MEMORY, because that
#: round trip is dear: keys cycling beyond the routes kept cost the receiving MCA ~60 µs a
#: message more and cut msg/s by 2.5 (``scripts/bench --scale``-like run, 6,000 keys, when
#: both bounds were 4,096).
ROUTE_CACHE = 65536


@dataclass(slots=True)
class Forgotten:
    """What the sending MCA forgot of its idle queue keys: ``queues`` whose figures it let go
    (beyond QUEUE_MEMORY), those figures added up (with the keys' it kept they make the
    whole), and ``routes`` it let go (beyond ROUTE_CACHE)."""

    queues: int = 0
    routes: int = 0
    sent: int = 0
    sent_bytes: int = 0
    delivered: int = 0
    lost: int = 0
    unconfirmed_at_close: int = 0
    dead_lettered: int = 0
    errors: int = 0
    route_changes: int = 0

    def add(self, info: RouteInfo) -> None:
        self.queues += 1
        self.sent += info.sent
        self.sent_bytes += info.sent_bytes
        self.delivered += info.delivered
        self.lost += info.lost
        self.unconfirmed_at_close += info.unconfirmed_at_close
        self.dead_lettered += info.dead_lettered
        self.errors += info.errors
        self.route_changes += info.route_changes


class SenderCore:
    """The sending MCA's decisions. Call a method, then :meth:`take_actions`."""

    def __init__(self, settings: Settings, new_key: Callable[[], int],
                 clock_ms: Callable[[], int] | None = None) -> None:
        """``clock_ms``: the wall clock in Unix milliseconds, for expiry (messages with an
        expiry are never dead-lettered as expired without one)."""
        if not settings.hosts:
            raise LocalProtocolError("a sending MCA needs at least one host to ask")
        self.settings = settings
        self._new_key = new_key
        self._clock_ms = clock_ms
        self._links = {host: _Link(host) for host in settings.hosts}
        #: The busy lanes (something waiting, in flight or asked), by id.
        self._lanes: dict[int, _Lane] = {}
        #: Idle lanes for reuse, by id, the least recently busy first (at most IDLE_LANES).
        self._idle_lanes: OrderedDict[object, _Lane] = OrderedDict()
        #: The busy lanes that have no route (asking, or waiting to ask again): what
        #: :meth:`waiting_for_route` counts.
        self._unrouted: set[_Lane] = set()
        #: The lanes that may be given a time (a back-off's ``retry_at``, a waiting message's
        #: expiry): what :meth:`next_deadline` and :meth:`tick` look at, so that their cost
        #: is that of these few, not of every busy lane (a thousand queue keys in flight). A
        #: superset, each read where it is used; one no longer timed or busy leaves it there.
        #: (A dict: in the order they were timed, as :meth:`tick` goes through them.)
        self._timed: dict[_Lane, None] = {}
        self.routes: dict[int, object] = {}
        self.errors: dict[tuple[object, int], int] = {}
        self._actions: list = []
        self._seq = 0
        self._now = 0.0
        #: What each queue key kept did, the least recently busy first (QUEUE_MEMORY).
        self.info: OrderedDict[int, RouteInfo] = OrderedDict()
        self.forgotten = Forgotten()
        #: Per (broadcast queue key, host): how its copies fared (rqpctl status).
        self.copies_info: dict[tuple[int, object], RouteInfo] = {}
        #: The end of the last FINISHED_MEMORY messages, by key (rqpctl trace):
        #: key -> (outcome, when, queue key, host or reason).
        self.finished: OrderedDict[int, tuple] = OrderedDict()
        #: Queue keys an operator stopped: their messages wait (in memory) until started.
        self.stopped: set[int] = set()

    # --- inspection ---------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Messages taken and not yet finished (delivered, lost or dead-lettered)."""
        return sum(len(lane.pending) + lane.inflight for lane in self._lanes.values())

    @property
    def in_flight(self) -> int:
        return sum(lane.inflight for lane in self._lanes.values())

    def waiting_for_route(self) -> int:
        """Messages of queue keys that have no route behind a SURE message: being asked for,
        or waiting with back-off to ask again because no host offered the queue or its host
        is down (with any UNSURE messages queued behind it); a broadcast message once, however
        many of its copies wait so. The sending MCA holds these beyond its budget (up to
        WAITING_FOR_ROUTE_MAX), so that they do not stop the queues that have a route. An
        UNSURE message at the head of such a queue is asked for once and dead-lettered (or its
        copy declined) if no host takes it, so it is not counted."""
        return _messages_in(self._waiting_for_route())

    def held_aside(self) -> int:
        """What the sending MCA holds beside its budget (up to WAITING_FOR_ROUTE_MAX): the
        messages waiting for a route (:meth:`waiting_for_route`) and every message waiting in
        a route an operator stopped (``rqpctl route stop``), each message once."""
        lanes = self._waiting_for_route()
        if self.stopped:
            lanes |= {lane for lane in self._lanes.values() if lane.queue_key in self.stopped}
        return _messages_in(lanes)

    def _waiting_for_route(self) -> set:
        return {lane for lane in self._unrouted
                if lane.pending and lane.pending[0].message_type == SURE_MSG}

    def link_state(self, host) -> LinkState:
        return self._links[host].state

    def removed_hosts_connected(self) -> list:
        """Hosts a reload took out of .rqprc whose connections are still open: answers to
        what was sent to them are due (then they are closed)."""
        return [link.host for link in self._links.values()
                if link.removed and link.state is not LinkState.DOWN]

    def connection_text(self, host) -> str:
        """The connection to ``host`` in words (rqpctl status): 'down' only after a failure,
        and 'up' only while it answers."""
        link = self._links.get(host)
        if link is not None and link.removed and link.state is not LinkState.DOWN:
            return (f"{link.state.value}, removed from .rqprc: closed once answered "
                    f"({len(link.outstanding)} answer(s) due)")
        if link is None or link.state is LinkState.DOWN:
            if link is None or not (link.up_at or link.failed_at):
                return "not connected (no message has needed it yet)"
            if link.last_error and link.failed_at >= link.up_at:
                return f"down ({link.last_error})"
            return "not connected (closed in order)"
        if link.state is LinkState.UP and link.heartbeat_failed_at is not None \
                and link.answered_at < link.heartbeat_failed_at:
            return "up, no answer since a lost heartbeat"
        return link.state.value

    def host_figures(self, host) -> dict:
        """Heartbeats sent to ``host`` and those that went unanswered, and the failed tries of
        messages sent to it (all time)."""
        link = self._links.get(host)
        return {"heartbeats": link.heartbeats if link else 0,
                "heartbeat_failures": link.heartbeat_failures if link else 0,
                "heartbeat_failed_at": link.heartbeat_failed_at if link else None,
                "failed_tries": link.failed_tries if link else 0}

    def error_count(self, host, queue_key: int) -> int:
        return self.errors.get((host, queue_key), 0)

    def take_actions(self) -> list:
        actions, self._actions = self._actions, []
        return actions

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must be called next (answer overdue, back-off over)."""
        times = [link.outstanding[0].deadline for link in self._links.values() if link.outstanding]
        if any(self._stranded(link) for link in self._links.values()):
            times.append(self._now)  # (tick() wakes them)
        times += [link.retry_at for link in self._links.values()
                  if link.waiting and link.state is LinkState.DOWN and link.retry_at > self._now]
        timed = self._timed_lanes()
        times += [lane.retry_at for lane in timed if lane.pending and lane.retry_at > self._now]
        times += [due for link in self._links.values()
                  if (due := self._heartbeat_due(link)) is not None]
        expiries = [lane.next_expiry_ms for lane in timed
                    if lane.pending and lane.next_expiry_ms]
        if expiries and self._clock_ms is not None:
            times.append(self._now + max(0, min(expiries) - self._clock_ms()) / 1000)
        return min(times, default=None)

    def _timed_lanes(self) -> list[_Lane]:
        """The busy lanes with a back-off or an expiry (the others leave :attr:`_timed`)."""
        lanes = self._lanes
        timed = self._timed
        for lane in [lane for lane in timed if not (lane.retry_at or lane.next_expiry_ms)
                     or lanes.get(lane.id) is not lane]:
            del timed[lane]
        return list(timed)

    # --- inputs -------------------------------------------------------------------------------

    def submit(self, message_type: int, queue_key: int, payload: bytes, now: float,
               origin: object = None, key: int = 0, *, mtype: int = 1,
               priority: int = DEFAULT_PRIORITY, expires_at_ms: int = 0,
               copies=None, members=None, taken_at: float | None = None,
               resumed: bool = False) -> Outgoing:
        """A record taken from the transmission queue.

        ``key``: the unique key already given to it (a SURE message is given its key when it is
        journaled, so that it keeps it across restarts); 0 = give one at the first send.
        ``mtype``, ``priority``, ``expires_at_ms``: the record's extras (spec section 6).
        ``copies``: for a broadcast queue key, ``((key, host), ...)``, the copies not done yet
        (journaled with the message; a host by its ``str``); None: one per host, keys given
        here. ``members``: an atomic batch, ``((mtype, data), ...)``, sent with keys ``key``,
        ``key + 1``, ... ``taken_at``: when it was taken, if before ``now`` (a journaled message
        after a restart: its ``retry_max_age`` goes on counting). ``resumed``: journaled before
        a restart (it may have been sent then). Returns the message (a broadcast one: its first
        copy).
        """
        self._now = now
        self._seq += 1
        msg = Outgoing(self._seq, message_type, queue_key, payload,
                       now if taken_at is None else min(taken_at, now), origin, key,
                       mtype=mtype, priority=priority, expires_at_ms=expires_at_ms,
                       members=None if members is None else tuple(members))
        problem = None
        if message_type not in (SURE_MSG, UNSURE_MSG):
            problem = (ReasonCode.BAD_MESSAGE_TYPE,
                       f"message_type {message_type} is neither SURE_MSG (0) nor UNSURE_MSG (1)")
        elif queue_key_problem(queue_key):
            problem = (ReasonCode.NO_QUEUE_KEY, queue_key_problem(queue_key))
        if problem:
            self._fire(msg, T.INVALID_MESSAGE)
            self._dead_letter(msg, *problem)
            return msg
        if self._expired(msg):
            self._expire(msg)
            return msg
        if queue_key in self.settings.broadcast:
            return self._fan_out(msg, copies, resumed)
        self._place(msg, None)
        return msg

    def _place(self, msg: Outgoing, target) -> None:
        """Into the lane of its queue key (of its host, for a copy), and on as far as it goes."""
        lane_id = msg.queue_key if target is None else (msg.queue_key, target)
        lane = self._lanes.get(lane_id)
        if lane is None:
            lane = self._idle_lanes.pop(lane_id, None)
            if lane is None:
                lane = _Lane(msg.queue_key, target, created_at=self._now)
            else:  # (every round of asking starts afresh: only these carry over)
                lane.created_at, lane.retry_at, lane.next_expiry_ms = self._now, 0.0, 0
                lane.failed = lane.probing = False
            self._lanes[lane_id] = lane  # (busy before _info: never the key it forgets)
            if lane_id not in self.routes:
                self._unrouted.add(lane)
            try:
                self.info.move_to_end(msg.queue_key)  # the most recently busy
            except KeyError:
                self._info(msg.queue_key)
        self._enqueue(lane, msg)
        self._pump(lane)

    def _fan_out(self, msg: Outgoing, copies, resumed: bool = False) -> Outgoing:
        """One copy of ``msg`` per host (spec section 6, broadcast names)."""
        by_name = {str(host): host for host in self.settings.hosts}
        if copies is None:
            copies = [(self._keys(msg.count), host) for host in self.settings.hosts]
        copies = [(key, by_name.get(str(host), host)) for key, host in copies]
        fanout = Fanout(len(copies), len(copies))
        made = []
        for key, host in copies:
            self._seq += 1
            made.append(Outgoing(self._seq, msg.message_type, msg.queue_key, msg.payload,
                                 msg.taken_at, msg.origin, key, mtype=msg.mtype,
                                 priority=msg.priority, expires_at_ms=msg.expires_at_ms,
                                 target=host, fanout=fanout, members=msg.members))
        for copy in made:
            if copy.target in self._links and copy.target in self.settings.hosts:
                self._copy_info(copy.queue_key, copy.target)
                self._place(copy, copy.target)
            else:
                self._fire(copy, T.INVALID_MESSAGE)
                self._dead_letter(copy, ReasonCode.NO_ROUTE,
                                  "the host is no longer in .rqprc" + (
                                      "; journaled before the sending MCA restarted, it may "
                                      "have been sent to that host then (the journal does not "
                                      "record sends): look there; " + _NO_COPY_REPLAY
                                      if resumed else ""))
        return made[0] if made else msg

    def _enqueue(self, lane: _Lane, msg: Outgoing) -> None:
        """Into its place: after every waiting message of its priority or a higher one that was
        taken before it (the order within a priority is the order taken)."""
        pending = lane.pending
        if not pending or (pending[-1].priority >= msg.priority and pending[-1].seq < msg.seq):
            pending.append(msg)  # the common case: one priority, in order
        else:
            pending.insert(bisect.bisect(pending, (-msg.priority, msg.seq), key=_place), msg)
        if msg.expires_at_ms and (not lane.next_expiry_ms
                                  or msg.expires_at_ms < lane.next_expiry_ms):
            lane.next_expiry_ms = msg.expires_at_ms
            self._timed[lane] = None

    def _expired(self, msg: Outgoing) -> bool:
        return bool(msg.expires_at_ms) and self._clock_ms is not None and \
            self._clock_ms() >= msg.expires_at_ms

    def _expire(self, msg: Outgoing) -> None:
        late = self._clock_ms() - msg.expires_at_ms
        self._fire(msg, T.EXPIRED)
        # (a trial: "before it could be sent" of a message sent and refused as expired)
        when = (f"after {_frames_sent(msg)}, none confirmed" if msg.attempts else
                "before it could be sent")
        self._dead_letter(msg, ReasonCode.EXPIRED,
                          f"expired {late / 1000:.3f}s ago (expires_at_ms {msg.expires_at_ms}) "
                          f"{when}" + (f"; last error: {msg.last_error}"
                                       if msg.last_error else ""))

    def _drop_expired(self, lane: _Lane) -> None:
        """Dead-letter every waiting message of ``lane`` whose expiry has passed."""
        if not lane.next_expiry_ms or self._clock_ms is None or \
                self._clock_ms() < lane.next_expiry_ms:
            return
        keep = deque()
        for msg in lane.pending:
            if self._expired(msg):
                self._expire(msg)
            else:
                keep.append(msg)
        lane.pending = keep
        lane.next_expiry_ms = min((m.expires_at_ms for m in keep if m.expires_at_ms), default=0)

    def connected(self, host, now: float) -> None:
        self._now = now
        link = self._links[host]
        self._go(link, LinkEvent.CONNECTED)
        link.decoder = FrameDecoder(accept=ANSWERS)
        link.agreed = None
        link.failures = 0
        link.heard_at = link.up_at = now
        link.rewarm = False
        self._note(NoteKind.CONNECTED, None, host)
        self._wake(link)
        if link.removed:
            self._close_removed(link)

    def connect_failed(self, host, error: str, now: float) -> None:
        self._now = now
        link = self._links[host]
        self._go(link, LinkEvent.FAILED)
        self._link_failed(link, f"cannot connect: {error}")

    def data_received(self, host, data: bytes, now: float) -> None:
        self._now = now
        link = self._links[host]
        if link.state is not LinkState.UP:
            return  # bytes from a connection we have already given up
        # Only the frames outstanding now were sent before these bytes came: frames pushed
        # while they are read (a MESSAGE after the QUEUE_YES in the same packet) are not on the
        # wire yet, so an answer for them came before its question (spec 5.3). The daemon
        # carries out every Send before it feeds more bytes.
        answerable = len(link.outstanding)
        try:
            link.decoder.receive_data(data)
            while (event := link.decoder.next_event()) is not NEED_DATA:
                if event is CLOSED:
                    self._peer_closed(link, "closed by the receiving MCA")
                    return
                if not answerable:
                    raise RemoteProtocolError(
                        f"{type(event).__name__} answers nothing: no frame sent to "
                        f"{host} is waiting for an answer")
                answerable -= 1
                frame = link.outstanding[0]
                self._check_answer(frame, event)  # (a wrong one leaves the frame unanswered)
                link.outstanding.popleft()
                self._answer(link, frame, event)
                if link.state is not LinkState.UP:
                    return
            if link.removed:
                self._close_removed(link)
        except RemoteProtocolError as exc:
            self._drop_link(link, f"protocol error: {exc}")

    def connection_lost(self, host, error: str, now: float, *, clean: bool = False) -> None:
        """The connection to ``host`` ended; ``clean``: the peer closed it in order (EOF)."""
        self._now = now
        link = self._links[host]
        if clean and link.state is LinkState.UP:
            self._peer_closed(link, error)
        elif link.state is not LinkState.DOWN:
            self._drop_link(link, error, close=False)

    def _peer_closed(self, link: _Link, why: str) -> None:
        """The receiver closed the connection in order. With nothing riding on it (its idle
        time-out) that is no failure: the next frame for that host connects again at once.
        Nor, with frames in flight that were sent after the connection had been quiet: its
        idle time-out met them (:meth:`_closed_mid_send`). Otherwise every frame it carried is
        unanswered: a failure (a receiving MCA at max_connections takes a connection and
        closes it; a peer that closes as frames come; a host a reload took out of .rqprc is
        not connected to again)."""
        if not (link.outstanding or link.waiting):
            link.free_closes = 0  # (an idle time-out as it should be: a third trial saw closes
            # 6 s apart, with 16 of these between, counted 'in a row', the fourth a failure)
            self._close_idle(link, why)
        elif (link.outstanding and link.agreed is not None and not link.removed
              and link.free_closes < self.settings.error_limit
              and link.outstanding[0].sent_at - link.answered_at >= QUIET_BEFORE_IDLE_CLOSE):
            # (answers come in order: none came since the first frame in flight was sent, so
            # answered_at is when the connection last had nothing in flight)
            self._closed_mid_send(link, why)
        else:
            self._drop_link(link, why)

    def _closed_mid_send(self, link: _Link, why: str) -> None:
        """The peer ended a connection that worked, in order, as frames sent after a quiet
        spell were on their way: its idle time-out met them. A trial (a 300 ms idle_timeout
        and bursts) counted each such frame as a failure: routes dropped and connections in
        back-off, during which UNSURE messages found no host (270 of 9,000 dead-lettered
        NO_ROUTE from a receiver that worked throughout). It is no failure: no error of the
        route, no failed try, no back-off; a receiving MCA reads what crosses its close and
        takes it unanswered. An UNSURE message in flight is lost (not confirmed: it was most
        likely put), a SURE one sent again with its key, an ask asked again of this host,
        over a new connection made at once. What that connection carries first goes right
        after its first answer, never after a quiet spell: a peer that closes it so fails
        (a hostile trial's peer, closing every connection at its first message, had been
        connected to 1.7 times a second for ever, and kept the messages from a working host
        listed after it, while a free close was only rationed in time). A peer that closes
        every frame sent after a quiet spell, and answers the others, gets error_limit such
        closes until it answers one, or closes a connection with nothing in flight (a second
        trial: one a message, for ever, before)."""
        frames, link.outstanding = link.outstanding, deque()
        link.free_closes += 1
        self._actions.append(Close(link.host, why, orderly=True))
        self._go(link, LinkEvent.LOST)
        link.decoder = None
        link.retry_at = self._now
        note = (f"{why}: its idle time-out, taken to have met {len(frames)} frame(s) on their "
                f"way (no failure: {link.free_closes} of {self.settings.error_limit} in a row)")
        why = "closed the connection in order before answering (it may have put it)"
        for frame in frames:
            if frame.lane is None:
                continue  # a heartbeat: nothing rides on it
            if frame.msg is not None:
                self._settled(link, frame.lane, frame.msg, False, why, counted=False)
            elif frame.lane.asking == link.host:
                self._wait_for(link, frame.lane)  # asked again once connected
        self._wake(link)
        self._note(NoteKind.CONNECTION_CLOSED, None, link.host, note + (
            "; connecting again" if link.state is not LinkState.DOWN else ""))

    def _close_idle(self, link: _Link, why: str) -> None:
        """An orderly end of a connection with nothing riding on it: no failure."""
        self._actions.append(Close(link.host, why, orderly=True))
        self._go(link, LinkEvent.LOST)
        link.decoder = None
        self._note(NoteKind.CONNECTION_CLOSED, None, link.host, why)

    def _close_removed(self, link: _Link) -> None:
        """The connection to a host a reload took out of .rqprc ends once nothing rides on it
        (a trial saw one stay open, and unlisted, until the receiver's idle time-out)."""
        if link.state is LinkState.UP and not link.outstanding and not link.waiting:
            self._close_idle(link, "host removed from .rqprc")

    def tick(self, now: float) -> None:
        """Let time pass: overdue answers end their connection; back-offs end; quiet
        connections are probed (heartbeats)."""
        self._now = now
        for link in self._links.values():
            if self._stranded(link):
                self._note(NoteKind.WOKEN_LATE, None, link.host,
                           f"{len(link.waiting)} of them, {len(link.outstanding)} frame(s) in "
                           "flight")
                self._wake(link)
            if link.outstanding and link.outstanding[0].deadline <= now:
                frame = link.outstanding[0]
                what = ("heartbeat QUEUE_ASK" if frame.lane is None else "QUEUE_ASK"
                        if frame.msg is None else _frame_name(link, frame.msg))
                if frame.lane is None:
                    link.heartbeat_failures += 1
                    link.heartbeat_failed_at = now
                    link.rewarm = True
                self._drop_link(link, f"no answer to {what} within {frame.timeout:g}s")
            elif link.waiting and link.state is LinkState.DOWN and link.retry_at <= now:
                self._wake(link)
            elif (due := self._heartbeat_due(link)) is not None and due <= now:
                if link.state is LinkState.UP:
                    self._heartbeat(link)
                else:  # connect again before a message needs it
                    self._go(link, LinkEvent.CONNECT)
                    self._actions.append(Connect(link.host))
        for lane in self._timed_lanes():
            if lane.pending and lane.next_expiry_ms:
                self._drop_expired(lane)
                if not lane.pending:
                    self._forget_if_idle(lane)
                    continue
            if lane.pending and lane.retry_at and lane.retry_at <= now:
                lane.retry_at = 0.0
                self._pump(lane)

    # --- the walk of a message ---------------------------------------------------------------

    def _fire(self, msg: Outgoing, trigger: Trigger) -> None:
        try:
            msg.state = TRANSITIONS[msg.state][trigger]
        except KeyError:
            raise LocalProtocolError(
                f"message seq={msg.seq} cannot go from {msg.state.value!r} on {trigger.value!r}"
            ) from None

    def _pump(self, lane: _Lane) -> None:
        """Move the head of ``lane`` on as far as it can go now."""
        if lane.queue_key in self.stopped:
            return  # (an operator's stop: what waits stays, what is in flight goes on)
        while lane.pending:
            if lane.asking is not None:
                return
            head = lane.pending[0]
            if head.failures and self._budget_spent(head):  # (tests first what is cheap:
                lane.pending.popleft()                       # every message passes here)
                self._fire(head, T.RETRY_BUDGET_SPENT)
                # (a second trial: a try that timed out after the budget was put after all)
                self._dead_letter(head, ReasonCode.RETRY_BUDGET_EXHAUSTED,
                                  f"not delivered after {head.failures} failed "
                                  f"{'try' if head.failures == 1 else 'tries'} "
                                  f"({_frames_sent(head)}); last error: "
                                  f"{head.last_error or 'none'}" + (
                                      "; that try had no answer: it may have been put all the "
                                      "same (" + (
                                          "sent again with its key, a receiving MCA that put "
                                          "it does not put it twice, within its "
                                          "de-duplication window)" if head.target is None else
                                          f"look on host {head.target}; {_NO_COPY_REPLAY})")
                                      if head.answer_lost else ""))
                continue
            if head.expires_at_ms and self._expired(head):
                lane.pending.popleft()
                self._expire(head)
                continue
            if lane.retry_at > self._now or (lane.probing and lane.inflight):
                return
            host = self.routes.get(lane.id)
            if host is None:
                if lane.inflight:
                    return  # let the frames already sent settle first, to keep the order
                self._ask(lane, 0)
                return
            link = self._links[host]
            if link.state is not LinkState.UP or len(link.outstanding) >= self.settings.window:
                self._wait_for(link, lane)
                return
            if link.agreed is None:
                # A new connection carries no message before it has answered a QUEUE_ASK: a
                # receiving MCA at max_connections takes a connection and closes it, and an
                # UNSURE message sent on it was lost (a trial: 2 of 35). The answer also says
                # which extensions it takes (spec section 6).
                if not link.outstanding:  # (a lane's QUEUE_ASK in flight does as well)
                    self._heartbeat(link, lane.queue_key)
                self._wait_for(link, lane)
                return
            if head.needs_ex and not link.agreed & EXT_MESSAGE:
                # Not on this connection: a plain RQP/1 peer. Ask again, for a host that
                # takes MESSAGE_EX (spec section 6).
                self._drop_route(lane.id, host, f"{head.why_ex} needs MESSAGE_EX and this "
                                 "connection is plain RQP/1")
                continue
            lane.pending.popleft()
            self._fire(head, T.NEW_MESSAGE_ROUTED if head.state is S.WAITING_FOR_MESSAGE
                       else T.QUEUE_YES)
            self._send_message(link, lane, head)
        if not lane.inflight and lane.asking is None:
            # emptied here (dead-lettered, expired): idle, so a new message finds it afresh
            # (a trial: a lane left busy and empty kept its failure, age and back-off)
            self._forget_if_idle(lane)

    def _keys(self, n: int) -> int:
        """The first of ``n`` consecutive new keys."""
        block = getattr(self._new_key, "block", None)
        if block is not None:
            return block(n)
        first = self._new_key()
        for _ in range(n - 1):
            self._new_key()
        return first

    def _send_message(self, link: _Link, lane: _Lane, msg: Outgoing) -> None:
        if not msg.key:
            msg.key = self._keys(msg.count)
        msg.attempts += 1
        msg.host = link.host
        lane.inflight += 1
        info = self._info(msg.queue_key)
        info.sent += msg.count
        info.sent_bytes += len(msg.payload)
        info.last_message_at = self._now
        if msg.target is not None:
            copy_info = self._copy_info(msg.queue_key, msg.target)
            copy_info.sent += msg.count
            copy_info.last_message_at = self._now
        if msg.members is not None:
            self._send_batch(link, lane, msg)
            return
        if msg.wants_ex and link.agreed & EXT_MESSAGE:
            data = encode_message_ex(msg.message_type, msg.key, msg.queue_key, msg.payload,
                                     msg.mtype, msg.priority, 0, msg.expires_at_ms)
        else:
            data = encode_message(msg.message_type, msg.key, msg.queue_key, msg.payload)
        self._push(link, _Frame(lane, msg, self.settings.confirm_timeout, 0.0), data)
        self._fire(msg, T.SENT)

    def _send_batch(self, link: _Link, lane: _Lane, msg: Outgoing) -> None:
        """All frames of a batch at once (the window may be passed: the receiver answers none
        before the last), ``BATCH_MORE`` on all but the last."""
        last = len(msg.members) - 1
        msg.unanswered, msg.batch_error = last + 1, ""
        data = [encode_message_ex(msg.message_type, msg.key + i, msg.queue_key, payload, mtype,
                                  msg.priority, BATCH_MORE if i < last else 0, msg.expires_at_ms)
                for i, (mtype, payload) in enumerate(msg.members)]
        timeout = self.settings.confirm_timeout
        for i in range(last):
            link.outstanding.append(_Frame(lane, msg, timeout, self._now + timeout,
                                           sent_at=self._now))
        self._push(link, _Frame(lane, msg, timeout, 0.0), b"".join(data))
        self._fire(msg, T.SENT)

    def _push(self, link: _Link, frame: _Frame, data: bytes) -> None:
        frame.sent_at = self._now
        frame.deadline = self._now + frame.timeout
        link.outstanding.append(frame)
        self._actions.append(Send(link.host, data))

    def _ask(self, lane: _Lane, index: int) -> None:
        """Ask hosts[index] (or the next one that can be reached) for ``lane``'s queue."""
        self._asked_for(lane.pending[0])
        if index == 0:
            lane.refusals = []
            lane.plain_yes = None
            lane.declined = False
            lane.contacted = lane.said_no = lane.unanswered = False
            lane.skipped_until = 0.0
        hosts = self._hosts_for(lane)
        while index < len(hosts):
            link = self._links[hosts[index]]
            if link.state is LinkState.DOWN and link.retry_at > self._now:
                # unreachable for now: as good as a time-out, ask the next host
                lane.refusals.append(f"{link.host}: {link.last_error or 'unreachable'}, next "
                                     f"connect in {link.retry_at - self._now:.3g}s")
                lane.skipped_until = min(lane.skipped_until or link.retry_at, link.retry_at)
                index += 1
                continue
            lane.asking = link.host
            lane.contacted = True
            if link.state is LinkState.UP and len(link.outstanding) < self.settings.window:
                # Sent now: if the lane was waiting for room on this link (to send on a route
                # it has just lost), that wait is over; _wake() must not ask a second time.
                link.waiting.pop(lane, None)
                self._push(link, _Frame(lane, None, self.settings.ask_timeout, 0.0),
                           encode(QueueAsk(queue_key=lane.queue_key,
                                           data=self.settings.extensions)))
            else:
                self._wait_for(link, lane)
            return
        self._no_route(lane)

    def _hosts_for(self, lane: _Lane) -> tuple:
        """Whom ``lane`` asks, in order: every host of ``.rqprc``, or a copy's own host."""
        if lane.target is None:
            return self.settings.hosts
        return (lane.target,) if lane.target in self.settings.hosts else ()

    def _asked_for(self, msg: Outgoing) -> None:
        """``msg`` is (now) the head of a lane whose queue is being asked for. The answer is
        about the queue key, so it counts for whichever message heads the lane when it comes
        (the one asked for may have been dead-lettered or taken out meanwhile)."""
        if msg.state is S.WAITING_FOR_MESSAGE:
            self._fire(msg, T.NEW_MESSAGE_UNROUTED)

    def _no_route(self, lane: _Lane) -> None:
        lane.asking = None
        hosts = ", ".join(map(str, self._hosts_for(lane)))
        why = "; ".join(lane.refusals) or (f"asked {hosts}" if hosts else
                                           f"host {lane.target} is no longer in .rqprc")
        lane.refusals = []
        if lane.target is not None and (lane.declined or not hosts):
            self._decline(lane, why)
            return
        plain, lane.plain_yes = lane.plain_yes, None
        if plain is not None and lane.pending and self._cannot_carry(lane, plain, why):
            return  # (else a SURE message that needs MESSAGE_EX heads it, and waits)
        if lane.target is not None:
            self._note(NoteKind.COPIES_WAIT, lane.queue_key, lane.target, why)
        else:
            self._note(NoteKind.NO_ROUTE, lane.queue_key, None, why)
        while lane.pending and lane.pending[0].message_type == UNSURE_MSG:
            msg = lane.pending.popleft()
            self._asked_for(msg)
            if msg.target is not None:  # an UNSURE copy: its host did not say yes
                self._declined(msg, why)
                continue
            self._fire(msg, T.NO_HOST_LEFT_UNSURE)
            self._error(lane.queue_key, _no_host(lane, why))
            self._dead_letter(msg, ReasonCode.NO_ROUTE, _no_host(lane, why))
        if lane.pending and not lane.contacted and hosts:
            # Every host was in its connection's back-off: nobody was tried, so this is no
            # failed try (it would use up retry_max_attempts without a packet sent). Ask
            # again when the first of those connections may be made.
            head = lane.pending[0]
            self._asked_for(head)
            lane.retry_at = max(min(self._links[h].retry_at for h in self._hosts_for(lane)),
                                self._now)
            self._timed[lane] = None
            self._note(NoteKind.RETRY_SCHEDULED, lane.queue_key, None,
                       f"attempt {head.failures + 1} in {lane.retry_at - self._now:.3g}s, when "
                       f"a connection may be made again ({why})", head.key)
        elif lane.pending and plain is not None and not lane.unanswered:
            # A plain host said yes; those that may take MESSAGE_EX were only passed over, in
            # their connections' back-off: no failed try either (a review: retry_max_attempts
            # ran out while the one host that could carry it was never dialled again).
            head = lane.pending[0]
            self._asked_for(head)
            lane.retry_at = max(lane.skipped_until, self._now)
            self._timed[lane] = None
            self._note(NoteKind.RETRY_SCHEDULED, lane.queue_key, None,
                       f"attempt {head.failures + 1} in {lane.retry_at - self._now:.3g}s, when "
                       "a host that may take MESSAGE_EX may be dialled again "
                       f"({_no_host(lane, why, True)})", head.key)
        elif lane.pending:
            head = lane.pending[0]
            self._asked_for(head)
            self._fire(head, T.NO_HOST_LEFT_SURE)
            head.failures += 1
            lane.failed = True
            head.last_error = (
                _no_host(lane, why, plain is not None) if lane.target is None else
                f"no answer for {broadcast_queue(lane.queue_key)} ({why})")
            self._failed_try(lane.queue_key, lane.target, head.last_error)  # a failed try too
            self._retry_later(lane, head)
            self._pump(lane)  # a retry due at once starts now; later ones wait for tick()
        else:
            self._forget_if_idle(lane)

    def _decline(self, lane: _Lane, why: str) -> None:
        """A copies lane's host said QUEUE_NO: its waiting copies are done. If it has left
        ``.rqprc``, its waiting copies are dead-lettered (never dropped unseen: a trial's
        UNSURE ones were counted "declined", which the host never said), as a message no host
        is asked for is."""
        removed = not self._hosts_for(lane)
        self._note(NoteKind.NO_ROUTE, lane.queue_key, lane.target, f"no copy: {why}")
        while lane.pending:
            msg = lane.pending.popleft()
            self._asked_for(msg)
            if removed:
                self._fire(msg, T.NO_HOST_TAKES_COPY)
                self._dead_letter(msg, ReasonCode.NO_ROUTE, "the host is no longer in .rqprc"
                                  + ("" if "no longer in .rqprc" in why else f" ({why})")
                                  + _tries_so_far(msg))
            else:
                self._declined(msg, why)
        self._forget_if_idle(lane)

    def _declined(self, msg: Outgoing, why: str) -> None:
        """``msg`` (a copy in Ask for queue) goes to none: its host declined it. The last copy
        of a message that reached no host is dead-lettered instead (NO_ROUTE)."""
        fanout = msg.fanout
        fanout.declined.append(why)
        if fanout.remaining == 1 and not fanout.reached:
            self._fire(msg, T.NO_HOST_TAKES_COPY)
            self._dead_letter(msg, ReasonCode.NO_ROUTE,
                              f"no host takes {broadcast_queue(msg.queue_key)} ("
                              + "; ".join(fanout.declined) + ")", whole=True)
            return
        self._fire(msg, T.DECLINED)
        self._copy_info(msg.queue_key, msg.target).declined += 1
        self._actions.append(Declined(msg, msg.target, why))
        self._copy_ended(msg, reached=False)

    def _copy_ended(self, msg: Outgoing, reached: bool) -> None:
        fanout = msg.fanout
        fanout.remaining -= 1
        fanout.reached += reached
        if not fanout.remaining:
            self._actions.append(FanoutEnded(msg, fanout))

    def _cannot_carry(self, lane: _Lane, plain, why: str) -> bool:
        """Only plain RQP/1 hosts said they offer the queue: the messages at the head that
        need MESSAGE_EX are dead-lettered (never put with the wrong mtype); the rest go to the
        first of those hosts (also when the head that needed it left the lane during the
        round: a review saw an UNSURE message behind it dead-lettered NO_ROUTE). If a host
        gave no answer (down, hung, or passed over in its back-off), it may yet carry them: a
        SURE one waits for the next round (False: it heads the lane); only the UNSURE ones
        before it, which cannot wait, are dead-lettered, NO_ROUTE (a trial: a SURE message
        was dead-lettered because the one host that could carry it was stopped a second)."""
        final = not lane.unanswered and not lane.skipped_until
        done = []
        while lane.pending and lane.pending[0].needs_ex:
            msg = lane.pending[0]
            if not final and msg.message_type == SURE_MSG:
                break
            done.append(lane.pending.popleft())
        waits = bool(lane.pending) and lane.pending[0].needs_ex
        if done:  # (a waiting head: _no_route says it, with the retry)
            self._note(NoteKind.NO_ROUTE, lane.queue_key, None, f"for MESSAGE_EX: {why}")
        for msg in done:
            self._asked_for(msg)
            if final:
                self._fire(msg, T.NO_HOST_CAN_CARRY)
                self._dead_letter(msg, ReasonCode.EXTENSION_UNSUPPORTED,
                                  f"{msg.why_ex} needs MESSAGE_EX (spec section 6), and the "
                                  f"hosts that offer queue {lane.queue_key:#x} do not take it "
                                  f"({why})")
            else:
                no_host = _no_host(lane, why, True)
                self._fire(msg, T.NO_HOST_LEFT_UNSURE)
                self._error(lane.queue_key, no_host)
                self._dead_letter(msg, ReasonCode.NO_ROUTE, f"{msg.why_ex} needs MESSAGE_EX "
                                  f"(spec section 6): {no_host}")
        if waits:
            return False
        if lane.pending:
            self._set_route(lane.id, plain)
            self._note(NoteKind.ROUTE_FOUND, lane.queue_key, plain, "plain RQP/1")
            self._pump(lane)
        self._forget_if_idle(lane)
        return True

    def _retry_later(self, lane: _Lane, msg: Outgoing) -> None:
        """``msg`` failed a try: the lane goes on after the back-off of the message it sends
        first (its head, ``msg`` or one before it), and never sooner than a retry already
        scheduled (the other frames in flight fail in the same round: a trial saw a SURE
        message sent again every 1.5 s, not after 30, because each of the ones behind it
        set the retry to "at once")."""
        head = lane.pending[0] if lane.pending else msg
        if self._budget_spent(head):
            return  # no retry to announce: the caller's _pump dead-letters it now
        retry_at = self._now + self.settings.backoff(head.failures)
        if self.settings.max_age is not None:  # not a back-off step past its budget: at its
            # end, the very time _budget_spent says it is spent (a trial: a delay computed
            # apart came to 0 while 'spent' was a rounding error short, and it asked again
            # and again at the same instant)
            retry_at = max(self._now, min(retry_at, head.taken_at + self.settings.max_age))
        if lane.retry_at >= retry_at:
            return  # (as late already, and said)
        lane.retry_at = retry_at
        self._timed[lane] = None
        self._note(NoteKind.RETRY_SCHEDULED, lane.queue_key, head.host,
                   f"attempt {head.failures + 1} in {retry_at - self._now:g}s: "
                   f"{head.last_error}", head.key)

    def _budget_spent(self, msg: Outgoing) -> bool:
        s = self.settings
        if msg.message_type != SURE_MSG or not msg.failures:
            return False
        return ((s.max_attempts is not None and msg.failures >= s.max_attempts)
                or (s.max_age is not None and self._now >= msg.taken_at + s.max_age))

    def _answer(self, link: _Link, frame: _Frame, event) -> None:
        if link.free_closes and link.agreed is not None \
                and frame.sent_at - link.answered_at >= QUIET_BEFORE_IDLE_CLOSE:
            link.free_closes = 0  # (it answers what comes after a quiet spell: see _peer_closed)
        if link.heartbeat_failed_at is not None and link.answered_at < link.heartbeat_failed_at:
            link.up_at = self._now  # alive again after a lost heartbeat: 'running' from here
        link.heard_at = link.answered_at = self._now
        if link.outstanding:  # the next frame's wait starts no earlier than now
            nxt = link.outstanding[0]
            nxt.deadline = max(nxt.deadline, self._now + nxt.timeout)
        lane = frame.lane
        if frame.msg is None:
            if link.agreed is None:  # the first answer fixes the bits (spec section 6)
                link.agreed = event.data & self.settings.extensions
            yes = isinstance(event, QueueYes)
            if lane is None:
                self._heartbeat_answered(link, frame, yes)
                self._wake(link)
                return
            head = lane.pending[0] if lane.pending else None
            if yes and head is not None and head.needs_ex and not link.agreed & EXT_MESSAGE:
                if lane.plain_yes is None:
                    lane.plain_yes = link.host
                # (not naming what the head needs: the reason goes with every message dead-
                # lettered for it, each of which says what of its own needs MESSAGE_EX)
                self._ask_answered(link, lane, False,
                                   "QUEUE_YES, but it speaks plain RQP/1 (no MESSAGE_EX)")
            else:
                lane.declined = lane.declined or not yes
                lane.said_no = lane.said_no or not yes
                self._ask_answered(link, lane, yes, "QUEUE_NO")
        else:
            self._info(lane.queue_key).rtts.append(self._now - frame.sent_at)
            self._settled(link, lane, frame.msg, isinstance(event, DeliveredYes),
                          "DELIVERED_ERROR")
        self._wake(link)

    def _settled(self, link: _Link, lane: _Lane, msg: Outgoing, ok: bool, why: str,
                 counted: bool = True) -> None:
        """A MESSAGE frame answered (or never to be): a batch is settled by its last frame.
        ``counted``: a failure of the route (False: see :meth:`_closed_mid_send`)."""
        if msg.members is not None:
            msg.unanswered -= 1
            if not ok and not msg.batch_error:
                msg.batch_error = why
            if msg.unanswered:
                return
            ok, why = not msg.batch_error, msg.batch_error
        if ok:
            self._confirmed(link, lane, msg)
        else:
            self._not_confirmed(link, lane, msg, why, counted)

    @staticmethod
    def _check_answer(frame: _Frame, event) -> None:
        if frame.msg is None:
            if not isinstance(event, (QueueYes, QueueNo)):
                raise RemoteProtocolError(f"{type(event).__name__} in answer to QUEUE_ASK")
        elif not isinstance(event, (DeliveredYes, DeliveredError)):
            raise RemoteProtocolError(f"{type(event).__name__} in answer to MESSAGE")

    def _ask_answered(self, link: _Link, lane: _Lane, yes: bool, why: str) -> None:
        if lane.asking != link.host:
            raise LocalProtocolError(f"answer to an ask not pending for {link.host}")
        if yes and link.host not in self._hosts_for(lane):
            # asked before a reload took the host out of .rqprc (a trial: its QUEUE_YES made
            # a route to it, kept for good): no route to it; the hosts listed now are asked
            lane.asking = None
            if lane.pending:
                self._fire(lane.pending[0], T.QUEUE_NO_OR_TIMEOUT)
                self._ask(lane, 0)
            else:
                self._forget_if_idle(lane)
            return
        if yes:
            lane.asking = None
            self._set_route(lane.id, link.host)
            self.errors.pop((link.host, lane.id), None)
            self._note(NoteKind.ROUTE_FOUND, lane.queue_key, link.host)
            self._pump(lane)
            self._forget_if_idle(lane)
        else:
            lane.refusals.append(f"{link.host}: {why}")
            if lane.pending:
                self._asked_for(lane.pending[0])
                self._fire(lane.pending[0], T.QUEUE_NO_OR_TIMEOUT)
                self._ask(lane, self._next_index(lane, link.host))
            else:  # the messages were taken out meanwhile (a graceful stop)
                lane.asking = None
                self._forget_if_idle(lane)

    def _next_index(self, lane: _Lane, host) -> int:
        """Where asking goes on after ``host``: the host after it in ``.rqprc`` (the end of
        the list, if a reload removed it, so the round ends there)."""
        hosts = self._hosts_for(lane)
        return hosts.index(host) + 1 if host in hosts else len(hosts)

    def update_settings(self, settings: Settings, now: float) -> None:
        """A reloaded ``.rqprc``: new hosts and timeouts from now on. Connections and frames in
        flight are kept; routes to hosts no longer listed are dropped."""
        if not settings.hosts:
            raise LocalProtocolError("a sending MCA needs at least one host to ask")
        self._now = now
        removed = set(self.settings.hosts) - set(settings.hosts)
        self.settings = settings
        self._idle_lanes.clear()  # (none for a removed host is made busy again)
        for host in settings.hosts:
            if host not in self._links:
                self._links[host] = _Link(host)
            self._links[host].removed = False  # (added again)
        by_name = {str(host): host for host in settings.hosts}
        for queue_key, host in list(self.copies_info):
            # a copy of a host the journal named (by its str) and .rqprc no longer did, back
            # in .rqprc: one line and one set of series for it, not two (a trial's status)
            real = by_name.get(str(host), host)
            if real != host and (queue_key, real) not in self.copies_info:
                self.copies_info[(queue_key, real)] = self.copies_info.pop((queue_key, host))
        for key, host in list(self.routes.items()):
            if host in removed:
                self._drop_route(key, host, "host removed from .rqprc")
        for lane in list(self._lanes.values()):
            if lane.target in removed and lane.asking is None:
                lane.retry_at = 0.0  # its copies are done with now, not after a back-off
            self._pump(lane)
        for host in removed:
            self._links[host].removed = True
            self._close_removed(self._links[host])

    def _confirmed(self, link: _Link, lane: _Lane, msg: Outgoing) -> None:
        lane.inflight -= 1
        lane.probing = lane.failed = False
        self.errors.pop((link.host, lane.id), None)
        self._fire(msg, T.DELIVERED)
        info = self._info(msg.queue_key)
        info.delivered += msg.count
        if self._now - max(lane.created_at, info.last_confirmed_at or lane.created_at,
                           info.started_at or lane.created_at) >= self.settings.stall_after:
            info.resumed_at = self._now  # a stall ends: 'running' counts from here
        info.last_confirmed_at = self._now
        self._finished(msg, "confirmed", link.host)  # (made a str by trace: not per message)
        self._actions.append(Delivered(msg, link.host))
        if msg.fanout is not None:
            copy_info = self._copy_info(msg.queue_key, msg.target)
            copy_info.delivered += msg.count
            copy_info.last_confirmed_at = self._now
            self._copy_ended(msg, reached=True)
        if lane.pending:
            self._pump(lane)  # (which lets the lane go idle if it empties it)
        elif not lane.inflight:  # (with many keys, most answers idle their lane)
            self._forget_if_idle(lane)

    def _not_confirmed(self, link: _Link, lane: _Lane, msg: Outgoing, why: str,
                       counted: bool = True) -> None:
        lane.inflight -= 1
        msg.last_error = (f"{why} from {link.host}" + (
            _REFUSED_WHY if why == "DELIVERED_ERROR" else "") if counted else
            f"{link.host} {why}")
        key = lane.id
        # A DELIVERED_ERROR after the route was dropped by an earlier one is the receiver
        # holding the later messages back to keep the order: no failed try of this one's own
        # (a trial's status said 176 errors for a handful of messages).
        tried = counted and (why != "DELIVERED_ERROR" or self.routes.get(key) == link.host)
        info, copy_info = self._failed_try(lane.queue_key, msg.target, msg.last_error, tried,
                                           link)
        if msg.message_type == UNSURE_MSG:
            for each in (info, copy_info) if copy_info is not None else (info,):
                if counted:
                    each.lost += msg.count
                else:
                    each.unconfirmed_at_close += msg.count
            if not counted:
                self._fire(msg, T.CLOSED_IN_ORDER_UNSURE)
            else:
                self._fire(msg, T.ERROR_OR_TIMEOUT_UNSURE)
                if self.routes.get(key) == link.host:  # (a dropped route counts no more)
                    count = self.errors.get((link.host, key), 0) + 1
                    self.errors[(link.host, key)] = count
                    self._note(NoteKind.ERROR_COUNTED, lane.queue_key, link.host,
                               f"{count} of {self.settings.error_limit}: {why}", msg.key)
                    if count > self.settings.error_limit:
                        self._drop_route(key, link.host, f"error counter {count} over the "
                                         f"limit {self.settings.error_limit}")
                self._fire(msg, T.COUNTED)
            self._finished(msg, "lost (UNSURE, not confirmed)" if counted else
                           "not confirmed: the receiver closed the connection in order with it "
                           "in flight (UNSURE; most likely put)", msg.last_error)
            self._actions.append(Lost(msg, link.host, msg.last_error, likely_put=not counted))
            if msg.fanout is not None:
                self._copy_ended(msg, reached=True)
        else:
            self._fire(msg, T.ERROR_OR_TIMEOUT_SURE)
            msg.answer_lost = why != "DELIVERED_ERROR"
            if tried:  # (held back: a trial saw them use up their retry budgets)
                msg.failures += 1
                lane.probing = lane.failed = True
            if counted:
                self._drop_route(key, link.host, f"SURE message key={msg.key:#018x} not "
                                 f"confirmed: {why}")
            self._requeue(lane, msg)
            if tried:  # (held back: the retry its round's first refusal set stands)
                self._retry_later(lane, msg)
        self._pump(lane)
        self._forget_if_idle(lane)

    def _requeue(self, lane: _Lane, msg: Outgoing) -> None:
        """Put ``msg`` back in its place (by priority, then the order it was taken in)."""
        self._enqueue(lane, msg)

    def _set_route(self, route, host) -> None:
        """``route`` (a lane's id) goes to ``host``; each link counts the routes it carries
        (heartbeats are for links that carry one: looked up for every next_deadline)."""
        old = self.routes.pop(route, None)  # (and back in as the most recent)
        if old is not None:
            self._links[old].routed -= 1
        self.routes[route] = host
        self._links[host].routed += 1
        lane = self._lanes.get(route)
        if lane is not None:
            self._unrouted.discard(lane)
        if len(self.routes) > ROUTE_CACHE:
            self._forget_routes(route)

    def _forget_routes(self, new_route) -> None:
        """Let go of the routes found least recently beyond ROUTE_CACHE that may be (not
        ``new_route``, no busy lane's, no broadcast copies'), with their error counters: the
        next message for one asks the hosts again."""
        lanes = self._lanes

        def gone(route, host) -> None:
            self._links[host].routed -= 1
            self.errors.pop((host, route), None)
            self.forgotten.routes += 1

        _let_go(self.routes, ROUTE_CACHE, lambda route: route == new_route or route in lanes
                or not isinstance(route, int), gone)

    def _drop_route(self, route, host, why: str) -> None:
        """``route``: a lane's id (a queue key, or (queue key, host) for broadcast copies)."""
        if self.routes.get(route) == host:
            del self.routes[route]
            self._links[host].routed -= 1
            lane = self._lanes.get(route)
            if lane is not None:
                self._unrouted.add(lane)
            self.errors.pop((host, route), None)
            self._note(NoteKind.ROUTE_DROPPED, route if isinstance(route, int) else route[0],
                       host, why)

    # --- connections --------------------------------------------------------------------------

    @staticmethod
    def _go(link: _Link, event: LinkEvent) -> None:
        try:
            link.state = LINK_TRANSITIONS[link.state][event]
        except KeyError:
            raise LocalProtocolError(f"connection to {link.host}: {event.value!r} in state "
                                     f"{link.state.value!r}") from None

    def _stranded(self, link: _Link) -> bool:
        """Lanes wait for ``link`` while it is up and has room: no answer to come would wake
        them. Every path that frees room wakes them at once; this is the net under those (a
        trial saw 128 lanes wait 30 s, until a heartbeat's answer woke them, after restarts
        of the sending MCA with 3,000 queues waiting for a route; not reproduced since)."""
        return bool(link.waiting) and link.state is LinkState.UP and self._room(link)

    def _room(self, link: _Link) -> bool:
        """Whether ``link`` (up) may carry one more frame now: within the window, and on a new
        connection nothing before its first answer (:meth:`_pump`)."""
        return len(link.outstanding) < self.settings.window and (
            link.agreed is not None or not link.outstanding)

    def _wait_for(self, link: _Link, lane: _Lane) -> None:
        link.waiting[lane] = None
        if link.state is LinkState.DOWN and link.retry_at <= self._now:
            self._go(link, LinkEvent.CONNECT)
            self._actions.append(Connect(link.host))

    def _wake(self, link: _Link) -> None:
        """Let the lanes waiting for ``link`` go on, oldest first, while there is room."""
        if link.state is LinkState.DOWN:
            if link.waiting and link.retry_at <= self._now:
                self._go(link, LinkEvent.CONNECT)
                self._actions.append(Connect(link.host))
            return
        if link.state is not LinkState.UP:
            return
        while link.waiting and self._room(link):
            lane = next(iter(link.waiting))
            del link.waiting[lane]
            if not lane.pending:  # taken out meanwhile (a graceful stop)
                if lane.asking == link.host:
                    lane.asking = None
                self._forget_if_idle(lane)
            elif lane.asking == link.host:
                lane.asking = None  # the ask could not be sent yet: send it now
                hosts = self._hosts_for(lane)
                self._ask(lane, hosts.index(link.host) if link.host in hosts else len(hosts))
            else:
                self._pump(lane)

    def _routed_key(self, link: _Link) -> int | None:
        """A queue key whose route is ``link``'s host (what a heartbeat asks for), or None."""
        for route, host in self.routes.items():
            if host == link.host:
                return route if isinstance(route, int) else route[0]
        return None

    def _heartbeat_due(self, link: _Link) -> float | None:
        """When ``link`` is to be probed (UP, quiet), or connected again after a failed
        heartbeat (DOWN, ``rewarm``); None: not while it carries no route, or is busy."""
        if not link.routed:
            return None
        if link.state is LinkState.UP:
            return None if link.outstanding else link.heard_at + self.settings.heartbeat_interval
        if link.state is LinkState.DOWN and link.rewarm and not link.waiting:
            return link.retry_at
        return None

    def _heartbeat(self, link: _Link, key: int | None = None) -> None:
        """A QUEUE_ASK for ``key`` (or a key routed to ``link``'s host) that nothing rides on:
        proof that the peer lives and still offers it."""
        if key is None:
            key = self._routed_key(link)
        link.heartbeats += 1
        self._push(link, _Frame(None, None, self.settings.ask_timeout, 0.0, probe=key),
                   encode(QueueAsk(queue_key=key, data=self.settings.extensions)))

    def _heartbeat_answered(self, link: _Link, frame: _Frame, yes: bool) -> None:
        """QUEUE_YES: the peer lives and still offers the queue. QUEUE_NO: it no longer offers
        it: the routes of that key to this host are dropped (the next message asks again)."""
        if yes:
            return
        for route, host in list(self.routes.items()):
            key = route if isinstance(route, int) else route[0]
            if host == link.host and key == frame.probe:
                self._drop_route(route, host, "heartbeat: QUEUE_NO (the receiving MCA no "
                                 "longer offers the queue)")

    def _drop_link(self, link: _Link, why: str, close: bool = True) -> None:
        """The connection ends: every frame it carried is unanswered (spec 5.11)."""
        if close:
            self._actions.append(Close(link.host, why))
        self._go(link, LinkEvent.LOST)
        link.decoder = None
        self._link_failed(link, why)

    def _link_failed(self, link: _Link, why: str) -> None:
        link.failures += 1
        link.last_error = why
        link.failed_at = self._now
        for route, host in self.routes.items():  # its routes show it, with the time
            key = route if isinstance(route, int) else route[0]
            if host == link.host and key in self.info:  # (not the idle ones forgotten)
                self._error(key, f"{link.host}: {why}")
        link.retry_at = self._now + self.settings.reconnect_delay(link.failures)
        self._note(NoteKind.CONNECTION_FAILED, None, link.host, why)
        waiting, link.waiting = list(link.waiting), {}
        frames, link.outstanding = link.outstanding, deque()
        for frame in frames:
            if frame.lane is None:
                continue  # a heartbeat: nothing rides on it
            if frame.msg is None:
                frame.lane.unanswered = True
                self._ask_answered(link, frame.lane, False, why)
            else:
                self._settled(link, frame.lane, frame.msg, False, why)
        # Lanes that were waiting for this link to come up (and were not just dealt with).
        for lane in waiting:
            if lane in link.waiting or lane.id not in self._lanes:
                continue
            if lane.asking == link.host:
                lane.unanswered = True
                self._ask_answered(link, lane, False, why)
            elif lane.pending and self.routes.get(lane.id) == link.host:
                self._route_unreachable(link, lane, why)
            else:
                self._pump(lane)

    def _route_unreachable(self, link: _Link, lane: _Lane, why: str) -> None:
        """A routed lane's receiver cannot be reached: an unconfirmed attempt for its head."""
        head = lane.pending[0]
        key = lane.id
        head.last_error = f"{link.host}: {why}"
        if head.message_type == SURE_MSG:
            self._error(lane.queue_key, head.last_error)
            lane.failed = True  # (asked again from here: retrying, not a route being found)
            self._drop_route(key, link.host, f"SURE message waiting and {why}")
        else:
            # a failed try as the error counter counts it: the status says both (a trial's log
            # said "error counter increased" where the status said 0)
            self._failed_try(lane.queue_key, lane.target, head.last_error, link=link)
            count = self.errors.get((link.host, key), 0) + 1
            self.errors[(link.host, key)] = count
            self._note(NoteKind.ERROR_COUNTED, lane.queue_key, link.host,
                       f"{count} of {self.settings.error_limit}: {why}")
            if count > self.settings.error_limit:
                self._drop_route(key, link.host, f"error counter {count} over the limit "
                                 f"{self.settings.error_limit}")
            else:
                link.waiting[lane] = None  # try the same route again after the back-off
                return
        self._pump(lane)

    # --- endings ------------------------------------------------------------------------------

    def _dead_letter(self, msg: Outgoing, reason: ReasonCode, detail: str,
                     whole: bool = False) -> None:
        """``whole``: a broadcast message dead-lettered once for all its hosts (none took it);
        any other copy's dead letter names its host and its broadcast queue, by which the
        replay tools know it for one host's copy (not to be sent to every host again)."""
        if msg.fanout is not None and not whole:
            detail = f"copy for host {msg.target} of {broadcast_queue(msg.queue_key)}: {detail}"
        if msg.queue_key in self.info or not queue_key_problem(msg.queue_key):
            self._info(msg.queue_key).dead_lettered += msg.count
        self._finished(msg, f"dead-lettered {reason.name}", detail)
        self._actions.append(DeadLetter(msg, reason, detail, whole))
        self._fire(msg, T.DEAD_LETTERED)
        if msg.fanout is not None:
            copy = self._copy_info(msg.queue_key, msg.target)
            if whole:  # (the last host declined too: a trial's status said "0 declined ...
                copy.declined += 1  # 2 dead" of it, "2 declined" of the others)
            else:
                copy.dead_lettered += 1
            self._copy_ended(msg, reached=not whole)

    def _finished(self, msg: Outgoing, outcome: str, where: object) -> None:
        """Remember how ``msg`` ended, by its key(s), for :meth:`trace`."""
        if not msg.key:
            return  # never sent, no key given: nothing to look it up by
        finished = self.finished
        for key in range(msg.key, msg.key + msg.count):
            finished[key] = (outcome, self._now, msg.queue_key, where)
        while len(finished) > FINISHED_MEMORY:
            finished.popitem(last=False)

    def stop_route(self, queue_key: int, now: float) -> int:
        """An operator's "stop": no message for ``queue_key`` is sent from now on (those in
        flight are answered as usual); they wait, journaled if SURE, until
        :meth:`start_route`. Returns how many wait now."""
        self._now = now
        self.stopped.add(queue_key)
        self._info(queue_key).stopped_at = now
        return sum(len(lane.pending) for lane in self._lanes.values()
                   if lane.queue_key == queue_key)

    def start_route(self, queue_key: int, now: float) -> int:
        """Undo :meth:`stop_route`: the waiting messages go on at once."""
        self._now = now
        self.stopped.discard(queue_key)
        self._info(queue_key).started_at = now  # (the stop is not counted as a stall)
        lanes = [lane for lane in self._lanes.values() if lane.queue_key == queue_key]
        waiting = sum(len(lane.pending) for lane in lanes)
        for lane in lanes:
            if lane.id in self._lanes:
                self._pump(lane)
        return waiting

    def retry_now(self, queue_key: int, now: float) -> int:
        """An operator's "retry now" for ``queue_key``: its back-off ends (the messages'
        failure counts start again) and the connections its lanes wait for are tried at once.
        Returns how many messages it concerned (waiting ones)."""
        self._now = now
        lanes = [lane for lane in self._lanes.values()
                 if lane.queue_key == queue_key and lane.pending]
        for lane in lanes:
            lane.retry_at = 0.0
            for msg in lane.pending:
                msg.failures = 0
            for host in self._hosts_for(lane):  # every host it may ask: connect at once
                link = self._links[host]
                if link.state is LinkState.DOWN:
                    link.retry_at = now
                    link.failures = 0
        for lane in lanes:
            if lane.id in self._lanes:
                self._pump(lane)
        for link in self._links.values():
            if link.waiting and link.state is LinkState.DOWN and link.retry_at <= now:
                self._wake(link)
        return sum(len(lane.pending) for lane in lanes) + sum(lane.inflight for lane in lanes)

    def trace(self, key: int, now: float | None = None) -> dict | None:
        """Where the message with RQP key ``key`` is, as far as this sending MCA knows:
        waiting (for which queue, how long, why), in flight (to which host, since when), or
        how it ended (confirmed by which host, lost, dead-lettered with which reason) while
        it is among the last FINISHED_MEMORY; None if it knows nothing of it."""
        now = self._now if now is None else now

        def holds(msg: Outgoing) -> bool:
            return msg.key <= key < msg.key + msg.count if msg.key else False

        for link in self._links.values():
            for frame in link.outstanding:
                if frame.msg is not None and holds(frame.msg):
                    msg = frame.msg
                    return {"state": "in flight", "queue_key": msg.queue_key,
                            "host": str(link.host), "taken_at": msg.taken_at,
                            "attempts": msg.attempts, "answer_due": frame.deadline,
                            "message_type": msg.message_type, "last_error": msg.last_error}
        for lane in self._lanes.values():
            for msg in lane.pending:
                if holds(msg):
                    state = self._lane_state(lane, self.routes.get(lane.id),
                                             self._info(msg.queue_key), now)
                    return {"state": "waiting", "route_state": state,
                            "queue_key": msg.queue_key, "taken_at": msg.taken_at,
                            "attempts": msg.attempts, "failures": msg.failures,
                            "message_type": msg.message_type,
                            "priority": msg.priority, "last_error": msg.last_error,
                            "retry_at": lane.retry_at if lane.retry_at > now else None}
        ended = self.finished.get(key)
        if ended is not None:
            outcome, at, queue_key, where = ended
            return {"state": outcome, "queue_key": queue_key, "at": at, "detail": str(where)}
        return None

    def _forget_if_idle(self, lane: _Lane) -> None:
        """An idle lane leaves the busy ones, kept for reuse (the least recently busy of
        those beyond IDLE_LANES is dropped)."""
        if not lane.pending and not lane.inflight and lane.asking is None:
            self._unrouted.discard(lane)
            if self._lanes.get(lane.id) is lane:  # (not another, busy lane of the same id)
                del self._lanes[lane.id]
                idle = self._idle_lanes
                idle[lane.id] = lane
                if len(idle) > IDLE_LANES:
                    idle.popitem(last=False)
            for link in self._links.values():
                link.waiting.pop(lane, None)

    def _note(self, kind: NoteKind, queue_key: int | None, host, detail: str = "",
              key=None) -> None:
        """``queue_key``: the queue's key, never a lane's id (a broadcast copy's lane is
        (key, host): given that, the agent's log line raised TypeError and it stopped)."""
        self._actions.append(Note(kind, queue_key, host, detail, key))
        if queue_key is not None and kind is not NoteKind.ERROR_COUNTED:
            info = self._info(queue_key)
            if kind in (NoteKind.ROUTE_FOUND, NoteKind.ROUTE_DROPPED):
                info.route_changes += 1
            if info.last_event != kind.value:
                info.last_event, info.since = kind.value, self._now
            info.last_event_at = self._now

    def _error(self, queue_key: int, text: str) -> RouteInfo:
        info = self._info(queue_key)
        info.last_error, info.last_error_at = text, self._now
        return info

    def _failed_try(self, queue_key: int, target, text: str, tried: int = 1,
                    link: _Link | None = None) -> tuple[RouteInfo, RouteInfo | None]:
        """A try that failed with ``text`` (``tried`` 0: one that is not counted), in the
        queue's figures, in those of the host it failed at (``link``; None: no one host, as
        when none offered the queue) and, for a broadcast copy (``target``: its host), in that
        host's line. Returns the queue's and the copy's (None for an ordinary queue)."""
        info = self._error(queue_key, text)
        info.errors += tried
        if link is not None:
            link.failed_tries += tried
        if target is None:
            return info, None
        copy_info = self._copy_info(queue_key, target)
        copy_info.errors += tried
        copy_info.last_error, copy_info.last_error_at = text, self._now
        return info, copy_info

    def _copy_info(self, queue_key: int, host) -> RouteInfo:
        info = self.copies_info.get((queue_key, host))
        if info is None:
            info = self.copies_info[(queue_key, host)] = RouteInfo(queue_key, since=self._now)
        return info

    def _info(self, queue_key: int) -> RouteInfo:
        info = self.info.get(queue_key)
        if info is None:
            info = self.info[queue_key] = RouteInfo(queue_key, since=self._now)
            if len(self.info) > QUEUE_MEMORY:
                self._forget_figures(queue_key)
        return info

    def _forget_figures(self, new_key: int) -> None:
        """Let go of the figures of the least recently busy queue keys beyond QUEUE_MEMORY that
        may be (not ``new_key``, none busy, stopped or broadcast): added to :attr:`forgotten`."""
        lanes, keep = self._lanes, self.stopped | self.settings.broadcast
        _let_go(self.info, QUEUE_MEMORY, lambda key: key == new_key or key in lanes
                or key in keep, lambda key, info: self.forgotten.add(info))

    def _in_flight_by_lane(self) -> tuple[dict, dict]:
        """By lane, when each message in flight was taken (for the lag), and the host they
        went to (a route dropped since: 'finishing'); status only."""
        taken: dict = {}
        carriers: dict = {}
        for link in self._links.values():
            for frame in link.outstanding:
                if frame.msg is not None:
                    taken.setdefault(frame.lane.id, []).append(frame.msg.taken_at)
                    carriers[frame.lane.id] = link.host
        return taken, carriers

    def _progress(self, lane: _Lane | None, info: RouteInfo, now: float,
                  taken: dict) -> tuple[float | None, float | None]:
        """(since when the lane is stalled, or None; when its oldest message was taken, or
        None if nothing waits or is in flight)."""
        if lane is None:
            return None, None
        oldest = min([m.taken_at for m in lane.pending] + taken.get(lane.id, []), default=None)
        if oldest is None or lane.queue_key in self.stopped:
            return None, oldest  # (stopped on purpose: not stalled)
        progress = max(lane.created_at, info.last_confirmed_at or lane.created_at,
                       info.started_at or lane.created_at)
        return (progress if now - progress >= self.settings.stall_after else None), oldest

    def _stalled_why(self, state: str, host, info: RouteInfo, since: float | None = None) -> str:
        """What a stalled route is doing, in words, as far as the sender knows (its last
        error too, if it came after ``since``: an older one is not why it is stuck now)."""
        if state == "running":
            why = f"connected to {host}, no answer confirmed a message"
        elif state == "connecting":
            why = f"cannot connect to {host}"
        elif state == "asking":
            why = "asking the hosts for the queue"
        elif state == "retrying":
            why = "retrying after errors"
        elif state == "no route":
            why = "no route for the queue"
        elif state == "finishing":
            why = f"route dropped; answers due from {host}"
        else:
            why = state
        fresh = info.last_error and (since is None or (info.last_error_at or 0) >= since)
        return f"{why}; last error: {info.last_error}" if fresh else why

    def _lane_state(self, lane: _Lane | None, host, info: RouteInfo,
                    now: float | None = None) -> str:
        if info.queue_key in self.stopped:
            return "stopped"
        if lane is not None and lane.asking is not None:
            # asking again after a failed try is part of retrying, not a route being found:
            # a host that stays down must not look healthy each time it is asked again
            return "retrying" if lane.failed else "asking"
        if lane is not None and host is None and lane.inflight and not (
                lane.pending and lane.failed):  # (a trial saw 'idle' beside 'in flight 3')
            return "finishing"  # (what came since waits for these answers, then asks: _pump)
        if lane is not None and lane.pending and (
                host is None or lane.retry_at > (self._now if now is None else now)):
            return "retrying"  # (with no route: until the next round of asking)
        if host is not None:
            link = self._links[host]
            if link.state is LinkState.UP and not (
                    link.heartbeat_failed_at is not None and
                    link.answered_at < link.heartbeat_failed_at):
                return "running"
            if lane is None and link.state is LinkState.DOWN and not link.rewarm:
                return "idle"  # (closed while idle, by the receiver: made again when needed)
            return "connecting"  # (or connected again and not answered since a lost heartbeat)
        if info.last_event == NoteKind.NO_ROUTE.value and (
                lane is not None or (self._now if now is None else now) - info.last_event_at
                < self.settings.stall_after):
            return "no route"  # (an UNSURE message dead-lettered NO_ROUTE long ago: idle)
        return "idle"

    def _copies_status(self, key: int, now: float, taken: dict) -> list[dict]:
        """Per host, how the copies of broadcast queue ``key`` fare."""
        out = []
        for (queue_key, host), info in self.copies_info.items():
            if queue_key != key:
                continue
            lane, route = self._lanes.get((key, host)), self.routes.get((key, host))
            state = ("declined" if info.declined and lane is None and route is None
                     else self._lane_state(lane, route, info, now))
            stalled, oldest = self._progress(lane, info, now, taken)
            why = self._stalled_why(state, host if route is None else route, info,
                                    stalled) if stalled is not None else ""
            state = "stalled" if stalled is not None else state
            out.append({
                "stalled_since": stalled, "oldest_taken_at": oldest, "stalled_why": why,
                "peer": str(host), "peer_host": host, "state": state, "sent": info.sent,
                "delivered": info.delivered, "declined": info.declined, "lost": info.lost,
                "unconfirmed_at_close": info.unconfirmed_at_close,
                "dead_lettered": info.dead_lettered, "errors": info.errors,
                # (its UNSURE error counter: ERROR_LIMIT of them drop that host's route)
                "error_counter": self.errors.get((host, (key, host)), 0),
                "in_flight": lane.inflight if lane is not None else 0,
                "waiting": len(lane.pending) if lane is not None else 0,
                "last_error": info.last_error, "last_error_at": info.last_error_at,
                "last_message_at": info.last_message_at,
            })
        return out

    def route_status(self, now: float | None = None,
                     only: int | None = None) -> list[dict]:
        """Every queue key this sending MCA has handled (or ``only`` that one, if it has):
        its route and its state in words (as of ``now``, the core's clock; default: its last
        input); a broadcast key: its copies per host under ``copies``. Progress:
        ``oldest_taken_at`` of what waits or is in flight, ``last_confirmed_at``;
        ``stalled_since`` when nothing was confirmed for ``stall_after`` while messages wait
        (``stalled_why``: what the route is doing)."""
        now = self._now if now is None else now
        taken, carriers = self._in_flight_by_lane()
        out = []
        for key in sorted(self.info) if only is None else [only] if only in self.info else []:
            info, lane, host = self.info[key], self._lanes.get(key), self.routes.get(key)
            since = info.since
            copies = self._copies_status(key, now, taken) if key in self.settings.broadcast \
                else None
            if copies:
                states = {c["state"] for c in copies}
                state = next((s for s in ("stalled", "retrying", "asking", "connecting",
                                          "stopped", "finishing", "running") if s in states),
                             "idle")
                in_flight = sum(c["in_flight"] for c in copies)
                waiting = sum(c["waiting"] for c in copies)
                stalled = min((c["stalled_since"] for c in copies
                               if c["stalled_since"] is not None), default=None)
                oldest = min((c["oldest_taken_at"] for c in copies
                              if c["oldest_taken_at"] is not None), default=None)
                why = "; ".join(f"{c['peer']}: {c['stalled_why']}" for c in copies
                                if c["stalled_why"])
            else:
                state = self._lane_state(lane, host, info, now)
                if state == "finishing":  # (no route: the host its answers are due from)
                    host = carriers.get(key)
                in_flight = lane.inflight if lane is not None else 0
                waiting = len(lane.pending) if lane is not None else 0
                stalled, oldest = self._progress(lane, info, now, taken)
                why = self._stalled_why(state, host, info, stalled) if stalled is not None else ""
                state = "stalled" if stalled is not None else state
                if state in ("retrying", "asking", "connecting") and lane is not None:
                    # for how long it has not got on, not since its last retry or ask
                    since = max(lane.created_at, info.last_confirmed_at or lane.created_at,
                                info.started_at or lane.created_at)
                elif state == "connecting":
                    since = max(info.since, self._links[host].failed_at)
                elif state == "running":  # since it last got going: a route found, a
                    # connection made, a stall ended, an operator's start
                    since = max(since, info.resumed_at or 0.0, info.started_at or 0.0,
                                self._links[host].up_at)
                elif state == "stopped":
                    since = info.stopped_at or since
                elif state == "idle":  # since the last thing it did
                    since = max(since, info.last_confirmed_at or 0.0, info.started_at or 0.0,
                                info.last_event_at + self.settings.stall_after
                                if info.last_event == NoteKind.NO_ROUTE.value else 0.0)
            by_priority: dict[int, int] = {}  # what waits, by priority (highest first)
            for each in ([lane] if lane is not None else []) + [
                    self._lanes.get((key, c["peer_host"])) for c in copies or ()]:
                for msg in each.pending if each is not None else ():
                    by_priority[msg.priority] = by_priority.get(msg.priority, 0) + 1
            out.append({
                "queue_key": key, "peer": None if host is None else str(host), "state": state,
                "since": since, "sent": info.sent, "sent_bytes": info.sent_bytes,
                "delivered": info.delivered, "lost": info.lost,
                "unconfirmed_at_close": info.unconfirmed_at_close,
                "dead_lettered": info.dead_lettered, "errors": info.errors,
                "error_counter": self.errors.get((host, key), 0) if host is not None else 0,
                "in_flight": in_flight, "waiting": waiting,
                "waiting_by_priority": {str(p): n for p, n in sorted(by_priority.items(),
                                                                     reverse=True)},
                "route_changes": info.route_changes, "last_error": info.last_error,
                "last_error_at": info.last_error_at, "last_message_at": info.last_message_at,
                "last_confirmed_at": info.last_confirmed_at, "oldest_taken_at": oldest,
                **_rtt_percentiles_ms(info.rtts),
                "retry_in": max(lane.retry_at - now, 0.0) if lane is not None and
                lane.pending and lane.retry_at > now else None,
                "lag": 0.0 if oldest is None else max(now - oldest, 0.0),
                "stalled_since": stalled, "stalled_why": why,
            })
            if copies is not None:
                for c in copies:
                    del c["peer_host"]  # (the host object: not for JSON)
                out[-1]["broadcast"] = True
                out[-1]["copies"] = copies
        return out

    def drain_pending(self) -> list[Outgoing]:
        """Take out every message not in flight, in the order taken (for a graceful stop).

        A broadcast message none of whose copies has been sent or ended comes out once (its
        first copy); UNSURE copies of one partly sent end :class:`Lost` (putting the record
        back would send it to the hosts that have it again); SURE ones stay journaled."""
        out, copies = [], {}
        for lane in list(self._lanes.values()):
            for msg in lane.pending:
                if msg.fanout is None:
                    out.append(msg)
                else:
                    copies.setdefault(msg.fanout, []).append(msg)
            lane.pending.clear()
            lane.retry_at = 0.0
            self._forget_if_idle(lane)
        for fanout, msgs in copies.items():
            if len(msgs) == fanout.copies and not any(m.attempts for m in msgs):
                out.append(min(msgs, key=lambda m: m.seq))
                continue
            for msg in msgs:
                if msg.message_type == UNSURE_MSG:
                    self._actions.append(Lost(msg, msg.target, "the sending MCA stopped before "
                                              "this broadcast copy was sent"))
                    self._copy_ended(msg, reached=False)
        return sorted(out, key=lambda m: m.seq)


def _place(msg: Outgoing) -> tuple[int, int]:
    """Where a message waits in its lane: higher priority first, then the order taken."""
    return (-msg.priority, msg.seq)


def _rtt_percentiles_ms(samples) -> dict:
    """``rtt_p50_ms`` and ``rtt_p99_ms``: the quantiles (nearest rank) of ``samples`` seconds,
    in ms (one sort for both); None if there are none."""
    if not samples:
        return {"rtt_p50_ms": None, "rtt_p99_ms": None}
    ordered, n = sorted(samples), len(samples)
    return {name: round(ordered[min(n - 1, max(0, math.ceil(p * n) - 1))] * 1000, 3)
            for name, p in (("rtt_p50_ms", 0.5), ("rtt_p99_ms", 0.99))}
