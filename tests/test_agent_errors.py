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
    PORT, log_lines, make_queue, receive, send, start_receiver, start_sender, write_rqprc,
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
    pytest.param("rqp_agents.intake:Intake._journal",
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


REMOVED_WHILE_TAKING = r"""
import sys, sysv_ipc
from rqp_agents import intake
take_off = intake.Intake._take_off
def removed_first(self, batch):  # the queue goes between the journal's fsync and the take
    if not getattr(intake, "removed", False):
        intake.removed = True
        sysv_ipc.remove_message_queue(self.queue.id)
    return take_off(self, batch)
intake.Intake._take_off = removed_first
from rqp_agents import sender
sys.exit(sender.main(sys.argv[1:]))
"""


def test_a_transmission_queue_removed_while_records_are_taken_off_loses_nothing(hosts):
    """A trial removed the queue in a loop: once it went between the journal's fsync and the
    take, the sending MCA took that for a journal failure and stopped, with exit status 0
    (systemd would not start it again), saying the records stayed on a queue that was gone.
    Now the records read are sent (the removed queue took nothing else with it) and the key
    is opened again."""
    a, b = hosts
    start_receiver(b)
    rqprc = write_rqprc(a, [b])
    sender = a.popen([sys.executable, "-c", REMOVED_WHILE_TAKING, "--rqprc", str(rqprc),
                      "--log-level", "DEBUG"])
    wait_for(lambda: "serving transmission queue" in a.output(sender, "stderr")
             or sender.poll() is not None, timeout=20, message="the sender did not start")
    send(a, rqprc, Q1, ["read before the removal"], SURE_MSG)
    assert receive(b, Q1, 1) == ["read before the removal"]
    wait_for(lambda: "was removed: opening its key again" in a.output(sender, "stderr"),
             timeout=20, message="the removal was not noticed")
    send(a, rqprc, Q1, ["after"], SURE_MSG)
    assert receive(b, Q1, 1) == ["after"]
    err = a.output(sender, "stderr")
    assert sender.poll() is None and "CRITICAL" not in err and "cannot journal" not in err


JOURNAL_FAILS = r"""
import sys
from rqp.storage import journal
def append(self, entries):
    raise journal.JournalError("injected: no space left on device")
journal.Journal.append = append
from rqp_agents import sender
sys.exit(sender.main(sys.argv[1:]))
"""


def test_a_journal_that_cannot_be_written_stops_the_sender_with_a_failure_status(hosts):
    """Not an unexpected error (no traceback) but no way on: the sending MCA stops as for
    SIGTERM, exit status 1 (Restart=on-failure starts it again), the record still queued."""
    a, b = hosts
    start_receiver(b)
    rqprc = write_rqprc(a, [b])
    failing = a.popen([sys.executable, "-c", JOURNAL_FAILS, "--rqprc", str(rqprc)])
    wait_for(lambda: "serving transmission queue" in a.output(failing, "stderr")
             or failing.poll() is not None, timeout=20, message="the sender did not start")
    send(a, rqprc, Q1, ["kept on the queue"], SURE_MSG)
    assert failing.wait(60) == 1, a.output(failing, "stderr")
    err = a.output(failing, "stderr")
    assert "cannot journal SURE records: injected: no space left on device" in err
    assert "Traceback" not in err
    sender = start_sender(a, rqprc)
    assert receive(b, Q1, 1) == ["kept on the queue"]
    assert sender.poll() is None


UNREADABLE_WHILE_FLAGGED = r"""
import os, sys
from rqp.protocol.errors import QueueError
from rqp.system import queues
peek = queues.LocalQueue.peek
def failing(self, index=0):  # while the flag file is there, reading the queue fails
    if os.path.exists(sys.argv[1]):
        raise QueueError("injected: msgrcv(MSG_COPY) failed: Invalid argument")
    return peek(self, index)
queues.LocalQueue.peek = failing
from rqp_agents import sender
sys.exit(sender.main(sys.argv[2:]))
"""


def test_a_transmission_queue_it_cannot_read_shows_in_the_status(hosts):
    """A trial: with the reader failing once a second (msgrcv EINVAL), `rqpctl status` said
    'transmission queue 0x52510000 (6 waiting)', the route running, exit 0: nothing said the
    records could not be read. The status now says so (exit 4) until it can read again."""
    a, b = hosts
    start_receiver(b)
    rqprc = write_rqprc(a, [b])
    flag = a.workdir / "unreadable"
    flag.write_text("")
    sender = a.popen([sys.executable, "-c", UNREADABLE_WHILE_FLAGGED, str(flag), "--rqprc",
                      str(rqprc)])
    wait_for(lambda: "serving transmission queue" in a.output(sender, "stderr")
             or sender.poll() is not None, timeout=20, message="the sender did not start")
    send(a, rqprc, Q1, ["waits"], SURE_MSG)
    status = [sys.executable, "-m", "rqp.tools.ctl", "status", "--agent", "sender", "--rqprc",
              str(rqprc)]
    out = wait_for(lambda: (o := a.run(status, check=False)).returncode == 4 and o, timeout=20,
                   message="the status did not say the queue cannot be read")
    assert "(1 waiting; CANNOT READ IT: injected: msgrcv(MSG_COPY) failed: Invalid " \
        "argument)" in out.stdout, out.stdout
    # ...and the metrics (a trial: no metric said so, no alert fired)
    metrics = [*status[:3], "metrics", *status[4:]]
    unreadable = "\nrqp_sender_transmission_queue_unreadable {}\n"
    assert unreadable.format("1.0") in a.run(metrics).stdout
    flag.unlink()
    assert receive(b, Q1, 1) == ["waits"]
    out = a.run(status, check=False)
    assert out.returncode == 0 and "CANNOT READ" not in out.stdout, out.stdout
    assert unreadable.format("0.0") in a.run(metrics).stdout
    assert len(log_lines(a, sender, "cannot read the transmission queue")) == 1  # said once
    assert len(log_lines(a, sender, "the transmission queue can be read again")) == 1


@pytest.mark.parametrize("error, fatal", [(ConnectionResetError(), False),
                                          (RuntimeError("a bug"), True)],
                         ids=["a-peer-reset", "a-bug"])
def test_a_future_collected_unread_stops_the_agent_only_for_a_bug(error, fatal):
    """A fresh machine's run: 500 TLS handshakes reset at once stopped a receiving MCA (exit
    70) with "Future exception was never retrieved": asyncio's streams had set the reset on a
    future of their own, collected unread. The connection's code had already dealt with it; a
    peer must not be able to stop an agent so. An error of the agent's own stays fatal."""
    import asyncio
    import gc
    import logging

    from rqp_agents.daemon import Daemon

    agent = Daemon(logging.getLogger("test.daemon"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(agent._on_loop_error)
        future = loop.create_future()
        future.set_exception(error)
        del future
        gc.collect()  # (asyncio reports it as the future is collected)

    asyncio.run(main())
    assert agent.failed is fatal
