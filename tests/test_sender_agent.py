"""The sending MCA against a receiver written independently with struct and sockets
(tests/fake_receiver.py) that misbehaves on demand: silence, garbage, errors, a held window.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
from pathlib import Path

import pytest

from rqp import SURE_MSG, UNSURE_MSG
from tests.agents import (
    PORT, dead_letters, log_lines, send, send_sequence, start_sender, write_rqprc,
)
from tests.testbed import wait_for

Q1 = 0x52510001
FAKE = str(Path(__file__).with_name("fake_receiver.py"))


class Fake:
    def __init__(self, host):
        self.host = host
        self.mode_file = host.workdir / "fake-mode"
        self.proc = host.popen([sys.executable, FAKE, f"{host.address}:{PORT}",
                                str(self.mode_file)])
        wait_for(lambda: self.events("listening"), timeout=20, message="fake did not start")

    def set(self, mode: str) -> None:
        tmp = self.mode_file.with_suffix(".tmp")
        tmp.write_text(mode)
        tmp.replace(self.mode_file)

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.host.output(self.proc).splitlines() if line]

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.lines() if kind in e or e.get("frame") == kind]


@pytest.fixture
def pair(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    return a, Fake(b)


def test_overdue_confirmation_ends_the_connection_and_the_sure_message_keeps_its_key(pair):
    a, fake = pair
    fake.set("mute")  # QUEUE_YES, then no DELIVERED_YES ever
    rqprc = write_rqprc(a, [fake.host], confirm_timeout="0.5s")
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["patient"], SURE_MSG)
    wait_for(lambda: log_lines(a, sender, "no answer to MESSAGE"), timeout=20,
             message="the overdue answer did not end the connection")
    assert "within 0.5s" in log_lines(a, sender, "no answer to MESSAGE")[0]
    wait_for(lambda: len(fake.events("MESSAGE")) >= 2, timeout=20, message="not re-sent")
    fake.set("yes")
    n = len(fake.events("MESSAGE"))
    wait_for(lambda: len(fake.events("MESSAGE")) > n, timeout=20, message="not re-sent")
    sender.send_signal(signal.SIGTERM)  # its last log line counts what was delivered
    assert sender.wait(30) == 0
    assert " delivered=1" in log_lines(a, sender, "stopped:")[0]
    sent = fake.events("MESSAGE")
    assert {m["body"] for m in sent} == {"patient"}
    assert len({m["key"] for m in sent}) == 1  # re-sent with the same unique key (spec 5.6)
    assert len(fake.events("closed")) >= 1 and len(fake.events("connected")) >= 2
    assert len(fake.events("QUEUE_ASK")) >= 2  # every retry starts from asking


def test_a_connection_given_up_is_reset_so_what_it_held_never_arrives_late(pair):
    """A trial on a link gone dark for a minute: the sending MCA gave up the connection at
    confirm_timeout and counted its UNSURE messages lost, but closing the socket left them in
    the kernel, which sent them once the link came back: 108 s late, put behind newer ones
    (order broken). Given up, a connection is now reset: what the kernel still held is
    dropped, and the receiving side sees the reset instead of those frames."""
    a, fake = pair
    fake.set("stall")
    rqprc = write_rqprc(a, [fake.host], confirm_timeout="1s")
    sender = start_sender(a, rqprc)
    count = 200  # 800 KB: more than the stalled side's kernel takes in
    send_sequence(a, rqprc, Q1, "." * 4000, count, UNSURE_MSG)
    wait_for(lambda: fake.events("stalled"), timeout=30, message="no MESSAGE came")
    wait_for(lambda: log_lines(a, sender, "no answer to MESSAGE"), timeout=30,
             message="the connection was not given up")
    fake.set("drain")
    [ended] = wait_for(lambda: fake.events("ended"), timeout=30, message="not ended")
    assert ended["ended"] == "reset"
    got = len(fake.events("MESSAGE"))
    assert got < count, f"all {got} frames came after the connection was given up"
    sender.send_signal(signal.SIGTERM)
    assert sender.wait(30) == 0


def test_garbage_answer_closes_and_the_sender_reconnects(pair):
    a, fake = pair
    fake.set("garbage")
    rqprc = write_rqprc(a, [fake.host])
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["g"], UNSURE_MSG)
    wait_for(lambda: log_lines(a, sender, "unknown message_code 9"), timeout=20,
             message="garbage not detected")
    fake.set("yes")
    send(a, rqprc, Q1, ["after"], UNSURE_MSG)
    wait_for(lambda: any(m["body"] == "after" for m in fake.events("MESSAGE")), timeout=20,
             message="no reconnect")
    assert sender.poll() is None


def test_the_window_bounds_frames_in_flight(pair):
    a, fake = pair
    fake.set("hold 8")
    rqprc = write_rqprc(a, [fake.host], window=8, confirm_timeout="20s")
    start_sender(a, rqprc)
    send(a, rqprc, Q1, [f"w{i}" for i in range(40)], UNSURE_MSG)
    wait_for(lambda: sum(1 for m in fake.events("MESSAGE")) == 40, timeout=30,
             message="not all sent")
    held = [e["outstanding"] for e in fake.events("outstanding")]
    assert held and max(held) == 8  # never more than the window, and the window is used
    bodies = [m["body"] for m in fake.events("MESSAGE")]
    assert bodies == [f"w{i}" for i in range(40)]


def test_delivered_error_never_confirms_a_sure_message(pair):
    a, fake = pair
    fake.set("error")
    rqprc = write_rqprc(a, [fake.host], retry_backoff_initial="0.05s")
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["sure"], SURE_MSG)
    wait_for(lambda: len(fake.events("MESSAGE")) >= 3, timeout=20, message="not retried")
    asks = fake.events("QUEUE_ASK")
    assert len(asks) >= 3  # each retry asks again from the start
    fake.set("yes")
    n = len(fake.events("MESSAGE"))
    wait_for(lambda: log_lines(a, sender, "route found") and len(fake.events("MESSAGE")) > n,
             timeout=20, message="not delivered after the receiver recovered")
    assert len({m["key"] for m in fake.events("MESSAGE")}) == 1
    assert dead_letters(a) == []


def _waits_in_msgrcv(pid: int) -> bool:
    """Whether a thread of process ``pid`` is blocked in msgrcv (an idle sending MCA's reader
    thread waits there for its next record)."""
    for wchan in Path(f"/proc/{pid}/task").glob("*/wchan"):
        try:
            if wchan.read_text() == "do_msgrcv":
                return True
        except OSError:  # (a thread that ended meanwhile)
            continue
    return False


def test_invalid_transmission_records_are_dead_lettered(pair):
    a, fake = pair
    rqprc = write_rqprc(a, [fake.host])
    sender = start_sender(a, rqprc)
    # Idle, it waits in msgrcv itself, which takes only an empty message: that one is taken
    # by the wait (no record: dead-lettered, not lost unseen); records put with nothing but
    # msgsnd (no doorbell, nothing else) wake it.
    wait_for(lambda: _waits_in_msgrcv(sender.pid), timeout=20,
             message="the idle sending MCA does not wait in msgrcv")
    a.python(r"""
