"""The application API: openConnection / sendMessage / closeConnection / receiveMessage.

Each test runs on a simulated host (its own IPC and network namespace) with a real receiving
MCA, and the sending MCA started by openConnection itself.
"""

from __future__ import annotations

import array
import json
import os
import sys
from pathlib import Path

import pytest

from tests.agents import start_receiver, start_sender, write_rqprc

Q1 = 0x52510001


@pytest.fixture
def host(testbed):
    h = testbed.add_host("a")
    h.receiver = start_receiver(h)
    h.python("import sysv_ipc; sysv_ipc.MessageQueue(0x52510001, sysv_ipc.IPC_CREAT, mode=0o600)")
    h.rqprc = write_rqprc(h, [h], queues={"PROD_THE_SCHED_COMMON": Q1})
    return h


#: ``err(name, fn)``: what ``fn()`` raised, in ``errors[name]`` ("Type: message"; None).
ERR = """
errors = {}
def err(name, fn):
    try:
        fn()
        errors[name] = None
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
"""


def run(host, code: str, *args, timeout: float = 60):
    """Run ``code`` on the host with ``rqprc`` bound and :data:`ERR`; it prints JSON, which is
    returned."""
    prelude = "import json, sys, rqp\nrqprc = sys.argv[1]\nargs = sys.argv[2:]\n" + ERR
    return json.loads(host.python(prelude + code, str(host.rqprc), *map(str, args),
                                  timeout=timeout))


def test_open_starts_the_sending_mca_and_a_message_goes_through_by_name(host):
    out = run(host, """
from rqp.system.service import serving_pid
before = serving_pid(0x52510000)
h = rqp.openConnection("PROD_THE_SCHED_COMMON", rqprc=rqprc)
rqp.sendMessage(h, b"\\x00binary\\xff", rqp.SURE_MSG)
rqp.sendMessage(h, b"second", rqp.UNSURE_MSG)
rqp.closeConnection(h)
got = [rqp.receiveMessage("PROD_THE_SCHED_COMMON", timeout=20, rqprc=rqprc) for _ in range(2)]
print(json.dumps([before, serving_pid(0x52510000), h, [g.hex() for g in got]]))
""")
    before, pid, handle, got = out
    assert before is None and pid > 0 and handle >= 1
    assert got == [b"\x00binary\xff".hex(), b"second".hex()]


def test_a_c_consumer_reads_plain_bytes_with_mtype_1(host):
    out = run(host, """
import ctypes, sysv_ipc
libc = ctypes.CDLL(None, use_errno=True)
h = rqp.openConnection(0x52510001, rqprc=rqprc)
rqp.sendMessage(h, b"for C", rqp.SURE_MSG)
qid = sysv_ipc.MessageQueue(0x52510001).id
class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 64)]
m = Msg()
n = libc.msgrcv(qid, ctypes.byref(m), 64, 0, 0)  # blocking, as a C consumer would
print(json.dumps([n, m.mtype, m.mtext[:n].decode()]))
""")
    assert out == [5, 1, "for C"]


def test_concurrent_opens_start_exactly_one_sending_mca(host):
    out = run(host, """
import multiprocessing as mp
from rqp.api import ensure_sender
from rqp.config import load_sender_config
def start(_):
    return ensure_sender(load_sender_config(rqprc), rqprc)
with mp.get_context("fork").Pool(6) as pool:
    started = pool.map(start, range(6))
from rqp.system.service import serving_pid
print(json.dumps([started, serving_pid(0x52510000)]))
""")
    started, pid = out
    assert started.count(True) == 1 and pid
    assert senders_on(host) == [pid]


def senders_on(host) -> list[int]:
    """Pids of sending MCAs in the host's IPC namespace (other tests may run their own)."""
    ipc = f"ipc:[{os.stat(host.ipc_ns_path).st_ino}]"
    found = []
    for pid in host.run(["pgrep", "-f", "rqp_agents.sender"], check=False).stdout.split():
        try:
            if os.readlink(f"/proc/{pid}/ns/ipc") == ipc:
                found.append(int(pid))
        except OSError:
            pass  # gone meanwhile
    return found


def test_an_already_running_sending_mca_is_used(host):
    sender = start_sender(host, host.rqprc)
    out = run(host, """
from rqp.system.service import serving_pid
h = rqp.openConnection(0x52510001, rqprc=rqprc)
rqp.sendMessage(h, b"via the running one", rqp.SURE_MSG)
print(json.dumps([serving_pid(0x52510000), rqp.receiveMessage(0x52510001, timeout=20).decode()]))
""")
    assert out == [sender.pid, "via the running one"]


