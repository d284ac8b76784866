"""The sending MCA core's atomic batches (spec section 6): one unit, consecutive MESSAGE_EX
frames with BATCH_MORE on all but the last, all-or-nothing retries, never to a plain peer."""

from __future__ import annotations

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.constants import BATCH_MORE, EXT_MESSAGE
from rqp.protocol.events import Message, MessageEx, QueueAsk, QueueYes
from rqp.protocol.frames import encode
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.sender import Close, DeadLetter, Delivered, Lost
from tests.test_sender_protocol import ERR, OK, Q1, Harness

MEMBERS = ((1, b"one"), (7, b"two"), (3, b"three"))


def batch_frames(frames) -> list:
    return [(host, ev) for host, ev in frames if isinstance(ev, (Message, MessageEx))]


def test_a_batch_goes_as_consecutive_message_ex_frames_and_is_delivered_whole():
    h = Harness()
    h.submit(payload=b"before")
    h.submit(payload=b"", members=MEMBERS, priority=6)
    h.submit(payload=b"after")
    frames = batch_frames(h.serve({"b": {Q1}}, ext={"b"}))
    # priority 6 overtakes the plain messages waiting behind the ask
    got = [(type(ev).__name__, ev.message, getattr(ev, "mtype", 1), getattr(ev, "flags", 0))
           for _, ev in frames]
    assert got == [("MessageEx", b"one", 1, BATCH_MORE), ("MessageEx", b"two", 7, BATCH_MORE),
                   ("MessageEx", b"three", 3, 0), ("Message", b"before", 1, 0),
                   ("Message", b"after", 1, 0)]
    keys = [ev.key for _, ev in frames[:3]]
    assert keys == [keys[0], keys[0] + 1, keys[0] + 2]
    assert all(ev.priority == 6 for _, ev in frames[:3])
    delivered = h.of(Delivered)
    assert [d.message.count for d in delivered] == [3, 1, 1]
    assert h.core.route_status()[0]["delivered"] == 5


def test_one_refused_frame_fails_the_unit_sure_sends_it_again_whole_with_the_same_keys():
    h = Harness()
    h.submit(members=MEMBERS)
    answers = iter([OK, OK, ERR])  # the receiver refused it (as a whole, it answers all ERR;
    # a mixed answer must still fail the unit)

    def deliver(host, msg):
        return next(answers, OK) is OK

    frames = batch_frames(h.serve({"b": {Q1}}, ext={"b"}, deliver=deliver))
    assert [ev.message for _, ev in frames] == [b"one", b"two", b"three"] * 2
    assert [ev.key for _, ev in frames[:3]] == [ev.key for _, ev in frames[3:]]
    [done] = h.of(Delivered)
    assert done.message.attempts == 2


def test_an_unsure_batch_not_confirmed_is_lost_as_a_whole():
    h = Harness()
    h.submit(message_type=UNSURE_MSG, members=MEMBERS)
    h.serve({"b": {Q1}}, ext={"b"}, deliver=lambda host, msg: False)
    [lost] = h.of(Lost)
    assert lost.message.count == 3 and h.of(Delivered) == []
    assert h.core.route_status()[0]["lost"] == 3


def test_a_plain_peer_never_gets_a_batch():
    for kind in (SURE_MSG, UNSURE_MSG):
        h = Harness()
        h.submit(message_type=kind, members=MEMBERS)
        frames = h.serve({"b": {Q1}, "c": {Q1}}, ext={"c"})
        assert {host for host, _ in batch_frames(frames)} == {"c"}
        h = Harness()
        h.submit(message_type=kind, members=MEMBERS)
        assert batch_frames(h.serve({"b": {Q1}, "c": {Q1}})) == []
        [dead] = h.of(DeadLetter)
        assert dead.reason is ReasonCode.EXTENSION_UNSUPPORTED
        assert "a batch of 3 needs MESSAGE_EX" in dead.detail


