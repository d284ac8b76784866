"""Atomic batches end to end (spec section 6): the API and rqp.h build one batch record (one
msgsnd: all or nothing), the sending MCA sends it as one MESSAGE_EX batch, the receiving MCA
puts all of it or none. Real daemons on simulated hosts, kill -9 where it hurts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.records import TransmissionFlags, TransmissionRecord, encode_batch
from tests.agents import (
    DLQ, Pair, dead_letters, log_lines, receive, send, start_receiver, start_sender, write_rqprc,
)
from tests.test_broadcast_e2e import depth, sender_status
from tests.test_c_api import cc  # noqa: F401 - the fixture
from tests.testbed import wait_for

Q1 = 0x52510001

BATCH_BUILD = r"""
#include <stdio.h>
#include <stdlib.h>
#include <rqp.h>
/* batch_build KIND QUEUE_KEY PRIORITY (MTYPE PAYLOAD)...: the batch record on stdout, or with
 * "put" as KIND+10 through the default transmission queue */
int main(int argc, char **argv) {
    struct rqp_batch b;
    struct rqp_extras e = rqp_default_extras();
    int kind = atoi(argv[1]);
    e.priority = atoi(argv[3]);
    if (rqp_batch_begin(&b, 8192, kind % 10, (key_t)strtoul(argv[2], NULL, 0), &e) < 0) {
        perror("rqp_batch_begin"); return 3;
    }
    for (int i = 4; i + 1 < argc; i += 2)
        if (rqp_batch_add(&b, argv[i + 1], strlen(argv[i + 1]), strtol(argv[i], NULL, 0)) < 0) {
            perror("rqp_batch_add"); return 3;
        }
    if (kind >= 10) {
        int xmit = rqp_open_transmission_queue(RQP_DEFAULT_TRANSMISSION_QUEUE);
        if (rqp_batch_commit(&b, xmit, RQP_DEFAULT_TRANSMISSION_QUEUE, 7, 0) < 0) {
            perror("rqp_batch_commit"); return 3;
        }
        return 0;
    }
    b.msg[0] = 1;
    rqp_header_((unsigned char *)(b.msg + 1), b.message_type, RQP_FLAG_BATCH, b.queue_key,
                &b.extras, 7);
    fwrite(b.msg + 1, 1, b.len, stdout);
    rqp_batch_rollback(&b);
    return 0;
}
"""

RECEIVE_TYPED = r"""
import json, sys, rqp
q, n = int(sys.argv[1]), int(sys.argv[2])
print(json.dumps([[m.decode(), t] for m, t in
                  (rqp.receiveMessage(q, 30, with_type=True) for _ in range(n))]))
"""

SEND_BATCH = r"""
import json, sys, rqp
rqprc, kind, members = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
with rqp.batch(h, kind) as b:
    for mtype, text in members:
        b.send(text.encode(), mtype=mtype)
print(len(b))
"""


def typed(host, n: int) -> list:
    return [tuple(x) for x in json.loads(host.python(RECEIVE_TYPED, str(Q1), str(n), timeout=60))]


def test_a_c_batch_record_is_the_python_record_byte_for_byte(cc):  # noqa: F811
    exe = cc("batch_build", BATCH_BUILD)
    raw = subprocess.run([exe, "1", hex(Q1), "7", "5", "five", "1", "", "3", "three"],
                         check=True, capture_output=True).stdout
    record = TransmissionRecord.from_bytes(raw)
    assert record.is_batch and record.members() == ((5, b"five"), (1, b""), (3, b"three"))
    assert record == TransmissionRecord(
        message_type=UNSURE_MSG, queue_key=Q1, flags=TransmissionFlags.BATCH,
        payload=encode_batch([(5, b"five"), (1, b""), (3, b"three")]), priority=7,
        producer_pid=record.producer_pid, sequence=7, enqueued_ns=record.enqueued_ns)
    assert record.to_bytes() == raw


def test_python_and_c_batches_arrive_whole_in_order_with_their_types(cc, testbed_factory):  # noqa: F811
    exe = cc("batch_build", BATCH_BUILD)
    p = Pair(testbed_factory(), Q1)
    a, b, rqprc, receiver = p.a, p.b, p.rqprc, p.receiver
    send(a, rqprc, Q1, ["before"], SURE_MSG)
    assert a.python(SEND_BATCH, str(rqprc), str(SURE_MSG),
                    json.dumps([[2, "p-one"], [9, "p-two"], [2, "p-three"]])).strip() == "3"
    a.run([exe, "10", hex(Q1), "4", "4", "c-one", "1", "c-two"])
    send(a, rqprc, Q1, ["after"], UNSURE_MSG)
    assert typed(b, 7) == [("before", 1), ("p-one", 2), ("p-two", 9), ("p-three", 2),
                           ("c-one", 4), ("c-two", 1), ("after", 1)]
    # each batch went as one MESSAGE_EX batch: the receiver saw BATCH_MORE runs, not singles
    assert len(log_lines(b, receiver, "batch of 3")) == 1
    assert len(log_lines(b, receiver, "batch of 2")) == 1
    assert dead_letters(a) == [] and dead_letters(b) == []


def test_a_producer_killed_before_commit_leaves_nothing(testbed_factory):
    p = Pair(testbed_factory(), Q1)
    a, b, rqprc = p.a, p.b, p.rqprc
    producer = a.popen([sys.executable, "-c", r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
rqp.beginBatch(h)
for i in range(3):
    rqp.sendMessage(h, b"uncommitted-%d" % i)
print("added", flush=True)
sys.stdin.read()  # until killed
""", str(rqprc)])
    wait_for(lambda: "added" in a.output(producer), timeout=30, message="producer never added")
    a.kill(producer, signal.SIGKILL)
    send(a, rqprc, Q1, ["marker"], SURE_MSG)  # the same path: had any of it been put, it
    assert receive(b, Q1, 1) == ["marker"]     # would be on the queue before the marker
    assert depth(b, Q1) == 0 and depth(a, 0x52510000) == 0


