"""The sending MCA core's broadcast names (spec section 6): one copy per host that answers
QUEUE_YES, each with its own key, each SURE copy assured on its own. Events and bytes only."""

from __future__ import annotations

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.events import Message, QueueAsk
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.sender import (
    DeadLetter, Declined, Delivered, FanoutEnded, Lost, MsgState, Note, NoteKind, Settings,
)
from tests.test_sender_protocol import OK, Q1, Q2, YES, Harness

BQ = 0x52510AAA  # a broadcast key (PROD_ALL_BA in a real .rqprc)


def cast(hosts=("a", "b", "c"), **settings) -> Harness:
    return Harness(hosts=hosts, broadcast=frozenset({BQ}), **settings)


def delivered(h: Harness) -> list:
    return sorted((d.host, d.message.payload) for d in h.of(Delivered))


def copy_states(h: Harness) -> dict:
    """Per host, the state of its copies, as ``rqpctl status`` shows it."""
    [row] = h.core.route_status()
    return {c["peer"]: c["state"] for c in row["copies"]}


def test_every_host_that_says_yes_gets_one_copy_with_its_own_key():
    h = cast()
    h.submit(BQ, payload=b"hello")
    frames = h.serve({"a": {BQ}, "b": set(), "c": {BQ}})
    asks = sorted(host for host, ev in frames if isinstance(ev, QueueAsk))
    assert asks == ["a", "b", "c"]  # every host is asked, not just up to the first yes
    sent = [(host, ev) for host, ev in frames if isinstance(ev, Message)]
    assert sorted((host, ev.message) for host, ev in sent) == [("a", b"hello"), ("c", b"hello")]
    assert len({ev.key for _, ev in sent}) == 2
    assert delivered(h) == [("a", b"hello"), ("c", b"hello")]
    [declined] = h.of(Declined)
    assert declined.host == "b" and declined.message.state is MsgState.DECLINED
    [ended] = h.of(FanoutEnded)
    assert (ended.fanout.copies, ended.fanout.remaining, ended.fanout.reached) == (3, 0, 2)
    assert h.log.index(ended) == len(h.log) - 1 or not [
        a for a in h.log[h.log.index(ended):] if isinstance(a, (Delivered, Declined))]
    assert h.of(DeadLetter) == [] and h.core.held == 0


def test_an_ordinary_key_still_stops_at_the_first_yes():
    h = cast()
    h.submit(Q1, payload=b"one")
    frames = h.serve({"a": {Q1}, "b": {Q1}, "c": {Q1}})
    assert [host for host, ev in frames if isinstance(ev, QueueAsk)] == ["a"]
    assert delivered(h) == [("a", b"one")] and h.of(FanoutEnded) == []


def test_sure_copy_for_a_host_that_is_down_waits_with_backoff_and_goes_when_it_is_back():
    h = cast(backoff_initial=1.0, backoff_max=4.0)
    for n in range(3):
        h.submit(BQ, payload=b"m%d" % n)
    h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"b"})
    assert delivered(h) == sorted([(host, b"m%d" % n) for host in "ac" for n in range(3)])
    assert h.of(FanoutEnded) == [] and h.of(Declined) == [] and h.of(DeadLetter) == []
    status = {c["peer"]: c for c in h.core.route_status()[0]["copies"]}
    assert status["b"]["waiting"] == 3 and status["b"]["state"] == "retrying"
    assert "Connection refused" in status["b"]["last_error"]
    assert status["b"]["errors"] == 1 and status["a"]["errors"] == 0  # (a trial: b's was 0)
    assert status["a"]["delivered"] == 3 and status["a"]["waiting"] == 0
    assert h.core.waiting_for_route() == 3  # (messages, each held for its copy to b)
    for _ in range(3):  # b stays down a while: asked again with back-off, nothing lost
        h.advance()  # (b's copies are asked for again: a connection to b is being made)
        assert copy_states(h)["b"] == "retrying", "b's copies looked healthy between tries"
        h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"b"})
        assert copy_states(h)["b"] == "retrying"
    frames = []
    for _ in range(3):  # b is back: its copies go at the next try (its connection's back-off
        h.advance()     # and the lane's may take a step or two to line up)
        frames = h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}})
        if frames:
            break
    assert [ev.message for host, ev in frames if isinstance(ev, Message)] == [b"m0", b"m1", b"m2"]
    assert delivered(h) == sorted([(host, b"m%d" % n) for host in "abc" for n in range(3)])
    assert len(h.of(FanoutEnded)) == 3 and h.core.held == 0
    assert h.core.waiting_for_route() == 0