def test_an_expired_batch_is_dead_lettered_whole_before_sending():
    h = Harness()
    h.submit(members=MEMBERS, expires_at_ms=h.wall + 1000)
    h.advance(2)
    assert batch_frames(h.serve({"b": {Q1}}, ext={"b"})) == []
    [dead] = h.of(DeadLetter)
    assert dead.reason is ReasonCode.EXPIRED and dead.message.count == 3


def test_a_connection_lost_mid_batch_settles_the_unit_once():
    h = Harness()
    h.submit(members=MEMBERS)
    h.sent()
    h.answer("b", b"\x05\x01")  # QUEUE_YES with EXT_MESSAGE
    assert len(batch_frames(h.sent())) == 3
    h.answer("b", OK)  # one answer, then the connection drops
    h.core.connection_lost("b", "reset", h.now)
    h.actions()
    assert h.core.held == 1 and h.core.in_flight == 0  # back to waiting, once
    frames = batch_frames(h.serve({"b": {Q1}}, ext={"b"}))  # (c is asked: it says no)
    h.advance()  # b's reconnect back-off
    frames += batch_frames(h.serve({"b": {Q1}}, ext={"b"}))
    assert [ev.message for _, ev in frames] == [b"one", b"two", b"three"]
    assert len(h.of(Delivered)) == 1 and h.core.held == 0


def test_a_batch_whose_retry_budget_runs_out_says_how_many_frames_carried_it():
    """A trial's batch of 3, sent 3 times, was dead-lettered 'after 3 failed tries (3 MESSAGE
    frame(s) sent)': 9 MESSAGE_EX frames had gone."""
    h = Harness(hosts=("b",), max_attempts=3, backoff_initial=0.001, backoff_max=0.001)
    h.submit(members=MEMBERS)
    for _ in range(3):
        h.serve({"b": {Q1}}, ext={"b"}, deliver=lambda host, msg: False)
        if not h.of(DeadLetter):
            h.advance()
    [dead] = h.of(DeadLetter)
    assert dead.reason is ReasonCode.RETRY_BUDGET_EXHAUSTED
    assert dead.detail.startswith("not delivered after 3 failed tries (sent 3 times: 9 "
                                  "MESSAGE_EX frames)"), dead.detail


def test_a_close_in_order_mid_batch_settles_the_unit_once_and_sends_it_again_at_once():
    """The receiver's idle time-out meeting a batch on its way (SenderCore._closed_mid_send):
    the unit is settled once, sent again whole on a new connection at once, with the same
    keys; no failed try, no error of the route."""
    h = Harness(hosts=("b",))
    h.submit(payload=b"first")
    h.serve({"b": {Q1}}, ext={"b"})
    h.advance(1.0)  # a quiet second
    h.submit(members=MEMBERS)
    first = batch_frames(h.sent())
    assert len(first) == 3
    h.core.data_received("b", b"", h.now)  # the receiver's end, nothing answered
    h.actions()
    assert h.core.held == 1 and h.core.in_flight == 0
    again = batch_frames(h.serve({"b": {Q1}}, ext={"b"}))  # no back-off to wait out
    assert [ev.key for _, ev in again] == [ev.key for _, ev in first]
    assert len(h.of(Delivered)) == 2 and h.core.held == 0
    assert h.core.route_status()[0]["errors"] == 0


def test_a_batch_answered_in_part_times_out_naming_its_first_unanswered_frame():
    """A trial's peer answered one frame of two: the log named the batch's first key, which
    had been answered, and called the MESSAGE_EX frame a MESSAGE."""
    h = Harness(hosts=("b",))
    h.submit(members=MEMBERS)
    [(_, ask)] = h.sent()
    assert isinstance(ask, QueueAsk)
    h.answer("b", encode(QueueYes(data=EXT_MESSAGE)))
    frames = batch_frames(h.sent())
    h.answer("b", OK)  # the first of three only
    h.advance()  # confirm_timeout passes
    [close] = h.of(Close)
    assert f"no answer to MESSAGE_EX key={frames[1][1].key:#018x} (message 2 of a batch " \
        "of 3)" in close.reason, close
