"""Spec section 6 with real daemons on simulated hosts, and RQP/1 kept byte for byte.

The plain RQP/1 ends are written in the tests from the spec's bytes, not from our frame code:
``tests/fake_receiver.py`` (a receiving MCA with ``struct`` and sockets) and
``tests/rqp_peer.py`` (a raw sending side).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path


from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.reasons import ReasonCode
from tests.agents import (
    PORT, dead_letters, make_queue, start_receiver, start_sender, write_rqprc,
)
from tests.rqp_peer import DELIVERED_ERROR, DELIVERED_YES, QUEUE_YES, ask, msg, raw
from tests.test_receiver_agent import rig
from tests.testbed import wait_for

Q1 = 0x52510001
FAKE = str(Path(__file__).with_name("fake_receiver.py"))
BIG_QUEUES = {"kernel.msgmnb": 1 << 22}

SEND = r"""
import json, sys, rqp
rqprc, key, messages = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
h = rqp.openConnection(key, rqprc=rqprc, start_sender=False)
for m in messages:
    text = m.pop("text").encode()
    rqp.sendMessage(h, text, m.pop("type", 0), **m)
rqp.closeConnection(h)
"""


def send(host, rqprc, messages: list[dict]) -> None:
    host.python(SEND, str(rqprc), str(Q1), json.dumps(messages))


def drain(host, key: int = Q1) -> list[tuple[int, str]]:
    out = host.python(r"""
import json, sys, sysv_ipc
q, got = sysv_ipc.MessageQueue(int(sys.argv[1])), []
while True:
    try:
        data, mtype = q.receive(block=False)
    except sysv_ipc.BusyError:
        break
    got.append([mtype, data.decode()])
print(json.dumps(got))
""", str(key))
    return [tuple(x) for x in json.loads(out)]


def gather(into: list, host) -> list:
    """``into`` with what is now on ``host``'s DEAD.LETTER.Q added (reading takes it off)."""
    into += dead_letters(host)
    return into


def depth(host, key: int) -> int:
    return int(host.python("import sys, sysv_ipc; "
                           "print(sysv_ipc.MessageQueue(int(sys.argv[1])).current_messages)",
                           str(key)))


def pack_message_ex(message_type, key, queue_key, mtype, priority, flags, expires_at_ms,
                    body: bytes) -> bytes:
    """MESSAGE_EX exactly as spec section 6 lays it out."""
    return struct.pack(">BBQQqBBQQ", 7, message_type, key, queue_key, mtype, priority, flags,
                       expires_at_ms, len(body)) + body


def test_the_spec_example_of_message_ex():
    spec = bytes.fromhex(
        "07 00 00 00 00 01 00 00 00 01 00 00 00 00 52 51 00 01 00 00 00 00 00 00 00 05 09 00"
        "00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 02 68 69")
    assert pack_message_ex(0, 0x0000000100000001, 0x52510001, 5, 9, 0, 0, b"hi") == spec


# --- our sending MCA, a plain RQP/1 receiving MCA --------------------------------------------

class Fake:
    def __init__(self, host):
        self.host = host
        self.proc = host.popen([sys.executable, FAKE, f"{host.address}:{PORT}",
                                str(host.workdir / "fake-mode")])
        wait_for(lambda: self.frames("listening"), timeout=20, message="fake did not start")

    def frames(self, kind: str) -> list[dict]:
        lines = [json.loads(x) for x in self.host.output(self.proc).splitlines() if x]
        return [e for e in lines if kind in e or e.get("frame") == kind]