def test_unsure_copy_for_a_host_that_does_not_answer_is_declined_not_dead_lettered():
    h = cast()
    h.submit(BQ, message_type=UNSURE_MSG, payload=b"u")
    h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"b"})
    assert delivered(h) == [("a", b"u"), ("c", b"u")]
    [declined] = h.of(Declined)
    assert declined.host == "b" and "Connection refused" in declined.detail
    assert len(h.of(FanoutEnded)) == 1 and h.of(DeadLetter) == []


def test_no_host_takes_it_one_dead_letter_for_the_message_not_one_per_host():
    for kind in (SURE_MSG, UNSURE_MSG):
        h = cast()
        h.submit(BQ, message_type=kind, payload=b"nobody")
        h.serve({"a": set(), "b": set(), "c": set()})
        [dead] = h.of(DeadLetter)
        assert dead.reason is ReasonCode.NO_ROUTE and "no host takes broadcast queue" in dead.detail
        assert dead.whole  # (its record names no destination host: replayed, to every host)
        assert all(f"{host}: QUEUE_NO" in dead.detail for host in "abc")
        assert len(h.of(Declined)) == 2 and len(h.of(FanoutEnded)) == 1
        # every host declined it, the last one too: not "dead" at that host (a trial)
        [row] = h.core.route_status()
        assert {c["peer"]: (c["declined"], c["dead_lettered"]) for c in row["copies"]} == \
            {"a": (1, 0), "b": (1, 0), "c": (1, 0)} and row["dead_lettered"] == 1, row


def test_a_failed_copy_is_retried_to_its_own_host_only_with_the_same_key():
    h = cast()
    h.submit(BQ, payload=b"x")
    failed = []

    def deliver(host, msg):
        if host == "c" and not failed:
            failed.append(msg.key)
            return False
        return True

    frames = h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, deliver=deliver)  # (retry at once)
    to_c = [ev.key for host, ev in frames if host == "c" and isinstance(ev, Message)]
    assert to_c == failed * 2  # sent again, with its key, to c only
    assert sorted(host for host, ev in frames if isinstance(ev, Message)) == ["a", "b", "c", "c"]
    assert delivered(h) == [("a", b"x"), ("b", b"x"), ("c", b"x")]


def test_every_dead_letter_of_a_copy_names_its_host_and_broadcast_queue():
    """A copy dead-lettered for its retry budget or its expiry said neither its host nor its
    broadcast queue: a replay tool whose .rqprc lacks the name took it for an ordinary
    message, and put it back for every host (those that had their copy got it twice)."""
    h = cast(max_attempts=1)
    h.submit(BQ, payload=b"spent")
    h.submit(BQ, payload=b"late", expires_at_ms=h.wall + 5_000)
    h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"b"})
    h.wall += 10_000
    for _ in range(5):
        h.advance()
        h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"b"})
    dead = {d.message.payload: d for d in h.of(DeadLetter)}
    assert {p: d.reason for p, d in dead.items()} == {
        b"spent": ReasonCode.RETRY_BUDGET_EXHAUSTED, b"late": ReasonCode.EXPIRED}
    for d in dead.values():
        assert d.detail.startswith(f"copy for host b of broadcast queue {BQ:#x}: "), d.detail
        assert not d.whole and d.message.target == "b"
    assert delivered(h) == sorted((host, p) for host in "ac" for p in (b"spent", b"late"))