def test_errors_say_what_to_do(host):
    out = run(host, """
import time
from rqp.system.queues import max_payload
res = {}
h = rqp.openConnection(0x52510001, rqprc=rqprc)
try:
    rqp.sendMessage(h, bytes(max_payload() + 1))
except rqp.MessageTooBig as e:
    res["big"] = [str(e), e.size, e.limit]
rqp.sendMessage(h, bytes(max_payload()))  # exactly at the limit: accepted
try:
    rqp.openConnection("PROD_THE_SCHED_COMON", rqprc=rqprc)
except rqp.ConfigError as e:
    res["name"] = str(e)
rqp.closeConnection(h)
for call in (lambda: rqp.sendMessage(h, b"x"), lambda: rqp.closeConnection(h)):
    try:
        call()
    except rqp.HandleError as e:
        res.setdefault("handle", []).append(str(e))
try:
    rqp.sendMessage(h, b"x", 7)
except rqp.RQPError as e:
    res["type"] = str(e)
for queue in ("DEAD.LETTER.Q", 0x52510000):
    try:
        rqp.openConnection(queue, rqprc=rqprc)
    except rqp.RQPError as e:
        res.setdefault("own", []).append(str(e))
h = rqp.openConnection(0x52510001, rqprc=rqprc)
for kwargs in ({"ttl": float("inf")}, {"ttl": 1e300}, {"expires_at": time.time() * 1000}):
    try:
        rqp.sendMessage(h, b"x", **kwargs)
    except rqp.RQPError as e:
        res.setdefault("time", []).append(str(e))
print(json.dumps(res))
""")
    big, size, limit = out["big"]
    assert (size, limit) == (8129, 8128) and "8129 bytes" in big and "8128-byte limit" in big
    assert "PROD_THE_SCHED_COMON" in out["name"] and "did you mean" in out["name"]
    assert "PROD_THE_SCHED_COMMON" in out["name"]
    assert len(out["handle"]) == 2 and all("is not open" in e for e in out["handle"])
    assert "handle" in out["type"] or "msg_type" in out["type"]
    assert len(out["own"]) == 2 and "is DEAD.LETTER.Q of the agents" in out["own"][0]
    assert "transmission queue of the agents" in out["own"][1]
    assert out["own"][1].startswith("queue 0x52510000 is ")  # (a trial: it said 1381040128)
    assert out["own"][0].startswith("queue 'DEAD.LETTER.Q' (0x")
    assert len(out["time"]) == 3  # RQPError, not OverflowError, and milliseconds are caught
    assert "past the year 500 million" in out["time"][0] and "milliseconds?" in out["time"][2]


def test_no_sending_mca_can_be_started_says_why(testbed):
    h = testbed.add_host("a")
    # The transmission queue exists and is the only one there is room for: the sending MCA
    # cannot create DEAD.LETTER.Q. (Left to both to create, the API's put and the starting
    # sending MCA raced for the one place, and the API lost about half the time.)
    h.python("import sysv_ipc; sysv_ipc.MessageQueue(0x52510000, sysv_ipc.IPC_CREAT, "
             "mode=0o660)")
    h.sysctl("kernel.msgmni", 1)
    h.rqprc = write_rqprc(h, [h])
    out = run(h, """
try:
    rqp.openConnection(0x52510001, rqprc=rqprc)
except rqp.AgentStartError as e:
    print(json.dumps(str(e)))
""")
    assert "exited with status 1" in out and "its log" in out
    assert "No space left" in out or "queue" in out


