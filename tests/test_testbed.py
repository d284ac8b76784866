"""The integration-test harness itself: simulated hosts are isolated, connected, and cleaned up.

Everything here stays on the test network inside namespaces the harness creates (or loopback).
"""

from __future__ import annotations

import os
import pathlib
import secrets
import select
import shutil
import subprocess
import sys

import pytest
import sysv_ipc

from tests.testbed import (  # noqa: F401  (testbed, testbed_factory: fixtures)
    RUN_DIR,
    HostCommandError,
    Testbed,
    free_port_on,
    sweep_stale,
    testbed,
    testbed_factory,
    wait_for,
)

pytest_plugins = ["pytester"]


# A TCP server that answers every connection with its tag, and says on stdout where it listens.
SERVER = r"""
import socket, sys
bind, port, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((bind, port))
s.listen(16)
print("listening", s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(tag.encode())
    c.close()
"""

# Connects once; prints "reply <tag>" or "error <ExceptionType> ...".
CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.settimeout(float(sys.argv[3]))
    print("reply", c.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__, e)
"""


def start_server(host, bind: str, tag: str) -> tuple[subprocess.Popen, int]:
    proc = host.popen([sys.executable, "-c", SERVER, bind, "0", tag])

    def port():
        assert proc.poll() is None, f"server exited: {host.output(proc, 'stderr')}"
        words = host.output(proc).split()
        return int(words[1]) if len(words) >= 2 and words[0] == "listening" else None

    return proc, wait_for(port, timeout=10, message=f"server on {host.name} never listened")


def connect(host, address: str, port: int, timeout: float = 2.0) -> str:
    return host.python(CLIENT, address, str(port), str(timeout), timeout=timeout + 10).strip()


def gone(pidfd: int) -> bool:
    """A pidfd turns readable when its process has exited."""
    return bool(select.select([pidfd], [], [], 0)[0])


def assert_cleaned_up(tb: Testbed) -> None:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert tb.name not in netns
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert tb.name not in links
    mountinfo = pathlib.Path("/proc/self/mountinfo").read_text()
    assert tb.name not in mountinfo
    assert str(tb.run_dir) not in mountinfo
    assert not tb.run_dir.exists()
    assert not tb.workdir.exists()
    assert tb.leftovers() == []
    assert tb.cleanup_problems == []


# --- helpers -----------------------------------------------------------------------------------


def test_wait_for_returns_the_value_and_times_out_with_the_last_one():
    values = iter([0, None, "", 42])
    assert wait_for(lambda: next(values), timeout=5, message="never") == 42

    def boom():
        raise OSError("not yet")

    with pytest.raises(AssertionError, match=r"the thing never happened.*OSError: not yet"):
        wait_for(boom, timeout=0.05, interval=0.01, message="the thing never happened")


# --- connectivity ------------------------------------------------------------------------------


def test_hosts_reach_each_other_by_address_and_have_their_own_loopback(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    assert a.address != b.address
    assert a.address.startswith("10.213.") and b.address.startswith("10.213.")

    if shutil.which("ping"):
        a.run(["ping", "-c1", "-W2", b.address], timeout=10)
        b.run(["ping", "-c1", "-W2", a.address], timeout=10)

    _, port_b = start_server(b, b.address, "hello from b")
    _, port_a = start_server(a, a.address, "hello from a")
    assert connect(a, b.address, port_b) == "reply hello from b"
    assert connect(b, a.address, port_a) == "reply hello from a"

    # 127.0.0.1 is per host: a's loopback server is reachable on a, not on b
    _, port_lo = start_server(a, "127.0.0.1", "a's loopback")
    assert connect(a, "127.0.0.1", port_lo) == "reply a's loopback"
    assert connect(b, "127.0.0.1", port_lo).startswith("error ConnectionRefusedError")

    assert isinstance(free_port_on(b), int)


def test_link_down_cuts_the_host_off_and_link_up_restores_it(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    _, port = start_server(b, b.address, "b")
    assert connect(a, b.address, port) == "reply b"

    b.link_down()
    wait_for(
        lambda: connect(a, b.address, port, timeout=0.5).startswith("error"),
        timeout=10,
        message="a still reaches b with b's link down",
    )
    b.link_up()
    wait_for(
        lambda: connect(a, b.address, port, timeout=0.5) == "reply b",
        timeout=10,
        message="a does not reach b after link_up",
    )


# --- IPC isolation -----------------------------------------------------------------------------

CREATE_QUEUE = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(int(sys.argv[1]), sysv_ipc.IPC_CREX, mode=0o600)
q.send(b"on " + sys.argv[2].encode())
print(q.id, q.max_size)
"""

PEEK_QUEUE = r"""
import sys, sysv_ipc
try:
    q = sysv_ipc.MessageQueue(int(sys.argv[1]))
except sysv_ipc.ExistentialError:
    print("absent")
else:
    print("present", q.current_messages)
"""


