"""rqp-demo stopped half-way (the whole demo is run by the README's first command, and so by
fresh-machine checks; PySpark makes it a minute long, so it is not run here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agents import HOLDING_SIGNALS, alive

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
