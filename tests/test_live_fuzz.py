"""A live receiving MCA fed mutated frame streams (rqp.tools.fuzz) over many connections from
one host, while a real sending MCA on another host delivers SURE messages: the receiver stays
up, logs no traceback, and every SURE message arrives once and in order (issue 12)."""

from __future__ import annotations

import sys
import threading

from rqp import SURE_MSG
from rqp.tools import fuzz
from tests.agents import (
    PORT, make_queue, receive, send_sequence, start_receiver, start_sender, write_rqprc,
)
from tests.rqp_peer import Peer, PeerError, raw

Q1, Q2 = 0x52510001, 0x52510002  # (Q2: the fuzz's own, which it puts into)
SURE_COUNT = 200
ATTACKS = 300

#: Takes every message of Q2 as it comes (so that the fuzz's puts never find it full) and
#: prints the largest type it saw.
DRAIN = r"""
import sys, sysv_ipc
q, most = sysv_ipc.MessageQueue(int(sys.argv[1])), 0
while True:
    try:
        _, mtype = q.receive()
    except sysv_ipc.Error:
        break
    if mtype > most:
        most = mtype
        print(most, flush=True)
"""


def test_mutated_streams_on_many_connections_do_not_hurt_a_real_sender(testbed):
    a, b, c = testbed.add_host("a"), testbed.add_host("b"), testbed.add_host("c")
    make_queue(a, Q1, 0o660)
    make_queue(a, Q2, 0o660)
    drain = a.popen([sys.executable, "-c", DRAIN, str(Q2)])
    receiver = start_receiver(a, log_level="INFO")
    rqprc = write_rqprc(b, [a])
    sender = start_sender(b, rqprc, log_level="INFO")
    errors: list[BaseException] = []

    def deliver() -> None:
        try:
            send_sequence(b, rqprc, Q1, "sure-", SURE_COUNT, SURE_MSG)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    honest = threading.Thread(target=deliver)
    honest.start()
    attacker = Peer.start(c)
    refused = 0
    for case in range(ATTACKS):
        data, _ = fuzz.case_stream(20261123, case, queue_keys=(Q2,))
        name = f"x{case}"
        try:
            if not attacker.connect(name, a.address, PORT)["connected"]:
                refused += 1
                continue
            attacker.send(name, [raw(data)])
            attacker.close(name)
        except PeerError:  # the receiver closed it first (a protocol error): as it should
            continue
    honest.join(timeout=180)
    assert not honest.is_alive() and not errors, errors
    got = receive(a, Q1, SURE_COUNT, timeout=60)
    assert got == [f"sure-{n}" for n in range(SURE_COUNT)]
    assert receive(a, Q1, 1, timeout=0.5) == []  # nothing twice
    assert receiver.poll() is None and sender.poll() is None
    log = a.output(receiver, "stderr")
    assert "Traceback" not in log and "CRITICAL" not in log
    assert refused < ATTACKS  # the attack did reach the receiver
    # and its puts: of an mtype beyond a C int too (which stopped a receiving MCA, a trial)
    assert drain.poll() is None
    most = [int(line) for line in a.output(drain, "stdout").split()]
    assert most and most[-1] > 2**31 - 1, most