def test_no_sending_mca_is_started_where_it_runs_as_a_service(host, tmp_path):
    """A trial: with the service stopped, an application's openConnection started its own
    sending MCA, whose journal (SURE messages not delivered yet) was in that user's home,
    where the service never looks, and then kept the service from starting. Where
    rqp-sender.service is installed, the records now wait on the transmission queue for it."""
    (tmp_path / "rqp-sender.service").write_text("[Service]\n")
    env = {"SYSTEMD_UNIT_PATH": f"{tmp_path}:"}  # (and systemd's own directories after it)
    code = """
from rqp.system.service import serving_pid
h = rqp.openConnection("PROD_THE_SCHED_COMMON", rqprc=rqprc)
rqp.sendMessage(h, b"waits", rqp.SURE_MSG)
h2 = rqp.openConnection("PROD_THE_SCHED_COMMON", rqprc=rqprc)  # (said once a process)
print(json.dumps(serving_pid(0x52510000)))
"""
    out = host.run([sys.executable, "-c", "import json, sys, rqp\nrqprc = sys.argv[1]\n" + code,
                    str(host.rqprc)], env={**os.environ, **env}, timeout=60)
    assert json.loads(out.stdout) is None  # none started
    assert out.stderr.count("no sending MCA serves transmission queue 0x52510000, and none "
                            "is started from here: this host runs it as a service (" +
                            str(tmp_path / "rqp-sender.service")) == 1, out.stderr
    assert "systemctl start rqp-sender.service" in out.stderr
    ctl = host.run([sys.executable, "-m", "rqp.tools.ctl", "send", "PROD_THE_SCHED_COMMON",
                    "second", "--rqprc", str(host.rqprc)], env={**os.environ, **env},
                   check=False, timeout=60)
    assert ctl.returncode == 3 and "it waits there for the service (" in ctl.stdout and \
        "systemctl start rqp-sender)" in ctl.stdout, ctl.stdout + ctl.stderr
    assert "rqp.api" not in ctl.stderr  # (one warning, not the API's too: a trial)
    start_sender(host, host.rqprc)  # the service starts: it takes them
    assert run(host, """
print(json.dumps([rqp.receiveMessage(0x52510001, timeout=20).decode() for _ in range(2)]))
""") == ["waits", "second"]


def test_the_service_is_found_where_systemd_looks():
    from rqp.system.service import sender_unit

    assert sender_unit({"SYSTEMD_UNIT_PATH": os.devnull}) is None
    assert sender_unit({"SYSTEMD_UNIT_PATH": "/nonexistent-rqp-units"}) is None


def test_an_application_outside_the_agents_group_is_told_so(testbed):
    """A trial: an application user outside the group got 'semget: Permission denied' and no
    word of what to do (rqpctl said 'be in its group')."""
    h = testbed.add_host("a")
    make = "from rqp.system.service import AgentSemaphores; AgentSemaphores(0x52510000)"
    h.python(make)  # (as root: mode 0660, root's group)
    out = h.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                 sys.executable, "-c", make], check=False)
    assert out.returncode == 1 and "semaphores of transmission queue 0x52510000: semget: " \
        "Permission denied (it is mode 0660, as the queues: be in the group of its owner" \
        in out.stderr, out.stderr


def test_full_transmission_queue_blocks_then_times_out(host):
    out = run(host, """
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
n = 0
try:
    while True:
        rqp.sendMessage(h, bytes(4000), timeout=0.2)
        n += 1
except rqp.QueueFull as e:
    print(json.dumps([n, str(e)]))
""")
    n, message = out
    assert n == 4 and "still full after 0.2 s" in message  # 16384-byte queue, 4064-byte records


def test_a_handle_goes_on_after_its_transmission_queue_is_removed(host):
    # A trial: after `ipcrm` of the transmission queue (the sending MCA opened it again), every
    # sendMessage on a handle opened before raised "was removed while putting a message".
    out = run(host, """
import sysv_ipc
from rqp.protocol.records import TransmissionRecord
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
rqp.sendMessage(h, b"before")
sysv_ipc.MessageQueue(0x52510000).remove()  # (and "before" with it, as the kernel does)
rqp.sendMessage(h, b"after")
rqp.sendMessage(h, b"and again")
q = sysv_ipc.MessageQueue(0x52510000)
print(json.dumps([TransmissionRecord.from_bytes(q.receive()[0]).payload.decode()
                  for _ in range(q.current_messages)]))
""")
    assert out == ["after", "and again"]


def test_extras_out_of_range_are_refused_naming_the_parameter(host):
    out = run(host, """
h = rqp.openConnection(0x52510001, rqprc=rqprc)
res = []
for kwargs in ({"mtype": 0}, {"mtype": True}, {"priority": 10}, {"ttl": 0}, {"ttl": 1e-9},
               {"ttl": 1, "expires_at": 2}, {"expires_at": "soon"}, {"timeout": -1},
               {"timeout": float("nan")}, {"timeout": "5"}):
    try:
        rqp.sendMessage(h, b"x", **kwargs)
        res.append("accepted")
    except rqp.RQPError as e:
        res.append(str(e))
for call in (lambda: rqp.receiveMessage(0x52510001, timeout=-1),
             lambda: rqp.commitBatch(h, timeout=-0.5)):
    try:
        call()
        res.append("accepted")
    except rqp.RQPError as e:
        res.append(str(e))
print(json.dumps(res))
""")
    assert [line.split(",")[0].split(" (")[0] for line in out] == [
        "mtype must be an integer in 1..9223372036854775807",
        "mtype must be an integer in 1..9223372036854775807",
        "priority must be an integer in 0..9", "ttl must be at least 0.001 seconds",
        "ttl must be at least 0.001 seconds", "give ttl or expires_at",
        "expires_at must be a number of seconds", *["timeout must be a number of seconds >= 0"]
        * 5]  # (a trial's timeout=-1 was taken)


