"""rqp.system.queues against real kernel System V queues (each one removed at teardown)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
import sysv_ipc

from rqp.protocol.constants import DEFAULT_MTYPE, INT64_MAX, KEY_T_MAX
from rqp.protocol.errors import (
    MessageTooBig,
    QueueError,
    QueueFull,
    QueueNotFound,
    QueuePermissionDenied,
)
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.records import (
    TRANSMISSION_HEADER_SIZE,
    DeadLetterRecord,
    TransmissionRecord,
)
from rqp.storage.deadletters import fit_dead_letter
from rqp.system.queues import (
    AccessStatus,
    InvalidQueueKey,
    LocalQueue,
    QueueEmpty,
    QueueStat,
    check_key,
    format_key,
    kernel_limits,
    max_payload,
    may_write,
    mode_permits,
    write_access,
)
from tests.testbed import wait_for

NOBODY = 65534


def _proc(name):
    with open(f"/proc/sys/kernel/{name}") as f:
        return int(f.read())


# --------------------------------------------------------------------------------------------
# Keys and limits
# --------------------------------------------------------------------------------------------


def test_format_key():
    assert format_key(0x52510001) == "0x52510001"
    assert format_key(1) == "0x00000001"
    assert format_key(-559038737) == "0xdeadbeef"  # a signed key_t as sysv_ipc reports it
    assert format_key(1 << 40) == "0x10000000000"


@pytest.mark.parametrize("key", [0, -1, KEY_T_MAX + 1, 1 << 63, True, "1"])
def test_invalid_keys(key):
    with pytest.raises(InvalidQueueKey):
        check_key(key)
    with pytest.raises(InvalidQueueKey):
        LocalQueue.open(key)
    assert issubclass(InvalidQueueKey, QueueError) and issubclass(InvalidQueueKey, ValueError)


def test_kernel_limits_and_max_payload():
    limits = kernel_limits()
    assert (limits.msgmax, limits.msgmnb, limits.msgmni) == (
        _proc("msgmax"), _proc("msgmnb"), _proc("msgmni"))
    assert max_payload() == limits.msgmax - TRANSMISSION_HEADER_SIZE
    assert max_payload(type(limits)(1000, 2000, 3)) == 1000 - TRANSMISSION_HEADER_SIZE


# --------------------------------------------------------------------------------------------
# LocalQueue basics
# --------------------------------------------------------------------------------------------


def test_put_get_depth_stat(make_queue):
    q = make_queue(mode=0o640)
    q.put(b"one")
    q.put(b"two", mtype=5)
    assert q.depth == 2
    st = q.stat()
    assert isinstance(st, QueueStat)
    assert (st.uid, st.gid, st.cuid, st.cgid) == (os.geteuid(), os.getegid(),) * 2
    assert st.mode == 0o640 and st.current_messages == 2
    assert st.max_size == kernel_limits().msgmnb
    assert q.get(mtype=5) == b"two"
    assert q.get() == b"one"
    assert q.depth == 0


def test_open_create_exists(make_queue, ipc_keys):
    key = ipc_keys()
    assert not LocalQueue.exists(key)
    with pytest.raises(QueueNotFound, match=format_key(key)):
        LocalQueue.open(key)
    created = LocalQueue.create(key, mode=0o620)
    assert LocalQueue.exists(key) and created.key == key
    again = LocalQueue.create(key, mode=0o666)  # opens it, mode kept
    assert again.id == created.id and again.stat().mode == 0o620
    assert LocalQueue.open(key).id == created.id
    assert repr(created) == f"<LocalQueue {format_key(key)} id={created.id}>"
    created.remove()
    assert not LocalQueue.exists(key)


def test_key_above_int_max(make_queue):
    q = make_queue(high_key=True)
    assert q.key > 0x7FFFFFFF
    opened = LocalQueue.open(q.key)
    assert opened.key == q.key and opened.id == q.id


def test_get_mtype_selection(make_queue):
    q = make_queue()
    for t in (3, 1, 2):
        q.put(bytes([t]), mtype=t)
    assert q.get(mtype=2) == b"\x02"
    assert q.get(mtype=-3) == b"\x01"  # lowest type <= 3
    assert q.get(mtype=0) == b"\x03"
    with pytest.raises(ValueError):
        q.put(b"x", mtype=0)


@pytest.mark.parametrize("big", [2**31, 2**62 + 7])
def test_an_mtype_beyond_a_c_int_is_put_and_selected_as_system_v_does(make_queue, big):
    """System V's mtype is a long; sysv_ipc takes a C int. A trial's MESSAGE_EX with mtype
    2^31 stopped a receiving MCA (OverflowError), again at each start."""
    q = make_queue()
    q.put(b"small", mtype=7)
    q.put(b"big", mtype=big)
    q.put(b"biggest", mtype=INT64_MAX)
    assert q.get(mtype=big, with_type=True) == (b"big", big)  # by its type
    with pytest.raises(QueueEmpty):
        q.get(mtype=big, block=False)  # (none of it left)
    assert q.get(mtype=-big, with_type=True) == (b"small", 7)  # the lowest type up to it
    assert q.get(with_type=True) == (b"biggest", INT64_MAX)
    q.put(b"blocking", mtype=big)  # (a blocking put, and a get that waits)
    assert q.get(mtype=big, timeout=1) == b"blocking"
    _fill(q)
    with pytest.raises(QueueFull):
        q.put(b"no room", mtype=big, block=False)


def test_get_empty(make_queue):
    q = make_queue()
    with pytest.raises(QueueEmpty, match=f"queue {format_key(q.key)} is empty"):
        q.get(block=False)
    t0 = time.monotonic()
    with pytest.raises(QueueEmpty, match="no message after 0.1 s"):
        q.get(timeout=0.1)
    assert 0.1 <= time.monotonic() - t0 < 1.0


def test_get_with_timeout_receives_message_that_arrives(make_queue):
    q = make_queue()
    threading.Timer(0.05, q.put, args=(b"late",)).start()
    t0 = time.monotonic()
    assert q.get(timeout=2) == b"late"
    assert time.monotonic() - t0 < 1.0  # polls, at most 50 ms apart, found it well before 2 s


# --------------------------------------------------------------------------------------------
# Sizes around the kernel limit
# --------------------------------------------------------------------------------------------


def test_max_payload_goes_through(make_queue):
    q = make_queue()
    payload = os.urandom(max_payload())
    raw = TransmissionRecord(0, q.key, payload).to_bytes()
    assert len(raw) == kernel_limits().msgmax
    q.put(raw)
    assert TransmissionRecord.from_bytes(q.get()).payload == payload


def test_one_byte_over_is_refused_up_front(make_queue):
    q = make_queue()
    msgmax = kernel_limits().msgmax
    raw = TransmissionRecord(0, q.key, bytes(max_payload() + 1)).to_bytes()
    with pytest.raises(MessageTooBig) as info:
        q.put(raw)
    assert (info.value.size, info.value.limit) == (msgmax + 1, msgmax)
    msg = str(info.value)
    assert str(msgmax + 1) in msg and str(msgmax) in msg
    assert "kernel.msgmax" in msg and format_key(q.key) in msg
    assert q.depth == 0


def test_bigger_than_queue_max_size(make_queue):
    q = make_queue()
    sysv_ipc.MessageQueue(q.key, 0, mode=0).max_size = 100  # IPC_SET msg_qbytes
    with pytest.raises(MessageTooBig) as info:
        q.put(b"x" * 101, block=False)
    assert (info.value.size, info.value.limit) == (101, 100)
    assert "max_size" in str(info.value)
    q.put(b"x" * 100)


def _fill(q):
    msgmax = kernel_limits().msgmax
    for _ in range(kernel_limits().msgmnb // msgmax + 2):
        try:
            q.put(b"f" * msgmax, block=False)
        except QueueFull:
            return
    raise AssertionError("queue never became full")


def test_queue_full(make_queue):
    q = make_queue()
    _fill(q)
    with pytest.raises(QueueFull, match=f"queue {format_key(q.key)} is full"):
        q.put(b"x", block=False)
    t0 = time.monotonic()
    with pytest.raises(QueueFull, match="still full after 0.05 s"):
        q.put(b"x", timeout=0.05)
    assert time.monotonic() - t0 >= 0.05


def test_put_with_timeout_succeeds_when_room_appears(make_queue):
    q = make_queue()
    _fill(q)
    threading.Timer(0.05, q.get).start()
    q.put(b"x", timeout=2)


# --------------------------------------------------------------------------------------------
# Removed queues, signals
# --------------------------------------------------------------------------------------------


def test_removed_queue(make_queue):
    q = make_queue()
    q.remove()
    for op in (lambda: q.put(b"x"), lambda: q.put(b"x", block=False), lambda: q.get(block=False),
               lambda: q.depth, q.stat, q.remove):
        with pytest.raises(QueueNotFound, match=format_key(q.key)):
            op()
    with pytest.raises(QueueNotFound):
        LocalQueue.open(q.key)


def test_removed_while_blocked_in_get(make_queue):
    q = make_queue()
    threading.Timer(0.05, sysv_ipc.remove_message_queue, args=(q.id,)).start()
    with pytest.raises(QueueNotFound, match=format_key(q.key)):
        q.get()


def test_removed_while_blocked_in_put(make_queue):
    q = make_queue()
    _fill(q)
    threading.Timer(0.05, sysv_ipc.remove_message_queue, args=(q.id,)).start()
    with pytest.raises(QueueNotFound, match=format_key(q.key)):
        q.put(b"x")


@pytest.fixture
def alarm():
    old = signal.getsignal(signal.SIGALRM)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_signal_with_quiet_handler_does_not_end_blocking_get(make_queue, alarm):
    q = make_queue()
    seen = []
    signal.signal(signal.SIGALRM, lambda *a: seen.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.02)
    threading.Timer(0.1, q.put, args=(b"after the signal",)).start()
    assert q.get() == b"after the signal"
    assert seen == [1]


def test_signal_handler_that_raises_ends_blocking_get(make_queue, alarm):
    q = make_queue()

    class Stop(Exception):
        pass

    def handler(*_):
        raise Stop

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.02)
    with pytest.raises(Stop):
        q.get()


# --------------------------------------------------------------------------------------------
# Dead letters of huge payloads
# --------------------------------------------------------------------------------------------


def test_huge_dead_letter_is_truncated_spilled_and_fits_a_real_queue(make_queue, tmp_path):
    q = make_queue()
    msgmax = kernel_limits().msgmax
    payload = os.urandom(5 * msgmax)
    rec = DeadLetterRecord(reason=ReasonCode.MESSAGE_TOO_BIG, queue_key=0x52510001,
                           message_key=42, payload=payload, detail="too big")
    fitted = fit_dead_letter(rec, msgmax, spill_dir=tmp_path)
    assert fitted.truncated and fitted.original_length == len(payload)
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(fitted.spill_path)]
    with open(fitted.spill_path, "rb") as f:
        assert f.read() == payload
    q.put(fitted.to_bytes())
    back = DeadLetterRecord.from_bytes(q.get())
    assert back == fitted and payload.startswith(back.payload)


# --------------------------------------------------------------------------------------------
# Write permission
# --------------------------------------------------------------------------------------------


def _stat(uid=1000, gid=1000, cuid=0, cgid=0, mode=0o600):
    return QueueStat(uid=uid, gid=gid, cuid=cuid, cgid=cgid, mode=mode, current_messages=0,
                     max_size=16384)


@pytest.mark.parametrize("st,euid,egid,groups,expected", [
    (_stat(mode=0o600), 1000, 1000, (), True),  # owner bits
    (_stat(mode=0o600), 1001, 1000, (), False),  # group bits: none
    (_stat(mode=0o060), 1000, 1000, (), False),  # owner matches: group bits not used
    (_stat(mode=0o620), 1001, 1000, (), True),  # group via egid
    (_stat(mode=0o620), 1001, 5, (7, 1000), True),  # group via a supplementary group
    (_stat(mode=0o620, cgid=9), 1001, 9, (), True),  # group via cgid
    (_stat(mode=0o600, cuid=1001), 1001, 5, (), True),  # owner via cuid
    (_stat(mode=0o602), 1001, 1000, (), False),  # in the group: other bits not used
    (_stat(mode=0o602), 1001, 5, (), True),  # other bits
    (_stat(mode=0o644), 1001, 5, (), False),
])
def test_mode_permits_follows_ipcperms(st, euid, egid, groups, expected):
    ok, why = mode_permits(st, euid=euid, egid=egid, groups=groups)
    assert ok is expected and f"mode {st.mode:03o}" in why


def test_may_write_root_and_missing(make_queue, ipc_keys):
    q = make_queue(mode=0o000)
    if os.geteuid() == 0:
        assert may_write(q.key)
        assert "CAP_IPC_OWNER" in write_access(q.key).reason
    missing = ipc_keys()
    access = write_access(missing)
    assert access.status is AccessStatus.NOT_FOUND and not access
    assert format_key(missing) in access.reason
    assert not may_write(missing)


def test_may_write_for_another_identity(make_queue):
    q = make_queue(mode=0o620)
    mq = sysv_ipc.MessageQueue(q.key, 0, mode=0)
    mq.uid, mq.gid = 4000, 4001  # root may IPC_SET the owner
    assert may_write(q.key, euid=4000, egid=1, groups=[])
    assert may_write(q.key, euid=5, egid=4001, groups=[])
    assert may_write(q.key, euid=5, egid=6, groups=[4001])
    access = write_access(q.key, euid=5, egid=6, groups=[])
    assert access.status is AccessStatus.NO_PERMISSION and "other bits" in access.reason
    assert may_write(q.key, euid=0, egid=0, groups=[])


def _as_child(key):
    """In a child that dropped privileges: what write_access and may_write say (its one
    msgget, without the reason), and what a real put does."""
    access, lean = write_access(key), may_write(key)
    try:
        LocalQueue.open(key).put(b"from child", block=False)
        put = "ok"
    except QueuePermissionDenied:
        put = "denied"
    return access.status.name, access.reason, put, lean


@pytest.mark.parametrize("mode,group_owner,child_groups,expected", [
    (0o600, None, [], "NO_PERMISSION"),  # IPC_STAT refused too: msgget(key, 0200) decides
    (0o644, None, [], "NO_PERMISSION"),  # readable, not writable by other
    (0o622, None, [], "EXISTS_WRITABLE"),  # write-only for other: no IPC_STAT, still writable
    (0o660, NOBODY, [], "EXISTS_WRITABLE"),  # group owner is nobody's egid
    (0o660, 4242, [4242], "EXISTS_WRITABLE"),  # via a supplementary group
    (0o660, 4242, [], "NO_PERMISSION"),
])
def test_may_write_as_nobody(make_queue, run_as, mode, group_owner, child_groups, expected):
    q = make_queue(mode=mode)
    if group_owner is not None:
        sysv_ipc.MessageQueue(q.key, 0, mode=0).gid = group_owner
    status, reason, put, lean = run_as(NOBODY, NOBODY, child_groups, _as_child, q.key)
    assert status == expected, reason
    assert put == ("ok" if expected == "EXISTS_WRITABLE" else "denied")
    assert lean == (expected == "EXISTS_WRITABLE")
    assert format_key(q.key) in reason
    if mode in (0o600, 0o622):
        assert "IPC_STAT refused" in reason
    assert q.depth == (1 if put == "ok" else 0)


def _child_sees_not_found(key):
    return write_access(key).status.name, may_write(key)


def test_may_write_as_nobody_missing_queue(ipc_keys, run_as):
    assert run_as(NOBODY, NOBODY, [], _child_sees_not_found, ipc_keys()) == ("NOT_FOUND", False)


def _child_write_only_queue(key):
    q = LocalQueue.open(key)  # opening asks for no access, so a write-only queue opens
    q.put(b"w")
    out = []
    for op in (q.get, lambda: q.depth):
        try:
            op()
        except QueuePermissionDenied as exc:
            out.append(str(exc))
    return out


def test_write_only_queue_from_unprivileged_process(make_queue, run_as):
    q = make_queue(mode=0o622)
    errors = run_as(NOBODY, NOBODY, [], _child_write_only_queue, q.key)
    assert len(errors) == 2
    assert all(re.search(rf"queue {format_key(q.key)}: permission denied", e) for e in errors)
    assert q.get() == b"w"


def test_default_mtype_used(make_queue):
    q = make_queue()
    q.put(b"x")
    mq = sysv_ipc.MessageQueue(q.key, 0, mode=0, max_message_size=64)
    assert mq.receive(block=False) == (b"x", DEFAULT_MTYPE)


def test_receive_buffer_grows_when_msgmax_was_raised_after_open(make_queue):
    # A LocalQueue opened when msgmax was 100: bigger messages re-read the kernel's msgmax
    # and re-open the queue with a bigger buffer (for put and for get).
    q = make_queue()
    small = LocalQueue(sysv_ipc.MessageQueue(q.key, 0, mode=0, max_message_size=100), q.key, 100)
    q.put(b"y" * 500)
    assert small.get() == b"y" * 500
    assert small.msgmax == kernel_limits().msgmax and small.id == q.id
    small = LocalQueue(sysv_ipc.MessageQueue(q.key, 0, mode=0, max_message_size=100), q.key, 100)
    small.put(b"z" * 300)
    assert q.get() == b"z" * 300


def test_a_message_put_before_msgmax_was_lowered_is_still_read(testbed):
    # A message longer than the kernel's msgmax (put before an operator lowered it) stopped
    # every reader: its get failed with E2BIG at msgmax, for ever, and its peek too, and with
    # it the sending MCA's whole transmission queue. A get reads it with a buffer that fits
    # it; a peek cannot (the kernel copies at most msgmax bytes) and says so.
    h = testbed.add_host("a")
    out = json.loads(h.python("""
