"""The sending MCA core's side of spec section 6: negotiation, MESSAGE_EX or plain MESSAGE,
what a plain RQP/1 peer cannot carry, priority and expiry. Events and bytes only."""

from __future__ import annotations

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.constants import EXT_MESSAGE
from rqp.protocol.events import Message, MessageEx, QueueYes
from rqp.protocol.frames import encode
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.sender import Connect, DeadLetter, Delivered, Note, NoteKind
from tests.test_sender_protocol import ERR, Q1, Ask, Harness

YES_EX = encode(QueueYes(data=EXT_MESSAGE))


def messages(frames) -> list:
    return [(host, ev) for host, ev in frames if isinstance(ev, Message)]


def test_asks_offer_the_extension_and_a_taking_peer_gets_message_ex_only_when_needed():
    h = Harness()
    h.submit(payload=b"plain")
    h.submit(payload=b"typed", mtype=5)
    h.submit(payload=b"urgent", priority=9)
    frames = h.serve({"b": {Q1}}, ext={"b"})
    assert frames[0] == ("b", Ask(Q1))
    sent = messages(frames)
    # priority 9 overtook the two waiting behind the ask; defaults go as a plain MESSAGE
    assert [(type(ev).__name__, ev.message) for _, ev in sent] == [
        ("MessageEx", b"urgent"), ("Message", b"plain"), ("MessageEx", b"typed")]
    assert (sent[0][1].priority, sent[0][1].mtype) == (9, 1)
    assert (sent[2][1].mtype, sent[2][1].priority, sent[2][1].expires_at_ms) == (5, 4, 0)
    assert len(h.of(Delivered)) == 3


def test_a_plain_peer_gets_plain_messages_priority_and_expiry_honoured_here():
    h = Harness()
    h.submit(payload=b"a", priority=9, expires_at_ms=h.wall + 60_000)
    frames = h.serve({"b": {Q1}})
    [(host, ev)] = messages(frames)
    assert host == "b" and type(ev) is Message and ev.message == b"a"


def test_an_mtype_a_plain_host_cannot_carry_goes_to_the_next_host_that_can():
    h = Harness()
    h.submit(payload=b"typed", mtype=7)
    frames = h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"})
    assert [f for f in frames if not isinstance(f[1], Message)] == [("b", Ask(Q1)),
                                                                      ("c", Ask(Q1))]
    [(host, ev)] = messages(frames)
    assert host == "c" and isinstance(ev, MessageEx) and ev.mtype == 7
    assert h.core.routes == {Q1: "c"}


def test_only_plain_hosts_offer_it_the_typed_message_is_dead_lettered_never_put_as_type_1():
    for kind in (SURE_MSG, UNSURE_MSG):
        h = Harness()
        h.submit(message_type=kind, payload=b"t1", mtype=3)
        h.submit(message_type=kind, payload=b"t2", mtype=5)
        h.submit(message_type=kind, payload=b"plain")
        frames = h.serve({"b": {Q1}, "c": {Q1}})
        assert [ev.message for _, ev in messages(frames)] == [b"plain"]
        dead = h.of(DeadLetter)
        assert [(d.message.payload, d.reason) for d in dead] == [
            (b"t1", ReasonCode.EXTENSION_UNSUPPORTED), (b"t2", ReasonCode.EXTENSION_UNSUPPORTED)]
        # each says what of its own needs MESSAGE_EX (a trial: a batch's said "mtype 5", the
        # message at the head when the hosts were asked)
        assert dead[0].detail.startswith("mtype 3 needs MESSAGE_EX") and \
            dead[1].detail.startswith("mtype 5 needs MESSAGE_EX") and "mtype 3" not in \
            dead[1].detail, [d.detail for d in dead]
        assert "b: QUEUE_YES, but it speaks plain RQP/1 (no MESSAGE_EX)" in dead[1].detail
        assert h.core.routes == {Q1: "b"}  # the plain messages still have their route


