"""The package as users get it: the wheel, installed (not editable) into a new virtual
environment without extras, as ``scripts/install`` does. Every console script it declares
answers ``--help`` with usage and nothing else: exit 0, no file written in the working
directory, no System V queue created (each runs in a new IPC namespace, and the namespace is
looked at afterwards). ``rqp-dlq-report`` then says what to install, without PySpark.

The suite otherwise runs from an editable install, where a module missing from the wheel
still imports (issue 10: ``rqp.report`` was not in the wheel).
"""

from __future__ import annotations

import configparser
import gzip
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, wheel path): the wheel built from this checkout, installed."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info/ next to the sources.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
        ".pytest_cache", "out"))
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"),
                  str(source)])
    assert built.returncode == 0, built.stderr
    [wheel] = (work / "dist").glob("rqp-*.whl")
    venv = work / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    # Its dependencies come from the package index as on a new machine (pip's cache helps).
    done = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", str(wheel)])
    assert done.returncode == 0, done.stderr
    return venv / "bin", wheel


def _console_scripts() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return [line.split("=")[0].strip() for line in lines]


def test_the_wheel_holds_every_package_of_the_checkout(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for source, package in ((ROOT / "rqp", "rqp"), (ROOT / "agents", "rqp_agents")):
        for module in source.rglob("*.py"):
            inside = f"{package}/{module.relative_to(source).as_posix()}"
            assert inside in names, f"{inside} is not in {wheel.name}"
    assert "rqp/include/rqp.h" in names  # the C API (rqp.get_include())


def test_the_wheel_declares_the_scripts_of_setup_cfg(installed):
    bin_dir, _ = installed
    scripts = _console_scripts()
    assert len(scripts) >= 6
    for name in scripts:
        assert (bin_dir / name).exists(), name


RQPCTL_COMMANDS = [[], ["status"], ["metrics"], ["queues"], ["send"], ["receive"], ["dlq"],
                   ["dlq", "replay"]]


@pytest.mark.parametrize("argv", [[name] for name in _console_scripts() if name != "rqpctl"]
                         + [["rqpctl", *sub] for sub in RQPCTL_COMMANDS],
                         ids=lambda argv: " ".join(argv))
def test_every_command_answers_help_and_does_nothing_else(installed, tmp_path, argv):
    bin_dir, _ = installed
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # In a new IPC namespace, then list its queues: --help must have created none.
    out = _run(["unshare", "--ipc", "--", "sh", "-c", '"$@" --help && echo "@@queues" && '
                "ipcs -q", "sh", str(bin_dir / argv[0]), *argv[1:]], cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    help_text, _, queues = out.stdout.partition("@@queues")
    assert help_text.lower().startswith("usage:"), help_text
    assert not [line for line in queues.splitlines() if line[:2] == "0x"], queues
    assert list(cwd.iterdir()) == [], f"{argv} --help wrote {list(cwd.iterdir())}"
    assert "Traceback" not in out.stderr


def test_report_without_pyspark_says_what_to_install(installed, tmp_path):
    bin_dir, _ = installed
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run([str(bin_dir / "rqp-dlq-report"), "--input", str(empty),
                "--output", str(tmp_path / "out")])
    assert out.returncode == 2 and "no archive files" in out.stderr, out.stderr
    archive = tmp_path / "archive"
    archive.mkdir()
    with gzip.open(archive / "dlq-0001.jsonl.gz", "wt") as f:
        f.write(json.dumps({"schema": 1}) + "\n")
    out = _run([str(bin_dir / "rqp-dlq-report"), "--input", str(archive),
                "--output", str(tmp_path / "out")])
    assert out.returncode == 2, out.stderr
    assert "pip install 'rqp[spark]'" in out.stderr and "Java" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("script", ["demo", "test", "bench", "chaos", "report-bench",
                                    "install"])
def test_every_script_answers_help_without_setting_anything_up(script, tmp_path):
    venv, log = tmp_path / "venv", tmp_path / "setup.log"
    out = _run(["bash", str(ROOT / "scripts" / script), "--help"], cwd=tmp_path,
               env={"PATH": "/usr/bin:/bin", "RQP_VENV": str(venv), "RQP_SETUP_LOG": str(log)})
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    assert not venv.exists() and not log.exists() and list(tmp_path.iterdir()) == []
