"""Shared pytest fixtures."""

from __future__ import annotations

# Simulated hosts (tests/testbed.py): the ``testbed`` and ``testbed_factory`` fixtures for all.
from tests.testbed import testbed, testbed_factory  # noqa: F401

# --------------------------------------------------------------------------------------------
# System V queue fixtures (rqp.system.queues / rqp.protocol.records tests): real kernel queues with random
# keys, every one removed at teardown even when the test fails; a runner for code that must
# run as an unprivileged user.
# --------------------------------------------------------------------------------------------

import os
import pickle
import random
import signal
import traceback

import pytest
import sysv_ipc

# Whether this machine has rqp-sender.service installed must not change what the tests see:
# openConnection does not start a sending MCA where it is (rqp.system.service.sender_unit).
# No systemd unit directory at all, for this process and every one it starts; the tests of
# that rule point it at their own.
os.environ["SYSTEMD_UNIT_PATH"] = os.devnull

# The signals this run was started with must not change what the tests see either. A signal
# mask and ignored signals survive exec: a runner that holds SIGTERM (started from a thread
# that waits for signals) or ignores SIGINT (a shell's background job) passes that to every
# process the tests start, and a helper that a test ends with SIGTERM (a pool's worker, a
# peer, `sleep`) would never end. As a terminal starts a program: nothing held, nothing
# ignored. (The project's own programs let go of the signals they take, however started:
# the tests that say so start them holding the signals, with tests.agents.HOLDING_SIGNALS.)
signal.pthread_sigmask(signal.SIG_SETMASK, ())
for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCHLD):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT
                      else signal.SIG_DFL)

_rng = random.SystemRandom()  # not the `random` module state that hypothesis seeds


def _random_key(high: bool = False) -> int:
    while True:
        key = _rng.randrange(0x80000000, 0xFFFFFFFF) if high else _rng.randrange(
            0x10000000, 0x7FFFFFFF)
        if key >> 16 != 0x5251:  # keep clear of the project's "RQ" keys
            return key


def _remove_id(qid: int) -> None:
    try:
        sysv_ipc.remove_message_queue(qid)
    except sysv_ipc.ExistentialError:
        pass


class _QueueFactory:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.keys: list[int] = []

    def new_key(self) -> int:
        """A key no queue has now; a queue later created with it is removed at teardown."""
        while True:
            key = _random_key()
            try:
                sysv_ipc.MessageQueue(key, 0, mode=0)
            except sysv_ipc.ExistentialError:
                self.keys.append(key)
                return key

    def __call__(self, mode: int = 0o600, high_key: bool = False):
        """Create a new queue (IPC_CREX) with a random key (above 0x7fffffff if ``high_key``)
        and return it as an rqp.system.queues.LocalQueue."""
        from rqp.system.queues import LocalQueue

        while True:
            k = _random_key(high_key)
            try:
                mq = sysv_ipc.MessageQueue(k, sysv_ipc.IPC_CREX, mode=mode)
            except sysv_ipc.ExistentialError:
                continue
            self.ids.append(mq.id)
            return LocalQueue.open(k)

    def cleanup(self) -> None:
        for qid in self.ids:
            _remove_id(qid)
        for key in self.keys:
            try:
                _remove_id(sysv_ipc.MessageQueue(key, 0, mode=0).id)
            except sysv_ipc.ExistentialError:
                pass


@pytest.fixture
def make_queue():
    """``make_queue(mode=0o600, high_key=False) -> LocalQueue``;
    ``make_queue.new_key()`` -> a key no queue has.

    Every queue made (and every queue created under a key from ``new_key``) is removed at
    teardown.
    """
    factory = _QueueFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def ipc_keys(make_queue):
    """``ipc_keys()`` -> a key no queue has yet; a queue made with it is removed at teardown."""
    return make_queue.new_key


def _run_as(uid: int, gid: int, groups: list[int], fn, *args):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        status = 0
        try:
            os.close(rfd)
            try:
                os.setgroups(groups)
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                result = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - sent to the parent
                result = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            with os.fdopen(wfd, "wb") as f:
                pickle.dump(result, f)
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    ok, value = pickle.loads(data)
    if not ok:
        raise AssertionError(f"in the child as uid {uid}:\n{value}")
    return value


@pytest.fixture
def run_as():
    """``run_as(uid, gid, groups, fn, *args)``: fn's (picklable) result, run in a forked child
    that dropped privileges to that identity. Fails unless we are root: the suite runs as root."""
    if os.geteuid() != 0:
        pytest.fail("changing identity needs root: run the test suite as root")
    return _run_as


# --------------------------------------------------------------------------------------------
# Spark: one local[2] session for the whole test run (tests/test_report.py and the end-to-end
# dead-letter test). Imported lazily, so tests that do not need Spark do not start a JVM.
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    from rqp.report.compute import jvm_temp, launching

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode stays on loopback
    with jvm_temp():  # (its temporary files in a directory of its own, removed at the end)
        with launching():
            session = (
                SparkSession.builder.master("local[2]")
                .appName("rqp-report-tests")
                .config("spark.sql.shuffle.partitions", "2")
                .config("spark.default.parallelism", "2")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.session.timeZone", "UTC")
                .config("spark.driver.memory", "1g")
                .getOrCreate()
            )
        session.sparkContext.setLogLevel("ERROR")
        yield session
        session.stop()