import sysv_ipc
q = sysv_ipc.MessageQueue(0x52510000, max_message_size=8192)
q.send(b"", type=1)
""")
    got = []  # (dead_letters takes them off DEAD.LETTER.Q)
    wait_for(lambda: got.extend(dead_letters(a)) or len(got) == 1, timeout=20,
             message="the empty message was not dead-lettered")
    wait_for(lambda: _waits_in_msgrcv(sender.pid), timeout=20, message="not waiting again")
    a.python(r"""
import sysv_ipc
from rqp.protocol.records import TransmissionRecord
q = sysv_ipc.MessageQueue(0x52510000, max_message_size=8192)
q.send(b"not a record at all", type=1)
q.send(b"", type=1)
q.send(TransmissionRecord(message_type=7, queue_key=0x52510001, payload=b"t").to_bytes(), type=1)
q.send(TransmissionRecord(message_type=0, queue_key=0, payload=b"k").to_bytes(), type=1)
""")
    wait_for(lambda: got.extend(dead_letters(a)) or len(got) >= 5, timeout=20,
             message="dead letters missing")
    assert [d["reason"] for d in got] == ["MALFORMED_RECORD"] * 3 + [
        "BAD_MESSAGE_TYPE", "NO_QUEUE_KEY"]
    assert [d["payload"] for d in got] == ["", "not a record at all", "", "t", "k"]
    assert "magic" in got[1]["detail"]
    assert all("0 bytes, shorter than its 64-byte header" in got[i]["detail"] for i in (0, 2))
    assert sender.poll() is None and dead_letters(a) == []
    assert a.python("import sysv_ipc; print(sysv_ipc.MessageQueue(0x52510000).current_messages)"
                    ).strip() == "0"


def test_a_removed_transmission_queue_is_opened_again_even_if_made_again_at_once(pair):
    """ipcrm of the transmission queue while the sending MCA waits on it: it opens the key
    again, whether a producer's msgget(IPC_CREAT) made a new queue under it first or not."""
    a, fake = pair
    rqprc = write_rqprc(a, [fake.host])
    sender = start_sender(a, rqprc)
    for n, remake in enumerate(("at once", "no")):
        wait_for(lambda: _waits_in_msgrcv(sender.pid), timeout=20, message="not idle")
        a.python(r"""
import sys, sysv_ipc
from rqp.protocol.records import TransmissionRecord
sysv_ipc.MessageQueue(0x52510000).remove()
if sys.argv[1] == "at once":
    q = sysv_ipc.MessageQueue(0x52510000, sysv_ipc.IPC_CREAT, mode=0o660, max_message_size=8192)
    q.send(TransmissionRecord(message_type=1, queue_key=0x52510001,
                              payload=sys.argv[1].encode()).to_bytes(), type=1)
""", remake)
        wait_for(lambda: len(log_lines(a, sender, "was removed: opening its key again")) > n,
                 timeout=20, message="the removal was not noticed")
    send(a, rqprc, Q1, ["after"], UNSURE_MSG)
    wait_for(lambda: {m["body"] for m in fake.events("MESSAGE")} == {"at once", "after"},
             timeout=20, message="not served after the queue was made again")
    assert sender.poll() is None
    assert not log_lines(a, sender, "cannot read the transmission queue")