def test_sender_killed_while_a_sure_batch_waits_it_arrives_whole_once(testbed_factory):
    p = Pair(testbed_factory(), Q1, receiver=False)
    a, b, rqprc, sender = p.a, p.b, p.rqprc, p.sender
    a.python(SEND_BATCH, str(rqprc), str(SURE_MSG), json.dumps([[1, "x1"], [1, "x2"], [5, "x3"]]))
    wait_for(lambda: sender_status(a, rqprc)["journal_depth"] == 1, timeout=30,
             message="the batch was never journaled (as one entry)")
    a.kill(sender, signal.SIGKILL)
    start_receiver(b)
    sender = start_sender(a, rqprc)
    assert typed(b, 3) == [("x1", 1), ("x2", 1), ("x3", 5)]
    wait_for(lambda: sender_status(a, rqprc)["journal_depth"] == 0, timeout=30,
             message="the delivered batch stayed in the journal")
    assert depth(b, Q1) == 0 and dead_letters(b) == [] and dead_letters(a) == []
    # every count is of messages (a trial: 'journal: 3 SURE message(s)' for a batch of 3 and
    # 2 singles, and taken/delivered/lost counting a batch as one, dead_lettered as three)
    assert "journal: 3 SURE message(s) in 1 record(s) to send again first" in \
        log_lines(a, sender, "journal:")[0]
    stats = sender_status(a, rqprc)["stats"]
    assert (stats["from_journal"], stats["delivered"]) == (3, 3), stats


def test_the_receiver_puts_all_of_a_batch_or_none(testbed_factory):
    p = Pair(testbed_factory(), Q1, receiver_config="max_message_size: 16\n")
    a, b, rqprc, sender, receiver = p.a, p.b, p.rqprc, p.sender, p.receiver
    a.python(SEND_BATCH, str(rqprc), str(UNSURE_MSG),
             json.dumps([[1, "small"], [1, "far too big for this receiver"], [1, "small"]]))
    wait_for(lambda: depth(b, DLQ) == 3, timeout=30,
             message="the receiver did not dead-letter the three messages of the batch")
    send(a, rqprc, Q1, ["marker"], SURE_MSG)
    assert receive(b, Q1, 1) == ["marker"]  # nothing of the batch was put before it
    assert depth(b, Q1) == 0
    dead = dead_letters(b)
    assert [d["payload"] for d in dead] == ["small", "", "small"]  # too big: header only
    # every one with the batch's reason (a replay rule for it takes the whole batch); the
    # detail of the others names the message that caused it
    assert [d["reason"] for d in dead] == ["MESSAGE_TOO_BIG"] * 3
    assert all("refused whole: message 2 MESSAGE_TOO_BIG" in d["detail"]
               for d in (dead[0], dead[2]))
    assert log_lines(a, sender, "not confirmed")
    assert log_lines(b, receiver, "batch of 3 for queue 0x52510001")


