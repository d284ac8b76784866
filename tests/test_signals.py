"""rqp.system.signals: a program lets go of the signals it takes, whatever mask it inherited
(the programs themselves are stopped that way in test_bench, test_drain and test_ops)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rqp.system import signals
from tests.agents import HOLDING_SIGNALS, held_signals

REPORT = r"""
import os, signal, sys
from pathlib import Path
from rqp.system import signals
if sys.argv[1] == "ignored":  # (as a non-interactive shell starts a background job, nohup)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
if sys.argv[2] == "handle":
    previous = signals.handle(lambda *_: None, (signal.SIGTERM, signal.SIGHUP))
    assert previous == ({signal.SIGTERM: signal.SIG_DFL} if sys.argv[1] == "ignored" else
                        {signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}), previous
else:
    signals.let_stops_through()
print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, signal.getsignal(signal.SIGHUP))
print(Path("/proc/self/status").read_text())
"""


def _run(start: str, call: str) -> tuple[str, set[signal.Signals]]:
    out = subprocess.run([*HOLDING_SIGNALS, sys.executable, "-c", REPORT, start, call],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    dispositions, status = out.split("\n", 1)
    return dispositions, held_signals(status)


@pytest.mark.parametrize("start", ["default", "ignored"])
def test_a_program_lets_go_of_the_signals_it_handles_and_only_those(start):
    dispositions, held = _run(start, "handle")
    assert not {signal.SIGTERM, signal.SIGHUP} & held
    assert {signal.SIGINT, signal.SIGUSR1} <= held  # (not handled: as they were)
    if start == "ignored":  # nohup's SIGHUP stays ignored: not taken over
        assert dispositions == f"True {int(signal.SIG_IGN)}"


@pytest.mark.parametrize("start", ["default", "ignored"])
def test_the_stop_signals_are_let_through_and_ignored_ones_stay_ignored(start):
    dispositions, held = _run(start, "through")
    assert not signals.STOP_SIGNALS & held
    assert signal.SIGUSR1 in held
    assert dispositions.startswith(str(start == "ignored"))


STOPS = r"""
import os, signal, sys
from rqp.system import signals
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
os.kill(os.getpid(), signal.SIGTERM)  # held: it waits
try:
    signals.take_stops()
except KeyboardInterrupt as exc:
    print("early:", exc)
try:
    signals.take_stops()
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000): pass
except KeyboardInterrupt as exc:
    print("first:", exc)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(os.getpid(), sig)  # a burst: noted, not raised
        for _ in range(1000): pass
    print("burst noted:", [signal.Signals(s).name for s in signals.stopped])
signals.take_stops()
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a library takes SIGINT: PySpark)
signals.quiet_stops()
os.kill(os.getpid(), signal.SIGINT)
for _ in range(1000): pass
print("quiet:", [signal.Signals(s).name for s in signals.stopped])
"""


def test_the_first_stop_raises_once_and_the_clean_up_is_not_broken_into():
    """A trial's find: a stop held by the starter raised a traceback from the tools' set-up,
    and a burst of different stop signals broke into the clean-up (tracebacks, a working
    directory left). The first stop raises, also one that waited; the rest are noted; after
    quiet_stops() nothing raises, even through a handler a library installed meanwhile."""
    out = subprocess.run([sys.executable, "-c", STOPS], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "early: signal SIGTERM", "first: signal SIGTERM",
        "burst noted: ['SIGTERM', 'SIGINT', 'SIGHUP', 'SIGTERM']", "quiet: ['SIGINT']"]


SWALLOWED = r"""
import os, signal, sys
from rqp.system import signals


class Dropped:
    def __del__(self):  # a finalizer: what the handler raises in it, Python only prints
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10 ** 5):
            pass


def swallowed():
    Dropped()  # (dropped at once)
    print("went on", flush=True)


signals.take_stops()
swallowed()
try:
    signals.raise_if_stopped()
except KeyboardInterrupt as exc:
    print("raised again:", exc, flush=True)
