"""rqp.system.signals: a program lets go of the signals it takes, whatever mask it inherited
(the programs themselves are stopped that way in test_bench, test_drain and test_ops)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.agents import HOLDING_SIGNALS, held_signals

REPORT = r"""
import signal, sys
from pathlib import Path
from rqp.system import signals
if sys.argv[1] == "ignored":  # (as a non-interactive shell starts a background job)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if sys.argv[2] == "handle":
    previous = signals.handle(lambda *_: None, (signal.SIGTERM,))
    assert previous == {signal.SIGTERM: signal.SIG_DFL}, previous
else:
    signals.let_ctrl_c_through()
print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
print(Path("/proc/self/status").read_text())
"""


def _run(sigint: str, call: str) -> tuple[bool, set[signal.Signals]]:
    out = subprocess.run([*HOLDING_SIGNALS, sys.executable, "-c", REPORT, sigint, call],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    ignored, status = out.split("\n", 1)
    return ignored == "True", held_signals(status)


def test_a_program_lets_go_of_the_signals_it_handles_and_only_those():
    ignored, held = _run("default", "handle")
    assert signal.SIGTERM not in held
    assert {signal.SIGINT, signal.SIGHUP, signal.SIGUSR1} <= held  # (not handled: as they were)
    assert not ignored


@pytest.mark.parametrize("sigint, let_through", [("default", True), ("ignored", False)])
def test_ctrl_c_is_let_through_unless_the_program_was_started_ignoring_it(sigint, let_through):
    ignored, held = _run(sigint, "ctrl-c")
    assert (signal.SIGINT not in held) == let_through
    assert ignored == (sigint == "ignored")
    assert signal.SIGTERM in held


POOL = r"""
import signal, tempfile
from pathlib import Path
from rqp.report import generate

def held_by_the_worker(task):
    blocked = int(next(line.split()[1] for line in Path("/proc/self/status").read_text()
                       .splitlines() if line.startswith("SigBlk:")), 16)
    return f"held={bool(blocked & (1 << (signal.SIGTERM - 1)))}", task[3]  # (path, lines)

generate._write_file = held_by_the_worker  # (inherited by the forked workers)
done = generate.generate(records=40, output=tempfile.mkdtemp(), per_file=10, processes=2)
print(sorted(set(done)))
"""


def test_the_archive_generators_workers_end_on_the_pools_sigterm():
    """A test run held SIGTERM (as CI's runner may): a worker of generate()'s pool, idle when
    the pool's `with` block ended it with SIGTERM, never ended, and the run waited for good."""
    run = subprocess.run([*HOLDING_SIGNALS, sys.executable, "-c", POOL], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['held=False']"  # no worker held SIGTERM