def test_a_plain_rqp1_receiver_never_gets_part_of_a_batch(testbed):
    from tests.test_extensions_e2e import Fake
    a, b = testbed.add_host("a"), testbed.add_host("b")
    fake = Fake(b)
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc)
    a.python(SEND_BATCH, str(rqprc), str(SURE_MSG), json.dumps([[3, "b1"], [4, "b2"]]))
    send(a, rqprc, Q1, ["marker"], SURE_MSG)
    wait_for(lambda: fake.frames("confirmed"), timeout=30, message="the marker did not arrive")
    assert [m["body"] for m in fake.frames("MESSAGE")] == ["marker"]
    assert fake.frames("UNEXPECTED") == []
    wait_for(lambda: depth(a, DLQ) == 2, timeout=30, message="the batch was not dead-lettered")
    dead = dead_letters(a)
    assert [(d["payload"], d["reason"]) for d in dead] == [
        ("b1", "EXTENSION_UNSUPPORTED"), ("b2", "EXTENSION_UNSUPPORTED")]
    assert [d["mtype"] for d in dead] == [3, 4]  # kept, so that a replay puts them so
    assert "a batch of 2 needs MESSAGE_EX" in dead[0]["detail"]
    assert "message 2 of a batch of 2" in dead[1]["detail"]


FILL = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(int(sys.argv[1]), max_message_size=8192)
while True:
    try:
        q.send(b"f" * 8000, block=False)
    except sysv_ipc.BusyError:
        break
print(q.current_messages)
"""


def test_a_full_destination_queue_never_gets_part_of_a_batch(testbed_factory):
    p = Pair(testbed_factory(), Q1,
             receiver_config="put_retry_count: 3\nput_retry_interval: 0.1\n")
    a, b, rqprc, receiver = p.a, p.b, p.rqprc, p.receiver
    assert b.python(FILL, str(Q1)).strip() == "2"  # 16000 of its 16384 bytes
    a.python(SEND_BATCH, str(rqprc), str(SURE_MSG),
             json.dumps([[10, "m" * 200], [11, "m" * 200], [12, "m" * 200]]))
    wait_for(lambda: depth(b, DLQ) >= 3, timeout=30,
             message="the receiver did not refuse the batch it had no room for")
    assert depth(b, Q1) == 2  # nothing of it was put beside the two fillers
    dead = dead_letters(b)
    assert dead[0]["reason"] == "QUEUE_FULL" and "no room for the batch's 600 bytes" in \
        dead[0]["detail"]
    assert all(d["reason"] == "QUEUE_FULL" and "refused whole" in d["detail"]
               for d in dead[1:3])
    assert typed(b, 1) == [("f" * 8000, 1)]  # a consumer makes room: the SURE batch, whole
    assert typed(b, 4) == [("f" * 8000, 1), ("m" * 200, 10), ("m" * 200, 11), ("m" * 200, 12)]
    assert not log_lines(b, receiver, "put before it")


MISUSE = r"""
#include <stdio.h>
#include <rqp.h>
/* the C batch calls in the wrong order, or with what no queue can take */
int main(void) {
    struct rqp_batch b;
    int xmit = rqp_open_transmission_queue(RQP_DEFAULT_TRANSMISSION_QUEUE);
    printf("begin key 0: %d\n", rqp_batch_begin(&b, 8192, RQP_SURE_MSG, 0, NULL));
    if (rqp_batch_begin(&b, 8192, RQP_SURE_MSG, (key_t)0x52510001, NULL) < 0) return 3;
    printf("add mtype 0: %d\n", rqp_batch_add(&b, "x", 1, 0));
    static char big[9000];
    int rc = rqp_batch_add(&b, big, sizeof big, 1);
    printf("add too big: %d %s\n", rc, strerror(errno));
    rqp_batch_rollback(&b);
    printf("add after rollback: %d\n", rqp_batch_add(&b, "x", 1, 1));
    printf("commit after rollback: %d\n",
           rqp_batch_commit(&b, xmit, RQP_DEFAULT_TRANSMISSION_QUEUE, 0, IPC_NOWAIT));
    return 0;
}
"""


def test_c_batch_calls_out_of_order_fail_with_einval_never_crash(cc, testbed):  # noqa: F811
    exe = cc("misuse", MISUSE)
    host = testbed.add_host("a")  # (its own IPC namespace: the transmission queue is ours)
    out = host.run([exe]).stdout
    assert out.splitlines() == ["begin key 0: -1", "add mtype 0: -1",
                                "add too big: -1 Message too long",
                                "add after rollback: -1", "commit after rollback: -1"]