def test_batch_errors_say_what_to_do_and_put_nothing(host):
    out = run(host, """
h = rqp.openConnection(0x52510001, rqprc=rqprc)
err("commit_none", lambda: rqp.commitBatch(h))
rqp.beginBatch(h, rqp.UNSURE_MSG)  # C style, no msg_type: the batch's (a trial's failed)
err("unsure_c_style", lambda: rqp.sendMessage(h, b"u", mtype=2))
rqp.rollbackBatch(h)
err("rollback_none", lambda: rqp.rollbackBatch(h))
b = rqp.beginBatch(h, rqp.SURE_MSG, priority=7)
err("twice", lambda: rqp.beginBatch(h))
err("priority_in_batch", lambda: rqp.sendMessage(h, b"x", priority=2))
err("batch_priority_again", lambda: rqp.sendMessage(h, b"x", priority=7))  # the batch's
err("default_priority_in_batch", lambda: rqp.sendMessage(h, b"x", priority=4))  # (4: given)
err("type_in_batch", lambda: rqp.sendMessage(h, b"x", rqp.UNSURE_MSG))
err("mtype", lambda: b.send(b"x", mtype=0))
err("too_big", lambda: b.send(b"y" * 9000))
for i in range(255):  # (one went in above, at the batch's priority)
    b.send(b"")
err("too_many", lambda: b.send(b""))
rolled = rqp.rollbackBatch(h)
try:
    with rqp.batch(h) as b:
        b.send(b"never")
        raise KeyError("the application failed")
except KeyError:
    pass
rqp.beginBatch(h)
rqp.sendMessage(h, b"dropped at close")
rqp.closeConnection(h)
h = rqp.openConnection(0x52510001, rqprc=rqprc)
with rqp.batch(h, rqp.UNSURE_MSG) as b:
    pass  # an empty batch puts nothing
rqp.sendMessage(h, b"marker")
got = rqp.receiveMessage(0x52510001, timeout=20)
import sysv_ipc
print(json.dumps([errors, rolled, got.decode(), sysv_ipc.MessageQueue(0x52510001).current_messages]))
""")
    errors, rolled, got, left = out
    assert errors["commit_none"].startswith("RQPError: handle") and "beginBatch first" in \
        errors["commit_none"] and "beginBatch first" in errors["rollback_none"]
    assert errors["unsure_c_style"] is None
    assert "has a batch open already" in errors["twice"]
    assert "priority 2 (the batch's is 7) given to sendMessage" in errors["priority_in_batch"]
    assert errors["batch_priority_again"] is None
    assert "priority 4 (the batch's is 7)" in errors["default_priority_in_batch"]
    assert "msg_type UNSURE_MSG here, SURE_MSG for the batch" in errors["type_in_batch"]
    assert "mtype must be an integer in 1.." in errors["mtype"]
    # (9000 and its 12 bytes, after the one b"x" of 13 sent at the batch's priority)
    assert errors["too_big"].startswith("MessageTooBig: the batch would be 9025 bytes")
    assert "at most 256 messages" in errors["too_many"]
    assert rolled == 256
    assert got == "marker" and left == 0  # nothing of the rolled-back, failed or closed batches


