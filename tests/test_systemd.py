"""systemd: the install script, the units (systemd-analyze verify, the strongest check that can
run without systemd as PID 1), and the agents' sd_notify protocol under a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agents import write_rqprc
from tests.testbed import wait_for

REPO = Path(__file__).resolve().parents[1]
UNITS = sorted(p.name for p in (REPO / "systemd").iterdir() if p.suffix in (".service", ".timer"))


def _system_python() -> str:
    """The Python an operator installs with: a system-wide one, which the user rqp may run
    (the test's own venv may link to one under root's private home, as pyenv's does)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK) and subprocess.run(
                [candidate, "-c", "import sys, venv, ensurepip; "
                 "sys.exit(sys.version_info < (3, 11))"]).returncode == 0:
            return candidate
    return sys.executable


SYSTEM_PYTHON = _system_python()


def install(root: Path, *args: str, umask: str = "022") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'umask {umask}; exec bash "$@"', "_",
                           str(REPO / "scripts" / "install"), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=SYSTEM_PYTHON))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A scratch root the install script has installed into (once for this module), from a
    shell whose umask is 077, as on a hardened host (a trial's venv was then unreadable for
    rqp: the install said nothing, every unit failed)."""
    root = tmp_path_factory.mktemp("root")
    done = install(root, umask="077")
    assert done.returncode == 0, done.stderr
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_staged_install_makes_nothing_in_the_hosts_opt(tmp_path):
    """A re-check: --root (even --dry-run) made /opt/rqp on the host itself, as the mount
    point of the staged one, and removed it again: a read-only /opt would fail it. A mkdir
    of /opt/rqp anywhere but on a tmpfs fails here, as on such a host. (And /opt keeps what
    it has meanwhile: a re-check's pip found no wheels under a bare tmpfs on /opt.)"""
    shims = tmp_path / "bin"
    shims.mkdir()
    real = shutil.which("mkdir")
    (shims / "mkdir").write_text(
        "#!/bin/sh\nfor a; do case $a in /opt/rqp|/opt/rqp/) [ \"$(stat -f -c %T /opt)\" = "
        f"tmpfs ] || {{ echo \"mkdir $a on the host\" >&2; exit 1; }};; esac; done\n"
        f'exec {real} "$@"\n')
    (shims / "mkdir").chmod(0o755)
    existed = Path("/opt/rqp").exists()
    done = subprocess.run(["bash", str(REPO / "scripts" / "install"), "--root",
                           str(tmp_path / "root")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=SYSTEM_PYTHON,
                                   PATH=f"{shims}:{os.environ['PATH']}"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on the host" not in done.stderr, done.stderr
    assert Path("/opt/rqp").exists() == existed
    assert (tmp_path / "root/opt/rqp/venv/bin/rqp-sender").exists()


def test_dry_run_changes_nothing_and_says_everything(tmp_path):
    root = tmp_path / "root"
    out = install(root, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert not root.exists()
    for what in ("groupadd", "useradd", "-m venv", "pip install", "/etc/rqp/rqprc",
                 "/etc/rqp/receiver.yaml", "60-rqp-ipc.conf", *UNITS):
        assert what in out.stdout, what


def test_install_lays_out_user_directories_configs_and_units(scratch):
    passwd = (scratch / "etc/passwd").read_text()
    assert "rqp:x:" in passwd and ":/usr/sbin/nologin" in passwd
    uid = int(passwd.split("rqp:x:")[1].split(":")[0])
    assert uid < 1000  # a system user: logind's RemoveIPC= never touches its queues
    # (0750: the group, the applications', may read, not change the journal and window)
    assert (scratch / "var/lib/rqp").stat().st_mode & 0o777 == 0o750
    assert (scratch / "etc/shadow").stat().st_mode & 0o777 == 0o640
    assert not list((scratch / "etc").glob("*-"))  # (useradd's backups, not there before)
    assert (scratch / "etc/rqp").stat().st_mode & 0o777 == 0o750
    for name, example in (("rqprc", "rqprc.example.yaml"),
                          ("receiver.yaml", "receiver.example.yaml")):
        installed = (scratch / "etc/rqp" / name).read_text()
        assert "\nrqp_template: " in installed  # a template the agents refuse
        settings = [line for line in (REPO / "config" / example).read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        assert settings and all(f"#{line}" in installed or f"# {line}" in installed
                                for line in settings)  # every setting shown, commented out
    for unit in UNITS:
        assert (scratch / "etc/systemd/system" / unit).read_bytes() == \
            (REPO / "systemd" / unit).read_bytes()
    for command in ("rqp-sender", "rqp-receiver"):
        assert os.access(scratch / "opt/rqp/venv/bin" / command, os.X_OK)
    for path in ("opt/rqp/venv", "opt/rqp/venv/bin", "opt/rqp/venv/bin/rqp-sender"):
        assert (scratch / path).stat().st_mode & 0o755 == 0o755, path  # (umask 077 above)
    # the commit it was installed from, which --version names (a trial: every build "0.1.0")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    [build] = scratch.glob("opt/rqp/venv/lib/python3*/site-packages/rqp/BUILD")
    assert head and build.read_text().split("-")[0].strip() == head
    version = subprocess.run([scratch / "opt/rqp/venv/bin/python", "-I", "-c",
                              "import rqp; print(rqp.VERSION_TEXT)"], capture_output=True,
                             text=True).stdout.strip()
    assert version.startswith(f"0.1.0 (build {head}")


def test_install_again_mends_a_half_made_venv_and_keeps_an_edited_unit(scratch):
    """Trial C: a venv left without pip by a run that failed (no python3-venv) was never
    mended by the next run; a unit edited in place was overwritten without a word. A unit
    the last run installed, and an older one of those, is just updated."""
    venv = scratch / "opt/rqp/venv"
    for pip in venv.glob("lib/python3*/site-packages/pip"):
        shutil.rmtree(pip)
    unit = scratch / "etc/systemd/system/rqp-sender.service"
    shipped = unit.read_text()
    unit.write_text(shipped + "Nice=5\n")  # an operator's edit
    older = scratch / "etc/systemd/system/rqp-receiver.service"
    older.write_text(older.read_text() + "# an older release's line\n")  # as installed...
    manifest = scratch / "opt/rqp/units.sha256"
    manifest.write_text(manifest.read_text() + "%s  rqp-receiver.service\n" % __import__(
        "hashlib").sha256(older.read_bytes()).hexdigest())  # ...by the last run
    try:
        out = install(scratch)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "(it has no pip: an earlier run stopped half-way)" in out.stdout, out.stdout
        assert subprocess.run([venv / "bin/python", "-m", "pip", "--version"],
                              capture_output=True).returncode == 0
        assert f"{unit} is not the one the last install put there (edited?)" in out.stdout
        assert (unit.parent / "rqp-sender.service.edited").read_text().endswith("Nice=5\n")
        assert unit.read_text() == shipped
        assert f"updating {older}" in out.stdout and \
            not (older.parent / "rqp-receiver.service.edited").exists()
        assert older.read_bytes() == (REPO / "systemd/rqp-receiver.service").read_bytes()
    finally:
        (unit.parent / "rqp-sender.service.edited").unlink(missing_ok=True)


def test_install_knows_earlier_releases_units_and_keeps_every_edit(scratch):
    """Left alone a round ago: an upgrade from a release before units.sha256 (be67f36) called
    each unit it changed "edited" and kept a copy; a second edit's copy overwrote the first's."""
    units = scratch / "etc/systemd/system"
    manifest = scratch / "opt/rqp/units.sha256"
    kept = manifest.read_text()
    drain = units / "rqp-dlq-drain.service"
    sender = units / "rqp-sender.service"
    shipped = sender.read_text()
    try:
        manifest.unlink()  # (as that release left the host)
        drain.write_bytes(subprocess.run(
            ["git", "-C", str(REPO), "show", "be67f36:systemd/rqp-dlq-drain.service"],
            capture_output=True, check=True).stdout)
        sender.write_text(shipped + "Nice=5\n")  # an edit, and later another
        out = install(scratch)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"updating {drain}" in out.stdout, out.stdout
        assert not (units / "rqp-dlq-drain.service.edited").exists()
        assert drain.read_bytes() == (REPO / "systemd/rqp-dlq-drain.service").read_bytes()
        sender.write_text(shipped + "Nice=7\n")
        out = install(scratch)
        assert f"kept as {sender}.edited.2;" in out.stdout, out.stdout
        assert (units / "rqp-sender.service.edited").read_text().endswith("Nice=5\n")
        assert (units / "rqp-sender.service.edited.2").read_text().endswith("Nice=7\n")
        sender.write_text(shipped + "Nice=7\n")  # the same edit again: its copy is there
        out = install(scratch)
        assert f"kept as {sender}.edited.2;" in out.stdout, out.stdout
        assert not (units / "rqp-sender.service.edited.3").exists()
        assert sender.read_text() == shipped
    finally:
        for copy in units.glob("rqp-sender.service.edited*"):
            copy.unlink()
        manifest.write_text(kept)


def test_install_is_idempotent_and_keeps_the_operators_config(scratch):
    rqprc = scratch / "etc/rqp/rqprc"
    template = rqprc.read_text()
    rqprc.write_text("hosts: [mine.example.org]\n")
    try:
        again = install(scratch)
        assert again.returncode == 0, again.stderr
        assert "keeping" in again.stdout and "creating" not in again.stdout
        assert rqprc.read_text() == "hosts: [mine.example.org]\n"
        assert (scratch / "etc/passwd").read_text().count("rqp:x:") == 1
    finally:  # (the module's other tests look at the template)
        rqprc.write_text(template)


def test_install_refuses_a_python_the_agents_user_cannot_run_and_options_without_values(
        tmp_path):
    """A trial: python3 was pyenv's, under root's private home; the venv linked to it and
    every agent failed "Permission denied". And --root without a value: "$2: unbound
    variable"."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python3").symlink_to(SYSTEM_PYTHON)
    root = tmp_path / "root"
    for dry in ((), ("--dry-run",)):  # (checked first, a dry run too: before rqp exists)
        out = install(root, "--python", str(private / "python3"), *dry)
        assert out.returncode == 1 and f"install: the user rqp cannot run {private}/python3" \
            in out.stderr and "--python /usr/bin/python3" in out.stderr, out.stderr
        assert not root.exists()  # nothing made
    for args in (["--root"], ["--python"], ["--root", "--dry-run"]):
        out = subprocess.run(["bash", str(REPO / "scripts" / "install"), *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"install: {args[0]} needs a value" in out.stderr, \
            out.stderr


def test_install_run_again_with_another_python_makes_the_venv_again(scratch, tmp_path):
    """A trial's second run with --python kept the venv made with the first Python."""
    cfg = scratch / "opt/rqp/venv/pyvenv.cfg"
    made = cfg.read_text()
    cfg.write_text(made.replace("executable = ", "executable = /elsewhere", 1))  # another's
    out = install(scratch)
    assert out.returncode == 0, out.stderr
    assert "re-creating" in out.stdout and "(it was made with /elsewhere" in out.stdout, \
        out.stdout
    assert "/elsewhere" not in cfg.read_text()
    again = install(scratch)  # the same Python, whatever path names it: kept
    assert again.returncode == 0 and "re-creating" not in again.stdout


def verify(root: Path, *units: str) -> subprocess.CompletedProcess:
    # (without the SYSTEMD_UNIT_PATH tests/conftest.py sets for the API: verify reads it too)
    env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_UNIT_PATH"}
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}",
                           *[f"/etc/systemd/system/{u}" for u in units]],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def verifiable(scratch):
    """The scratch root plus what verify needs of the system: its units and /bin/kill."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing (Debian: systemd)"
    target = scratch / "usr/lib/systemd/system"
    if not target.exists():
        shutil.copytree("/lib/systemd/system", target, symlinks=True)
    (scratch / "bin").mkdir(exist_ok=True)
    shutil.copy2("/bin/kill", scratch / "bin/kill")
    # the drain's command comes with the dead-letter tools; a stand-in if it is not there yet
    drain = scratch / "opt/rqp/venv/bin/rqp-dlq-drain"
    if not drain.exists():
        drain.write_text("#!/bin/sh\n")
        drain.chmod(0o755)
    return scratch


def test_every_unit_verifies_cleanly(verifiable):
    result = verify(verifiable, *UNITS)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_verify_does_catch_a_broken_unit(verifiable):
    good = (REPO / "systemd/rqp-receiver.service").read_text()
    broken = verifiable / "etc/systemd/system/rqp-broken.service"
    broken.write_text(good.replace("WatchdogSec=", "WatchdogSecs="))
    try:
        result = verify(verifiable, "rqp-broken.service")
    finally:
        broken.unlink()
    assert "Unknown key 'WatchdogSecs'" in result.stderr


def test_the_report_runs_daily_into_dated_runs():
    """Issue 16: rqp-dlq-report.timer builds the report once a day (made up after downtime),
    keeping dated runs with a latest link; an empty archive is a run that succeeded (not a
    failed one), and a drop-in can add options (--metrics-file) without repeating the
    command."""
    service = (REPO / "systemd/rqp-dlq-report.service").read_text()
    timer = (REPO / "systemd/rqp-dlq-report.timer").read_text()
    assert "Type=oneshot" in service and "User=rqp" in service
    assert "--reports /var/lib/rqp/dlq-reports --keep 14" in service
    assert "--input /var/lib/rqp/dlq-archive" in service  # where rqp-dlq-drain.service puts it
    assert "--keep 14 --allow-empty $RQP_REPORT_OPTIONS\n" in service
    assert "\nEnvironment=RQP_REPORT_OPTIONS=\n" in service  # (empty: zero arguments)
    assert "OnCalendar=*-*-* 05:30:00" in timer and "Persistent=true" in timer
    assert "WantedBy=timers.target" in timer


def test_units_say_why_not_dynamic_user_or_private_ipc():
    for unit in ("rqp-receiver.service", "rqp-sender.service"):
        text = (REPO / "systemd" / unit).read_text()
        assert "Type=notify" in text and "ExecReload=/bin/kill -HUP $MAINPID" in text
        assert "Restart=on-failure" in text and "User=rqp" in text
        # a config error (exit 1 at once) settles to failed, not a restart every 2 s for ever
        assert "\nStartLimitIntervalSec=60s\nStartLimitBurst=5\n" in text.split("[Service]")[0]
        assert "Not DynamicUser=" in text and "Not PrivateIPC=" in text
        assert "\nDynamicUser=" not in text and "\nPrivateIPC=" not in text
        assert "SystemCallFilter=@system-service" in text


# --- sd_notify -------------------------------------------------------------------------------

class FakeSystemd:
    """A NOTIFY_SOCKET that records the datagrams a daemon sends."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.path = path
        self.messages: list[str] = []

    def poll(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return self.messages

    def has(self, text: str) -> int:
        return sum(text in m for m in self.poll())

    def env(self) -> dict:
        return dict(os.environ, NOTIFY_SOCKET=str(self.path), WATCHDOG_USEC="200000")


@pytest.mark.parametrize("agent", ["receiver", "sender"])
def test_agents_speak_sd_notify(testbed, tmp_path, agent):
    host = testbed.add_host("a")
    fake = FakeSystemd(tmp_path / "notify")
    if agent == "receiver":
        argv = [sys.executable, "-m", "rqp_agents.receiver", "--listen", f"{host.address}:7460",
                "--state-dir", str(host.workdir / "state"), "--plaintext"]
    else:
        argv = [sys.executable, "-m", "rqp_agents.sender", "--rqprc",
                str(write_rqprc(host, [host]))]
    proc = host.popen(argv, env=fake.env())
    wait_for(lambda: fake.has("READY=1"), timeout=20, message=f"{agent}: no READY=1")
    wait_for(lambda: fake.has("WATCHDOG=1") >= 3, timeout=20,
             message=f"{agent}: no watchdog pings (WatchdogSec= half-interval)")
    assert not fake.has("STOPPING=1")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert fake.has("STOPPING=1") == 1
    ready = next(i for i, m in enumerate(fake.messages) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(fake.messages) if "STOPPING=1" in m)
    assert ready < stopping


def _agent(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=30)


def test_agents_refuse_the_installed_templates_until_filled_in(scratch, tmp_path):
    """Issue 10: the examples were installed as the live configs, and the sender retried
    invented hosts for ever. The templates are refused, naming the file and the keys."""
    rqprc, receiver = scratch / "etc/rqp/rqprc", scratch / "etc/rqp/receiver.yaml"
    out = _agent(["rqp_agents.sender", "--rqprc", str(rqprc)])
    assert out.returncode == 1
    assert f"{rqprc}: this is the template scripts/install put here" in out.stderr, out.stderr
    assert "'hosts'" in out.stderr and "delete the line 'rqp_template: ...' (line 4)" \
        in out.stderr
    out = _agent(["rqp_agents.receiver", "--config", str(receiver), "--listen",
                  "127.0.0.1:7460", "--state-dir", str(tmp_path)])
    assert out.returncode == 1 and f"{receiver}: this is the template" in out.stderr
    assert "'offer'" in out.stderr
    # Filled in: the marker deleted and the keys this host needs set.
    from rqp.config import load_receiver_config, load_sender_config
    filled = tmp_path / "rqprc"
    filled.write_text(rqprc.read_text().replace('rqp_template: "delete this line once the '
                                                'file is filled in"\n', "")
                      + "hosts: [receiver.example.net]\n")
    assert [str(h) for h in load_sender_config(filled).hosts] == ["receiver.example.net:7460"]
    filled = tmp_path / "receiver.yaml"
    filled.write_text("\n".join(line for line in receiver.read_text().splitlines()
                                if not line.startswith("rqp_template:")))
    assert load_receiver_config(filled).source == str(filled)


def test_root_stages_the_tree_with_the_target_hosts_paths(scratch):
    """Issue 10: --root DIR wrote #! lines into DIR, so the staged tree could not be packaged.
    Nothing under DIR names DIR; the venv runs once it is where the target host has it."""
    venv = scratch / "opt/rqp/venv"
    named = subprocess.run(["grep", "-rlI", "--", str(scratch), str(scratch / "opt"),
                            str(scratch / "etc")], capture_output=True, text=True)
    assert named.stdout == "", f"files that name the staging root:\n{named.stdout}"
    assert (venv / "bin/rqp-sender").read_text().splitlines()[0] == \
        "#!/opt/rqp/venv/bin/python"
    assert "/opt/rqp/venv" in (venv / "pyvenv.cfg").read_text() or \
        "command" not in (venv / "pyvenv.cfg").read_text()
    made = not Path("/opt/rqp").exists()
    if made:
        Path("/opt/rqp").mkdir(parents=True)
    try:
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             'mount --bind "$1" /opt/rqp && /opt/rqp/venv/bin/rqp-sender --help', "sh",
             str(scratch / "opt/rqp")], capture_output=True, text=True, timeout=60)
    finally:
        if made:
            Path("/opt/rqp").rmdir()
    assert out.returncode == 0 and out.stdout.startswith("usage: rqp-sender"), out.stderr


def test_the_target_host_makes_the_user_and_the_owners_again(scratch, tmp_path):
    """A new user found a tree staged with --root carries the scratch user database's ids: the
    sysusers.d and tmpfiles.d snippets it installs make the user and the owners on the target
    host, with that host's ids (systemd-sysusers / systemd-tmpfiles run on an image root)."""
    sysusers = scratch / "usr/lib/sysusers.d/rqp.conf"
    tmpfiles = scratch / "usr/lib/tmpfiles.d/rqp.conf"
    assert sysusers.read_bytes() == (REPO / "config/rqp.sysusers.conf").read_bytes()
    assert tmpfiles.read_bytes() == (REPO / "config/rqp.tmpfiles.conf").read_bytes()
    image = tmp_path / "image"
    (image / "etc").mkdir(parents=True)
    # an image whose ids 999 are taken already: rqp gets others
    (image / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n"
                                      "other:x:999:999::/:/usr/sbin/nologin\n")
    (image / "etc/group").write_text("root:x:0:\nother:x:999:\n")
    for snippet, tool in ((sysusers, "systemd-sysusers"), (tmpfiles, "systemd-tmpfiles")):
        target = image / snippet.relative_to(scratch)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(snippet, target)
    (image / "etc/rqp").mkdir()
    made = subprocess.run(["systemd-sysusers", f"--root={image}"], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    gid = int([line for line in (image / "etc/group").read_text().splitlines()
               if line.startswith("rqp:")][0].split(":")[2])
    assert gid != 999
    owned = subprocess.run(["systemd-tmpfiles", f"--root={image}", "--create"],
                           capture_output=True, text=True, timeout=60)
    assert owned.returncode == 0, owned.stderr
    assert (image / "var/lib/rqp").stat().st_gid == gid
    assert (image / "etc/rqp").stat().st_gid == gid
    assert (image / "etc/rqp").stat().st_mode & 0o777 == 0o750