def test_a_typed_sure_message_waits_while_a_host_that_may_carry_it_gives_no_answer():
    """A plain host said QUEUE_YES, the other host did not answer (a trial: stopped for a
    second, or refusing connections): the SURE message needing MESSAGE_EX is a failed try,
    sent when that host answers; the UNSURE one before it cannot wait (NO_ROUTE), and the
    plain messages behind wait in order behind the SURE one."""
    h = Harness()
    h.submit(message_type=UNSURE_MSG, payload=b"u", mtype=3)
    h.submit(payload=b"typed", mtype=5)
    h.submit(payload=b"plain")
    frames = h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"}, down={"c"})
    assert {(host, type(ev).__name__) for host, ev in frames} == {("b", "QueueAsk")}
    [dead] = h.of(DeadLetter)
    assert (dead.message.payload, dead.reason) == (b"u", ReasonCode.NO_ROUTE), dead
    assert dead.detail.startswith("mtype 3 needs MESSAGE_EX (spec section 6): no host "), \
        dead.detail
    assert "b: QUEUE_YES, but it speaks plain RQP/1" in dead.detail and "c: " in dead.detail
    assert h.core.held == 2 and not h.core.routes
    retry = [n for n in h.of(Note) if n.kind is NoteKind.RETRY_SCHEDULED][-1]
    assert "no host that takes MESSAGE_EX answered for queue" in retry.detail, retry
    h.advance()  # the failed try's back-off: c is up again
    frames = h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"})
    assert [(host, ev.message) for host, ev in messages(frames)] == [
        ("c", b"typed"), ("c", b"plain")]
    assert len(h.of(DeadLetter)) == 1 and len(h.of(Delivered)) == 2


def test_a_typed_message_is_dead_lettered_once_every_host_answered_and_none_can_carry_it():
    h = Harness()
    h.submit(payload=b"typed", mtype=5)
    h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"}, down={"c"})
    assert not h.of(DeadLetter)
    h.advance()
    h.serve({"b": {Q1}}, ext={"c"})  # c answers now: QUEUE_NO
    [dead] = h.of(DeadLetter)
    assert dead.reason is ReasonCode.EXTENSION_UNSUPPORTED and "c: QUEUE_NO" in dead.detail


def test_a_plain_yes_routes_the_rest_when_the_typed_head_left_during_the_round():
    """A review: the typed head expired while c's ask was unanswered; b (plain) had said
    QUEUE_YES, yet the UNSURE message behind was dead-lettered NO_ROUTE."""
    from tests.test_sender_protocol import YES
    h = Harness(ask_timeout=5.0)
    h.submit(payload=b"typed", mtype=5, expires_at_ms=h.wall + 1000)
    h.submit(message_type=UNSURE_MSG, payload=b"u")
    h.submit(payload=b"P")
    assert h.sent() == [("b", Ask(Q1))]
    h.answer("b", YES)  # plain RQP/1 (data 0)
    assert h.sent() == [("c", Ask(Q1))]  # c never answers
    sent = []
    for _ in range(10):
        if sent:
            break
        h.advance()
        sent = messages(h.sent())
    assert [(host, ev.message) for host, ev in sent] == [("b", b"u"), ("b", b"P")], sent
    assert [(d.message.payload, d.reason) for d in h.of(DeadLetter)] == [
        (b"typed", ReasonCode.EXPIRED)]


def test_retries_are_not_spent_while_the_host_that_may_carry_it_is_only_in_back_off():
    """A review: with retry_max_attempts 3, the typed SURE message was dead-lettered when c,
    the one host that could carry it, had been dialled twice: one try passed it over in its
    connection's back-off. That is no try: c is dialled once for each."""
    h = Harness(max_attempts=3)
    h.submit(payload=b"typed", mtype=5)
    for _ in range(10):
        h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"}, down={"c"})
        if h.of(DeadLetter):
            break
        h.advance()
    [dead] = h.of(DeadLetter)
    assert dead.reason is ReasonCode.RETRY_BUDGET_EXHAUSTED, dead
    assert [a.host for a in h.of(Connect)].count("c") == 3