import json
from rqp.protocol.errors import MessageTooBig
from rqp.system.queues import LocalQueue
q = LocalQueue.create(0x5251c0de)
q.put(b"a" * 6000, mtype=3)
q.put(b"b", mtype=1)
before = LocalQueue.open(q.key)  # opened before: an 8192-byte buffer, long enough
with open("/proc/sys/kernel/msgmax", "w") as f:
    f.write("1000")
fresh = LocalQueue.open(q.key)  # opened after: a 1000-byte buffer
res = {"buffer": fresh.msgmax}
try:
    fresh.peek()  # the kernel copies at most msgmax bytes (E2BIG: the buffer is shorter)
except MessageTooBig as exc:
    res["peek"] = str(exc)
try:
    before.peek()  # (EINVAL: the buffer is long enough, the message longer than msgmax)
except MessageTooBig as exc:
    res["peek before"] = str(exc)
data, mtype = LocalQueue.open(q.key).get(with_type=True)
res["get"] = [len(data), mtype, fresh.peek()[0].decode(), fresh.get().decode()]
try:
    fresh.put(b"c" * 1500)  # the bigger buffer is no licence to put more than msgmax
except MessageTooBig as exc:
    res["put"] = str(exc)
print(json.dumps(res))
"""))
    assert out["buffer"] == 1000
    assert re.search(r"queue 0x5251c0de: message 0 is longer than kernel.msgmax \(1000 bytes; "
                     r"lowered since it was put\): it can be taken, not copied", out["peek"])
    assert out["peek before"] == out["peek"]
    assert out["get"] == [6000, 3, "b", "b"]
    assert "msgmax" in out["put"] and "1000" in out["put"]


# --- peek (MSG_COPY): what lets the sending MCA journal a record before taking it ----------

def test_peek_copies_without_taking(make_queue):
    from rqp.system.queues import peek_supported
    assert peek_supported()  # the sending MCA's no-loss take depends on it
    q = make_queue()
    assert q.peek(0) is None
    q.put(b"first")
    q.put(b"second", mtype=3)
    assert q.peek(0) == (b"first", 1) and q.peek(1) == (b"second", 3) and q.peek(2) is None
    assert q.depth == 2
    assert q.get() == b"first" and q.peek(0) == (b"second", 3)


def test_peek_of_a_message_larger_than_the_ones_before_asks_again_with_room_for_any(make_queue):
    """A peek asks for about the size of the last messages (the kernel copies all of msgsz);
    a longer one is copied whole all the same, at any index and after any mix of sizes."""
    from rqp.system.queues import PEEK_SIZE_MIN

    q = make_queue()
    limit = min(q.msgmax, kernel_limits().msgmnb // 2)
    sizes = [10, PEEK_SIZE_MIN + 1, 3, limit, 1, 2 * PEEK_SIZE_MIN - 1, 2 * PEEK_SIZE_MIN + 1]
    for i, size in enumerate(sizes):
        body = bytes([65 + i]) * size
        q.put(body, mtype=i + 1)
        assert q.peek(0) == (body, i + 1)  # growing and shrinking, one at a time
        assert q.get() == body
    for size in (5, limit // 2, 7):  # several in the queue: each index its own size
        q.put(b"m" * size)
    assert [len(q.peek(i)[0]) for i in range(3)] == [5, limit // 2, 7]
    assert [len(q.peek(i)[0]) for i in (2, 1, 0)] == [7, limit // 2, 5]


def test_copy_head_and_take_head_a_batch_of_any_sizes_in_order(make_queue):
    """The sending MCA's batch: copies of the head (a tight loop; a message longer than the
    last ones, or the queue's end, left to peek), then the same records taken off."""
    from rqp.system.queues import PEEK_SIZE_MIN

    q = make_queue()
    limit = min(q.msgmax, kernel_limits().msgmnb // 4)
    bodies = [bytes([65 + i]) * size for i, size in enumerate(
        [10, PEEK_SIZE_MIN + 1, 3, limit, 1, 2 * PEEK_SIZE_MIN + 1])]
    for body in bodies:
        q.put(body)
    assert q.copy_head(4) == (bodies[:4], None)
    assert q.copy_head(100) == (bodies, None)  # (stops at the end of the queue)
    assert q.depth == len(bodies)
    assert q.take_head(2) == bodies[:2] and q.copy_head(100) == (bodies[2:], None)
    assert q.take_head(4) == bodies[2:] and q.copy_head(5) == ([], None)
    q.put(b"only one")
    with pytest.raises(QueueEmpty):  # fewer than asked: as get(block=False) says
        q.take_head(2)
    assert q.depth == 0


def test_peek_of_a_removed_queue(make_queue):
    q = make_queue()
    q.remove()
    with pytest.raises(QueueNotFound):
        q.peek(0)


# --- wait (msgrcv with a zero-byte buffer): how an idle sending MCA waits for a record -----

_MSGRCV = {"x86_64": 70, "aarch64": 188}


def _waiting_in_msgrcv(thread: threading.Thread) -> bool:
    task = f"/proc/self/task/{thread.native_id}"
    with open(f"{task}/wchan") as f:
        if f.read() == "do_msgrcv":
            return True
    with open(f"{task}/syscall") as f:  # (where wchan is hidden)
        return f.read().split()[0] == str(_MSGRCV.get(os.uname().machine))


def _waiter(q):
    """A thread blocked in ``q.wait()`` (checked in /proc); its result lands in ``.got``."""
    thread = threading.Thread(target=lambda: thread.got.append(_outcome(q.wait)), daemon=True)
    thread.got = []
    thread.start()
    wait_for(lambda: _waiting_in_msgrcv(thread) or thread.got, timeout=10,
             message="the thread did not block in msgrcv")
    assert not thread.got
    return thread


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


def test_wait_returns_at_once_and_takes_nothing_when_a_message_is_there(make_queue):
    q = make_queue()
    q.put(b"waiting", mtype=5)
    assert q.wait() is None
    assert q.depth == 1 and q.peek(0) == (b"waiting", 5)


def test_a_put_wakes_a_waiting_reader_and_stays_on_the_queue(make_queue):
    """The put hands the message to the waiting msgrcv, which is too small for it: the kernel
    wakes the reader with E2BIG and queues the message as if nobody had waited."""
    q = make_queue()
    thread = _waiter(q)
    LocalQueue.open(q.key).put(b"arrives")
    thread.join(10)
    assert not thread.is_alive() and thread.got == [None]
    assert q.depth == 1 and q.get() == b"arrives"


def test_wait_takes_an_empty_message_and_says_so(make_queue):
    """The one message a zero-byte buffer can take: returned, so it is not lost unseen."""
    q = make_queue()
    raw = sysv_ipc.MessageQueue(q.key, 0, mode=0, max_message_size=64)
    raw.send(b"", type=9)
    raw.send(b"next", type=1)
    assert q.wait() == (b"", 9)
    assert q.wait() is None and q.depth == 1 and q.get() == b"next"
    thread = _waiter(q)  # and the same for one that arrives while it waits
    raw.send(b"", type=4)
    thread.join(10)
    assert thread.got == [(b"", 4)] and q.depth == 0


def test_a_signal_ends_a_wait(make_queue, alarm):
    q = make_queue()
    signal.signal(signal.SIGALRM, lambda *_: None)  # (a handler that does not raise)
    thread = _waiter(q)
    signal.pthread_kill(thread.ident, signal.SIGALRM)
    thread.join(10)
    assert not thread.is_alive() and thread.got == [None] and q.depth == 0


def test_removed_while_waiting(make_queue):
    q = make_queue()
    thread = _waiter(q)
    sysv_ipc.remove_message_queue(q.id)
    thread.join(10)
    assert len(thread.got) == 1 and isinstance(thread.got[0], QueueNotFound)
    assert format_key(q.key) in str(thread.got[0])
    with pytest.raises(QueueNotFound):
        q.wait()


def test_a_queue_made_again_under_the_key_is_not_taken_for_the_old_one(make_queue):
    """Removed and made again at once (a producer's msgget(IPC_CREAT) right after an ipcrm):
    peek and wait on the old object say the queue was removed, so that the caller opens the
    key again, instead of failing with EINVAL for ever."""
    key = make_queue.new_key()  # (whatever queue has it at the end is removed)
    old = LocalQueue.create(key)
    thread = _waiter(old)
    sysv_ipc.remove_message_queue(old.id)
    new = LocalQueue.create(key)
    assert new.id != old.id
    thread.join(10)
    assert len(thread.got) == 1 and isinstance(thread.got[0], QueueNotFound)
    new.put(b"into the new one")
    for op in (old.wait, lambda: old.peek(0)):
        with pytest.raises(QueueNotFound, match=format_key(key)):
            op()
    assert LocalQueue.open(key).peek(0) == (b"into the new one", 1)