def test_a_batch_is_its_threads_and_ends_for_good(host):
    """A trial, as a System V programmer: a Batch kept after commit or rollback took more
    messages without a word, and they went nowhere; another thread's plain sendMessage on the
    same handle joined a batch and was rolled back with it; a child forked with a batch open
    committed it a second time. Each is refused now, or kept apart, and nothing is lost."""
    out = run(host, """
import os, threading
h = rqp.openConnection(0x52510001, rqprc=rqprc)
with rqp.batch(h) as b:
    b.send(b"committed", mtype=3)
err("after_commit", lambda: b.send(b"after commit"))
b = rqp.beginBatch(h)
b.send(b"rolled back")
rqp.rollbackBatch(h)
err("after_rollback", lambda: b.send(b"after rollback"))
b = rqp.beginBatch(h)
rqp.closeConnection(h)
err("after_close", lambda: b.send(b"after close"))
h = rqp.openConnection(0x52510001, rqprc=rqprc)
rqp.beginBatch(h)
rqp.sendMessage(h, b"in the batch")
other = threading.Thread(target=lambda: rqp.sendMessage(h, b"another thread's", mtype=2))
other.start(); other.join()
other = threading.Thread(target=lambda: err("commit_in_thread", lambda: rqp.commitBatch(h)))
other.start(); other.join()
held = rqp.rollbackBatch(h)
b = rqp.beginBatch(h, priority=None)
b.send(b"before the fork")
pid = os.fork()
if pid == 0:
    try:
        rqp.commitBatch(h)
        os._exit(3)  # (committed in the child: the bug)
    except rqp.RQPError:
        pass
    try:
        b.send(b"child")
        os._exit(4)
    except rqp.RQPError:
        os._exit(0)
_, status = os.waitpid(pid, 0)
rqp.commitBatch(h)
got = sorted(rqp.receiveMessage(0x52510001, timeout=20, with_type=True) for _ in range(3))
import sysv_ipc
print(json.dumps([errors, held, os.waitstatus_to_exitcode(status),
                  [[d.decode(), t] for d, t in got],
                  sysv_ipc.MessageQueue(0x52510001).current_messages]))
""")
    errors, held, child, got, left = out
    assert "this batch was committed: nothing more can be added" in errors["after_commit"]
    assert "this batch was rolled back" in errors["after_rollback"]
    assert "this batch was dropped by closeConnection" in errors["after_close"]
    assert "has no batch open in this thread" in errors["commit_in_thread"]
    assert held == 1  # the other thread's message was not in it...
    assert child == 0  # (the child could neither commit the parent's batch nor add to it)
    # ...but sent on its own; the batch once, by the parent
    assert got == [["another thread's", 2], ["before the fork", 1], ["committed", 3]]
    assert left == 0


def test_data_is_any_buffer_by_its_bytes_and_msg_type_no_bool(host):
    """A trial: an array of 2,100 ints passed the size check as 2,100 bytes (it is 8,400) and
    then failed in the kernel; True as msg_type (meant "sure") sent UNSURE_MSG; str data
    raised a bare TypeError; expires_at=0 (rqp.h's "never") was dead-lettered EXPIRED at
    once; beginBatch(priority=None) was refused, though sendMessage takes None as 4."""
    out = run(host, """
import array, ctypes, enum, time, tracemalloc
h = rqp.openConnection(0x52510001, rqprc=rqprc)
err("ints", lambda: rqp.sendMessage(h, memoryview(array.array("i", range(2100)))))
err("true", lambda: rqp.sendMessage(h, b"x", True))
err("float", lambda: rqp.sendMessage(h, b"x", 0.0))
err("str", lambda: rqp.sendMessage(h, "text"))
err("never", lambda: rqp.sendMessage(h, b"x", expires_at=0))
err("past", lambda: rqp.sendMessage(h, b"x", expires_at=time.time() - 10))
err("this_ms", lambda: rqp.sendMessage(  # (this millisecond's start + 0.1 ms: still in it,
    h, b"x", expires_at=int(time.time() * 1000) / 1000 + 0.0009))  # or past if it just ended)
released = memoryview(b"gone"); released.release()
err("released", lambda: rqp.sendMessage(h, released))
late = rqp.beginBatch(h, ttl=0.01)
late.send(b"too late")
time.sleep(0.05)  # (its expiry passes: what is tested)
err("expired_batch", lambda: rqp.commitBatch(h))
rqp.rollbackBatch(h)
err("batch_priority_none", lambda: rqp.rollbackBatch(h) if rqp.beginBatch(
    h, priority=None).priority == 4 else None)
rqp.sendMessage(h, array.array("H", [0x4142, 0x4344]))
rqp.sendMessage(h, (ctypes.c_char * 3)(b"x", b"y", b"z"))
class Kind(enum.IntEnum):  # (an application's own: refused a round ago, as not an int)
    SURE = 0
    UNSURE = 1
rqp.sendMessage(h, b"own enum", Kind.UNSURE)
huge = bytearray(64 << 20)  # (refused by its size before any copy of it: left alone a round
tracemalloc.start()         # ago, a buffer was copied whole first)
err("huge", lambda: rqp.sendMessage(h, huge))
copied = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
got = [rqp.receiveMessage(0x52510001, timeout=20) for _ in range(3)]
print(json.dumps([errors, [g.hex() for g in got], copied,
                  [issubclass(rqp.DataTypeError, c) for c in (rqp.RQPError, TypeError)]]))
""")
    errors, got, copied, kinds = out
    assert errors["huge"].startswith(f"MessageTooBig: message of {64 << 20} bytes"), errors
    assert copied < 1 << 20, copied
    assert errors["ints"].startswith("MessageTooBig: message of 8400 bytes"), errors["ints"]
    for case in ("true", "float"):
        assert errors[case].startswith("RQPError: msg_type must be SURE_MSG"), errors[case]
    assert errors["str"] == \
        "DataTypeError: data must be bytes, got str (encode it: text.encode())"
    assert kinds == [True, True]
    for case in ("never", "past"):
        assert "is already past" in errors[case], errors[case]
    assert "is within this millisecond" in errors["this_ms"] or \
        "is already past" in errors["this_ms"], errors["this_ms"]
    assert errors["released"].startswith("DataTypeError: data cannot be read"), errors
    assert "the batch's expiry passed before its commit" in errors["expired_batch"], errors
    assert errors["batch_priority_none"] is None
    assert got == [array.array("H", [0x4142, 0x4344]).tobytes().hex(), b"xyz".hex(),
                   b"own enum".hex()]


