"""Ctrl-C of rqp-dlq-report (a real job, with its own JVM, as an operator runs it): one line
that says what it stopped, exit 130, no traceback, no JVM left behind, and no summary.json
that would make a half-written output pass for a finished report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agents import alive, descendants
from tests.report_data import archive_of, generate_archive
from tests.testbed import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("interrupt")
    return archive_of(root, generate_archive(root / "generated", files=8))


def _start(archive: Path, out: Path, *extra: str, **env: str) -> subprocess.Popen:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT), **env)
    return subprocess.Popen(
        [sys.executable, "-m", "rqp.report.job", "--master", "local[2]", "--input",
         str(archive), "--output", str(out), *extra], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # (a group:
    # Ctrl-C goes to every process of the terminal's foreground group, the JVM's too)


def _interrupt(proc: subprocess.Popen, seen: set[int], *,
               to_the_job: int | None = None) -> tuple[int, str]:
    """Ctrl-C to the job's group (or signal ``to_the_job`` to the job alone); its exit status
    and stderr. Fails if a process it started (``seen``) outlives it by a minute (ended first:
    it holds the job's stderr open)."""
    try:
        try:
            if to_the_job is not None:
                os.kill(proc.pid, to_the_job)
            else:
                os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass  # (its group has ended already)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the JVM ends with the job (it watches its stdin), or the job ends it
    deadline = time.monotonic() + 60
    while any(map(alive, seen)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(filter(alive, seen))
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # (started by this test's job)
    err = proc.stderr.read()
    proc.stdout.read()
    assert not left, f"left running after the job ended: {left}\n{err}"
    return code, err


def test_a_jvm_s_temporary_directory_is_its_own_and_not_passed_on(spark):
    """The JVM's java.io.tmpdir is given for its launch only: a test session's was passed on
    to every job the tests started (SPARK_SUBMIT_OPTS), and their JVMs wrote there."""
    tmpdir = spark.sparkContext._jvm.java.lang.System.getProperty("java.io.tmpdir")
    assert Path(tmpdir).name.startswith("rqp-dlq-report-jvm-") and Path(tmpdir).is_dir()
    assert tmpdir not in os.environ.get("SPARK_SUBMIT_OPTS", "")


def test_what_a_run_killed_9_left_is_removed_by_the_next(tmp_path):
    """A trial: kill -9 of a report's whole process group left Spark's files in the run's
    directory under TMPDIR, and the next run did not remove them."""
    from rqp.system.files import remove_abandoned

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # (its id no longer runs)
    left = tmp_path / f"rqp-dlq-report-jvm-{gone.pid}-abcd1234"
    (left / "spark-1" / "userFiles-2").mkdir(parents=True)
    (left / "spark-1" / "userFiles-2" / "f").write_text("x")
    running = tmp_path / f"rqp-dlq-report-jvm-{os.getpid()}-efgh5678"
    running.mkdir()
    other = tmp_path / "rqp-dlq-report-jvm-notapid-x"
    other.mkdir()
    remove_abandoned("rqp-dlq-report-jvm-", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, other.name])


def test_ctrl_c_while_the_report_runs_says_so_in_a_line_and_stops_spark(archive, tmp_path):
    """A trial: two screens of py4j tracebacks and exit -2 (PySpark's own SIGINT handler
    called into the JVM over the connection the job was in the middle of a call on)."""
    out, temp = tmp_path / "out", tmp_path / "tmp"
    temp.mkdir()
    proc = _start(archive, out, TMPDIR=str(temp))
    lines = []
    try:
        for line in proc.stderr:  # up to the line that says Spark is up and the job reads
            lines.append(line)
            if "started; reading" in line:
                break
    finally:
        seen = descendants(proc.pid)
        if not lines or "started; reading" not in lines[-1]:
            _interrupt(proc, seen)  # (ended, and what it started gone, before failing)
    assert "started; reading" in lines[-1], "".join(lines)
    assert seen, "the JVM was expected to run by now"
    # the JVM keeps its temporary files in a directory of the run's own under TMPDIR (it
    # ignores TMPDIR: a JVM killed by a second Ctrl-C left them in /tmp), gone at the end
    jvm_temps = [(p.name, sorted(q.name.split("-")[0] for q in p.iterdir()))
                 for p in temp.iterdir()]
    code, err = _interrupt(proc, seen)
    err = "".join(lines) + err
    assert [(n.startswith("rqp-dlq-report-jvm-"), "spark" in q) for n, q in jvm_temps] == [
        (True, True)], (jvm_temps, err)
    assert sorted(temp.iterdir()) == [], err
    assert code == 130, err
    assert "rqp-dlq-report: interrupted (Ctrl-C); this run's report is not finished" in err
    assert "Traceback" not in err and "py4j" not in err, err
    # nor what the JVM logs of the work it broke (a trial: up to 470 lines of Java)
    assert "ERROR" not in err and "Exception" not in err, err
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("metrics", [True, False], ids=["metrics-file", "no-metrics-file"])
def test_sigterm_ends_the_run_says_so_and_leaves_no_temporary_files(archive, tmp_path,
                                                                    metrics):
    """A re-check: SIGTERM (systemctl stop, the unit's time-out) killed the run at once, and
    --metrics-file still said the last run had succeeded: no RQPDeadLetterReportFailed. A
    trial: without --metrics-file it still did, leaving the JVM's temporary files."""
    prom, temp = tmp_path / "rqp-dlq-report.prom", tmp_path / "tmp"
    temp.mkdir()
    proc = _start(archive, tmp_path / "out",
                  *(("--metrics-file", str(prom)) if metrics else ()), TMPDIR=str(temp))
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "started; reading" in line:
                break
    finally:
        seen = descendants(proc.pid)
    code, err = _interrupt(proc, seen, to_the_job=signal.SIGTERM)
    err = "".join(lines) + err
    assert code == 143, err
    assert "rqp-dlq-report: interrupted (signal SIGTERM)" in err
    assert "Traceback" not in err, err
    assert sorted(temp.iterdir()) == [], err
    if metrics:
        assert "\nrqp_dlq_report_last_run_exit_status 143\n" in prom.read_text()


def test_ctrl_c_while_spark_starts_waits_for_it_and_leaves_no_jvm(archive, tmp_path):
    """A trial: Ctrl-C while the JVM started left it running, with no parent, for good (it
    ends with its parent only once it is up). The job now waits for it, then stops it."""
    proc = _start(archive, tmp_path / "out")
    seen: set[int] = set()

    def starting() -> bool:
        seen.update(descendants(proc.pid))
        return bool(seen) or proc.poll() is not None

    wait_for(starting, timeout=60, message="the job started no process (spark-submit)")
    code, err = _interrupt(proc, seen)
    assert code == 130, err
    assert "stopping once Spark has started" in err and "interrupted (Ctrl-C)" in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("presses", [2, 3])
def test_a_second_ctrl_c_while_spark_starts_ends_it_at_once_and_leaves_nothing(archive,
                                                                            tmp_path, presses):
    """A trial: two Ctrl-Cs while Spark started exited 130 at once, but left PySpark's
    connection directory (a temporary one, with the gateway's secret) behind, 3 times of 4:
    the thread making the session was abandoned before its clean-up ran. Another: so did a
    third Ctrl-C 40-200 ms after the second (8 times of 8)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = _start(archive, tmp_path / "out", TMPDIR=str(temp))
    seen: set[int] = set()
    try:
        def starting() -> bool:
            seen.update(descendants(proc.pid))
            return bool(seen) or proc.poll() is not None

        wait_for(starting, timeout=60, message="the job started no process (spark-submit)")
        os.killpg(proc.pid, signal.SIGINT)
        for line in proc.stderr:  # (what it says at the first: it waits for Spark)
            if "stopping once Spark has started" in line:
                break
        assert "Ctrl-C or SIGTERM again: end it now" in line, line
    except BaseException:
        _interrupt(proc, seen | set(descendants(proc.pid)))
        raise
    seen |= set(descendants(proc.pid))
    if presses == 3:  # the second, and a third as its clean-up runs (an impatient operator)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(0.1)
        except subprocess.TimeoutExpired:
            pass
    code, err = _interrupt(proc, seen)  # the last Ctrl-C
    # (a third that comes as the job exits ends it by the signal: a shell says 130 as well)
    assert code == 130 or (presses == 3 and code == -signal.SIGINT), err
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err, err
    assert sorted(p.name for p in temp.iterdir()) == [], err


def test_an_error_raised_while_a_ctrl_c_was_handled_is_the_ctrl_c():
    """A trial: a call into the JVM in a finally, after Ctrl-C had broken one, failed ('Answer
    from Java side is empty') and the report said 'Spark failed', exit 1."""
    from rqp.report.job import _interrupt_behind

    def broken():
        try:
            raise KeyboardInterrupt("signal SIGINT")
        finally:
            raise RuntimeError("Answer from Java side is empty")

    with pytest.raises(RuntimeError) as info:
        broken()
    found = _interrupt_behind(info.value)
    assert isinstance(found, KeyboardInterrupt) and str(found) == "signal SIGINT"
    assert _interrupt_behind(RuntimeError("a failure of its own")) is None


_HUSHED = """
import sys
from rqp.report import compute
spark, _ = compute.get_session("local[1]")
compute.hush(spark)
jvm = spark.sparkContext._jvm
for name in ("org.apache.spark.scheduler.DAGScheduler", "org.sparkproject.jetty.server.Server",
             "org.sparkproject.jetty.util.component.AbstractLifeCycle", "rqp.any.other"):
    logger = jvm.org.slf4j.LoggerFactory.getLogger(name)
    logger.warn("hushed-but-logged warn on " + name)
    logger.error("hushed-but-logged error on " + name)
print("after-hush", file=sys.stderr, flush=True)
spark.stop()
"""


def test_after_a_ctrl_c_no_logger_of_the_jvm_writes(tmp_path):
    """CI (stop 44): a Ctrl-C while the session built its SQL tab printed a screen of Jetty's
    WARN, py4j in its stack: the level set after a Ctrl-C was the root logger's, and Spark's
    defaults give Jetty's loggers levels of their own."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _HUSHED], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "after-hush" in done.stderr, done.stderr  # (it ran to the end)
    assert "hushed-but-logged" not in done.stderr, done.stderr


_SWALLOWED = """
import os, signal, weakref
from rqp.report import compute
spark, _ = compute.get_session("local[1]")


class Collected:
    pass


def finalizer(_):  # as py4j's, when Python lets go of a JVM object
    print("in the finalizer", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10 ** 6):
        pass  # (the handler runs here: what it raises, Python only prints)
    print("the finalizer went on", flush=True)


try:
    with compute.quiet_interrupts(spark):
        obj = Collected()
        ref = weakref.ref(obj, finalizer)
        del obj
        print("went on", flush=True)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
finally:
    spark.stop()
"""


def test_a_ctrl_c_that_a_finalizer_swallowed_still_interrupts_the_report(tmp_path):
    """A demo stopped during its report exited 0, its report finished (twice in nine runs):
    the Ctrl-C's KeyboardInterrupt was raised while a py4j finalizer ran, and Python only
    printed it ('Exception ignored in')."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _SWALLOWED], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # the case it is about: raised in the finalizer, which went no further; the run did
    assert done.stdout.splitlines() == ["in the finalizer", "went on", "interrupted"], (
        done.stdout + done.stderr)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, (
        done.stderr)  # (it is raised again: what Python prints of it is no news)
