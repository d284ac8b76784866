"""Simulated hosts on one machine, for integration tests that run real daemons.

Each simulated *host* is a pair of Linux namespaces of its own:

* a network namespace (``/run/netns/<prefix>-<suffix>-<host>``) whose only links are ``lo``
  (up, so a daemon can listen on 127.0.0.1 "on that host") and one veth into a shared
  bridge, with an address from a private /24 in 10.213.0.0/16;
* an IPC namespace, kept alive by a bind mount of its nsfs file
  (``/run/rqp-testbed/<prefix>-<suffix>/<host>.ipc``), so System V message queues created on
  one host are invisible on every other host and in the root namespace, and the per-IPC
  sysctls (``kernel.msgmnb`` ...) can differ per host.

The bridge lives in a dedicated "switch" network namespace (``<prefix>-<suffix>-sw``).  Nothing
is ever configured in the root network namespace: no address, no route, no link.  Every name
carries a random per-Testbed suffix, so parallel runs and leftovers never collide.  Needs root.

Using it from a test module (the checkout's root is on sys.path through setup.cfg's
``pythonpath``; ``tests`` has no ``__init__.py`` and resolves as a namespace package; the
``testbed`` and ``testbed_factory`` fixtures come from tests/conftest.py)::

    from tests.testbed import wait_for

    def test_something(testbed):
        a, b = testbed.add_host("a"), testbed.add_host("b")
        server = b.popen([sys.executable, "-m", "some.daemon", "--listen", b.address])
        wait_for(lambda: ..., timeout=5, message="daemon on b never came up")

Importing the name ``testbed`` into the module is what makes the fixture visible (pytest
looks fixtures up in the test module's namespace).  ``pytest_plugins = ["tests.testbed"]`` in a
test module works too.  On a failed test the fixture appends each host's ``logs()`` to the
failure report (section "testbed logs"); the workdirs are deleted at close unless the
environment variable ``RQPT_KEEP=1`` is set (then their path is logged).

To give the fixture arguments, parametrize it indirectly::

    @pytest.mark.parametrize("testbed", [{"sysctls": {"kernel.msgmnb": 1 << 20}}], indirect=True)

or use the ``testbed_factory`` fixture (``from tests.testbed import testbed_factory``), a
callable taking Testbed's keyword arguments; all testbeds it made are closed at teardown.

Waiting: tests never sleep to synchronise; they call :func:`wait_for` with a deadline.

Cleanup: close() (also run by __exit__, the fixtures, and an atexit fallback) kills the
process group of everything started with Host.popen, then any process still inside the
testbed's own namespaces (e.g. one that daemonised with setsid), deletes the network namespaces
(veths and bridge go with them), unmounts and removes the IPC namespace files and the private
bind mount of the run dir, and deletes the workdirs.  It never raises; what it could not remove
is logged (logger "rqp.testbed") and listed in ``Testbed.cleanup_problems``.  After a run that
was SIGKILLed, :func:`sweep_stale` removes testbeds whose owner process is dead.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import logging
import os
import pathlib
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, TypeVar

import pytest

__all__ = [
    "Host",
    "HostCommandError",
    "Testbed",
    "TestbedError",
    "free_port_on",
    "sweep_stale",
    "testbed",
    "testbed_factory",
    "wait_for",
]

log = logging.getLogger("rqp.testbed")

T = TypeVar("T")

#: Parent of the per-testbed directories that hold the IPC namespace files.
RUN_DIR = pathlib.Path("/run/rqp-testbed")
NETNS_DIR = pathlib.Path("/run/netns")
#: All testbed subnets are /24s inside this range, and only inside created namespaces.
TEST_RANGE = ipaddress.ip_network("10.213.0.0/16")

IP = shutil.which("ip") or "/usr/sbin/ip"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
MOUNT = shutil.which("mount") or "/usr/bin/mount"
UMOUNT = shutil.which("umount") or "/usr/bin/umount"

#: Sysctls that belong to an IPC or network namespace.  Anything else would change the real
#: machine, so Host.sysctl refuses it.
_NAMESPACED_SYSCTL = re.compile(
    r"^(kernel\.(msgmax|msgmnb|msgmni|msg_next_id|sem|sem_next_id|shmall|shmmax|shmmni"
    r"|shm_next_id|shm_rmid_forced)|fs\.mqueue\.[a-z_]+|net\.[A-Za-z0-9_.\-]+)$"
)
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,31}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,4}$")

_LOGFILE = object()  # default for Host.popen's stdout/stderr: a file in the host's workdir
_TAIL_BYTES = 8192


class TestbedError(RuntimeError):
    """Setting up the testbed failed."""

    __test__ = False  # not a test class, despite the name


class HostCommandError(subprocess.CalledProcessError):
    """A command run on a host failed; str() shows the host, the command and its stderr."""

    def __init__(self, host: str, returncode: int, cmd: list[str], output: str, stderr: str):
        super().__init__(returncode, cmd, output, stderr)
        self.host = host

    def __str__(self) -> str:
        shown = shlex.join(self.cmd) if isinstance(self.cmd, list) else str(self.cmd)
        if len(shown) > 300:
            shown = shown[:300] + "..."
        return (
            f"on host {self.host!r}: {shown} exited with {self.returncode}\n"
            f"--- stderr ---\n{_tail_text(self.stderr or '')}\n"
            f"--- stdout ---\n{_tail_text(self.output or '')}"
        )


# --------------------------------------------------------------------------------------------
# waiting


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.02,
    message: str,
    ignore: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    An exception of a type in ``ignore`` counts as "not yet" (and is remembered).  When
    ``timeout`` seconds have passed, raise AssertionError(message + the last value or
    exception).  The predicate is always tried at least once, and once more at the deadline.
    """
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except ignore as exc:  # noqa: PERF203
            last = exc
        else:
            if value:
                return value
            last = value
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(interval, max(deadline - now, 0.0)))
    shown = f"{type(last).__name__}: {last}" if isinstance(last, BaseException) else repr(last)
    raise AssertionError(f"{message} (waited {timeout:g}s; last value: {shown})")