def test_journaled_copies_resume_only_those_not_done_with_their_keys():
    h = cast()
    h.submit(BQ, payload=b"again", copies=((0x77, "c"), (0x78, "gone:1")), resumed=True)
    frames = h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}})
    [(host, ev)] = [(host, ev) for host, ev in frames if isinstance(ev, Message)]
    assert (host, ev.key) == ("c", 0x77)
    [dead] = h.of(DeadLetter)  # a host that left .rqprc: its SURE copy is not dropped unseen
    assert dead.message.key == 0x78 and "no longer in .rqprc" in dead.detail
    # (a trial: after a kill -9, that host had put it; nothing said it may have been sent)
    assert "it may have been sent to that host then" in dead.detail, dead.detail
    assert len(h.of(FanoutEnded)) == 1


class _Host:
    """A host as .rqprc gives it (an object), where the journal names it by its str."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def test_a_host_the_journal_named_back_in_rqprc_has_one_status_line():
    """A trial: after a restart whose .rqprc left host b out (its journaled copy was
    dead-lettered) and a reload that put it back, status and metrics had two lines for b."""
    a, b = _Host("a:1"), _Host("b:1")
    h = Harness(hosts=(a,), broadcast=frozenset({BQ}))
    h.submit(BQ, payload=b"again", copies=((0x78, "b:1"),), resumed=True)
    assert [d.message.key for d in h.of(DeadLetter)] == [0x78]
    h.core.update_settings(Settings(hosts=(a, b), broadcast=frozenset({BQ})), h.now)
    h.submit(BQ, payload=b"later")
    h.serve({a: {BQ}, b: {BQ}})
    [row] = h.core.route_status()
    peers = [(c["peer"], c["delivered"], c["dead_lettered"]) for c in row["copies"]]
    assert sorted(peers) == [("a:1", 1, 0), ("b:1", 1, 1)], peers


def test_a_copy_for_a_host_gone_before_it_was_journaled_says_nothing_of_a_send():
    h = cast()
    h.submit(BQ, payload=b"new", copies=((0x79, "gone:1"),))
    [dead] = h.of(DeadLetter)
    assert "no longer in .rqprc" in dead.detail and "may have been sent" not in dead.detail


def test_a_host_removed_by_reload_gets_its_waiting_copies_dead_lettered():
    """Its SURE copies, and the UNSURE ones waiting in order behind them (which were counted
    "declined", which that host never said, and kept nowhere)."""
    h = cast()
    h.submit(BQ, payload=b"r")
    h.submit(BQ, payload=b"u", message_type=UNSURE_MSG)
    h.serve({"a": {BQ}, "b": {BQ}, "c": {BQ}}, down={"c"})
    h.core.update_settings(Settings(hosts=("a", "b"), broadcast=frozenset({BQ})), h.now)
    dead = h.of(DeadLetter)
    assert [(d.message.payload, d.message.target, d.reason) for d in dead] == [
        (b"r", "c", ReasonCode.NO_ROUTE), (b"u", "c", ReasonCode.NO_ROUTE)]
    assert len(h.of(FanoutEnded)) == 2 and h.core.held == 0
    [row] = h.core.route_status()
    assert {c["peer"]: (c["declined"], c["dead_lettered"]) for c in row["copies"]}["c"] == \
        (0, 2)


def test_order_within_a_host_and_priority_overtaking_per_host():
    h = cast(hosts=("a", "b"))
    h.submit(BQ, payload=b"low1", priority=1)
    h.submit(BQ, payload=b"low2", priority=1)
    h.submit(BQ, payload=b"high", priority=9)
    frames = h.serve({"a": {BQ}, "b": {BQ}})
    for host in "ab":
        got = [ev.message for hh, ev in frames if hh == host and isinstance(ev, Message)]
        assert got == [b"high", b"low1", b"low2"]


def test_graceful_stop_returns_an_untouched_broadcast_once_and_loses_partly_sent_unsure():
    h = cast()
    h.submit(BQ, message_type=UNSURE_MSG, payload=b"untouched")
    back = h.core.drain_pending()
    assert [m.payload for m in back] == [b"untouched"] and h.core.held == 0
    h = cast()
    h.submit(BQ, message_type=UNSURE_MSG, payload=b"partly")
    h.sent(connect=False)  # b and c are still connecting when the stop comes
    h.core.connected("a", h.now)
    assert h.sent(connect=False) == [("a", QueueAsk(queue_key=BQ, data=1))]
    h.answer("a", YES)
    assert [ev.message for _, ev in h.sent(connect=False)] == [b"partly"]
    assert h.core.drain_pending() == []  # not put back: a has it (or will)
    lost = h.of(Lost)
    assert sorted(x.host for x in lost) == ["b", "c"] and "stopped before" in lost[0].detail
    h.answer("a", OK)
    assert delivered(h) == [("a", b"partly")] and len(h.of(FanoutEnded)) == 1


def test_status_shows_each_hosts_progress():
    h = cast()
    h.submit(BQ, payload=b"s")
    h.submit(Q2, payload=b"plain")
    h.serve({"a": {BQ, Q2}, "b": set(), "c": {BQ}}, down={"c"})
    rows = {row["queue_key"]: row for row in h.core.route_status()}
    assert rows[BQ]["broadcast"] and "copies" not in rows[Q2]
    copies = {c["peer"]: (c["state"], c["delivered"], c["declined"], c["waiting"])
              for c in rows[BQ]["copies"]}
    assert copies == {"a": ("running", 1, 0, 0), "b": ("declined", 0, 1, 0),
                      "c": ("retrying", 0, 0, 1)}
    assert rows[BQ]["waiting"] == 1 and rows[BQ]["state"] == "retrying"
    assert rows[BQ]["waiting_by_priority"] == {"4": 1}


def test_a_stopped_broadcast_queue_shows_stopped_while_its_copies_wait():
    """A trial: the copies said 'stopped', the queue's own line 'idle' (exit 0)."""
    h = cast(hosts=("a",))
    h.core.stop_route(BQ, h.now)
    h.submit(BQ, message_type=UNSURE_MSG, payload=b"x")
    [row] = h.core.route_status()
    assert (row["state"], row["waiting"], copy_states(h)) == ("stopped", 1, {"a": "stopped"})
    h.core.start_route(BQ, h.now)
    h.serve({"a": {BQ}})
    assert delivered(h) == [("a", b"x")] and h.core.route_status()[0]["state"] != "stopped"


