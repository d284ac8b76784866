"""Broadcast names end to end (spec section 6): real daemons on simulated hosts. Host a sends to
the broadcast name PROD_ALL_BA; b, c and d offer it, d is down for a while (and the sender is
killed meanwhile): each host gets every copy once, in order, d when it is back."""

from __future__ import annotations

import json
import re
import signal

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.sender import budget_size
from tests.agents import (
    dead_letters, log_lines, make_queue, receive, send, start_receiver, start_sender, write_rqprc,
)
from tests.test_ops import rqpctl
from tests.testbed import wait_for

BQ = 0x52510AAA
DEPTH = "import sys, sysv_ipc; print(sysv_ipc.MessageQueue(int(sys.argv[1])).current_messages)"


def depth(host, key: int) -> int:
    return int(host.python(DEPTH, str(key)))


def sender_status(host, rqprc) -> dict:
    out = rqpctl(host, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
    return next(iter(json.loads(out.stdout).values()))


def copies(status: dict) -> dict:
    [route] = [r for r in status["routes"] if r["queue_key"] == BQ]
    assert route["broadcast"] and route["name"] == "PROD_ALL_BA"
    return {c["peer"].split(":")[0]: c for c in route["copies"]}


def test_broadcast_to_three_hosts_one_down_and_back_across_a_sender_kill(testbed):
    a, b, c, d = (testbed.add_host(n) for n in "abcd")
    for host in (b, c, d):
        make_queue(host, BQ)
    start_receiver(b)
    start_receiver(c)
    rqprc = write_rqprc(a, [b, c, d], queues={"PROD_ALL_BA": BQ, "PROD_THE_BA": 0x52510001})
    sender = start_sender(a, rqprc)
    sure = [f"sure-{i}" for i in range(5)]
    send(a, rqprc, BQ, sure, SURE_MSG)
    send(a, rqprc, BQ, ["unsure"], UNSURE_MSG)
    for host in (b, c):
        assert receive(host, BQ, 6) == [*sure, "unsure"]
    # d is down: its SURE copies wait (and are retried), the UNSURE one waits behind them in
    # order, as for an ordinary queue (only memory holds it: the kill below loses it)
    wait_for(lambda: copies(sender_status(a, rqprc))[d.address]["waiting"] == 6, timeout=30,
             message="d's six copies never showed as waiting")
    st = sender_status(a, rqprc)
    per_host = copies(st)
    assert (per_host[b.address]["delivered"], per_host[c.address]["delivered"]) == (6, 6)
    assert per_host[d.address]["delivered"] == 0 and per_host[d.address]["state"] in (
        "retrying", "connecting")  # (asked again after a failed try: retrying, not asking)
    assert st["journal_depth"] == 5  # each message stays journaled until its last copy is done
    text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert text.returncode == 4, text.stdout  # a broadcast with a host behind is not healthy
    assert f"copies to {d.address}" in text.stdout and "(broadcast)" in text.stdout
    [line] = [x for x in text.stdout.splitlines() if f"copies to {d.address}" in x]
    errors = re.search(r" (\d+) errors  ", line)  # d's failed tries (more by now, maybe)
    assert errors and int(errors[1]) >= max(1, per_host[d.address]["errors"]), line
    # the sender is killed: the copies done (b, c) stay done, d's stay owed
    a.kill(sender, signal.SIGKILL)
    sender = start_sender(a, rqprc)
    start_receiver(d)
    assert receive(d, BQ, 5) == sure
    wait_for(lambda: sender_status(a, rqprc)["journal_depth"] == 0, timeout=30,
             message="the journal kept broadcast messages whose copies were all delivered")
    assert "journal: 5 SURE message(s) to send again first" in \
        "\n".join(log_lines(a, sender, "journal:"))
    # counted apart from those taken (a trial's stop said delivered=3397 taken=3396)
    assert sender_status(a, rqprc)["stats"]["from_journal"] == 5
    for host in (b, c, d):  # once each: nothing sent again to b and c after the kill
        assert depth(host, BQ) == 0
        assert dead_letters(host) == []
    assert dead_letters(a) == []


def test_no_host_offers_the_broadcast_one_dead_letter(testbed):
    a, b, c = (testbed.add_host(n) for n in "abc")
    start_receiver(b)
    start_receiver(c)
    rqprc = write_rqprc(a, [b, c], queues={"ALL_NOWHERE": BQ})
    start_sender(a, rqprc)
    send(a, rqprc, BQ, ["lonely"], UNSURE_MSG)
    wait_for(lambda: depth(a, 0x5251DEAD) == 1, timeout=30, message="no dead letter")
    [dead] = dead_letters(a)
    assert dead["reason"] == "NO_ROUTE" and dead["payload"] == "lonely"
    assert "no host takes broadcast queue" in dead["detail"]


def test_sure_copies_for_a_host_that_is_down_do_not_stop_the_other_queues(testbed):
    """More SURE broadcast messages than the sending MCA's budget, one host of the name down:
    each message waits for its copy to that host, and used to hold its place in the budget
    until then, so the budget filled and nothing else was taken off the transmission queue.
    They are held beside the budget now: an ordinary queue still gets its messages."""
    a, b, d = (testbed.add_host(n) for n in "abd")
    make_queue(b, BQ)
    make_queue(b, 0x52510001)
    start_receiver(b)  # (d has none: down)
    rqprc = write_rqprc(a, [b, d], window=8, retry_backoff_initial="30s",
                        retry_backoff_max="30s",
                        queues={"PROD_ALL_BA": BQ, "PROD_THE_BA": 0x52510001})
    start_sender(a, rqprc)
    count = budget_size(8, 2) + 16  # (more than the budget holds)
    many = [f"all-{i}" for i in range(count)]
    send(a, rqprc, BQ, many, SURE_MSG)
    send(a, rqprc, 0x52510001, ["after them"], SURE_MSG)
    assert receive(b, 0x52510001, 1, timeout=30) == ["after them"]
    assert receive(b, BQ, count) == many
    st = wait_for(lambda: (st := sender_status(a, rqprc))["waiting_for_route"] == count and st,
                  timeout=30, message="the broadcast messages did not all wait for d")
    assert copies(st)[d.address]["waiting"] == count and st["journal_depth"] == count


def test_a_host_that_fails_an_unsure_copy_does_not_stop_the_sending_mca(testbed):
    """A hostile trial: one host of a broadcast name answering DELIVERED_ERROR to an UNSURE
    copy, or refusing the connection for one, stopped the whole sending MCA (exit 70): the
    error counter's log line was given the copy's lane, (key, host), for a queue key. The
    other host gets every copy; the failing host's counts say what happened."""
    a, b, c = (testbed.add_host(n) for n in "abc")
    for host in (b, c):
        make_queue(host, BQ)
    start_receiver(b, config="max_message_size: 100\n")  # (a longer message: DELIVERED_ERROR)
    receiver_c = start_receiver(c)
    rqprc = write_rqprc(a, [b, c], queues={"PROD_ALL_BA": BQ})
    sender = start_sender(a, rqprc)
    send(a, rqprc, BQ, ["short"], UNSURE_MSG)
    for host in (b, c):
        assert receive(host, BQ, 1) == ["short"]
    send(a, rqprc, BQ, ["L" * 200], UNSURE_MSG)  # b refuses its copy
    assert receive(c, BQ, 1) == ["L" * 200]
    wait_for(lambda: log_lines(a, sender, "error counter increased") or sender.poll() is not None,
             timeout=20, message="b's DELIVERED_ERROR was not counted")
    assert sender.poll() is None, a.output(sender, "stderr")[-3000:]  # (it stopped here: 70)
    c.stop(receiver_c)  # c refuses connections now
    send(a, rqprc, BQ, ["after"], UNSURE_MSG)
    assert receive(b, BQ, 1) == ["after"]
    wait_for(lambda: len(log_lines(a, sender, "error counter increased")) >= 2, timeout=20,
             message="c's refused connection was not counted")
    assert sender.poll() is None, a.output(sender, "stderr")[-3000:]
    per_host = copies(sender_status(a, rqprc))  # (c's copy is tried again meanwhile: 1 or more)
    assert per_host[b.address]["errors"] == 1 and per_host[c.address]["errors"] >= 1, per_host
    assert "Connection refused" in per_host[c.address]["last_error"]
    assert "Traceback" not in a.output(sender, "stderr")