def test_sigterm_keeps_sure_messages_journaled_and_the_next_start_sends_them_first(pair):
    a, fake = pair
    fake.set("no")  # no route: the messages wait in the sender
    rqprc = write_rqprc(a, [fake.host])
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["w1", "w2"], SURE_MSG)
    send(a, rqprc, Q1, ["u3"], UNSURE_MSG)
    wait_for(lambda: log_lines(a, sender, "will be retried"), timeout=20, message="no retry")
    sender.send_signal(signal.SIGTERM)
    assert sender.wait(30) == 0
    assert "1 record(s) not sent yet put back on the transmission queue (1 message(s))" in \
        log_lines(a, sender, "put back")[0]
    fake.set("yes")
    again = start_sender(a, rqprc)
    wait_for(lambda: len(fake.events("MESSAGE")) == 3, timeout=20, message="not sent")
    assert "2 SURE message(s) to send again first" in log_lines(a, again, "journal:")[0]
    assert [m["body"] for m in fake.events("MESSAGE")] == ["w1", "w2", "u3"]  # order kept
    keys = [m["key"] for m in fake.events("MESSAGE")]
    assert len(set(keys)) == 3 and keys[0] >> 32 != keys[2] >> 32  # journaled keys kept


def test_a_second_sender_for_the_same_transmission_queue_is_refused(pair):
    a, fake = pair
    rqprc = write_rqprc(a, [fake.host])
    first = start_sender(a, rqprc)
    second = a.popen([sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc)])
    assert second.wait(30) == 1
    assert f"(pid {first.pid}) already serves transmission queue 0x52510000" in \
        a.output(second, "stderr")
    assert first.poll() is None