def test_a_handle_starts_its_sending_mca_again_when_it_was_killed(host):
    """A trial: after kill -9 of the sending MCA, sendMessage on an open handle returned
    success and its records waited on the transmission queue, without a word, until some
    later openConnection. A handle that may start one checks (at most once a second, when
    it puts) and starts it again, saying so; a handle opened with start_sender=False never
    does."""
    out = run(host, """
import logging, os, signal, time
from rqp import api
from rqp.system.service import sender_serving, serving_pid
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("rqp.api").addHandler(Keep())
h = rqp.openConnection(0x52510001, rqprc=rqprc)
never = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
first = serving_pid(0x52510000)
os.kill(first, signal.SIGKILL)
os.waitpid(first, 0)  # (our child: openConnection started it)
deadline = time.monotonic() + 10
while sender_serving(0x52510000) and time.monotonic() < deadline:
    time.sleep(0.01)
api._handles[h].producer.keep_sender.next_at = 0  # (due at the next put, not a second later)
rqp.sendMessage(never, b"waits", rqp.UNSURE_MSG)
alone = serving_pid(0x52510000)
rqp.sendMessage(h, b"after the kill", rqp.UNSURE_MSG)
got = sorted(rqp.receiveMessage(0x52510001, timeout=20) for _ in range(2))
print(json.dumps([first, alone, serving_pid(0x52510000), [g.decode() for g in got], said]))
""")
    first, alone, second, got, said = out
    assert alone is None  # start_sender=False: none started
    assert second not in (None, first), (first, second)
    assert got == ["after the kill", "waits"]
    assert any("no sending MCA served transmission queue 0x52510000 any more" in line
               for line in said), said


def test_a_batch_put_but_not_synced_is_committed_and_never_put_twice(host):
    """A re-check: commitBatch(sync=True) that timed out waiting for the journal left the
    batch open though it was put; committed again, it was delivered twice (a debit and a
    credit, twice). It is committed once put: a second commit or a rollback finds none."""
    out = run(host, """
import sysv_ipc
from rqp.protocol.records import TransmissionRecord
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)  # (no sending MCA)
b = rqp.beginBatch(h)
b.send(b"debit 42", mtype=2)
b.send(b"credit 42", mtype=3)
err("sync", lambda: rqp.commitBatch(h, sync=True, timeout=0.3))
err("again", lambda: rqp.commitBatch(h))
err("rollback", lambda: rqp.rollbackBatch(h))
err("with", lambda: [w.send(b"x") for w in [rqp.batch(h, sync=True, timeout=0.3).__enter__()]])
q = sysv_ipc.MessageQueue(0x52510000)
print(json.dumps([errors, b.ended, q.current_messages]))
""")
    errors, ended, records = out
    assert errors["sync"].startswith("RQPError: sync: the sending MCA has not journaled"), errors
    assert "has no batch open in this thread" in errors["again"], errors
    assert "has no batch open in this thread" in errors["rollback"], errors
    assert ended == "committed" and records == 1


