"""rqp-demo stopped half-way (the whole demo is run by the README's first command, and so by
fresh-machine checks; its report makes it a minute long, so it is not run to its end here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.agents import HOLDING_SIGNALS, alive, descendants

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_demo_stops_its_agents_and_removes_what_it_made(tmp_path, sig):
    """A trial's find: `timeout 15 bash scripts/demo` left both agents running (a receiver
    still listening), the demo's directory and its IPC namespace: the demo ran as a child of
    a wrapper that the signal ended, and took no stop signal itself. Now it is one process
    that takes Ctrl-C, SIGTERM and SIGHUP (also started holding them) and cleans up.
    (SIGHUP takes the same path as SIGTERM: rqp.system.signals.take_stops.)"""
    proc = subprocess.Popen([*HOLDING_SIGNALS, sys.executable, "-m", "rqp.tools.demo",
                             "--report-dir", str(tmp_path / "report")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items()
                                 if k != "RQP_DEMO_ISOLATED"})
    try:
        lines = []
        for line in proc.stdout:  # up to the point where both agents run
            lines.append(line)
            if line.startswith("2. openConnection"):
                break
        out = "".join(lines)
        workdir = Path(re.search(r"== RQP demo in (\S+)", out).group(1))
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
        assert len(pids) == 2 and all(map(alive, pids)), out
        proc.send_signal(sig)
        code = proc.wait(60)
        out += proc.stdout.read()
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, (out, err)
    assert "agents stopped, queues removed" in out
    assert f"rqp-demo: interrupted (signal {sig.name})" in err
    assert not any(map(alive, pids)), "an agent of the stopped demo still runs"
    assert not workdir.exists()


def test_a_demo_stopped_during_its_report_ends_its_jvm_before_it_removes_its_directory(
        tmp_path):
    """A trial found Spark's ``_temporary`` made again in a stopped demo's directory after the
    demo removed it: the report's JVM ends by itself only when it sees its stdin closed, once
    the demo has exited (0.3 s later, measured). Now the demo ends it, and waits, first."""
    proc = subprocess.Popen([sys.executable, "-m", "rqp.tools.demo", "--report-dir",
                             str(tmp_path / "report")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={k: v for k, v in os.environ.items()
                                 if k != "RQP_DEMO_ISOLATED"})
    err: list[str] = []
    reading = threading.Event()

    def read_err() -> None:
        for line in proc.stderr:
            err.append(line)
            if "started; reading" in line:
                reading.set()
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        out = ""
        for line in proc.stdout:
            out += line
            if line.startswith("8. rqp-dlq-report"):
                break
        workdir = Path(re.search(r"== RQP demo in (\S+)", out).group(1))
        assert reading.wait(120), "".join(err)  # Spark has started: the JVM runs the report
        started = descendants(proc.pid)
        assert any(b"java" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in started
                   if alive(pid)), "no JVM under the demo"
        os.killpg(proc.pid, signal.SIGINT)  # (Ctrl-C: to the terminal's foreground group)
        code = proc.wait(120)
        left = [pid for pid in started if alive(pid)]  # (at once: the JVM outlived it 0.3 s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # (started by this test's demo)
    assert code == 130 and not left, (code, left, "".join(err))
    assert not workdir.exists()
    assert "rqp-demo: interrupted (signal SIGINT)" in "".join(err)