signals.quiet_stops()
signals.raise_if_stopped()  # (gone its way: the clean-up has begun)
for end in ("ends", "fails"):
    signals.take_stops()
    try:
        with signals.raised_for_sure():
            swallowed()
            if end == "fails":
                raise OSError("a failure that the stop caused")
        print("not stopped", flush=True)
    except KeyboardInterrupt as exc:
        print(f"{end}: {exc}; context {exc.__context__!r}", flush=True)
    signals.quiet_stops()
signals.take_stops()
try:
    with signals.raised_for_sure():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10 ** 5):
            pass
except KeyboardInterrupt as exc:
    print("raised at once:", exc, flush=True)
signals.raise_if_stopped()  # (it went its way through the block: nothing more)
print("done", flush=True)
"""


def test_a_stop_that_a_finalizer_swallowed_is_raised_again_and_not_printed():
    """What a stop's handler raises while a finalizer runs, Python only prints, and the run
    goes on (a tool ran on after its SIGTERM; a demo stopped during its report exited 0):
    raise_if_stopped() raises it again, and a raised_for_sure() block ends with it, also one
    that another exception (the stop's doing) ends. Python's print of it is dropped."""
    out = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "went on", "raised again: signal SIGTERM",
        "went on", "ends: signal SIGTERM; context None",
        "went on", "fails: signal SIGTERM; context OSError('a failure that the stop caused')",
        "raised at once: signal SIGTERM", "done"]
    assert out.stderr == ""  # (no "Exception ignored in", no traceback)


POOL = r"""
import signal, sys
from pathlib import Path
from rqp.report import generate

def held_by_the_worker(task):
    blocked = int(next(line.split()[1] for line in Path("/proc/self/status").read_text()
                       .splitlines() if line.startswith("SigBlk:")), 16)
    return f"held={bool(blocked & (1 << (signal.SIGTERM - 1)))}", task[3]  # (path, lines)

generate._write_file = held_by_the_worker  # (inherited by the forked workers)
done = generate.generate(records=40, output=sys.argv[1], per_file=10, processes=2)
print(sorted(set(done)))
"""


def test_the_archive_generators_workers_end_on_the_pools_sigterm(tmp_path):
    """A test run held SIGTERM (as CI's runner may): a worker of generate()'s pool, idle when
    the pool's `with` block ended it with SIGTERM, never ended, and the run waited for good."""
    run = subprocess.run([*HOLDING_SIGNALS, sys.executable, "-c", POOL, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # (its own directory:
    # a temporary one of its own was left behind, empty, by every run of the suite)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['held=False']"  # no worker held SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_rqpctl_waiting_for_a_message_ends_on_each_stop_signal_however_started(make_queue,
                                                                               sig):
    """A trial's find: rqpctl receive (and status --watch) let only SIGINT through: started by
    a process that held SIGTERM, `timeout` could not end them, only a SIGKILL did."""
    queue = make_queue()
    proc = subprocess.Popen([*HOLDING_SIGNALS, sys.executable, "-m", "rqp.tools.ctl", "receive",
                             "--timeout", "120", f"{queue.key:#x}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        # (rqpctl itself, no longer the holder it replaced, has let go of them: it waits)
        while _cmdline(proc.pid)[1:3] != ["-m", "rqp.tools.ctl"] or \
                held_signals(_status(proc.pid) or "SigBlk: 1") & signals.STOP_SIGNALS:
            assert time.monotonic() < deadline, _status(proc.pid)
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == (130 if sig == signal.SIGINT else -sig), proc.stderr.read()


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_the_unraisable_hook_holds_at_the_interpreters_end(monkeypatch):
    """A re-check: a second SIGTERM at the end of a report printed "TypeError: 'NoneType'
    object is not iterable" from the hook, the module's globals gone."""
    import types

    from rqp.system import signals as module

    seen = []
    monkeypatch.setattr(module, "_raised", None)  # (as at the interpreter's end)
    monkeypatch.setattr(module, "_unraisable_before", seen.append)
    info = types.SimpleNamespace(exc_value=ValueError("x"))
    module._unraisable(info)
    assert seen == [info]