# --------------------------------------------------------------------------------------------
# small helpers


def _tail_text(text: str, limit: int = _TAIL_BYTES) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def _tail_file(path: pathlib.Path, limit: int = _TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    text = data.decode("utf-8", "replace")
    return text if size <= limit else "[...]\n" + text


def _sh(argv: list[str], *, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    """Run a setup/cleanup command in the root namespaces."""
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise TestbedError(
            f"{shlex.join(argv)} exited with {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def _ns_id(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _mount_points() -> list[str]:
    points = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    # octal escapes (\040 for space) are not expected in our paths
                    points.append(fields[4])
    except OSError:
        pass
    return points


def _root_routes() -> list[ipaddress.IPv4Network]:
    """Destinations of the root namespace's IPv4 routes (all tables), read only."""
    nets = []
    proc = _sh([IP, "-4", "-j", "route", "show", "table", "all"], check=False)
    try:
        entries = json.loads(proc.stdout or "[]")
    except ValueError:
        entries = []
    for entry in entries:
        dst = entry.get("dst", "")
        if not dst or dst == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
    return nets


def require_root() -> None:
    """Fail the calling test unless we can create namespaces: a skipped test proves nothing,
    and the README's test command runs as root and installs what is missing."""
    if os.geteuid() != 0:
        pytest.fail("the testbed needs root (network and IPC namespaces): run the suite as root")
    for tool in (IP, NSENTER, UNSHARE, MOUNT, UMOUNT):
        if not os.path.exists(tool):
            pytest.fail(f"the testbed needs {tool} (Debian: iproute2, util-linux, mount)")


def _pids_in(ids: set[tuple[int, int]]) -> list[int]:
    """Processes whose network or IPC namespace is one of ``ids`` (zombies have none)."""
    found: list[int] = []
    if not ids:
        return found
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == me:
            continue
        for kind in ("net", "ipc"):
            ident = _ns_id(f"/proc/{pid}/ns/{kind}")
            if ident is not None and ident in ids:
                found.append(pid)
                break
    return found


# --------------------------------------------------------------------------------------------
# processes


class _Started:
    __slots__ = ("proc", "argv", "stdout_path", "stderr_path")

    def __init__(self, proc, argv, stdout_path, stderr_path):
        self.proc = proc
        self.argv = argv
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group led by ``proc`` (started with start_new_session=True).

    While the leader is unreaped its pid (= the group id) cannot be reused, so killpg only
    reaches processes we started.  Once it is reaped we do not killpg any more (the id could
    belong to someone else by now); the namespace sweep in close() catches stragglers.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class Host:
    """One simulated host: its own network and IPC namespace, and a private workdir."""

    def __init__(self, testbed: "Testbed", name: str, index: int, address: str, prefixlen: int):
        self.testbed = testbed
        self.name = name
        self.index = index
        self.address = address
        self.prefixlen = prefixlen
        self.netns = f"{testbed.name}-{name}"
        self.netns_path = str(NETNS_DIR / self.netns)
        self.ipc_ns_path = str(testbed.run_dir / f"{name}.ipc")
        self.iface = f"{testbed.name}-h{index}"  # inside the host's netns
        self.switch_port = f"{testbed.name}-s{index}"  # inside the switch netns
        self.workdir = testbed.workdir / name
        self._started: list[_Started] = []
        self._counter = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address} netns={self.netns}>"

    # -- running things on the host ---------------------------------------------------------

    def command(self, argv: Iterable[str]) -> list[str]:
        """``argv`` prefixed so that it runs in this host's network and IPC namespaces."""
        argv = [os.fspath(a) for a in argv]
        if not argv:
            raise ValueError("empty argv")
        return [NSENTER, f"--net={self.netns_path}", f"--ipc={self.ipc_ns_path}", "--", *argv]

    @staticmethod
    def _env(env: dict[str, str] | None) -> dict[str, str]:
        merged = dict(os.environ if env is None else env)
        merged.setdefault("PYTHONUNBUFFERED", "1")  # so logs() shows output of killed processes
        return merged

    def popen(
        self,
        argv: Iterable[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        stdout: Any = _LOGFILE,
        stderr: Any = _LOGFILE,
        stdin: Any = subprocess.DEVNULL,
        **kw: Any,
    ) -> subprocess.Popen:
        """Start ``argv`` on this host in a new session (its own process group).

        stdout/stderr go by default to ``<workdir>/<argv0>-<n>.out`` / ``.err`` (see logs()).
        ``env`` replaces the environment (default: inherited); PYTHONUNBUFFERED=1 is added
        unless set.  The process is killed (its whole group) by close().
        """
        argv = [os.fspath(a) for a in argv]
        if self.testbed.closed:
            raise TestbedError("testbed is closed")
        with self._lock:
            self._counter += 1
            n = self._counter
        stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", os.path.basename(argv[0]) or "proc")[:40]
        files = []
        out_path = err_path = None
        try:
            if stdout is _LOGFILE:
                out_path = self.workdir / f"{stem}-{n}.out"
                stdout = open(out_path, "wb")
                files.append(stdout)
            if stderr is _LOGFILE:
                err_path = self.workdir / f"{stem}-{n}.err"
                stderr = open(err_path, "wb")
                files.append(stderr)
            kw.pop("start_new_session", None)
            proc = subprocess.Popen(
                self.command(argv),
                env=self._env(env),
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                **kw,
            )
        finally:
            for f in files:
                f.close()
        self._started.append(_Started(proc, argv, out_path, err_path))
        log.debug("host %s: started pid %d: %s", self.name, proc.pid, shlex.join(argv))
        return proc

    def run(
        self,
        argv: Iterable[str],
        *,
        timeout: float = 30,
        check: bool = True,
        input: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion (text, captured).

        On timeout the whole process group is killed and TimeoutExpired raised; with
        ``check`` a non-zero exit raises HostCommandError (whose str() includes stderr).
        """
        argv = [os.fspath(a) for a in argv]
        proc = subprocess.Popen(
            self.command(argv),
            env=self._env(env),
            cwd=cwd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            _kill_group(proc, signal.SIGKILL)  # leader not reaped yet: the group is ours
            proc.communicate()
            raise
        if check and proc.returncode != 0:
            raise HostCommandError(self.name, proc.returncode, argv, out, err)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def python(self, code: str, *args: str, timeout: float = 30) -> str:
        """Run ``sys.executable -c code args...`` on this host; return its stdout."""
        return self.run([sys.executable, "-c", code, *map(str, args)], timeout=timeout).stdout

    # -- namespace settings -------------------------------------------------------------------

    def sysctl(self, name: str, value: int) -> None:
        """Set a per-namespace sysctl (kernel.msg*, kernel.sem, kernel.shm*, fs.mqueue.*, net.*)
        inside this host's IPC/network namespace, and check that it took."""
        if not _NAMESPACED_SYSCTL.match(name):
            raise ValueError(f"{name!r} is not a per-namespace sysctl; refusing to change the machine")
        path = "/proc/sys/" + name.replace(".", "/")
        self.run(["sh", "-c", 'printf "%s\\n" "$1" > "$2"', "sh", str(value), path], timeout=10)
        got = self.read_sysctl(name)
        if got.split() != str(value).split():
            raise TestbedError(f"host {self.name}: {name} = {got!r} after writing {value!r}")

    def read_sysctl(self, name: str) -> str:
        if not _NAMESPACED_SYSCTL.match(name):
            raise ValueError(f"{name!r} is not a per-namespace sysctl")
        return self.run(["cat", "/proc/sys/" + name.replace(".", "/")], timeout=10).stdout.strip()

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``ip -n <netns> args...`` (e.g. ``host.ip("-br", "addr")``)."""
        return _sh([IP, "-n", self.netns, *args], check=check)

    def link_down(self) -> None:
        """Cut the host off the test network (its veth goes down inside its netns)."""
        self.ip("link", "set", self.iface, "down")

    def link_up(self) -> None:
        """Reconnect the host (its veth up again; its address and route come back)."""
        self.ip("link", "set", self.iface, "up")
        # the kernel drops the connected route with the link; it comes back with "up"

    # -- processes ----------------------------------------------------------------------------

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL, *, timeout: float = 10) -> int | None:
        """Send ``sig`` to the process group of ``proc`` (started by popen).  For SIGKILL, wait
        for it and return its exit status."""
        _kill_group(proc, sig)
        if sig == signal.SIGKILL:
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("host %s: pid %d did not die within %ss", self.name, proc.pid, timeout)
        return proc.poll()

    def stop(self, proc: subprocess.Popen, *, timeout: float = 5) -> int | None:
        """SIGTERM the group, wait up to ``timeout`` s, then SIGKILL; return the exit status."""
        _kill_group(proc, signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.kill(proc, signal.SIGKILL)

    def output(self, proc: subprocess.Popen, stream: str = "stdout") -> str:
        """Everything ``proc`` (started by popen with the default log files) has written so
        far to ``stream`` ("stdout" or "stderr")."""
        for s in self._started:
            if s.proc is proc:
                path = s.stdout_path if stream == "stdout" else s.stderr_path
                if path is None:
                    raise ValueError(f"{stream} of pid {proc.pid} was not sent to a log file")
                return path.read_text(errors="replace")
        raise ValueError(f"pid {proc.pid} was not started on host {self.name}")

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [s.proc for s in self._started]

    def log_paths(self) -> list[pathlib.Path]:
        return [p for s in self._started for p in (s.stdout_path, s.stderr_path) if p is not None]

    def logs(self, limit: int = _TAIL_BYTES) -> str:
        """Tails of stdout/stderr of every process started with popen on this host."""
        parts = [f"===== host {self.name} ({self.address}, netns {self.netns}) ====="]
        for s in self._started:
            rc = s.proc.poll()
            state = "running" if rc is None else f"exit {rc}"
            parts.append(f"--- pid {s.proc.pid} [{state}]: {shlex.join(s.argv)}")
            for label, path in (("stdout", s.stdout_path), ("stderr", s.stderr_path)):
                if path is None:
                    continue
                text = _tail_file(path, limit)
                parts.append(f"--- {label} ({path.name}){' (empty)' if not text else ''}")
                if text:
                    parts.append(text.rstrip("\n"))
        if not self._started:
            parts.append("(no processes started)")
        return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# the testbed

_LIVE: set["Testbed"] = set()
_LIVE_LOCK = threading.Lock()


def _close_all_at_exit() -> None:
    for tb in list(_LIVE):
        log.warning("testbed %s was not closed; closing it at exit", tb.name)
        with contextlib.suppress(Exception):
            tb.close()


atexit.register(_close_all_at_exit)


class Testbed:
    """A set of simulated hosts joined by one bridge.  Use as a context manager, or close()."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, name_prefix: str = "rqpt", sysctls: dict[str, int] | None = None):
        if not _PREFIX.match(name_prefix):
            raise ValueError("name_prefix must be 1-5 lowercase letters/digits, starting with a letter")
        self.prefix = name_prefix
        self.sysctls = dict(sysctls or {})
        for key in self.sysctls:
            if not _NAMESPACED_SYSCTL.match(key):
                raise ValueError(f"{key!r} is not a per-namespace sysctl")
        self.hosts: dict[str, Host] = {}
        self.closed = False
        self.cleanup_problems: list[str] = []
        self._lock = threading.RLock()
        # what to undo, recorded *before* each step so a half-done step is undone too
        self._netns: list[str] = []
        self._ipc_files: list[str] = []
        self._run_dir_mounted = False
        self._run_dir_created = False
        self.keep_workdir = os.environ.get("RQPT_KEEP", "") not in ("", "0")

        self.suffix = self._pick_suffix()
        self.name = f"{self.prefix}-{self.suffix}"
        self.switch_netns = f"{self.name}-sw"
        self.bridge = f"{self.name}-br"
        self.run_dir = RUN_DIR / self.name
        self.subnet = self._pick_subnet()
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._setup_run_dir()
            self._setup_switch()
        except BaseException:
            self.close()
            raise
        log.info("testbed %s: subnet %s, workdir %s", self.name, self.subnet, self.workdir)

    def __repr__(self) -> str:
        return f"<Testbed {self.name} {self.subnet} hosts={list(self.hosts)}{' closed' if self.closed else ''}>"

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- setup --------------------------------------------------------------------------------

    def _pick_suffix(self) -> str:
        for _ in range(100):
            suffix = secrets.token_hex(2)
            name = f"{self.prefix}-{suffix}"
            if not (NETNS_DIR / f"{name}-sw").exists() and not (RUN_DIR / name).exists():
                return suffix
        raise TestbedError("could not find an unused testbed name")

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        taken = _root_routes()
        start = int(self.suffix, 16) % 256
        for i in range(256):
            third = (start + i) % 256
            net = ipaddress.ip_network(f"10.213.{third}.0/24")
            if not any(net.overlaps(r) for r in taken):
                return net
        raise TestbedError("every /24 in 10.213.0.0/16 overlaps a route of the root namespace")

    def _setup_run_dir(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir()
        self._run_dir_created = True
        # "unshare --ipc=FILE" bind-mounts the nsfs file on FILE, which the kernel refuses
        # under a shared mount; a private bind mount of the directory onto itself fixes that.
        self._run_dir_mounted = True
        _sh([MOUNT, "--bind", str(self.run_dir), str(self.run_dir)])
        _sh([MOUNT, "--make-private", str(self.run_dir)])
        (self.run_dir / "owner").write_text(f"{os.getpid()}\n")

    def _setup_switch(self) -> None:
        self._netns.append(self.switch_netns)
        _sh([IP, "netns", "add", self.switch_netns])
        sw = [IP, "-n", self.switch_netns]
        _sh([*sw, "link", "set", "lo", "up"])
        _sh([*sw, "link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _sh([*sw, "link", "set", self.bridge, "up"])

    def add_host(self, name: str) -> Host:
        """Create a host: netns + veth into the bridge + address, IPC ns, workdir, sysctls."""
        with self._lock:
            if self.closed:
                raise TestbedError("testbed is closed")
            if not _HOST_NAME.match(name):
                raise ValueError(f"bad host name {name!r}")
            if name in self.hosts:
                raise ValueError(f"host {name!r} already exists")
            index = len(self.hosts)
            hosts_avail = list(self.subnet.hosts())[1:]  # .1 left free (a gateway, never used)
            if index >= min(len(hosts_avail), 99):
                raise TestbedError("too many hosts")
            host = Host(self, name, index, str(hosts_avail[index]), self.subnet.prefixlen)
            self.hosts[name] = host  # registered first: close() undoes whatever was done
            host.workdir.mkdir()
            self._setup_host_netns(host)
            self._setup_host_ipc(host)
            for key, value in self.sysctls.items():
                host.sysctl(key, value)
            log.info("testbed %s: host %s at %s", self.name, name, host.address)
            return host

    def _setup_host_netns(self, host: Host) -> None:
        self._netns.append(host.netns)
        _sh([IP, "netns", "add", host.netns])
        sw = [IP, "-n", self.switch_netns]
        hn = [IP, "-n", host.netns]
        _sh([*hn, "link", "set", "lo", "up"])
        # both ends are born in the switch netns and one is moved straight into the host:
        # nothing ever appears in the root namespace
        _sh([*sw, "link", "add", host.switch_port, "type", "veth", "peer", "name", host.iface,
             "netns", host.netns])
        _sh([*sw, "link", "set", host.switch_port, "master", self.bridge])
        _sh([*sw, "link", "set", host.switch_port, "up"])
        _sh([*hn, "addr", "add", f"{host.address}/{host.prefixlen}", "dev", host.iface])
        _sh([*hn, "link", "set", host.iface, "up"])

    def _setup_host_ipc(self, host: Host) -> None:
        path = pathlib.Path(host.ipc_ns_path)
        self._ipc_files.append(str(path))
        path.touch()
        _sh([UNSHARE, f"--ipc={path}", "true"])

    # -- teardown -----------------------------------------------------------------------------

    def _problem(self, what: str) -> None:
        self.cleanup_problems.append(what)
        log.warning("testbed %s cleanup: %s", self.name, what)

    def _namespace_ids(self) -> set[tuple[int, int]]:
        ids = set()
        for path in [str(NETNS_DIR / n) for n in self._netns] + self._ipc_files:
            ident = _ns_id(path)
            if ident is not None:
                ids.add(ident)
        # a file that is not (or no longer) a namespace mount stats as a plain file; the
        # sweep compares against /proc/PID/ns/* (nsfs inodes), which such ids never match
        return ids

    def _pids_in_namespaces(self, ids: set[tuple[int, int]]) -> list[int]:
        return _pids_in(ids)

    def _sweep_processes(self) -> None:
        """Kill any process still inside this testbed's namespaces (escaped its group, e.g.
        daemonised with setsid).  Only namespaces we created are considered, so only processes
        started through the testbed can match."""
        ids = self._namespace_ids()
        if not ids:
            return
        deadline = time.monotonic() + 5
        reported: set[int] = set()
        while True:
            pids = self._pids_in_namespaces(ids)
            if not pids:
                return
            for pid in pids:
                if pid not in reported:
                    reported.add(pid)
                    log.info("testbed %s: killing stray pid %d in its namespaces", self.name, pid)
                self._kill_if_still_ours(pid, ids)
            if time.monotonic() > deadline:
                self._problem(f"processes still in the namespaces: {pids}")
                return
            time.sleep(0.02)

    @staticmethod
    def _kill_if_still_ours(pid: int, ids: set[tuple[int, int]]) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            # pid reuse check, after pinning the process with the pidfd
            if any(_ns_id(f"/proc/{pid}/ns/{k}") in ids for k in ("net", "ipc")):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def close(self) -> None:
        """Kill everything started on the hosts, remove namespaces, links, mounts and temp
        dirs.  Idempotent; never raises; problems are logged and kept in cleanup_problems."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._close()
            except BaseException as exc:  # never raise from cleanup
                self._problem(f"unexpected error: {exc!r}")
            finally:
                with _LIVE_LOCK:
                    _LIVE.discard(self)

    def _close(self) -> None:
        # 1. process groups we created
        started = [s for h in self.hosts.values() for s in h._started]
        for s in started:
            try:
                _kill_group(s.proc, signal.SIGKILL)
            except Exception as exc:
                self._problem(f"killing pid {s.proc.pid}: {exc!r}")
        for s in started:
            try:
                s.proc.wait(timeout=5)
            except Exception as exc:
                self._problem(f"pid {s.proc.pid} did not exit: {exc!r}")
        # 2. anything else still living in our namespaces
        try:
            self._sweep_processes()
        except Exception as exc:
            self._problem(f"process sweep: {exc!r}")
        # 3. network namespaces (veths and the bridge go with them)
        for netns in reversed(self._netns):
            path = NETNS_DIR / netns
            if not path.exists():
                continue
            proc = _sh([IP, "netns", "del", netns], check=False)
            if proc.returncode != 0 or path.exists():
                self._problem(f"ip netns del {netns}: {proc.stderr.strip()}")
        # 4. IPC namespace files, then the private bind mount of the directory
        mounts = set(_mount_points())
        for path in reversed(self._ipc_files):
            if path in mounts:
                proc = _sh([UMOUNT, path], check=False)
                if proc.returncode != 0:
                    proc = _sh([UMOUNT, "-l", path], check=False)
                    if proc.returncode != 0:
                        self._problem(f"umount {path}: {proc.stderr.strip()}")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._problem(f"rm {path}: {exc}")
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / "owner").unlink()
        if self._run_dir_mounted:
            run_dir = str(self.run_dir)
            while run_dir in set(_mount_points()):
                proc = _sh([UMOUNT, run_dir], check=False)
                if proc.returncode != 0:
                    proc = _sh([UMOUNT, "-l", run_dir], check=False)
                    if proc.returncode != 0:
                        self._problem(f"umount {run_dir}: {proc.stderr.strip()}")
                        break
        if self._run_dir_created:
            try:
                self.run_dir.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._problem(f"rmdir {self.run_dir}: {exc}")
        # 5. the workdir
        if self.keep_workdir:
            log.warning("testbed %s: keeping workdir %s (RQPT_KEEP set)", self.name, self.workdir)
        elif self.workdir.exists():
            if sys.version_info >= (3, 12):
                shutil.rmtree(self.workdir, onexc=lambda f, p, e: self._problem(f"rm {p}: {e}"))
            else:
                shutil.rmtree(self.workdir, onerror=lambda f, p, e: self._problem(f"rm {p}: {e[1]}"))

    # -- reporting ----------------------------------------------------------------------------

    def logs(self) -> str:
        """logs() of every host."""
        return "\n".join(h.logs() for h in self.hosts.values()) or f"(testbed {self.name}: no hosts)"

    def leftovers(self) -> list[str]:
        """What of this testbed still exists on the machine (empty after a clean close)."""
        found = []
        names = set(self._netns)
        for netns in names:
            if (NETNS_DIR / netns).exists():
                found.append(f"netns {netns}")
        for point in _mount_points():
            if point.startswith(str(self.run_dir)) or any(
                point == str(NETNS_DIR / n) for n in names
            ):
                found.append(f"mount {point}")
        if self.run_dir.exists():
            found.append(f"dir {self.run_dir}")
        if self.workdir.exists() and not self.keep_workdir:
            found.append(f"dir {self.workdir}")
        proc = _sh([IP, "-br", "link"], check=False)
        for line in proc.stdout.splitlines():
            if line.split("@")[0].split()[0].startswith(self.name):
                found.append(f"link {line.split()[0]} in the root netns")
        ids = self._namespace_ids()
        if ids:
            found.extend(f"pid {p}" for p in self._pids_in_namespaces(ids))
        return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(prefix: str = "rqpt") -> list[str]:
    """Remove what testbeds of dead owners left behind (a pytest run that was SIGKILLed, so
    neither close() nor atexit ran): their netns files, IPC namespace mounts, run dirs and
    workdirs.  A testbed whose owner process still lives is never touched.  Processes still
    running inside a stale testbed's namespaces are logged, not killed.  Not called
    automatically; returns what it removed."""
    removed: list[str] = []
    if not _PREFIX.match(prefix) or not RUN_DIR.is_dir():
        return removed
    for run_dir in sorted(RUN_DIR.iterdir()):
        name = run_dir.name
        if not re.fullmatch(re.escape(prefix) + r"-[0-9a-f]{4}", name):
            continue
        try:
            owner = int((run_dir / "owner").read_text())
        except (OSError, ValueError):
            continue  # being set up (or not ours)
        if _pid_alive(owner):
            continue
        netns_files = sorted(NETNS_DIR.glob(f"{name}-*"))
        ipc_files = sorted(run_dir.glob("*.ipc"))
        ids = {i for i in (_ns_id(p) for p in [*netns_files, *ipc_files]) if i is not None}
        for pid in _pids_in(ids):
            log.warning("stale testbed %s: pid %d still runs in its namespaces (not killed)", name, pid)
        for path in netns_files:
            if _sh([IP, "netns", "del", path.name], check=False).returncode == 0:
                removed.append(f"netns {path.name}")
        mounts = set(_mount_points())
        for path in ipc_files:
            if str(path) in mounts and _sh([UMOUNT, str(path)], check=False).returncode == 0:
                removed.append(f"mount {path}")
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            (run_dir / "owner").unlink()
        while str(run_dir) in set(_mount_points()):
            if _sh([UMOUNT, str(run_dir)], check=False).returncode != 0:
                break
            removed.append(f"mount {run_dir}")
        with contextlib.suppress(OSError):
            run_dir.rmdir()
            removed.append(f"dir {run_dir}")
        for workdir in pathlib.Path(tempfile.gettempdir()).glob(f"{name}-*"):
            if workdir.is_dir():
                shutil.rmtree(workdir, ignore_errors=True)
                removed.append(f"dir {workdir}")
    for what in removed:
        log.info("sweep_stale: removed %s", what)
    return removed


def free_port_on(host: Host) -> int:
    """A TCP port that is free on ``host.address`` right now (the netns is fresh, so any
    port nobody in the test has taken)."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])\n"
    )
    return int(host.python(code, host.address, timeout=10).strip())


# --------------------------------------------------------------------------------------------
# pytest integration

_REPORTER_NAME = "rqp-testbed-log-reporter"
_ITEM_ATTR = "_rqp_testbeds"


class _LogReporter:
    """Registered on first use of the fixture: on a failed test phase, appends the logs of
    every testbed the test used to the report (shown with the failure)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        beds = getattr(item, _ITEM_ATTR, None)
        if not beds or not rep.failed or getattr(rep, "_rqp_logs_added", False):
            return
        text = []
        for tb in beds:
            try:
                text.append(f"##### testbed {tb.name} ({tb.subnet}) #####\n{tb.logs()}")
            except Exception as exc:  # pragma: no cover
                text.append(f"##### testbed {tb.name}: logs unavailable: {exc!r}")
        rep.sections.append(("testbed logs", "\n".join(text)))
        rep._rqp_logs_added = True


def _track(request: pytest.FixtureRequest, tb: Testbed) -> None:
    pm = request.config.pluginmanager
    if not pm.has_plugin(_REPORTER_NAME):
        pm.register(_LogReporter(), _REPORTER_NAME)
    beds = getattr(request.node, _ITEM_ATTR, None)
    if beds is None:
        beds = []
        setattr(request.node, _ITEM_ATTR, beds)
    beds.append(tb)


def _finish(request: pytest.FixtureRequest, tb: Testbed) -> None:
    tb.close()
    if tb.cleanup_problems:
        # no exception from teardown (it would hide the real failure); show it instead
        request.node.add_report_section(
            "teardown", "testbed cleanup", "\n".join(tb.cleanup_problems)
        )


@pytest.fixture
def testbed(request: pytest.FixtureRequest):
    """A fresh Testbed, closed at teardown; hosts' logs are added to a failure report.

    Keyword arguments for Testbed via indirect parametrization (a dict)."""
    require_root()
    kwargs = getattr(request, "param", None) or {}
    tb = Testbed(**kwargs)
    _track(request, tb)
    try:
        yield tb
    finally:
        _finish(request, tb)


@pytest.fixture
def testbed_factory(request: pytest.FixtureRequest):
    """A callable ``make(**Testbed kwargs) -> Testbed``; every testbed made is closed at teardown."""
    require_root()
    made: list[Testbed] = []

    def make(**kwargs: Any) -> Testbed:
        tb = Testbed(**kwargs)
        made.append(tb)
        _track(request, tb)
        return tb

    try:
        yield make
    finally:
        for tb in reversed(made):
            _finish(request, tb)
