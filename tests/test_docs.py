"""What the README, the example configs and the units say about commands is true.

Every ``rqp-…`` command they name exists (a console script of setup.cfg), and every ``--option``
written after a command (in the same code span, code-block line or comment line) is an option
of that command, as its own ``--help`` shows. (Issue 10: the example .rqprc named an
``rqp-put`` command that never existed and a ``--config`` option the sender does not have.)
"""

from __future__ import annotations

import configparser
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "config").glob("*")),
        *sorted((ROOT / "systemd").glob("*"))]

_cfg = configparser.ConfigParser()
_cfg.read(ROOT / "setup.cfg")
ENTRY_POINTS = dict(
    (name.strip(), target.strip()) for name, _, target in (
        line.partition("=") for line in
        _cfg["options.entry_points"]["console_scripts"].strip().splitlines()))
RQPCTL_GROUPS = ("status", "metrics", "queues", "send", "receive", "dlq", "tls")
#: Names with the prefix that are not commands: units, files, directories, package extras.
NOT_COMMANDS = re.compile(r"rqp-(ipc|demo-report|dlq-drain\.timer)\b|rqp-[a-z-]+\.(service|"
                          r"timer|conf|log|pid|sock)\b")
COMMAND = re.compile(r"\b(rqpctl(?: (?:" + "|".join(RQPCTL_GROUPS) + r")(?: [a-z]+(?:-[a-z]+)*)?)?"
                     r"|rqp-[a-z]+(?:-[a-z]+)*)\b")


def _mentions():
    """(file, line number, command, [options]) for each command named in the docs."""
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NOT_COMMANDS.search(line) and not COMMAND.search(NOT_COMMANDS.sub("", line)):
                continue
            text = NOT_COMMANDS.sub("", line)
            spans = re.findall(r"`([^`]+)`", text) if "`" in text else [text]
            for span in spans:
                for match in COMMAND.finditer(span):
                    rest = span[match.end():]
                    nxt = COMMAND.search(rest)
                    options = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)",
                                         rest[:nxt.start()] if nxt else rest)
                    yield path.relative_to(ROOT), number, match.group(1), options


MENTIONS = list(_mentions())


@functools.lru_cache(maxsize=None)
def _help(command: str) -> str:
    words = command.split()
    if words[0] == "rqpctl":
        argv = [sys.executable, "-m", "rqp.tools.ctl", *words[1:]]
        if len(words) == 3 and words[1] not in ("dlq", "tls"):
            argv = argv[:-1]  # "rqpctl status foo": foo is an argument, not a command
    else:
        module = ENTRY_POINTS[words[0]].split(":")[0]
        argv = [sys.executable, "-m", module]
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, f"{command} --help: {out.stderr}"
    return out.stdout


def test_the_docs_name_commands():
    assert len(MENTIONS) > 20 and any(m[3] for m in MENTIONS)


@pytest.mark.parametrize("where, line, command, options", MENTIONS,
                         ids=[f"{m[0]}:{m[1]}:{m[2]}" for m in MENTIONS])
def test_every_command_and_option_the_docs_name_exists(where, line, command, options):
    name = command.split()[0]
    assert name == "rqpctl" or name in ENTRY_POINTS, \
        f"{where}:{line} names {name}, which is not a command (setup.cfg: " \
        f"{', '.join(ENTRY_POINTS)})"
    text = _help(command)
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}\b", text), \
            f"{where}:{line}: {command} has no option {option}"
