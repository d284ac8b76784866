"""The alert rules shipped in config/prometheus-rules.yaml: valid for the real promtool
(Debian's prometheus package; scripts/test installs it), each rule fires in a promtool unit
test (config/prometheus-rules.test.yaml), and every rqp_* metric they use is one the running
agents really export."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.agents import make_queue, receive, send, start_receiver, start_sender, write_rqprc

CONFIG = Path(__file__).resolve().parent.parent / "config"
RULES = CONFIG / "prometheus-rules.yaml"
Q1 = 0x52510001


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # scripts/test installs it; a bare pytest run must say so, not skip
        pytest.fail("promtool is missing: run scripts/test (it installs it) or apt-get install "
                    "prometheus")
    return path


def test_the_rules_are_valid_for_promtool():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert rules == 10 and f"SUCCESS: {rules} rules found" in out.stdout


def test_every_rule_fires_in_its_promtool_unit_test():
    tests = yaml.safe_load((CONFIG / "prometheus-rules.test.yaml").read_text())
    tested = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"]
              if case["exp_alerts"]}
    rules = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == rules  # each alert is shown to fire (and most not to fire too early)
    out = subprocess.run([promtool(), "test", "rules", "prometheus-rules.test.yaml"],
                         cwd=CONFIG, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_the_rules_use_metrics_the_agents_export(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver_sock = b.workdir / "receiver.sock"
    start_receiver(b, config=f"control_socket: {receiver_sock}\n")
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["one"])
    assert receive(b, Q1, 1) == ["one"]
    ctl = [sys.executable, "-m", "rqp.tools.ctl", "metrics"]
    exported = a.run([*ctl, "--agent", "sender", "--rqprc", str(rqprc)]).stdout + \
        b.run([*ctl, "--agent", "receiver", "--socket", str(receiver_sock)]).stdout
    names = set(re.findall(r"^# TYPE (\w+) ", exported, re.M))
    used = set(re.findall(r"\b(rqp_\w+)", RULES.read_text()))
    assert used and used <= names, f"not exported: {sorted(used - names)}"
    # both agents at once: one valid exposition, an agent label on every sample (a trial:
    # the two printed one after the other repeated HELP lines)
    sender_sock = next((a.workdir / "sender-state").glob("*.sock"))
    both = a.run([*ctl, "--socket", str(sender_sock), "--socket", str(receiver_sock)]).stdout
    lint = subprocess.run([promtool(), "check", "metrics"], input=both, capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr  # (a counter x_total and a gauge x)
    assert 'rqp_up_seconds{agent="sender"}' in both and 'rqp_up_seconds{agent="receiver"}' in both
