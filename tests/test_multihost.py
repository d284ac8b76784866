"""The sending and receiving MCAs across simulated hosts (issue: test bed scenarios 1-6).

Host a runs the sending MCA; hosts b and c run receiving MCAs. Each host has its own network
and IPC namespace, so each has its own System V queues and DEAD.LETTER.Q.
"""

from __future__ import annotations

import sys

import pytest

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.events import QueueAsk
from rqp.protocol.frames import MESSAGE_HEADER, encode
from tests.agents import (
    PORT, dead_letters, log_lines, make_queue, receive, send, send_sequence, start_receiver,
    start_sender, write_rqprc,
)
from tests.testbed import wait_for

Q1, Q2 = 0x52510001, 0x52510002
BIG_QUEUES = {"kernel.msgmnb": 1 << 22}


@pytest.fixture
def site(testbed_factory):
    """Hosts a (sender), b and c (receivers running), with 4 MiB queues everywhere."""
    bed = testbed_factory(sysctls=BIG_QUEUES)
    a, b, c = bed.add_host("a"), bed.add_host("b"), bed.add_host("c")
    return bed, a, b, c, start_receiver(b), start_receiver(c)


def asks(host, proc, answer: str) -> int:
    return len(log_lines(host, proc, answer))


def test_asks_in_order_delivers_to_the_first_yes_and_keeps_the_route(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q1)  # b lacks the queue, c has it
    rqprc = write_rqprc(a, [b, c])
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["one", "two"], SURE_MSG)
    assert receive(c, Q1, 2) == ["one", "two"]
    send(a, rqprc, Q1, ["three"], UNSURE_MSG)
    send(a, rqprc, Q1, ["four"], SURE_MSG)
    assert receive(c, Q1, 2) == ["three", "four"]
    assert asks(b, rb, "QUEUE_NO") == 1 and asks(b, rb, "QUEUE_YES") == 0
    assert asks(c, rc, "QUEUE_YES") == 1  # asked once: the route is kept
    [found] = log_lines(a, sender, "route found")
    assert f"peer={c.address}:{PORT}" in found
    assert dead_letters(a) == [] and dead_letters(b) == [] and dead_letters(c) == []


def test_receiver_killed_unsure_counts_errors_then_moves_to_b(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q1)
    rqprc = write_rqprc(a, [b, c], error_limit=3)
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["before"], UNSURE_MSG)
    assert receive(c, Q1, 1) == ["before"]
    c.kill(rc)
    make_queue(b, Q1)  # the queue now exists on b as well
    send(a, rqprc, Q1, [f"u{i}" for i in range(5)], UNSURE_MSG)
    # each failed attempt on the dead route counts; over ERROR_LIMIT the route is dropped
    wait_for(lambda: log_lines(a, sender, "route dropped"), timeout=30,
             message="the route to c was never dropped")
    counted = log_lines(a, sender, "error counter increased")
    assert [f"{n} of 3" in line for n, line in zip(range(1, 5), counted)] == [True] * 4
    assert "over the limit 3" in log_lines(a, sender, "route dropped")[0]
    got = receive(b, Q1, 5, timeout=30)
    assert got == [f"u{i}" for i in range(5)]  # never sent to c: none lost, order kept
    assert f"peer={b.address}:{PORT}" in log_lines(a, sender, "route found")[-1]


def test_receiver_killed_sure_reasks_at_once_and_moves_to_b(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q1)
    rqprc = write_rqprc(a, [b, c])
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["s0"], SURE_MSG)
    assert receive(c, Q1, 1) == ["s0"]
    c.kill(rc)
    make_queue(b, Q1)
    send(a, rqprc, Q1, ["s1", "s2", "s3"], SURE_MSG)
    assert receive(b, Q1, 3) == ["s1", "s2", "s3"]
    dropped = log_lines(a, sender, "route dropped")
    assert dropped and "SURE message waiting" in dropped[0]
    assert not log_lines(a, sender, "error counter increased")  # SURE: no counting


def test_no_host_has_the_queue_unsure_dead_letter_sure_waits(site):
    _, a, b, c, rb, rc = site
    rqprc = write_rqprc(a, [b, c])
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["lost cause"], UNSURE_MSG)
    [dl] = wait_for(lambda: dead_letters(a), timeout=20, message="no dead letter on a")
    assert dl["reason"] == "NO_ROUTE" and dl["queue_key"] == Q1 and dl["type"] == UNSURE_MSG
    assert dl["payload"] == "lost cause" and dl["host"] and b.address in dl["detail"]
    send(a, rqprc, Q2, ["patience"], SURE_MSG)
    wait_for(lambda: len(log_lines(a, sender, "will be retried")) >= 2, timeout=20,
             message="the SURE message was not retried")
    assert receive(c, Q2, 1, timeout=0.5) == []
    make_queue(c, Q2)
    assert receive(c, Q2, 1, timeout=30) == ["patience"]
    assert len(dead_letters(a)) == 0  # the SURE one never became a dead letter


