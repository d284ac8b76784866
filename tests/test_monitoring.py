"""The alert rules shipped in config/prometheus-rules.yaml: valid for the real promtool
(Debian's prometheus package; scripts/test installs it), each rule fires in a promtool unit
test (config/prometheus-rules.test.yaml), and every rqp_* metric they use is one the running
agents really export."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rqp.report import job
from tests.agents import make_queue, receive, send, start_receiver, start_sender, write_rqprc
from tests.report_data import generate_archive

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
    assert rules == 14 and f"SUCCESS: {rules} rules found" in out.stdout


def test_every_rule_fires_in_its_promtool_unit_test():
    tests = yaml.safe_load((CONFIG / "prometheus-rules.test.yaml").read_text())
    tested = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"]
              if case.get("exp_alerts")}
    rules = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == rules  # each alert is shown to fire (and most not to fire too early)
    out = subprocess.run([promtool(), "test", "rules", "prometheus-rules.test.yaml"],
                         cwd=CONFIG, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


#: The report job's metrics (its --metrics-file), which the agents do not export.
REPORT_METRICS = {name for name, _ in job.METRICS}


def _metrics(path) -> dict[str, float]:
    return {name: float(value) for name, value in
            re.findall(r"^(rqp_\w+) (\S+)$", path.read_text(), re.M)}


def test_an_archive_the_report_user_cannot_read_is_an_error_not_an_empty_one():
    """A trial: an archive directory the report's user could not read was "empty", and with
    --allow-empty (the daily unit's) each run a success: no report, no alert. Now exit 2,
    naming it; so is a host's directory in it, and a file behind one. (As uid 65534: root
    reads everything.)"""
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="rqp-unreadable-", dir="/tmp"))
    try:
        top.chmod(0o755)
        closed, open_ = top / "closed", top / "open"
        for d in (closed, open_, open_ / "host-b"):
            d.mkdir()
            d.chmod(0o755)
        (closed / "dl.jsonl").write_text("{}\n")
        (open_ / "dl.jsonl").write_text("{}\n")
        (open_ / "dl.jsonl").chmod(0o644)
        closed.chmod(0o700)
        (open_ / "host-b").chmod(0o700)
        # (re-check: a glob into it, a directory listed but not searchable, a link to a
        # host's directory, and a link loop)
        listed = top / "listed"
        (listed / "host-c").mkdir(parents=True)
        (listed / "host-c" / "dl.jsonl").write_text("{}\n")
        listed.chmod(0o744)
        linked = top / "linked"
        linked.mkdir()
        linked.chmod(0o755)
        (linked / "host-a").symlink_to(top / "shared")
        (top / "shared").mkdir()
        (top / "shared").chmod(0o755)
        (top / "shared" / "dl.jsonl").write_text("{}\n")
        (top / "shared" / "dl.jsonl").chmod(0o644)
        looped = top / "looped"
        (looped / "host-d").mkdir(parents=True)
        for d in (looped, looped / "host-d"):
            d.chmod(0o755)
        (looped / "host-d" / "dl.jsonl").write_text("{}\n")
        (looped / "host-d" / "dl.jsonl").chmod(0o644)
        (looped / "host-d" / "loop").symlink_to("..")
        script = ("import sys\nfrom rqp.report import job\n"
                  "for path in sys.argv[1:]:\n"
                  "    try: job.check_local_inputs([path]); print('taken')\n"
                  "    except job.ReportError as exc: print(type(exc).__name__, exc)\n")
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", script, str(closed), str(open_), str(closed / "dl.jsonl"), f"{closed}/*",
             f"{top}/*/*.jsonl", str(listed), str(linked), str(looped)],
            capture_output=True, text=True, timeout=60, cwd=Path(job.__file__).parents[2])
    finally:
        shutil.rmtree(top)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8, lines
    for line, paths in zip(lines, ([closed], [open_ / "host-b"], [closed / "dl.jsonl"],
                                   [closed], [closed, listed], [listed])):
        assert any(line.startswith(f"ReportError cannot read the input: {path}: Permission "
                                   "denied (this report runs as nobody)") for path in paths), line
    assert lines[6] == "taken", lines
    assert lines[7].startswith(f"ReportError cannot read the input: {looped}/host-d/loop is "
                               f"{looped} again, through a symbolic link"), lines[7]


def test_a_full_disk_under_the_output_is_named_in_the_error_line(spark, tmp_path, capsys):
    """A trial: a report onto a full filesystem ended in 'Spark failed: ... TASK_WRITE_FAILED
    ...', "No space left on device" only in the stack traces above it. The root cause is
    in the line now."""
    archive = tmp_path / "archive"
    generate_archive(archive, files=1)
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        assert job.main(["--input", str(archive), "--output", str(full / "out"),
                         "--no-store"]) == 1
    finally:
        subprocess.run(["umount", str(full)], check=True)
    [line] = [l for l in capsys.readouterr().err.splitlines() if "Spark failed:" in l]
    assert "; at its root: " in line and "No space left on device" in line, line


def test_the_report_job_records_each_runs_outcome_for_its_alerts(spark, tmp_path, capsys):
    """A failed or missed daily report was seen by nobody: each run now leaves its outcome in
    --metrics-file (node_exporter's textfile collector), whatever it is, and the rules
    RQPDeadLetterReportFailed and RQPDeadLetterReportStale read exactly those names."""
    used = set(re.findall(r"\b(rqp_dlq_report_\w+)", RULES.read_text()))
    assert used and used <= REPORT_METRICS
    prom = tmp_path / "node-exporter" / "rqp-dlq-report.prom"
    prom.parent.mkdir()
    empty = tmp_path / "empty-archive"
    empty.mkdir()

    # an empty archive: an error for a person (exit 2), a success for the timer
    assert job.main(["--input", str(empty), "--output", str(tmp_path / "o0"),
                     "--metrics-file", str(prom)]) == 2
    assert _metrics(prom)["rqp_dlq_report_last_run_exit_status"] == 2
    assert _metrics(prom)["rqp_dlq_report_last_success_timestamp_seconds"] == 0  # never
    before = time.time()
    assert job.main(["--input", str(empty), "--output", str(tmp_path / "o1"), "--allow-empty",
                     "--metrics-file", str(prom)]) == 0
    assert "no archive files" in capsys.readouterr().err
    # a name the textfile collector would not read: said (a trial's typo went unseen)
    assert job.main(["--input", str(empty), "--output", str(tmp_path / "o1"), "--allow-empty",
                     "--metrics-file", str(prom.with_suffix(".txt"))]) == 0
    assert "does not end in .prom: node_exporter's textfile collector reads only *.prom" in \
        capsys.readouterr().err
    prom.with_suffix(".txt").unlink()
    assert not (tmp_path / "o1").exists()  # Spark was not started, nothing written
    first = _metrics(prom)
    assert first["rqp_dlq_report_last_run_exit_status"] == 0
    assert before <= first["rqp_dlq_report_last_success_timestamp_seconds"] <= time.time()
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644  # (the collector is another user)

    # a real report, in Spark
    archive = tmp_path / "archive"
    generate_archive(archive, files=1)
    assert job.main(["--input", str(archive), "--output", str(tmp_path / "o2"),
                     "--metrics-file", str(prom)]) == 0
    done = _metrics(prom)
    assert done["rqp_dlq_report_last_run_exit_status"] == 0
    success = done["rqp_dlq_report_last_success_timestamp_seconds"]
    assert success > first["rqp_dlq_report_last_success_timestamp_seconds"]
    assert done["rqp_dlq_report_last_run_duration_seconds"] > 0

    # a run that fails keeps the last success
    assert job.main(["--input", str(archive), "--output", str(tmp_path / "o3"),
                     "--store", "/proc/rqp-store", "--metrics-file", str(prom)]) == 2
    failed = _metrics(prom)
    assert failed["rqp_dlq_report_last_run_exit_status"] == 2
    assert failed["rqp_dlq_report_last_success_timestamp_seconds"] == success
    assert failed["rqp_dlq_report_last_run_timestamp_seconds"] > success
    lint = subprocess.run([promtool(), "check", "metrics"], input=prom.read_text(),
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert set(_metrics(prom)) == REPORT_METRICS
    assert not [p for p in prom.parent.iterdir() if p != prom]  # (no temporary file left)

    # a command line that does not parse is a failed run too (a typo in the unit's options)
    with pytest.raises(SystemExit) as usage:
        job.main(["--input", str(archive), "--output", str(tmp_path / "o5"), "--master",
                  "bogus", "--metrics-file", str(prom)])
    assert usage.value.code == 2
    assert _metrics(prom)["rqp_dlq_report_last_run_exit_status"] == 2
    assert _metrics(prom)["rqp_dlq_report_last_success_timestamp_seconds"] == success

    # a metrics file it cannot write is said before anything runs
    capsys.readouterr()
    assert job.main(["--input", str(archive), "--output", str(tmp_path / "o4"),
                     "--metrics-file", str(tmp_path / "nowhere" / "r.prom")]) == 2
    assert f"--metrics-file {tmp_path}/nowhere/r.prom: {tmp_path}/nowhere is not a " \
        "directory" in capsys.readouterr().err
    assert not (tmp_path / "o4").exists()


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
    used = set(re.findall(r"\b(rqp_\w+)", RULES.read_text())) - REPORT_METRICS
    assert used and used <= names, f"not exported: {sorted(used - names)}"
    # both agents at once: one valid exposition, an agent label on every sample (a trial:
    # the two printed one after the other repeated HELP lines)
    sender_sock = next((a.workdir / "sender-state").glob("*.sock"))
    both = a.run([*ctl, "--socket", str(sender_sock), "--socket", str(receiver_sock)]).stdout
    lint = subprocess.run([promtool(), "check", "metrics"], input=both, capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr  # (a counter x_total and a gauge x)
    assert 'rqp_up_seconds{agent="sender"}' in both and 'rqp_up_seconds{agent="receiver"}' in both
    # one of them not answering: the other's samples keep their label (a trial: they lost it,
    # and its series changed with which agents answered)
    one = a.run([*ctl, "--socket", str(sender_sock), "--socket", str(b.workdir / "gone.sock")],
                check=False)
    assert one.returncode == 3 and 'rqp_up_seconds{agent="sender"}' in one.stdout, one.stdout


def test_merged_expositions_are_each_agents_samples_with_its_label():
    """rqpctl metrics joins the agents' expositions line by line (a re-check: 97,000 lines
    took 5.5 s through prometheus_client's parser): every sample of each, with an agent label,
    each family's HELP and TYPE once, a counter x_total beside a gauge x, escaped label
    values kept, and valid for promtool."""
    from prometheus_client.parser import text_string_to_metric_families as parse

    from rqp.tools.ctl_agents import merge_expositions

    def exposition(n: int) -> str:
        return ("# HELP rqp_x_total counted\n# TYPE rqp_x_total counter\n"
                + "".join(f'rqp_x_total{{queue="0x{i:08x}",name="a \\"q\\" \\\\ {{}}"}} {i}\n'
                          for i in range(n))
                + "# HELP rqp_x a gauge\n# TYPE rqp_x gauge\nrqp_x 2.5\n"
                + "# HELP rqp_z empty braces\n# TYPE rqp_z gauge\nrqp_z{} 1\n"
                # (a certificate's name with U+2028 in it: str.splitlines cut the sample)
                + "# HELP rqp_p by peer\n# TYPE rqp_p gauge\nrqp_p{peer=\"CN=a\u2028b\"} 2\n")
    texts = {"sender": exposition(3), "receiver": exposition(2)}
    merged = merge_expositions(texts)

    def samples(text: str, agent: str | None = None):
        return sorted((f.name, f.type, s.name, tuple(sorted(
            {**s.labels, **({"agent": agent} if agent else {})}.items())), s.value)
            for f in parse(text) for s in f.samples)
    assert samples(merged) == sorted(samples(texts["sender"], "sender")
                                     + samples(texts["receiver"], "receiver"))
    assert merged.count("# HELP rqp_x_total ") == merged.count("# TYPE rqp_x ") == 1
    lint = subprocess.run([promtool(), "check", "metrics"], input=merged, capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
