"""Bad command lines and environments are refused before anything starts, with a message that
names what is wrong (issue 10's sweep for the same kind of defect: a bad $RQP_LOG_LEVEL was
taken silently, a bad --listen was found only after the config was read, a queue key typo was
reported as "no .rqprc found")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(module: str, *args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RQPRC", "RQP_LOG_LEVEL")}
    environ.update(HOME=str(cwd), **(env or {}))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("module", ["rqp_agents.sender", "rqp_agents.receiver",
                                    "rqp_agents.drain"])
def test_a_bad_log_level_in_the_environment_is_named(module, tmp_path):
    out = run(module, cwd=tmp_path, env={"RQP_LOG_LEVEL": "verbose"})
    assert out.returncode == 2, out.stderr
    assert "unknown log level 'verbose' (from $RQP_LOG_LEVEL)" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was set up


@pytest.mark.parametrize("module, prog", [
    ("rqp_agents.sender", "rqp-sender"), ("rqp_agents.receiver", "rqp-receiver"),
    ("rqp_agents.drain", "rqp-dlq-drain"), ("rqp.tools.ctl", "rqpctl"),
    ("rqp.report.job", "rqp-dlq-report"), ("rqp.tools.demo", "rqp-demo")])
def test_every_command_says_its_version(module, prog, tmp_path):
    """A trial: an operator could not tell which version an agent ran."""
    from rqp import __version__

    out = run(module, "--version", cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, f"{prog} (rqp) {__version__}\n"), out.stderr


def test_a_bad_listen_address_is_refused_as_an_argument(tmp_path):
    out = run("rqp_agents.receiver", "--listen", "127.0.0.1:99999", cwd=tmp_path)
    assert out.returncode == 2
    assert "argument --listen: bad value '127.0.0.1:99999'" in out.stderr, out.stderr


@pytest.mark.parametrize("days", ["0", "-3", "soon"])
def test_rqpctl_tls_days_says_what_it_takes(tmp_path, days):
    """A trial: --days 0 said "invalid _days value: '0'" (a function's name)."""
    out = run("rqp.tools.ctl", "tls", "issue", "h.test", "--ca", str(tmp_path), "--days", days,
              cwd=tmp_path)
    assert out.returncode == 2 and "argument --days: expected a whole number of days >= 1, " \
        f"got '{days}'" in out.stderr, out.stderr


@pytest.mark.parametrize("mtype", ["0", "9223372036854775808", "two", "1" + "0" * 400])
def test_rqpctl_send_refuses_an_mtype_no_msgsnd_takes_as_a_usage_error(tmp_path, mtype):
    """A trial: --mtype 2^63 exited 1 from deep inside, where --mtype 0 was a usage error."""
    out = run("rqp.tools.ctl", "send", "0x52510001", "x", "--mtype", mtype, cwd=tmp_path)
    assert out.returncode == 2 and "argument --mtype: expected a System V message type in " \
        f"1..9223372036854775807, got '{mtype}'" in out.stderr, out.stderr


def test_rqpctl_receive_refuses_an_msgtyp_beyond_a_c_long_as_a_usage_error(tmp_path):
    out = run("rqp.tools.ctl", "receive", "0x52510001", "--mtype", "9223372036854775808",
              cwd=tmp_path)
    assert out.returncode == 2 and "argument --mtype: expected a msgrcv type (0, N or -N) in " \
        "-9223372036854775807..9223372036854775807" in out.stderr, out.stderr


def test_rqpctl_receive_tells_a_bad_key_from_a_name(tmp_path):
    out = run("rqp.tools.ctl", "receive", "0x1234567890", cwd=tmp_path)
    assert out.returncode == 2 and "argument queue:" in out.stderr, out.stderr
    assert "(or a queue name from .rqprc)" in out.stderr
    out = run("rqp.tools.ctl", "receive", "PROD_THE_SCHED_COMMON", cwd=tmp_path)
    assert out.returncode != 0
    assert "queue 'PROD_THE_SCHED_COMMON' is a name, looked up in a .rqprc" in out.stderr, \
        out.stderr


def test_report_output_onto_a_file_is_refused_before_spark(tmp_path):
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "a.jsonl").write_text("{}\n")
    (tmp_path / "taken").write_text("a file, not a directory\n")
    out = run("rqp.report.job", "--input", str(archive), "--output",
              str(tmp_path / "taken" / "report"), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--output {tmp_path / 'taken' / 'report'}: {tmp_path / 'taken'} is not a directory" \
        in out.stderr
    # the store, kept in the archive by default: a trial's archive was read-only to its user
    (archive / ".columnar").write_text("in the way\n")
    out = run("rqp.report.job", "--input", str(archive), "--output", str(tmp_path / "out"),
              cwd=tmp_path)
    assert out.returncode == 2 and "give --store DIR elsewhere, or --no-store" in out.stderr, \
        out.stderr


def test_rqpctl_whose_reader_went_away_exits_as_on_sigpipe(tmp_path):
    """A trial: `rqpctl status | head -1` printed "[Errno 32] Broken pipe" and exited 1, a
    code rqpctl does not document. Its reader gone, it exits quietly with 141 (128 + SIGPIPE)
    as any Unix tool does."""
    read, write = os.pipe()
    os.close(read)  # (gone before rqpctl writes a byte)
    try:
        out = subprocess.run([sys.executable, "-m", "rqp.tools.ctl", "status"], cwd=tmp_path,
                             env={**os.environ, "HOME": str(tmp_path)}, stdout=write,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             timeout=60)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")


def test_check_reads_a_config_as_a_start_would_and_starts_nothing(tmp_path):
    """Trial C: no way to check a file (before an upgrade, before a reload) but to start the
    agent. --check reads it and its TLS files as a start would, says what would run (exit 0)
    or why not (exit 1), and makes nothing: no state_dir, no queue, no socket."""
    state = tmp_path / "state"
    rqprc = tmp_path / "rqprc"
    rqprc.write_text(f"hosts: [10.9.9.9]\nstate_dir: {state}\n")
    out = run("rqp_agents.sender", "--check", "--rqprc", str(rqprc), cwd=tmp_path)
    assert out.returncode == 1 and "plaintext RQP/1 to 10.9.9.9:7460 without saying so" in \
        out.stderr, out.stderr
    rqprc.write_text(f"hosts: [10.9.9.9]\nstate_dir: {state}\nplaintext: true\n")
    out = run("rqp_agents.sender", "--check", "--rqprc", str(rqprc), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == (
        f"OK: {rqprc}: a sending MCA for transmission queue 0x52510000 would send to "
        f"10.9.9.9:7460 (plaintext); state_dir {state}\n"), out.stdout + out.stderr
    config = tmp_path / "receiver.yaml"
    config.write_text(f"listen: ':7460'\nstate_dir: {state}\noffer: {{allow: [0x52510001]}}\n"
                      f"tls: {{cert: {tmp_path}/a.crt, key: {tmp_path}/a.key, "
                      f"ca: {tmp_path}/ca.crt}}\n")
    out = run("rqp_agents.receiver", "--check", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 1 and f"{tmp_path}/a.crt" in out.stderr, out.stderr
    config.write_text(f"listen: ':7460'\nstate_dir: {state}\nplaintext: true\n"
                      "offer: {allow: [0x52510001]}\nmax_message_size: 100000000\n")
    out = run("rqp_agents.receiver", "--check", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == (
        f"OK: {config}: a receiving MCA would listen on 0.0.0.0:7460 (plaintext); "
        f"state_dir {state}\n"), out.stdout + out.stderr
    # (a trial: a max_message_size over msgmax was taken without a word)
    assert "max_message_size 100000000 is over this host's kernel.msgmax" in out.stderr
    assert not state.exists()
