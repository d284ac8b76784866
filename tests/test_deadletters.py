"""The one dead-letter writer (rqp.storage.deadletters): spill space is bounded, and a record
that was not written leaves no spill file behind (issue 12: oversized frames to a refused
queue left 1,282 orphaned spill files, 10.5 MB in 20 s)."""

from __future__ import annotations

import pytest

from rqp.protocol.records import AgentKind, DeadLetterFlags, DeadLetterRecord
from rqp.protocol.reasons import ReasonCode
from rqp.storage.deadletters import DeadLetterWriter


def record(size: int) -> DeadLetterRecord:
    return DeadLetterRecord(reason=ReasonCode.QUEUE_NOT_OFFERED, message_type=0,
                            agent=AgentKind.RECEIVER, host="h", detail="not offered",
                            payload=b"x" * size)


def test_spill_space_is_bounded_and_said_in_the_record(ipc_keys, tmp_path):
    writer = DeadLetterWriter(ipc_keys(), tmp_path / "spill", msgmax=1000, spill_limit=5000)
    first = DeadLetterRecord.from_bytes(writer.encode(record(3000)))
    assert first.spill_path and first.flags & DeadLetterFlags.TRUNCATED
    second = DeadLetterRecord.from_bytes(writer.encode(record(3000)))  # 6000 > 5000
    assert second.spill_path == "" and second.flags & DeadLetterFlags.TRUNCATED
    assert "not spilled" in second.detail and "spill limit 5000" in second.detail
    assert second.original_length == 3000
    assert [p.stat().st_size for p in (tmp_path / "spill").iterdir()] == [3000]


def test_spill_files_removed_by_the_drain_make_room_again(ipc_keys, tmp_path):
    # A trial: the bytes spilled were counted once at the first spill and then only added
    # to, so spill_limit worked as a lifetime total: with the spill directory empty after
    # each drain, payloads were cut ("holds 16000 bytes, spill limit 20480").
    writer = DeadLetterWriter(ipc_keys(), tmp_path / "spill", msgmax=1000, spill_limit=5000)
    for _ in range(4):
        spilled = DeadLetterRecord.from_bytes(writer.encode(record(3000)))
        assert spilled.spill_path, spilled.detail
        for path in (tmp_path / "spill").iterdir():  # what the drain does once archived
            path.unlink()


def test_a_record_not_written_leaves_no_spill_file(ipc_keys, tmp_path):
    writer = DeadLetterWriter(ipc_keys(), tmp_path / "spill", msgmax=1000, spill_limit=5000)
    data = writer.encode(record(4000))
    assert len(list((tmp_path / "spill").iterdir())) == 1
    writer.discard(data)  # e.g. DEAD.LETTER.Q stayed full: the sender keeps the message
    assert list((tmp_path / "spill").iterdir()) == []
    again = DeadLetterRecord.from_bytes(writer.encode(record(4000)))  # the room is back
    assert again.spill_path
    assert writer.try_put(writer.encode(record(10))) and writer.by_reason["QUEUE_NOT_OFFERED"] == 1


def test_a_spill_file_that_cannot_be_written_raises_or_cuts_as_asked(ipc_keys, tmp_path):
    (tmp_path / "spill").write_text("a file where the directory should be")
    holds = DeadLetterWriter(ipc_keys(), tmp_path / "spill", msgmax=1000)
    with pytest.raises(NotADirectoryError):
        holds.encode(record(3000))  # (the sending MCA holds it: a SURE one is journaled)
    cuts = DeadLetterWriter(ipc_keys(), tmp_path / "spill", msgmax=1000, cut_unspillable=True)
    cut = DeadLetterRecord.from_bytes(cuts.encode(record(3000)))
    assert cut.flags & DeadLetterFlags.TRUNCATED and not cut.spill_path
    assert cut.original_length == 3000 and len(cut.to_bytes()) == 1000
    why = f"cannot write a spill file in {tmp_path / 'spill'}: Not a directory"
    assert cut.detail == f"not offered; payload cut to fit one message, not spilled: {why}"
    assert (cuts.spill_trouble, cuts.unspilled) == (why, 1)
    (tmp_path / "spill").unlink()
    assert DeadLetterRecord.from_bytes(cuts.encode(record(3000))).spill_path  # (room again)


def test_a_dead_letter_queue_smaller_than_msgmax_gets_records_that_fit_it(ipc_keys, tmp_path):
    """DEAD.LETTER.Q's own size (msg_qbytes) below msgmax: records are fitted to it, also one
    encoded before the queue was made smaller (a trial: MessageTooBig stopped the sending
    MCA, at every start when the message was journaled)."""
    import sysv_ipc

    key = ipc_keys()
    writer = DeadLetterWriter(key, tmp_path / "spill", msgmax=8192)
    early = writer.encode(record(5000))  # fitted to msgmax: the queue's size is 16 KiB
    assert len(early) > 4096
    sysv_ipc.MessageQueue(key).max_size = 4096  # (lowering it needs no privilege)
    later = writer.encode(record(6000))
    assert len(later) <= 4096
    assert writer.try_put(later) and writer.queue.get(block=False) == later
    assert writer.try_put(early)
    back = DeadLetterRecord.from_bytes(writer.queue.get(block=False))
    assert back.flags & DeadLetterFlags.TRUNCATED and back.original_length == 5000
    assert back.payload == b"x" * len(back.payload) and len(back.to_bytes()) <= 4096
    with open(back.spill_path, "rb") as f:  # (the whole payload, as for any record cut)
        assert f.read() == b"x" * 5000
    assert writer.by_reason["QUEUE_NOT_OFFERED"] == 2