@pytest.mark.parametrize("extra", [1, 10])
def test_answers_before_their_questions_close_the_connection_and_lose_nothing(pair, extra):
    """Issue 10: QUEUE_YES and DELIVERED_YES in one packet used to release SURE messages that
    no receiver had confirmed (1 extra answer: 1 lost; 10: all)."""
    a, fake = pair
    fake.set(f"early {extra}")
    rqprc = write_rqprc(a, [fake.host])
    sender = start_sender(a, rqprc)
    bodies = [f"s{i}" for i in range(10)]
    send(a, rqprc, Q1, bodies, SURE_MSG)
    wait_for(lambda: log_lines(a, sender, "answers nothing"), timeout=20,
             message="the early answer was not refused")
    fake.set("yes")
    wait_for(lambda: {e["confirmed"] for e in fake.events("confirmed")} == set(bodies),
             timeout=30, message="not every SURE message was confirmed by the receiver")
    sender.send_signal(signal.SIGTERM)
    assert sender.wait(30) == 0
    assert " delivered=10" in log_lines(a, sender, "stopped:")[0]
    assert not dead_letters(a)


def test_unsure_then_sure_to_a_host_refusing_connections_keeps_retrying(testbed):
    """Issue 10: UNSURE then SURE to the only host, which refuses connections: the UNSURE one
    is dead-lettered at once, the SURE one retried (the route used to freeze for good), and
    delivered once a receiver listens there."""
    from tests.agents import make_queue, receive, start_receiver
    from tests.test_ops import rqpctl

    a, b = testbed.add_host("a"), testbed.add_host("b")
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])  # nothing listens on b yet: connections are refused
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["u"], UNSURE_MSG)
    send(a, rqprc, Q1, ["s"], SURE_MSG)
    [dl] = wait_for(lambda: dead_letters(a), timeout=20, message="UNSURE not dead-lettered")
    assert (dl["reason"], dl["payload"]) == ("NO_ROUTE", "u")
    assert "Connection refused" in dl["detail"]

    def route():
        out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
        return next(iter(json.loads(out.stdout).values()))["routes"][0]
    r = wait_for(lambda: (r := route())["state"] == "retrying" and r, timeout=20,
                 message="the route does not show it is retrying")
    assert "Connection refused" in r["last_error"] and r["waiting"] == 1
    start_receiver(b)
    assert receive(b, Q1, 1) == ["s"]
    assert "Task exception" not in a.output(sender, "stderr")
    assert sender.poll() is None


def test_why_a_connection_failed_is_said_in_words():
    # A trial: `rqpctl status` showed "down (cannot connect: Unknown error -3)" (os.strerror
    # of getaddrinfo's EAI_AGAIN) where `rqpctl ping` said what it was.
    from rqp_agents.links import _failure
    assert _failure(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
                    ) == "cannot resolve the host name: Temporary failure in name resolution"
    assert _failure(ConnectionRefusedError(111, "Connect call failed")) == "Connection refused"
    # a second: "cannot connect: " and nothing, for asyncio's TLS ConnectionResetError()
    assert _failure(ConnectionResetError()) == "Connection reset by peer"
    assert _failure(EOFError()) == "EOFError"