def test_a_plain_receiver_sees_rqp1_byte_for_byte_and_a_typed_message_is_never_put_as_type_1(
        testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    fake = Fake(b)
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc)
    send(a, rqprc, [{"text": "plain"}, {"text": "typed", "mtype": 5},
                    {"text": "urgent", "priority": 9, "ttl": 600},
                    {"text": "unsure-typed", "type": UNSURE_MSG, "mtype": 2},
                    {"text": "last", "type": UNSURE_MSG}])
    wait_for(lambda: len(fake.frames("confirmed")) == 3, timeout=30,
             message="the plain messages did not arrive")
    dead = []  # reading DEAD.LETTER.Q takes the records off it: keep what was read
    wait_for(lambda: len(gather(dead, a)) == 2 or None, timeout=30,
             message="the typed messages were not dead-lettered")
    assert fake.frames("UNEXPECTED") == []  # never a MESSAGE_EX
    for ask_frame in fake.frames("QUEUE_ASK"):  # the data octet offers EXT_MESSAGE; ignored
        assert bytes.fromhex(ask_frame["raw"]) == struct.pack(">BBQ", 4, 1, Q1)
    sent = fake.frames("MESSAGE")
    # (whether "urgent" overtakes "plain" depends on when the sender took it: not checked here)
    assert sorted(m["body"] for m in sent) == ["last", "plain", "urgent"]
    for m in sent:  # exactly spec section 4: code, type, key, queue_key, length, body
        body = m["body"].encode()
        assert bytes.fromhex(m["raw"]) == struct.pack(">BBQQQ", 1, m["type"], m["key"], Q1,
                                                      len(body)) + body
    dead = {d["payload"]: d for d in dead}
    assert {p: d["reason"] for p, d in dead.items()} == {
        "typed": "EXTENSION_UNSUPPORTED", "unsure-typed": "EXTENSION_UNSUPPORTED"}
    assert "mtype 5 needs MESSAGE_EX" in dead["typed"]["detail"]


# --- a plain RQP/1 sending side, our receiving MCA --------------------------------------------

def test_a_plain_sender_gets_rqp1_answers_byte_for_byte_and_message_ex_unasked_is_refused(
        testbed):
    r = rig(testbed, {}, queues={Q1: 0o666})
    r.pb.connect("plain", r.a.address, PORT)
    got = r.pb.exchange("plain", [ask(Q1), msg(Q1, b"hello", key=1)])
    assert got == QUEUE_YES + DELIVERED_YES  # 05 00 02 00: data 0 to a peer that sent 0
    assert r.qa.drain(Q1) == [(1, b"hello")]
    # A MESSAGE_EX where the bit was never agreed: a protocol error, the connection ends.
    r.pb.send("plain", [raw(pack_message_ex(SURE_MSG, 2, Q1, 5, 4, 0, 0, b"sneaky"))])
    end = r.pb.read_to_eof("plain")
    assert end["data"] == b"" and (end["eof"] or end["reset"])
    assert r.qa.drain(Q1) == []
    wait_for(lambda: "MESSAGE_EX" in r.log() or None, timeout=10, message="not logged")


def test_message_ex_is_put_with_its_mtype_and_an_expired_one_is_dead_lettered(testbed):
    r = rig(testbed, {}, queues={Q1: 0o666})
    r.pb.connect("ex", r.a.address, PORT)
    assert r.pb.exchange("ex", [ask(Q1, data=0x01)]) == bytes((5, 1))  # QUEUE_YES, EXT_MESSAGE
    future = int(time.time() * 1000) + 3_600_000
    r.pb.send("ex", [
        raw(pack_message_ex(SURE_MSG, 11, Q1, 5, 9, 0, future, b"five")),
        raw(pack_message_ex(UNSURE_MSG, 12, Q1, 1, 0, 0, 0, b"one")),
        raw(pack_message_ex(UNSURE_MSG, 13, Q1, 3, 4, 0, 1, b"stale")),  # expired in 1970
        msg(Q1, b"plain-on-ex", key=14),
    ])
    got = r.pb.recv("ex", 8)["data"]
    assert got == DELIVERED_YES + DELIVERED_YES + DELIVERED_ERROR + DELIVERED_YES
    assert r.qa.drain(Q1) == [(5, b"five"), (1, b"one"), (1, b"plain-on-ex")]
    [dead] = r.qa.dead_letters()
    assert (dead["reason"], dead["payload"], dead["message_key"]) == (7, b"stale", 13)
    # the dead letter keeps what MESSAGE_EX carried, so that a replay puts it with its type
    assert (dead["record_mtype"], dead["priority"], dead["expires_at_ms"]) == (3, 4, 1)
    assert "expired on arrival" in dead["detail"]