def test_ten_thousand_messages_for_one_key_arrive_in_order(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q1)
    rqprc = write_rqprc(a, [b, c])
    start_sender(a, rqprc)
    send_sequence(a, rqprc, Q1, "m", 10_000, SURE_MSG)
    got = receive(c, Q1, 10_000, timeout=120)
    assert len(got) == 10_000 and got == [f"m{i}" for i in range(10_000)]


def test_a_blocked_key_holds_back_only_itself(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q2)  # Q1 exists nowhere yet
    rqprc = write_rqprc(a, [b, c])
    start_sender(a, rqprc)
    for i in range(20):
        send(a, rqprc, Q1, [f"q1-{i}"], SURE_MSG)
        send(a, rqprc, Q2, [f"q2-{i}"], SURE_MSG)
    assert receive(c, Q2, 20) == [f"q2-{i}" for i in range(20)]  # Q2 flows
    make_queue(c, Q1)
    assert receive(c, Q1, 20, timeout=30) == [f"q1-{i}" for i in range(20)]  # Q1 in order


def test_garbage_to_a_receiver_closes_only_that_connection(site):
    _, a, b, c, rb, rc = site
    make_queue(c, Q1)
    rqprc = write_rqprc(a, [c])
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["first"], SURE_MSG)
    assert receive(c, Q1, 1) == ["first"]
    attack = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
results = []
for payload in [bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4]), bytes.fromhex(sys.argv[5])]:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(payload)
    if payload[0] == 0x04:  # truncated QUEUE_ASK: then close our side
        s.shutdown(socket.SHUT_WR)
    results.append(s.recv(100).hex() or "EOF")
    s.close()
print(" ".join(results))
"""
    huge = MESSAGE_HEADER.build({"message_type": 0, "key": 1, "queue_key": Q1,
                                 "message_length": 2**63})
    out = b.python(attack, c.address, str(PORT), "0900ff", encode(QueueAsk(queue_key=Q1))[:5].hex(),
                   huge.hex())
    assert out.split() == ["EOF", "EOF", "EOF"]
    send(a, rqprc, Q1, ["after"], SURE_MSG)  # the sender's connection was not disturbed
    assert receive(c, Q1, 1) == ["after"]
    closing = log_lines(c, rc, "closing connection from")
    assert len(closing) == 3
    assert "unknown message_code 9" in closing[0] and "stream closed inside" in closing[1]
    assert "hard cap" in closing[2]
    assert rc.poll() is None


def test_twenty_sending_mcas_against_one_receiver(testbed_factory):
    bed = testbed_factory(sysctls=BIG_QUEUES)
    r = bed.add_host("r")
    senders = [bed.add_host(f"s{i}") for i in range(4)]
    start_receiver(r, log_level="INFO")
    make_queue(r, Q1)
    configs = []
    for host in senders:  # five sending MCAs per host, each with its own transmission queue
        for j in range(5):
            rqprc = write_rqprc(host, [r], transmission_queue=0x52500000 + j,
                                state_dir=str(host.workdir / f"state{j}"))
            start_sender(host, rqprc, log_level="INFO")
            configs.append((host, rqprc, f"{host.name}.{j}."))
    produce = r"""
import sys, threading, rqp
jobs = [a.split("|") for a in sys.argv[1:]]
def run(rqprc, prefix):
    h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
    for i in range(100):
        rqp.sendMessage(h, f"{prefix}{i}".encode(), rqp.SURE_MSG)
threads = [threading.Thread(target=run, args=job) for job in jobs]
[t.start() for t in threads]
[t.join() for t in threads]
"""
    for host in senders:
        jobs = [f"{rqprc}|{prefix}" for h, rqprc, prefix in configs if h is host]
        host.popen([sys.executable, "-c", produce, *jobs])
    got = receive(r, Q1, 2000, timeout=120)
    assert len(got) == 2000
    for _, _, prefix in configs:  # per sending MCA, in order
        assert [m for m in got if m.startswith(prefix)] == [f"{prefix}{i}" for i in range(100)]