def test_a_sysv_queue_exists_only_on_the_host_that_made_it(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    key = 0x52510000 | secrets.randbits(16)

    a.python(CREATE_QUEUE, str(key), "a")
    # the IPC namespace outlives the process that created the queue
    assert a.python(PEEK_QUEUE, str(key)).strip() == "present 1"
    assert b.python(PEEK_QUEUE, str(key)).strip() == "absent"
    with pytest.raises(sysv_ipc.ExistentialError):
        sysv_ipc.MessageQueue(key)  # the root namespace (this process)

    # the same key can be taken independently on b
    b.python(CREATE_QUEUE, str(key), "b")
    assert b.python(PEEK_QUEUE, str(key)).strip() == "present 1"
    with pytest.raises(HostCommandError, match="ExistentialError"):
        a.python(CREATE_QUEUE, str(key), "a again")  # IPC_CREX: exists on a already


@pytest.mark.parametrize("testbed", [{"sysctls": {"kernel.msgmnb": 1048576}}], indirect=True)
def test_ipc_sysctls_are_per_host(testbed):
    root_before = pathlib.Path("/proc/sys/kernel/msgmnb").read_text().strip()
    a, b = testbed.add_host("a"), testbed.add_host("b")
    b.sysctl("kernel.msgmnb", 2097152)

    read = "print(open('/proc/sys/kernel/msgmnb').read().strip())"
    assert a.python(read).strip() == "1048576"
    assert b.python(read).strip() == "2097152"
    assert a.read_sysctl("kernel.msgmnb") == "1048576"
    assert pathlib.Path("/proc/sys/kernel/msgmnb").read_text().strip() == root_before
    assert root_before not in ("1048576", "2097152")

    key = 0x52510000 | secrets.randbits(16)
    assert a.python(CREATE_QUEUE, str(key), "a").split()[1] == "1048576"  # queue max_size

    with pytest.raises(ValueError, match="not a per-namespace sysctl"):
        a.sysctl("vm.swappiness", 10)  # would change the real machine


# --- cleanup -----------------------------------------------------------------------------------

ESCAPE = r"""
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()  # leaves the process group popen made
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while True:
        time.sleep(1)
os.waitpid(pid, 0)
"""


def test_close_kills_everything_and_removes_every_trace():
    with Testbed() as tb:
        a, b = tb.add_host("a"), tb.add_host("b")
        sleeper = a.popen(["sleep", "1000"])
        loop = b.popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
        pidfile = a.workdir / "escaped.pid"
        a.popen([sys.executable, "-c", ESCAPE, str(pidfile)])
        escaped = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), timeout=10,
                               message="the escaping child never wrote its pid"))
        pidfds = [os.pidfd_open(p) for p in (sleeper.pid, loop.pid, escaped)]
        assert tb.name in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                         text=True).stdout
        assert str(tb.run_dir) in pathlib.Path("/proc/self/mountinfo").read_text()
    try:
        assert sleeper.returncode is not None and loop.returncode is not None
        assert all(gone(fd) for fd in pidfds), "a process survived close()"
    finally:
        for fd in pidfds:
            os.close(fd)
    assert_cleaned_up(tb)
    tb.close()  # idempotent
    assert tb.cleanup_problems == []


def test_close_runs_after_a_failure_inside_the_with_block():
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed() as tb:
            a = tb.add_host("a")
            proc = a.popen(["sleep", "1000"])
            raise RuntimeError("boom")
    assert proc.returncode is not None
    assert_cleaned_up(tb)


def test_close_undoes_a_host_that_failed_halfway():
    # msgmnb cannot be negative: add_host fails after the netns and IPC ns of "a" exist
    with pytest.raises(HostCommandError, match="msgmnb"):
        with Testbed(sysctls={"kernel.msgmnb": -1}) as tb:
            tb.add_host("a")
    assert "a" in tb.hosts
    assert_cleaned_up(tb)


def test_sweep_stale_removes_what_a_dead_owner_left_and_close_copes_with_it():
    with Testbed(name_prefix="rqps") as tb:
        a = tb.add_host("a")
        proc = a.popen(["sleep", "1000"])
        assert sweep_stale("rqps") == []  # the owner (this process) is alive: untouched
        assert tb.leftovers() != []
        pid_max = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
        (tb.run_dir / "owner").write_text(f"{pid_max}\n")  # no process has this pid
        removed = sweep_stale("rqps")
        assert f"netns {a.netns}" in removed and f"netns {tb.switch_netns}" in removed
        assert f"mount {a.ipc_ns_path}" in removed and f"dir {tb.run_dir}" in removed
        assert [x for x in tb.leftovers() if not x.startswith("pid ")] == []
        assert proc.poll() is None  # reported, not killed
    # close() on a half-removed testbed: no exception, nothing to complain about
    assert proc.returncode is not None
    assert_cleaned_up(tb)


def test_the_fixture_reports_host_logs_on_failure_and_cleans_up(pytester, monkeypatch):
    # the inner pytest runs in a subprocess elsewhere: tell it where the tests package is
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).resolve().parents[1]))
    pytester.makepyfile(
        test_inner=r'''
        import sys
        from tests.testbed import testbed, wait_for

        def test_fails(testbed):
            a = testbed.add_host("a")
            p = a.popen([sys.executable, "-c",
                         "import sys, time; print('marker-out-a', flush=True); "
                         "print('marker-err-a', file=sys.stderr, flush=True); time.sleep(1000)"])
            wait_for(lambda: "marker-out-a" in a.output(p), timeout=10, message="no output")
            print("TESTBED-NAME", testbed.name)
            assert False, "deliberate"
        '''
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "testbed logs" in out
    assert "marker-out-a" in out and "marker-err-a" in out
    name = next(line.split()[1] for line in out.splitlines() if line.startswith("TESTBED-NAME"))
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in pathlib.Path("/proc/self/mountinfo").read_text()
    assert not (RUN_DIR / name).exists()