def batch_frames(message_type, first_key, queue_key, bodies, expires_at_ms=0) -> list[dict]:
    """An atomic batch (spec section 6): MESSAGE_EX frames, BATCH_MORE on all but the last."""
    return [raw(pack_message_ex(message_type, first_key + i, queue_key, i + 1, 4,
                                0x01 if i + 1 < len(bodies) else 0, expires_at_ms, body))
            for i, body in enumerate(bodies)]


def answered(r, frames: list[dict]) -> bytes:
    """Send raw request frames on r's connection "ex"; their answers (two octets each)."""
    r.pb.send("ex", frames)
    return r.pb.recv("ex", 2 * len(frames), timeout=15)["data"]


def full_by_number(testbed, retries: int, empties: int):
    """A receiver (put retried every 100 ms, ``retries`` times) with Q1 of 100 bytes holding
    ``empties`` empty messages, and connection "ex" from b that has asked for Q1 with
    MESSAGE_EX agreed."""
    r = rig(testbed, {"put_retry_count": retries, "put_retry_interval": "100ms"})
    r.qa.create(Q1, 0o666, max_size=100)
    for _ in range(empties):
        r.qa.put(Q1, b"")
    r.pb.connect("ex", r.a.address, PORT)
    assert r.pb.exchange("ex", [ask(Q1, data=0x01)]) == bytes((5, 1))
    return r


def test_a_queue_full_by_its_number_of_messages_gets_no_part_of_a_batch_and_no_late_expiry(
        testbed):
    """The kernel counts a queue's messages against msg_qbytes too: a queue of 100 bytes
    holding 95 empty messages has room for 100 bytes but 5 messages (a trial: a batch of 10
    was put half, "the queue filled up meanwhile" though nobody else wrote). And a message
    that waits for room is not put after its expiry (a trial's was put 175 ms after it)."""
    r = full_by_number(testbed, 10, 95)
    bodies = [b"B%d" % i for i in range(10)]
    assert answered(r, batch_frames(UNSURE_MSG, 100, Q1, bodies)) == DELIVERED_ERROR * 10
    assert r.qa.depth(Q1) == 95  # none of it put
    dead = r.qa.dead_letters()
    assert [(ReasonCode(d["reason"]), d["payload"]) for d in dead] == [
        (ReasonCode.QUEUE_FULL, b) for b in bodies], dead  # every one: refused whole
    assert "no room for the batch's 20 bytes and 10 messages" in dead[0]["detail"], \
        dead[0]["detail"]  # (which it was short of: the number, here)
    # 4 messages can never be in a queue of 3 bytes: refused at once, as too big
    r.qa.create(Q1 + 1, 0o666, max_size=3)
    assert answered(r, batch_frames(UNSURE_MSG, 200, Q1 + 1, [b""] * 4)) == DELIVERED_ERROR * 4
    dead = r.qa.dead_letters()
    assert {ReasonCode(d["reason"]) for d in dead} == {ReasonCode.MESSAGE_TOO_BIG} and \
        "4 messages are more than queue" in dead[0]["detail"], dead[0]
    for _ in range(5):  # full by number: 100 messages
        r.qa.put(Q1, b"")
    soon = int(time.time() * 1000) + 300  # well inside the 1 s the put may wait
    assert answered(r, [raw(pack_message_ex(UNSURE_MSG, 300, Q1, 1, 4, 0, soon, b"brief"))]
                    ) == DELIVERED_ERROR
    assert answered(r, batch_frames(UNSURE_MSG, 400, Q1, [b"b1", b"b2"], soon + 300)
                    ) == DELIVERED_ERROR * 2
    dead = r.qa.dead_letters()
    assert [(ReasonCode(d["reason"]), d["payload"]) for d in dead] == [
        (ReasonCode.EXPIRED, b"brief"), (ReasonCode.EXPIRED, b"b1"), (ReasonCode.EXPIRED, b"b2")]
    assert "while it waited for room in queue" in dead[0]["detail"], dead[0]["detail"]
    assert "while the batch waited for room" in dead[1]["detail"], dead[1]["detail"]
    assert r.qa.depth(Q1) == 100


