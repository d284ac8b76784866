"""An unexpected error in any part of an agent stops it at once: the traceback is logged, the
exit status is 70 (so systemd's Restart=on-failure starts it again), and nothing SURE is lost:
the restarted agents deliver it.

The agents are the real ones, run on simulated hosts, with one method replaced by one that
raises (the stand-in for a bug) before ``main()`` starts.
"""

from __future__ import annotations

import sys

import pytest

from rqp import SURE_MSG
from tests.agents import (
    PORT, make_queue, receive, send, start_receiver, start_sender, write_rqprc,
)
from tests.testbed import wait_for

Q1 = 0x52510001
EXIT_UNEXPECTED = 70

FAULTY = r"""
import importlib, sys
target, agent, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
module, _, attribute = target.partition(":")
owner, _, method = attribute.rpartition(".")
def boom(*args, **kwargs):
    raise RuntimeError("injected fault")
setattr(getattr(importlib.import_module(module), owner), method, boom)
sys.exit(importlib.import_module("rqp_agents." + agent).main(argv))
"""


def _faulty(host, target: str, agent: str, *argv: str):
    return host.popen([sys.executable, "-c", FAULTY, target, agent, *argv,
                       "--log-level", "DEBUG"])


def _assert_stopped_by(host, proc, where: str) -> str:
    assert proc.wait(60) == EXIT_UNEXPECTED, host.output(proc, "stderr")
    err = host.output(proc, "stderr")
    assert f"unexpected error in {where}" in err, err
    assert "Traceback (most recent call last)" in err and "RuntimeError: injected fault" in err
    return err


@pytest.fixture
def hosts(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    make_queue(b, Q1)
    return a, b


@pytest.mark.parametrize("target, where, receiver_up", [
    pytest.param("rqp.protocol.sender:SenderCore.connected", "connecting to", True,
                 id="task"),
    pytest.param("rqp.protocol.sender:SenderCore.data_received", "the connection to", True,
                 id="protocol-callback"),
    pytest.param("rqp.protocol.sender:SenderCore.tick", "the event loop (Exception in callback",
                 False, id="timer"),
    pytest.param("rqp_agents.intake:Intake._journal_and_take",
                 "the transmission-queue reader thread", True, id="reader-thread"),
])
def test_sender_stops_on_an_unexpected_error_and_its_restart_delivers(
        hosts, target, where, receiver_up):
    a, b = hosts
    rqprc = write_rqprc(a, [b])
    if receiver_up:
        start_receiver(b)
    faulty = _faulty(a, target, "sender", "--rqprc", str(rqprc))
    wait_for(lambda: "serving transmission queue" in a.output(faulty, "stderr")
             or faulty.poll() is not None, timeout=20, message="faulty sender did not start")
    send(a, rqprc, Q1, ["kept"], SURE_MSG)
    err = _assert_stopped_by(a, faulty, where)
    assert "Task exception was never retrieved" not in err
    if not receiver_up:
        start_receiver(b)
    sender = start_sender(a, rqprc)
    assert receive(b, Q1, 1) == ["kept"]
    assert sender.poll() is None


def test_receiver_stops_on_an_unexpected_error_and_the_sure_message_waits_for_its_restart(
        hosts):
    a, b = hosts
    state = str(b.workdir / "receiver-state")
    faulty = _faulty(b, "rqp.protocol.receiver:ReceiverConnection.answer_ask", "receiver",
                     "--listen", f"{b.address}:{PORT}", "--state-dir", state, "--plaintext")
    wait_for(lambda: "listening on" in b.output(faulty, "stderr") or faulty.poll() is not None,
             timeout=20, message="faulty receiver did not start")
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["waits"], SURE_MSG)
    _assert_stopped_by(b, faulty, "the connection from")
    start_receiver(b)
    assert receive(b, Q1, 1) == ["waits"]


def test_an_unknown_event_loop_is_refused_with_what_is_expected(tmp_path):
    """RQP_EVENT_LOOP (what scripts/bench --uvloop sets): a wrong value stops the agent at
    once with exit status 1 and says what it takes."""
    import os
    import subprocess
    done = subprocess.run([sys.executable, "-m", "rqp_agents.receiver", "--listen",
                           "127.0.0.1:7", "--state-dir", str(tmp_path)],
                          env={**os.environ, "RQP_EVENT_LOOP": "tokio"}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    assert "RQP_EVENT_LOOP='tokio': expected asyncio or uvloop" in done.stderr