def test_an_unsure_copy_whose_host_refuses_the_connection_is_a_failed_try_of_that_copy():
    """The route's error counter counted the refused connection of a routed UNSURE copy, and
    the log said so, while the status's errors (route and copy line) stayed 0."""
    h = cast(hosts=("a", "b"))
    h.submit(BQ, UNSURE_MSG, b"first")
    h.serve({"a": {BQ}, "b": {BQ}})
    h.core.connection_lost("b", "reset by peer", h.now)
    h.submit(BQ, UNSURE_MSG, b"second")
    h.sent()  # (a's copy goes; b's waits for its reconnect back-off)
    h.advance()
    h.sent(connect=False)
    h.core.connect_failed("b", "Connection refused", h.now)
    [counted] = [n for n in h.actions() if isinstance(n, Note)
                 and n.kind is NoteKind.ERROR_COUNTED]  # (the harness checks its queue_key)
    assert (counted.queue_key, counted.host) == (BQ, "b")
    assert h.core.error_count("b", (BQ, "b")) == 1
    [row] = h.core.route_status(h.now)
    copies = {c["peer"]: c for c in row["copies"]}
    assert copies["b"]["errors"] == 1 and "Connection refused" in copies["b"]["last_error"]
    assert copies["a"]["errors"] == 0 and row["errors"] == 1
    # and how near b's route is to its drop (a trial: the log said "1 of 3", the status 0)
    assert (copies["b"]["error_counter"], copies["a"]["error_counter"]) == (1, 0)