def test_a_route_to_a_plain_host_is_asked_again_for_a_typed_message():
    h = Harness()
    h.submit(payload=b"first")
    h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"})
    assert h.core.routes == {Q1: "b"}
    h.submit(payload=b"typed", mtype=2)
    frames = h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"})
    assert [(host, type(ev).__name__) for host, ev in frames] == [
        ("b", "QueueAsk"), ("c", "QueueAsk"), ("c", "MessageEx")]
    drops = [n for n in h.of(Note) if n.kind is NoteKind.ROUTE_DROPPED]
    assert "mtype 2 needs MESSAGE_EX and this connection is plain RQP/1" in drops[-1].detail


def test_bits_are_learned_again_on_every_connection():
    h = Harness(hosts=("b",))
    h.submit(payload=b"one", mtype=4)
    h.serve({"b": {Q1}}, ext={"b"})
    h.core.connection_lost("b", "reset", h.now)  # the peer was replaced by a plain one
    h.submit(payload=b"two", mtype=4)
    h.advance()  # the reconnect's back-off
    frames = h.serve({"b": {Q1}})
    assert frames[0] == ("b", Ask(Q1)) and not messages(frames)
    assert [d.reason for d in h.of(DeadLetter)] == [ReasonCode.EXTENSION_UNSUPPORTED]


def test_priority_order_under_a_backlog_and_order_kept_within_a_priority():
    h = Harness(hosts=("b",), window=1)
    order = [(b"a4", 4), (b"b4", 4), (b"c9", 9), (b"d0", 0), (b"e9", 9), (b"f4", 4), (b"g0", 0)]
    for payload, priority in order:
        h.submit(payload=payload, priority=priority)
    frames = h.serve({"b": {Q1}}, ext={"b"})
    assert [ev.message for _, ev in messages(frames)] == [
        b"c9", b"e9", b"a4", b"b4", b"f4", b"d0", b"g0"]


def test_failed_sure_messages_go_back_to_their_places_by_priority():
    h = Harness(hosts=("b",), window=4)
    for payload, priority in ((b"z4", 4), (b"x9", 9), (b"y9", 9)):
        h.submit(payload=payload, priority=priority)
    h.sent()
    h.answer("b", YES_EX)
    assert [ev.message for _, ev in messages(h.sent())] == [b"x9", b"y9", b"z4"]
    h.answer("b", ERR * 3)  # refused (the receiver holds the rest back after the first)
    h.core.submit(SURE_MSG, Q1, b"w9", h.now, priority=9)  # arrives while they wait
    sent = [ev.message for _, ev in messages(h.serve({"b": {Q1}}, ext={"b"}))]
    assert sent == [b"x9", b"y9", b"w9", b"z4"]


def test_expired_before_sending_is_dead_lettered_at_once():
    h = Harness()
    h.submit(payload=b"late", expires_at_ms=h.wall - 1)
    assert h.sent() == []
    [dead] = h.of(DeadLetter)
    assert dead.reason is ReasonCode.EXPIRED and "expired 0.001s ago" in dead.detail


def test_a_sure_message_waiting_for_a_route_expires_by_the_clock_not_by_a_sleep():
    h = Harness(hosts=("b",), backoff_initial=10.0, backoff_max=60.0)
    h.submit(payload=b"soon", expires_at_ms=h.wall + 25_000)
    h.submit(payload=b"never")
    h.serve({})  # nobody offers Q1: SURE retries with back-off
    assert not h.of(DeadLetter)
    waited = 0.0
    while not h.of(DeadLetter):
        waited += h.advance()
        h.serve({})
    [dead] = h.of(DeadLetter)
    assert dead.message.payload == b"soon" and dead.reason is ReasonCode.EXPIRED
    assert 25.0 <= waited <= 25.0 + 1e-6  # woken at the expiry, not at the next retry
    assert h.core.held == 1  # the one without expiry still waits


def test_expired_in_the_middle_of_a_lane_leaves_the_rest_in_order():
    h = Harness(hosts=("b",))
    h.submit(payload=b"1")
    h.submit(payload=b"2", expires_at_ms=h.wall + 1000)
    h.submit(payload=b"3")
    h.serve({})
    h.advance(2.0)  # (the retry's QUEUE_ASK goes out now too)
    assert [d.message.payload for d in h.of(DeadLetter)] == [b"2"]
    sent = [ev.message for _, ev in messages(h.serve({"b": {Q1}}))]
    assert sent == [b"1", b"3"]