def test_a_sure_batch_sent_again_needs_room_only_for_what_was_not_put(testbed):
    """Its first message was put already (a repeat, answered without a second put): the
    batch needs room for the second only (it waited for room for both, and was refused)."""
    r = full_by_number(testbed, 2, 98)
    assert answered(r, [raw(pack_message_ex(SURE_MSG, 500, Q1, 1, 4, 0, 0, b"a"))]) == \
        DELIVERED_YES  # 99 messages: room for one more
    assert answered(r, batch_frames(SURE_MSG, 500, Q1, [b"a", b"b"])) == DELIVERED_YES * 2
    assert r.qa.depth(Q1) == 100 and r.qa.dead_letters() == []
    assert r.qa.drain(Q1)[-2:] == [(1, b"a"), (2, b"b")]  # once each


# --- priority and expiry through the real agents ----------------------------------------------

def test_priority_overtakes_under_a_backlog_and_survives_a_sender_kill(testbed_factory):
    bed = testbed_factory(sysctls=BIG_QUEUES)
    a, b = bed.add_host("a"), bed.add_host("b")
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc)  # b has no receiver yet: a backlog builds
    plan = [("a4", 4), ("b0", 0), ("c9", 9), ("d4", 4), ("e9", 9), ("f0", 0), ("g4", 4)]
    send(a, rqprc, [{"text": t, "priority": p} for t, p in plan])
    wait_for(lambda: depth(a, 0x52510000) == 0, timeout=30,
             message="the sending MCA did not take the backlog")
    from tests.test_broadcast_e2e import sender_status
    [route] = sender_status(a, rqprc)["routes"]  # what waits, by priority, for an operator
    assert route["waiting_by_priority"] == {"9": 2, "4": 3, "0": 2}
    a.kill(sender)  # kill -9: the journal keeps them, and their order
    start_sender(a, rqprc)
    start_receiver(b)
    wait_for(lambda: depth(b, Q1) == len(plan) or None, timeout=60,
             message="the backlog was not delivered")
    assert [text for _, text in drain(b)] == ["c9", "e9", "a4", "d4", "g4", "b0", "f0"]
    assert dead_letters(a) == [] and dead_letters(b) == []


def test_expiry_at_the_sender_while_a_sure_message_waits_for_a_route(testbed_factory):
    bed = testbed_factory(sysctls=BIG_QUEUES)
    a, b = bed.add_host("a"), bed.add_host("b")
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc)
    start_receiver(b)  # running, but Q1 does not exist on b yet: QUEUE_NO, SURE retries
    send(a, rqprc, [{"text": "brief", "ttl": 1.5}, {"text": "patient"}])
    dead = []  # reading DEAD.LETTER.Q takes the records off it: keep what was read
    wait_for(lambda: gather(dead, a), timeout=30,
             message="the expired message was not dead-lettered")
    make_queue(b, Q1)
    wait_for(lambda: depth(b, Q1) == 1 or None, timeout=30, message="patient not delivered")
    assert drain(b) == [(1, "patient")]
    assert [(d["payload"], d["reason"]) for d in dead] == [("brief", "EXPIRED")]
    assert "before it could be sent" in dead[0]["detail"]