#: Script lines: kill -9 the sending MCA that serves (``first``), and fill the transmission
#: queue with records the length of the next test message (``n`` of them), nothing taking them.
KILL_SENDER_AND_FILL = """
import os, signal, time
from rqp.system.service import sender_serving, serving_pid
first = serving_pid(0x52510000)
os.kill(first, signal.SIGKILL)
os.waitpid(first, 0)
deadline = time.monotonic() + 10
while sender_serving(0x52510000) and time.monotonic() < deadline:
    time.sleep(0.01)
filler = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
n = 0
try:
    while True:  # (nothing takes them now: the queue fills)
        rqp.sendMessage(filler, b"filler!", rqp.UNSURE_MSG, timeout=0)  # (as long as the next)
        n += 1
except rqp.QueueFull:
    pass
"""


def test_a_producer_blocked_on_a_full_queue_starts_its_killed_sending_mca(host):
    """A re-check: a producer that outran its sending MCA sat in msgsnd on the full
    transmission queue when the MCA was killed, and was never woken: the check came before
    each put only. A thread looks while a put waits, and starts one again."""
    out = run(host, """
import os, signal, time
from rqp.system.service import sender_serving, serving_pid
h = rqp.openConnection(0x52510001, rqprc=rqprc)
""" + KILL_SENDER_AND_FILL + """
from rqp import api
import threading
api.WATCH_IDLE = 1  # (the watcher ends a period after the wait, not ten)
rqp.sendMessage(h, b"blocked", rqp.UNSURE_MSG)  # waits in msgsnd until a sending MCA runs
got = [rqp.receiveMessage(0x52510001, timeout=30) for _ in range(n + 1)]
watching = lambda: [t for t in threading.enumerate() if t.name == "rqp-sender-watch"]
deadline = time.monotonic() + 20
while watching() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps([first, serving_pid(0x52510000), n, got[-1].decode(), len(watching())]))
""", timeout=90)
    first, second, filled, last, watchers = out
    assert filled > 0 and second not in (None, first) and last == "blocked", out
    assert watchers == 0  # (its watcher thread ended once nothing waited)


def test_a_new_thread_never_inherits_the_batch_of_one_that_ended(host):
    """A re-check: batches were keyed by the thread's ident, which new threads reuse: the
    plain messages of 20 new threads went into the batches that ended threads had left open,
    and vanished. A thread's batch dies with it."""
    out = run(host, """
import gc, sysv_ipc, threading
from rqp import api
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
def opens():
    rqp.beginBatch(h)
    rqp.sendMessage(h, b"in a batch never committed")
for _ in range(5):
    t = threading.Thread(target=opens); t.start(); t.join()
gc.collect()
rqp.beginBatch(h); rqp.rollbackBatch(h)  # (the next beginBatch drops ended threads' batches)
left = len(api._batches)
def plain(i):
    rqp.sendMessage(h, b"plain %d" % i)
threads = [threading.Thread(target=plain, args=(i,)) for i in range(20)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps([left, sysv_ipc.MessageQueue(0x52510000).current_messages]))
""")
    assert out == [0, 20]


def test_one_watcher_a_process_and_a_timed_out_put_does_not_end_anothers_watch(host):
    """Re-check 2: a put on a shared handle that timed out cleared the handle's one 'waiting
    since', and another thread, blocked on the same handle, was never watched again (no
    sending MCA after 12 s); and each handle had a watcher thread of its own (296 threads).
    One watcher a process, one entry a waiting put."""
    out = run(host, """
import os, signal, threading, time
from rqp import api
from rqp.system.service import sender_serving, serving_pid
h = rqp.openConnection(0x52510001, rqprc=rqprc)
others = [rqp.openConnection(0x52510001, rqprc=rqprc) for _ in range(20)]
""" + KILL_SENDER_AND_FILL + """
blocked = threading.Thread(target=lambda: rqp.sendMessage(h, b"blocked", rqp.UNSURE_MSG))
blocked.start()
while not api._waiting and time.monotonic() < deadline:  # (until it waits)
    time.sleep(0.01)
timed_out = 0
for other in others:  # (each put waits a moment and gives up: QueueFull)
    try:
        rqp.sendMessage(other, b"filler!", rqp.UNSURE_MSG, timeout=0.05)
    except rqp.QueueFull:
        timed_out += 1
watchers = len([t for t in threading.enumerate() if t.name == "rqp-sender-watch"])
blocked.join(30)
got = [rqp.receiveMessage(0x52510001, timeout=30) for _ in range(n + 1)]
print(json.dumps([timed_out, watchers, blocked.is_alive(), serving_pid(0x52510000) not in
                  (None, first), got[-1].decode()]))
""", timeout=120)
    timed_out, watchers, still_blocked, restarted, last = out
    assert timed_out >= 1 and watchers == 1, out
    assert not still_blocked and restarted and last == "blocked", out


