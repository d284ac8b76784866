"""The package layers (ARCHITECTURE.md) hold: which package may import which, and the protocol
imports nothing that does I/O. Read from the source (every import statement, also those inside
functions) and checked in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Layer -> the project layers it may import (besides itself). Lower layers never import
#: higher ones; nothing imports the tools or the agents.
ALLOWED = {
    "rqp.protocol": set(),
    "rqp.system": {"rqp.protocol"},
    "rqp.storage": {"rqp.protocol", "rqp.system"},
    "rqp.config": {"rqp.protocol"},
    "rqp.cli": {"rqp.protocol", "rqp.config"},
    "rqp.api": {"rqp.protocol", "rqp.system", "rqp.config"},
    "rqp.report": {"rqp.protocol", "rqp.system", "rqp.storage", "rqp.report"},
    "rqp_agents": {"rqp", "rqp.protocol", "rqp.system", "rqp.storage", "rqp.config", "rqp.cli",
                   "rqp.api"},
    "rqp.tools": {"rqp", "rqp.protocol", "rqp.system", "rqp.storage", "rqp.config", "rqp.cli",
                  "rqp.api", "rqp.report"},
    "rqp": {"rqp.protocol", "rqp.api"},  # rqp/__init__.py: the public names
}
#: Modules the protocol must not import, directly or through anything it imports.
NO_IO = ("socket", "selectors", "asyncio", "sysv_ipc", "subprocess", "yaml")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "rqp_agents":
        return "rqp_agents"
    if len(parts) >= 2 and f"rqp.{parts[1]}" in ALLOWED:
        return f"rqp.{parts[1]}"
    return "rqp"


def project_modules():
    for package in ("rqp", "rqp_agents"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def imports_of(module: str, path: Path) -> set[str]:
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_every_project_module_is_in_a_layer():
    modules = dict(project_modules())
    assert "rqp.protocol.frames" in modules and "rqp_agents.sender" in modules
    assert {layer_of(m) for m in modules} <= set(ALLOWED)


@pytest.mark.parametrize("module,path", list(project_modules()), ids=lambda v: str(v))
def test_imports_follow_the_layers(module, path):
    layer = layer_of(module)
    wrong = set()
    for name in imports_of(module, path):
        if name.split(".")[0] not in ("rqp", "rqp_agents"):
            if layer == "rqp.protocol" and name.split(".")[0] in NO_IO:
                wrong.add(name)
            continue
        target = layer_of(name)
        if target != layer and target not in ALLOWED[layer]:
            # (the package's version and build, which every layer may say)
            if not (target == "rqp" and name in ("rqp", "rqp.__version__", "rqp.VERSION_TEXT",
                                                 "rqp.BUILD")):
                wrong.add(name)
    assert not wrong, f"{module} ({layer}) imports {sorted(wrong)}"


def test_a_layer_rule_breach_is_seen(tmp_path):
    """The check above can fail: a protocol module that imports the System V adapter."""
    bad = tmp_path / "bad.py"
    bad.write_text("import socket\nfrom rqp.system import queues\n")
    names = imports_of("rqp.protocol.bad", bad)
    assert "socket" in names and "rqp.system.queues" in names
    assert layer_of("rqp.system.queues") not in ALLOWED["rqp.protocol"]


def test_importing_the_protocol_loads_no_io():
    code = ("import json, sys; import rqp.protocol, rqp.protocol.frames, rqp.protocol.records, "
            "rqp.protocol.sender, rqp.protocol.receiver, rqp.protocol.reasons, "
            "rqp.protocol.keys; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    loaded = set(json.loads(out.stdout))
    assert not loaded & set(NO_IO), sorted(loaded & set(NO_IO))
    assert not {m for m in loaded if m.startswith(("rqp.system", "rqp.storage", "rqp.api"))}
    out = subprocess.run([sys.executable, "-c", "import json, sys, rqp; "
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "sysv_ipc" not in json.loads(out.stdout)  # the API is imported on first use


def test_the_public_api_is_still_reachable_from_rqp():
    import rqp
    from rqp import api

    assert rqp.openConnection is api.openConnection and "sendMessage" in dir(rqp)
    with pytest.raises(AttributeError):
        rqp.no_such_name