def test_a_receiver_closing_in_order_as_messages_come_is_no_failure_of_the_route(pair):
    """A trial (a receiving MCA with a 300 ms idle_timeout, bursts of messages): each close
    that met messages on their way counted them as errors of the route, dropped it, and put
    the connection in its back-off, in which the UNSURE messages that came found no host:
    270 of 9,000 dead-lettered NO_ROUTE, from a receiver that worked throughout. The sender
    now takes such a close for what it is and connects again at once."""
    a, fake = pair
    # a back-off that no wait below outlasts: a close taken for a failure shows at once
    rqprc = write_rqprc(a, [fake.host], retry_backoff_initial="120s", retry_backoff_max="120s")
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["warm"], UNSURE_MSG)
    wait_for(lambda: fake.events("confirmed"), timeout=20, message="'warm' not confirmed")
    fake.set("close-once")  # the next MESSAGE meets the receiver's end of the connection
    burst = [f"u{i}" for i in range(8)]
    send(a, rqprc, Q1, burst, UNSURE_MSG)
    wait_for(lambda: fake.events("late"), timeout=20, message="the fake did not close")
    send(a, rqprc, Q1, ["s0", "s1"], SURE_MSG)
    after = [f"after{i}" for i in range(5)]
    send(a, rqprc, Q1, after, UNSURE_MSG)

    def confirmed() -> set:
        return {e["confirmed"] for e in fake.events("confirmed")}
    wait_for(lambda: {"s0", "s1", *after} <= confirmed() or dead_letters(a), timeout=60,
             message="not delivered after the close: " + a.output(sender, "stderr")[-3000:])
    assert not dead_letters(a)
    late = {e["late"]["body"] for e in fake.events("late")}
    assert late and late | confirmed() >= set(burst)  # every one reached the receiver
    log = a.output(sender, "stderr")
    for failure in ("connection failed", "error counter increased", "route dropped"):
        assert failure not in log, log
    # what was on its way is not confirmed (an UNSURE message is never sent twice)
    assert len(log_lines(a, sender, "closed the connection in order")) == len(late), log
    assert len(fake.events("connected")) == 2
    # counted apart from the lost ones, in the status and the metrics (not an alarm)
    from tests.test_ops import rqpctl
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
    st = next(iter(json.loads(out.stdout).values()))
    [route] = st["routes"]
    assert (route["lost"], route["unconfirmed_at_close"]) == (0, len(late)), route
    assert (st["stats"].get("lost", 0), st["stats"]["unconfirmed_at_close"]) == (0, len(late))
    metrics = rqpctl(a, "metrics", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    outcomes = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("rqp_sender_outcomes_total{") and route["queue"] in line}
    assert outcomes["unconfirmed_at_close"] == len(late) and outcomes["lost"] == 0, outcomes


def test_a_peer_closing_in_order_at_every_message_fails_and_a_working_host_gets_them(testbed):
    """A hostile trial: a peer listed first that answers each ask after 0.6 s and closes the
    connection in order at its first message, each time, was taken for a receiver's idle
    time-out every time (a free close was rationed in time only): 48 connections in 20 s,
    every SURE message held, every UNSURE one 'lost' there, none reached the working receiver
    listed after it. Such a close is a failure: the connection's back-off sends the next
    asks to the host after it."""
    from tests.agents import make_queue, receive, start_receiver

    a, b, c = testbed.add_host("a"), testbed.add_host("b"), testbed.add_host("c")
    fake = Fake(b)
    fake.set("close-each 0.6")
    start_receiver(c)
    make_queue(c, Q1)
    rqprc = write_rqprc(a, [b, c], retry_backoff_initial="0.5s", retry_backoff_max="30s",
                        retry_max_attempts=5)
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["s0", "s1"], SURE_MSG)
    assert receive(c, Q1, 2, timeout=60) == ["s0", "s1"], a.output(sender, "stderr")[-3000:]
    assert log_lines(a, sender, "connection failed")
    send(a, rqprc, Q1, ["u0", "u1", "u2"], UNSURE_MSG)  # (the route is c's now)
    assert receive(c, Q1, 3, timeout=60) == ["u0", "u1", "u2"]
    assert not dead_letters(a)
    assert len(fake.events("connected")) == 1, fake.events("connected")