def test_a_dead_letter_queue_too_small_for_any_record_holds_them_and_says_why(
        ipc_keys, tmp_path, caplog):
    """Smaller than a record without payload (the next trial: msg_qbytes 150 against a
    244-byte header; 64 here): encode and try_put do not raise (they stopped the sending MCA
    at every start); the record waits, one ERROR line says why, and it is written once the
    queue is made larger."""
    import sysv_ipc

    key = ipc_keys()
    writer = DeadLetterWriter(key, tmp_path / "spill", msgmax=8192)
    queue = sysv_ipc.MessageQueue(key)
    queue.max_size = 64
    data = writer.encode(record(50))
    assert len(data) > 64 + 50  # (the header alone is larger than the queue)
    with caplog.at_level("ERROR", logger="rqp.deadletters"):
        assert not writer.try_put(data) and not writer.try_put(data)
    [line] = [r.getMessage() for r in caplog.records]
    assert "takes records of at most 64 bytes" in line and "made larger" in line
    queue.max_size = 4096
    assert writer.try_put(data) and writer.by_reason["QUEUE_NOT_OFFERED"] == 1
    assert DeadLetterRecord.from_bytes(writer.queue.get(block=False)).payload == b"x" * 50


def test_a_record_fitted_again_and_then_discarded_leaves_no_spill_file(ipc_keys, tmp_path):
    import sysv_ipc

    key = ipc_keys()
    writer = DeadLetterWriter(key, tmp_path / "spill", msgmax=8192)
    for _ in range(14):  # (fills it: the refitted record waits)
        assert writer.try_put(writer.encode(record(1000)))
    data = writer.encode(record(3000))
    sysv_ipc.MessageQueue(key).max_size = 2048
    assert not writer.try_put(data) and not writer.try_put(data)  # fitted (spilled) once
    assert len(list((tmp_path / "spill").iterdir())) == 1
    writer.discard(data)  # (a stop with it still held)
    assert list((tmp_path / "spill").iterdir()) == []


def _child_writes_dead_letters(key, spill_dir):
    import logging
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("rqp").addHandler(handler)
    writer = DeadLetterWriter(key, spill_dir, msgmax=1000)
    puts = [writer.try_put(writer.encode(record(10))) for _ in range(3)]
    return puts, lines


def test_a_dead_letter_queue_it_may_not_write_holds_the_dead_letters(make_queue, run_as,
                                                                      tmp_path):
    # A trial: a sending MCA whose DEAD.LETTER.Q it could not write (a queue made by another
    # user, mode 0644) stopped with exit 70 at its first dead letter, and again at every
    # start. Like a full queue, it now holds them (try_put is False), with one ERROR line.
    q = make_queue(mode=0o644)
    puts, lines = run_as(65534, 65534, [], _child_writes_dead_letters, q.key,
                         str(tmp_path / "spill"))
    assert puts == [False, False, False]
    assert len(lines) == 1 and "permission denied" in lines[0] and \
        "dead letters wait until this agent may write to DEAD.LETTER.Q" in lines[0], lines



UNMADE = r"""
import json, sys, sysv_ipc
from rqp.storage.deadletters import DeadLetterWriter
from rqp.protocol.records import AgentKind, DeadLetterRecord
from rqp.protocol.reasons import ReasonCode
writer = DeadLetterWriter(0x5251DEAD, sys.argv[1])
data = writer.encode(DeadLetterRecord(reason=ReasonCode.NO_ROUTE, message_type=0,
                                      agent=AgentKind.SENDER, host="h", payload=b"x"))
sysv_ipc.MessageQueue(0x5251DEAD).remove()
with open("/proc/sys/kernel/msgmni", "w") as f:  # (this host's IPC namespace only)
    f.write("1\n")
other = sysv_ipc.MessageQueue(0x7A11000F, sysv_ipc.IPC_CREX, 0o600)  # the one queue there is
out = {"full": writer.try_put(data), "unmade": writer.unmade}
other.remove()
out["after"], out["unmade_after"] = writer.try_put(data), writer.unmade
out["there"] = len(sysv_ipc.MessageQueue(0x5251DEAD).receive(block=False)[0]) > 0
sysv_ipc.MessageQueue(0x5251DEAD).remove()
print(json.dumps(out))
"""


def test_a_removed_dead_letter_queue_that_cannot_be_made_again_holds_the_dead_letters(testbed):
    """A trial: DEAD.LETTER.Q removed while the system's kernel.msgmni queues were all taken:
    making it again raised, the sending MCA stopped (exit 70) and the UNSURE messages it held
    were lost. A put then fails as into a full queue (the caller holds the record), says why
    (``unmade``, in the status), and goes once the queue can be made."""
    import json
    a = testbed.add_host("a")
    out = json.loads(a.python(UNMADE, str(a.workdir / "spill")))
    assert out["full"] is False
    assert out["unmade"].startswith("DEAD.LETTER.Q was removed and cannot be made again: ")
    assert out["after"] is True and out["unmade_after"] is None and out["there"]