def test_a_fork_while_threads_use_batches_never_hangs_the_child(host):
    """Re-check 2: a thread's batches were dropped, under the API's lock, when its local data
    was freed, which a forked child does inside fork, before its lock is made anew: 32 of 51
    children hung. The drop takes no lock now."""
    out = run(host, """
import os, threading, time
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
stop = threading.Event()
def churn():
    while not stop.is_set():
        rqp.beginBatch(h)
        rqp.rollbackBatch(h)
threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads: t.start()
hung = 0
for _ in range(40):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 5
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)
stop.set()
for t in threads: t.join()
print(json.dumps(hung))
""", timeout=300)
    assert out == 0


def test_a_keeper_that_raises_does_not_end_the_watching(monkeypatch, caplog):
    """The watcher thread serves every waiting put of the process: an unexpected error in one
    producer's check is logged, and the others are still looked after."""
    import threading

    from rqp import api
    from tests.testbed import wait_for

    monkeypatch.setattr(api, "SENDER_CHECK_INTERVAL", 0.01)
    monkeypatch.setattr(api, "WATCH_IDLE", 1)

    class Keeper:
        def __init__(self, broken: bool) -> None:
            self.broken, self.calls = broken, 0

        def due(self) -> bool:
            return True

        def __call__(self) -> None:
            self.calls += 1
            if self.broken:
                raise ValueError("a bug")

    class Producer:
        def __init__(self, broken: bool) -> None:
            self.keep_sender = Keeper(broken)
            self.config = type("Config", (), {"transmission_queue": 0x52519999})()

    broken, working = Producer(True), Producer(False)
    entries = [(broken, object()), (working, object())]
    try:
        for entry in entries:
            api._waiting[entry] = 0.0
        api._watch()
        wait_for(lambda: broken.keep_sender.calls >= 3 and working.keep_sender.calls >= 3,
                 timeout=20, message="the watcher stopped looking")
    finally:
        for entry in entries:
            api._waiting.pop(entry, None)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "rqp-sender-watch"],
             timeout=20, message="the watcher did not end once nothing waited")
    assert "checking the sending MCA of transmission queue 0x52519999 failed" in caplog.text


def test_the_keeper_never_raises_and_a_watcher_it_cannot_start_is_tried_again(monkeypatch,
                                                                              caplog):
    """Re-check 3: a foreign semaphore set made the keeper's first look raise, out of
    sendMessage after its record was put (an application retrying would send it twice), and
    out of the watcher thread, which ended for good; a watcher thread that could not be
    started raised out of the put and was never tried again."""
    import threading

    from rqp import api
    from rqp.config import sender_config_from_mapping

    from rqp import RQPError

    def foreign(_key):
        raise RQPError("semaphores of transmission queue 0x52510000: semget: Invalid "
                           "argument")
    monkeypatch.setattr(api, "sender_serving", foreign)
    keeper = api._Keeper(sender_config_from_mapping({"hosts": ["a"], "plaintext": True}),
                         Path("/nonexistent/rqprc"), False)
    keeper()  # (no exception)
    assert keeper.wait == 2 * api.SENDER_CHECK_INTERVAL and not keeper.due()
    assert "or it cannot be told" in caplog.text and "semget: Invalid argument" in caplog.text

    def no_thread(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    monkeypatch.setattr(api, "_watcher_pid", None)
    api._watch()  # (no exception)
    assert api._watcher_pid is None  # (the next put tries again)
    assert "cannot start the thread that watches puts" in caplog.text


def test_a_put_that_gives_up_on_a_full_queue_starts_the_killed_sending_mca(host):
    """Re-check 3: producers with a timeout under a second (give up, back off, try again) never
    had a killed sending MCA started again: the check ran after a put that went in only."""
    out = run(host, """
from rqp import api
h = rqp.openConnection(0x52510001, rqprc=rqprc)
""" + KILL_SENDER_AND_FILL + """
api._handles[h].producer.keep_sender.next_at = 0  # (due now)
try:
    rqp.sendMessage(h, b"gives up", rqp.UNSURE_MSG, timeout=0.2)
    gave_up = False
except rqp.QueueFull:
    gave_up = True
print(json.dumps([gave_up, serving_pid(0x52510000) not in (None, first)]))
""", timeout=90)
    assert out == [True, True]
