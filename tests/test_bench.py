"""rqp-bench (rqp/bench.py): the quick run goes end to end and prints its table; the checker
that every benchmark case relies on catches what it must. No speed is asserted anywhere."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rqp.protocol.records import TRANSMISSION_HEADER_SIZE
from rqp.system import signals
from rqp.system.queues import kernel_limits
from rqp.tools import bench, scale
from rqp.tools.bench import PAYLOAD_HEAD, BenchError, filler
from tests.agents import descendants, held_signals

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
CASES = ("SURE 100 B", "UNSURE 100 B", "SURE 4 KiB", "UNSURE 4 KiB")


def test_quick_run_prints_the_table(tmp_path):
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "figures.json"
    proc = subprocess.run([str(python), "-m", "rqp.tools.bench", "--quick", "--json", str(figures)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    headers = [line for line in lines if line.split()[:1] == ["case"]]
    assert len(headers) == 1, proc.stdout
    assert headers[0].split() == ["case", "RQP", "msg/s", "spread", "raw", "msg/s", "RQP/raw"]
    assert [line.split()[:2] for line in lines if line.startswith("CPU µs/msg")] == [
        ["CPU", "µs/msg"]]
    for case in CASES:
        rows = [line for line in lines if line.split()[:3] == case.split()]
        assert len(rows) == 2, f"not one row per table for {case!r} in:\n{proc.stdout}"
        cells = rows[0].split()[3:]
        assert len(cells) == 4, rows[0]  # RQP msg/s, its spread, raw msg/s and the ratio
        assert cells[1] == "-"  # (one round with --quick: no spread)
        rqp_rate, raw_rate, ratio = (float(cells[i].replace(",", "")) for i in (0, 2, 3))
        assert rqp_rate > 0 and raw_rate > 0 and ratio > 0, rows[0]
        cpu = [float(cell) for cell in rows[1].split()[3:]]  # per process, and the total
        assert len(cpu) == 5 and cpu[4] > 0 and all(x >= 0 for x in cpu), rows[1]
    assert any(line.startswith("single SURE latency") for line in lines), proc.stdout
    assert "msgmnb" in proc.stdout
    data = json.loads(figures.read_text())
    assert [c["case"] for c in data["cases"]] == list(CASES)
    for c in data["cases"]:
        assert set(c["cpu_us_per_message"]) == {"producer", "sending MCA", "receiving MCA",
                                                "consumer"}
        assert sum(c["cpu_us_per_message"].values()) > 0
    assert data["latency"]["samples"] > 0
    # --quick's small counts, one round, few latency samples: said, not left to be taken for
    # the README's figures (a trial: 2.02x RabbitMQ at 3,000 messages, 1.42x at 15,000)
    notes = [line for line in lines if line.startswith("NOTE: ")]
    assert any("fewer messages per case than the defaults" in n for n in notes), notes
    assert any("1 round(s) per case" in n for n in notes), notes
    assert data["caveats"] == [n.removeprefix("NOTE: ") for n in notes]


def test_tls_run_measures_every_case_over_both_transports(tmp_path):
    """Issue 12: TLS against plaintext in the same run, against the same raw pipeline."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "figures.json"
    proc = subprocess.run([str(python), "-m", "rqp.tools.bench", "--quick", "--tls",
                           "--messages", "100", "--latency-samples", "10", "--json",
                           str(figures)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads(figures.read_text())
    assert [(c["case"], c["transport"]) for c in data["cases"]] == \
        [(case, t) for t in ("plaintext", "TLS") for case in CASES]
    assert [lat["transport"] for lat in data["latencies"]] == ["plaintext", "TLS"]
    ratios = next(line for line in proc.stdout.splitlines()
                  if line.startswith("TLS / plaintext, msg/s: "))
    assert len(ratios.split(": ", 1)[1].split(", ")) == len(CASES), ratios


# --- the consumer's checks -------------------------------------------------------------------


class _Progress:
    value = 0


def _payloads(seqs, tag=7, size=100):
    return [PAYLOAD_HEAD.pack(tag, seq) + filler(size) for seq in seqs]


def _consume(messages, ordered, count=None, size=100):
    it = iter(messages)
    return bench._consume(lambda: next(it), 7, len(messages) if count is None else count, size,
                          ordered, _Progress())


@pytest.mark.parametrize("ordered", [True, False])
def test_checker_accepts_a_whole_case(ordered):
    first, last = _consume(_payloads(range(50)), ordered)
    assert 0 < first <= last


def test_checker_accepts_unsure_messages_out_of_order():
    _consume(_payloads([2, 0, 1]), ordered=False)


@pytest.mark.parametrize("messages, ordered, error", [
    (_payloads([0, 2, 1]), True, "out of order"),
    (_payloads([0, 1, 1]), False, "duplicate"),
    (_payloads([0, 1, 5]), False, "out of range"),
    (_payloads([0]) + _payloads([1], tag=8), True, "case 8"),
    (_payloads([0]) + [_payloads([1])[0][:-1] + b"?"], False, "content differs"),
    (_payloads([0]) + _payloads([1], size=99), True, "99 bytes"),
])
def test_checker_rejects_a_bad_case(messages, ordered, error):
    with pytest.raises(BenchError, match=error):
        _consume(messages, ordered)


def test_percentile_is_nearest_rank():
    values = list(range(1, 501))
    assert bench.percentile(values, 50) == 250
    assert bench.percentile(values, 99) == 495
    assert bench.percentile([3], 99) == 3


def test_rabbitmq_publisher_confirms_are_counted_in_any_mix_and_order():
    """The RabbitMQ producer's window counts confirms right however the broker mixes single
    and multiple acks: counting "tag if multiple else one more" lost one for every single ack
    seen before a multiple one below it, until a round hung with the whole window thought in
    flight (SURE 4 KiB, 7,900 of 15,000 confirmed and nothing moving)."""
    import random

    from rqp.tools.rabbit_load import Confirms

    c = Confirms()
    for tag, multiple in ((1, False), (3, False), (2, True), (5, False), (4, False)):
        c.ack(tag, multiple)
    assert (c.count, c.prefix, c.above) == (5, 5, set())
    rng = random.Random(14)
    for _ in range(50):
        c, covered, sent = Confirms(), set(), 2000
        while len(covered) < sent:
            open_ = sorted(set(range(1, sent + 1)) - covered)[:40]
            tag = rng.choice(open_)
            multiple = rng.random() < 0.3
            c.ack(tag, multiple)
            covered |= set(range(1, tag + 1)) if multiple else {tag}
            assert c.count == len(covered)
        assert c.prefix == sent and not c.above


def test_against_rabbitmq_without_its_client_says_how_to_get_it(tmp_path):
    """Issue 14: --against rabbitmq needs rabbitmq-server and pika; without them it stops
    with what to run, and leaves nothing behind."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    env = {**os.environ, "RQP_RABBIT_PYTHON": str(tmp_path / "no-such-python")}
    proc = subprocess.run([str(python), "-m", "rqp.tools.bench", "--quick", "--against",
                           "rabbitmq"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode != 0
    assert "scripts/bench --against rabbitmq" in proc.stdout + proc.stderr


def test_scale_sweeps_run_every_case_and_leave_nothing_behind(tmp_path):
    """Issue 14, scale: 1 to 1,000 queue keys, 1 to 20 producers, 1 to 10 sending MCAs; every
    message checked by the consumer (exactly once, SURE in order per producer and queue)."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "scale.json"
    before = set(Path("/tmp").glob("rqp-scale-*"))
    proc = subprocess.run([str(python), "-m", "rqp.tools.scale", "--messages", "400",
                           "--rounds", "1", "--json", str(figures)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads(figures.read_text())
    assert [(c["keys"], c["producers"], c["senders"]) for c in data] == [
        (1, 1, 1), (10, 1, 1), (100, 1, 1), (1000, 1, 1), (1, 1, 1), (1, 5, 1), (1, 20, 1),
        (1, 1, 1), (1, 10, 10)]
    for case in data:
        assert len(case["msg_per_s"]) == 1 and case["msg_per_s"][0] > 0, case
        assert set(case["cpu_us"]) == {"producer", "sending MCA", "receiving MCA", "consumer"}
        assert case["cpu_us"]["receiving MCA"][0] > 0, case
    assert "keys: 1000 key(s), 1 producer(s), 1 sending MCA(s)" in proc.stdout
    assert set(Path("/tmp").glob("rqp-scale-*")) <= before  # gone (and any a killed run left)


def test_scale_passes_interleave_the_cases_and_compare_each_with_the_first_pass_by_pass(
        tmp_path):
    """--passes: the cases run in turn, again and again, with fresh agents; each case after
    the sweep's first is compared with it within each pass (a drifting machine moves both)."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "scale.json"
    proc = subprocess.run([str(python), "-m", "rqp.tools.scale", "--sweeps", "keys", "--keys",
                           "1,3", "--messages", "200", "--rounds", "1", "--passes", "2",
                           "--json", str(figures)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    order = [line for line in proc.stderr.splitlines() if line.startswith("rqp-scale: keys:")]
    assert order == [f"rqp-scale: keys: {k} key(s), 1 producer(s), 1 sending MCA(s), pass {p} "
                     "of 2 ..." for p in (1, 2) for k in (1, 3)]
    one, three = json.loads(figures.read_text())
    assert {k: three[k] for k in ("type", "size", "messages", "window", "hosts", "tls")} == {
        "type": "SURE", "size": 100, "messages": 200, "window": None, "hosts": False,
        "tls": False}  # (what ran, beside the figures: a file read later says it)
    assert one["pass"] == three["pass"] == [1, 2] and len(three["msg_per_s"]) == 2
    assert one["msg_per_s_vs_first_pct"] == [] and len(three["msg_per_s_vs_first_pct"]) == 2
    assert three["msg_per_s_vs_first_pct"][1] == pytest.approx(
        100 * (three["msg_per_s"][1] / one["msg_per_s"][1] - 1))
    assert "2 passes over the cases in turn" in proc.stdout


def test_scale_says_at_once_that_an_agent_died_and_keeps_the_rounds_measured(tmp_path):
    """A trial killed the run's receiving MCA in its second pass: rqp-scale noticed only at
    the round's time-out (300 s), the table's heading counted rounds never run, and --json
    wrote nothing."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "scale.json"
    proc = subprocess.Popen([str(python), "-m", "rqp.tools.scale", "--sweeps", "keys",
                             "--keys", "1", "--messages", "300000", "--rounds", "1",
                             "--passes", "2", "--json", str(figures)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the second pass has started: the first's rounds are in
            if line.startswith("rqp-scale: keys: 1 key(s), 1 producer(s), 1 sending MCA(s), "
                               "pass 2 of 2"):
                break
        deadline = time.monotonic() + 60

        def serving() -> int | None:  # the receiving MCA, once a sending MCA connected to it
            for pid in descendants(proc.pid):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if b"rqp_agents.receiver" in argv:
                        log = Path(argv[argv.index(b"--config") + 1].decode()).with_name(
                            "receiver.log")
                        if "connection from" in log.read_text(errors="replace"):
                            return pid
                except OSError:  # (gone meanwhile: a producer, the last pass's agents)
                    continue
            return None

        while (receiver := serving()) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no receiving MCA"
            time.sleep(0.1)  # (polling /proc and a log for a condition, with a deadline)
        os.kill(receiver, signal.SIGKILL)  # (one this test started, through rqp-scale)
        code, out, err = proc.wait(120), proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 1, err
    assert "the receiving MCA exited with status -9 during round" in err, err
    assert "the rounds measured before the failure" in err and "pass 2" not in out
    [case] = json.loads(figures.read_text())
    assert case["pass"] == [1] and len(case["msg_per_s"]) == 1


def test_scale_changes_against_the_first_case_are_paired_by_pass():
    first = scale.Case("keys", 1, 1, 1, seconds=[1.0, 2.0], passes=[1, 2],
                       cpu={"sending MCA": [20.0, 40.0]})
    later = scale.Case("keys", 1000, 1, 1, seconds=[1.25, 2.0], passes=[1, 2],
                       cpu={"sending MCA": [22.0, 40.0]})
    other = scale.Case("producers", 1, 5, 1, seconds=[1.0], passes=[1],
                       cpu={"sending MCA": [20.0]})
    changes = scale.against_first([first, later, other], messages=1000)
    assert list(changes) == [id(later)]  # (each sweep's first case is the base: no change)
    rates, cpu = changes[id(later)]
    assert rates == pytest.approx([-20.0, 0.0]) and cpu == pytest.approx([10.0, 0.0])
    assert scale._change(rates) == "-10.0% (-20.0..+0.0)"


def test_scale_on_simulated_hosts_over_tls_leaves_no_namespace(tmp_path):
    """Issue 14, scale: a receiver serving 10 sending *hosts* (each agent in network and IPC
    namespaces of its own, over the testbed's bridge), the agents talking mutual TLS; every
    message checked, and the hosts' namespaces gone afterwards."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    figures = tmp_path / "scale.json"
    netns = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout.split())
    proc = subprocess.run([str(python), "-m", "rqp.tools.scale", "--sweeps", "keys,senders",
                           "--keys", "3", "--hosts", "--tls", "--messages", "400",
                           "--rounds", "1", "--json", str(figures)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads(figures.read_text())
    assert [(c["keys"], c["senders"], c["hosts"], c["tls"]) for c in data] == [
        (3, 1, True, True), (1, 1, True, True), (1, 10, True, True)]
    assert all(c["msg_per_s"][0] > 0 and c["cpu_us"]["receiving MCA"][0] > 0 for c in data)
    assert "SURE 100 B, TLS, each agent on a simulated host of its own" in proc.stdout
    left = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout.split()) - netns
    assert not {name for name in left if name.startswith("scale-")}


@pytest.mark.parametrize("args, error", [
    (["--sweeps", "keys,hosts"], "unknown sweep(s) hosts"),
    (["--size", "99999"], "--size 99999: a payload of 10..{largest} bytes"),
    (["--window", "0"], "argument --window: expected a window of frames in 1..65536, got '0'"),
    (["--rounds", "0"], "--rounds 0: at least 1"),
    (["--passes", "0"], "--passes 0: at least 1"),
    (["--json", "/tmp"], "argument --json: '/tmp' is a directory: name a file in it"),
    (["--keys", "10,x"], "argument --keys: expected whole numbers >= 1, comma-separated"),
    (["--keys", "+3"], "argument --keys: expected whole numbers >= 1, comma-separated"),
    (["--keys", "1,1"], "argument --keys: each count once, got '1,1'"),
    (["--keys", "1,99999"], "--keys 99999: at most {msgmni_room} (kernel.msgmni"),
    (["--keys", "500", "--messages", "100"], "--keys 500: more keys than --messages 100"),
    (["--sweeps", "producers", "--keys", "5"], "--keys sets the keys sweep's counts: add keys "
     "to --sweeps"),
])
def test_scale_refuses_bad_arguments_at_once(args, error):
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    proc = subprocess.run([str(python), "-m", "rqp.tools.scale", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    error = error.format(largest=kernel_limits().msgmax - TRANSMISSION_HEADER_SIZE,
                         msgmni_room=kernel_limits().msgmni - scale.QUEUES_BESIDE)
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr


def test_corebench_carries_every_message_through_both_cores(tmp_path, capsys):
    """rqp-corebench: the two protocol cores against each other (no I/O), key counts
    interleaved; every message must be confirmed, each core's CPU a message is reported."""
    from rqp.tools import corebench

    figures = tmp_path / "core.json"
    assert corebench.main(["--keys", "1,7", "--messages", "500", "--repeat", "2",
                           "--type", "unsure", "--json", str(figures)]) == 0
    data = json.loads(figures.read_text())
    assert (data["type"], data["messages"], sorted(data["runs"])) == ("UNSURE", 500, ["1", "7"])
    for runs in data["runs"].values():
        assert len(runs) == 2 and all(r["sending"] > 0 and r["receiving"] > 0 for r in runs)
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["1", "7"]


def test_corebench_fails_when_a_message_is_not_confirmed(monkeypatch, capsys):
    """A message the sending core dead-letters (queue key 0 is IPC_PRIVATE, never sent) fails
    the run: the figures count only messages carried end to end."""
    from rqp.tools import corebench

    monkeypatch.setattr(corebench, "FIRST_KEY", 0)
    assert corebench.main(["--keys", "2", "--messages", "10", "--repeat", "1"]) == 1
    assert "the sending core did DeadLetter(" in capsys.readouterr().err


@pytest.mark.parametrize("args, error", [
    (["--keys", "1,many"], "argument --keys: expected whole numbers >= 1, comma-separated "
     "(e.g. 1,1000), got '1,many'"),
    (["--keys", "0"], "expected whole numbers >= 1, comma-separated (e.g. 1,1000), got '0'"),
    (["--window", "0"], "expected a window of frames in 1..65536, got '0'"),
    (["--json", "/nonexistent-dir/figures.json"], "'/nonexistent-dir/figures.json': its "
     "directory does not exist"),
    (["--json", "/tmp"], "'/tmp' is a directory: name a file in it"),
    (["--window", "70000"], "expected a window of frames in 1..65536, got '70000'"),
    (["--size", "100000000"], "--size 100000000: at most"),
    (["--keys", "\u0661\u0662"], "expected whole numbers >= 1"),  # (Arabic-Indic: int() takes)
    (["--keys", "100000000", "--messages", "100"], "--keys 100000000: more keys than "
     "--messages 100"),
])
def test_corebench_names_a_bad_argument_before_running(args, error, capsys):
    from rqp.tools import corebench

    with pytest.raises(SystemExit) as exit_:
        corebench.main(args)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("held", [False, True], ids=["plain", "started-holding-them"])
def test_scale_stopped_by_sigterm_cleans_up_and_a_killed_runs_directory_is_swept(tmp_path,
                                                                                 held):
    """A new user's trial: `timeout 12 scripts/bench --scale ...` (SIGTERM) left its working
    directory in /tmp (36 MB), and SIGKILL's stayed for good. SIGTERM now cleans up as Ctrl-C
    does (exit 130, agents stopped, queues removed); the next run removes what a SIGKILL left.
    And a signal mask survives exec: started by a process that holds the stop signals (a
    harness's thread), it used to run on after its SIGTERM, for good."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    stale = Path(tempfile.mkdtemp(prefix=f"rqp-scale-{_dead_pid()}-"))
    (stale / "receiver-left-behind").mkdir()
    before = set(Path("/tmp").glob("rqp-scale-*")) - {stale}
    proc = subprocess.Popen([str(python), "-m", "rqp.tools.scale", "--sweeps", "keys",
                             "--messages", "200000", "--rounds", "3"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_hold_stop_signals if held else None)
    try:
        for line in proc.stderr:  # the first case has started: a directory, then agents
            if line.startswith("rqp-scale: keys: 1 key(s)"):
                break
        assert not stale.exists()  # swept at the start
        [workdir] = set(Path("/tmp").glob("rqp-scale-*")) - before
        deadline = time.monotonic() + 60
        while not any("serving transmission queue" in log.read_text(errors="replace")
                      for log in workdir.glob("sender-*/sender.log")):
            assert time.monotonic() < deadline and proc.poll() is None, "no sending MCA"
            time.sleep(0.1)  # (polling a log for a condition, with a deadline)
        proc.send_signal(signal.SIGTERM)
        code, err = proc.wait(60), proc.stderr.read()
        # (CI saw -2 here twice, with no traceback, the second time after the line below, said
        # once the clean-up is done: the run ended by SIGINT after its clean-up, not yet
        # explained. A shell shows that as 130 too; what must hold is the clean-up)
        assert code == 130 or code == -signal.SIGINT and "rqp-scale: stopped" in err, \
            f"exit {code}, working directory left: {workdir.exists()}: {err}"
        assert "rqp-scale: stopped; its agents, queues and files are removed" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(stale, ignore_errors=True)
    assert not workdir.exists()
    assert set(Path("/tmp").glob("rqp-scale-*")) <= before
    running = [p for p in Path("/proc").glob("[0-9]*/cmdline")
               if str(workdir) in _read_bytes(p).decode(errors="replace")]
    assert not running, "agents of the stopped run still running"


def test_scale_on_simulated_hosts_removes_the_hosts_a_killed_run_left():
    """A new user's trial: `timeout -s KILL 4 scripts/bench --scale --hosts ...` left 12
    network namespaces, their IPC namespace mounts and directories, and no later run removed
    them. The next --hosts run now does (those of runs whose process is gone)."""
    from tests.testbed import Testbed

    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    with Testbed(name_prefix="scale") as left:
        host = left.add_host("r")
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        (left.run_dir / "owner").write_text(f"{pid_max}\n")  # its run was killed
        proc = subprocess.run([str(python), "-m", "rqp.tools.scale", "--hosts", "--sweeps",
                               "keys", "--keys", "1", "--messages", "20", "--rounds", "1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"netns {host.netns}" in proc.stderr and f"dir {left.run_dir}" in proc.stderr
        assert [x for x in left.leftovers() if not x.startswith("pid ")] == []


@pytest.fixture
def stop_signals_through(monkeypatch):
    """These tests take the stop signals in this process: let them through here, whatever
    mask the suite was started with (a signal mask survives exec), and put it back after;
    no stop noted yet, none quieted (as take_stops() leaves it)."""
    monkeypatch.setattr(signals, "stopped", [])
    monkeypatch.setattr(signals, "_quiet", False)
    monkeypatch.setattr(signals, "_raised", [])
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.STOP_SIGNALS)
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


_ARMED: list[int] = []  # (os.register_at_fork has no undo: the hook below acts once when armed)


def _signal_at_fork() -> None:
    if _ARMED:
        _ARMED.pop()
        # To this thread, which holds it: sent to the process, the kernel gives it to any
        # thread that does not, and a Spark session of an earlier test has threads of its own
        # (the test then failed when run after tests/test_report.py).
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


os.register_at_fork(after_in_parent=_signal_at_fork)


def _child_that_stops(parent: int) -> None:
    bench._child_setup(parent)
    sys.exit(3 if held_signals(Path("/proc/self/status").read_text()) & bench.STOP_SIGNALS
             else 0)


@pytest.mark.usefixtures("stop_signals_through")
def test_a_stop_signal_while_a_child_starts_is_handled_after_its_record():
    """CI saw rqp-scale go on after its SIGTERM: the signal came during the fork of a child,
    and its handler ran in logging's at-fork hook, whose exception Python only prints. Here an
    at-fork hook sends the signal at that moment every time: held while the child starts, it
    stops the run once the child is recorded for the clean-up."""
    before = signal.signal(signal.SIGTERM, signals._raise_on_stop)
    child = multiprocessing.get_context("fork").Process(target=_child_that_stops,
                                                        args=(os.getpid(),))
    recorded = []
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with bench.stop_signals_held():
                _ARMED.append(os.getpid())
                child.start()
                recorded.append(child)
    finally:
        _ARMED.clear()
        signal.signal(signal.SIGTERM, before)
        child.join(30)
    assert recorded == [child]
    assert child.exitcode == 0  # (3: the child still held the stop signals)


class _StoppedWhileDropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # (the handler runs here: inside the finalizer)
            pass


@pytest.mark.usefixtures("stop_signals_through")
def test_a_stop_whose_exception_python_swallowed_is_raised_by_the_next_wait(monkeypatch):
    """What a signal handler raises while a finalizer runs, Python only prints: the run went
    on as if not stopped. The tools' waits raise the stop again; the print is dropped."""
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    before = signal.signal(signal.SIGTERM, signals._raise_on_stop)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _StoppedWhileDropped()  # dropped at once; the KeyboardInterrupt is swallowed
        assert signals.stopped == [signal.SIGTERM]
        assert printed == []
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            bench.wait_started("nothing", lambda: False, sleeper)
    finally:
        signal.signal(signal.SIGTERM, before)
        sleeper.kill()
        sleeper.wait()


@pytest.mark.usefixtures("stop_signals_through")
def test_the_watchdog_thread_never_takes_a_stop_signal():
    """A reviewer's find: a signal mask is a thread's, and the kernel gave a SIGTERM to the
    running watchdog thread; its handler then ran in the main thread inside a held block, and
    an agent started for the TLS variant escaped the clean-up. The watchdog thread is started
    holding the stop signals, so they go to the main thread."""
    before = signal.getsignal(signal.SIGUSR2)
    dog = bench.Watchdog(60)
    dog.start()
    try:
        watchdog = Path(f"/proc/self/task/{dog._thread.native_id}/status").read_text()
        assert held_signals(watchdog) >= bench.STOP_SIGNALS
        ours = Path("/proc/thread-self/status").read_text()
        assert not held_signals(ours) & bench.STOP_SIGNALS  # (and not this thread)
    finally:
        dog.stop()
        signal.signal(signal.SIGUSR2, before)


def test_a_command_started_while_stop_signals_are_held_does_not_inherit_the_hold():
    """A signal mask survives exec: an agent started in the held block must still stop on
    SIGTERM."""
    with bench.stop_signals_held():
        proc = subprocess.run(["cat", "/proc/self/status"], preexec_fn=bench._child_preexec,
                              capture_output=True, text=True, timeout=30, check=True)
    assert not held_signals(proc.stdout) & bench.STOP_SIGNALS


def _hold_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, bench.STOP_SIGNALS)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # (a process that ended meanwhile)
        return b""


def _dead_pid() -> int:
    """A process ID that no process has now."""
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_the_spread_is_half_the_range_of_the_rounds_rates_over_their_median():
    from rqp.tools.bench import _spread

    assert _spread([1.0]) == "-"
    assert _spread([1.0, 2.0, 1.5]) == "±38%"  # rates 1, 0.5, 0.667: (1 - 0.5) / 2 / 0.667
