"""rqp.storage.dedup: the receiver's de-duplication window, on real files in tmp_path."""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rqp.protocol.constants import UINT64_MAX
from rqp.storage.dedup import (
    DEDUP_ENTRY,
    DEDUP_ENTRY_SIZE,
    DEDUP_HEADER,
    DEDUP_HEADER_SIZE,
    DedupError,
    DedupWindow,
    encode_entry,
    window_path,
)
from tests.logfiles import written

HEADER = b"RQPD\x01\x00\x00\x00"
T0 = 1_700_000_000.0  # a unix time, in seconds


class Clock:
    """An injectable clock: unix seconds, moved by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "receiver.dedup"


def entries_of(data: bytes) -> list[tuple[int, int]]:
    """(key, time_ms) of every entry of a window file, parsed with the construct declarations."""
    assert DEDUP_HEADER.parse(data[:DEDUP_HEADER_SIZE]).version == 1
    body = data[DEDUP_HEADER_SIZE:]
    assert len(body) % DEDUP_ENTRY_SIZE == 0
    out = []
    for i in range(0, len(body), DEDUP_ENTRY_SIZE):
        e = DEDUP_ENTRY.parse(body[i:i + DEDUP_ENTRY_SIZE])
        assert e.crc32 == zlib.crc32(body[i + 4:i + DEDUP_ENTRY_SIZE])
        out.append((e.key, e.time_ms))
    return out


def window_bytes(path) -> bytes:
    """A window file's header and entries, without the zero bytes reserved after them (checked
    to be zeros). The entries end at the first entry boundary after the last non-zero byte: an
    entry is never all zeros (its crc32 would be 0xecbb4b55)."""
    last = max(DEDUP_HEADER_SIZE, len(path.read_bytes().rstrip(b"\0")))
    entries = -(-(last - DEDUP_HEADER_SIZE) // DEDUP_ENTRY_SIZE)
    return written(path, DEDUP_HEADER_SIZE + entries * DEDUP_ENTRY_SIZE)


def file_keys(path) -> list[int]:
    return [k for k, _ in entries_of(window_bytes(path))]


# --------------------------------------------------------------------------------------------
# The format, byte by byte
# --------------------------------------------------------------------------------------------


def test_header_and_entry_bytes():
    assert DEDUP_HEADER_SIZE == 8 and DEDUP_ENTRY_SIZE == 20
    assert DEDUP_HEADER.build({"reserved": b"\0\0\0"}) == HEADER
    key, time_ms = 0x0102030405060708, 0x0000018BCFE56800
    body = (
        b"\x01\x02\x03\x04\x05\x06\x07\x08"  # key
        b"\x00\x00\x01\x8b\xcf\xe5\x68\x00"  # time_ms
    )
    crc = zlib.crc32(body).to_bytes(4, "big")
    assert encode_entry(key, time_ms) == crc + body
    assert DEDUP_ENTRY.build({"crc32": zlib.crc32(body), "key": key,
                              "time_ms": time_ms}) == crc + body
    assert encode_entry(UINT64_MAX, 0) == DEDUP_ENTRY.build(
        {"crc32": zlib.crc32(b"\xff" * 8 + b"\0" * 8), "key": UINT64_MAX, "time_ms": 0})


def test_file_is_header_then_entries_in_record_order(path, clock):
    w = DedupWindow(path, clock=clock)
    assert path.read_bytes() == HEADER  # created (atomically) at open
    w.record(7)
    clock.advance(0.0015)
    w.record(UINT64_MAX)
    w.commit()
    ms = int(T0 * 1000)
    assert window_bytes(path) == HEADER + encode_entry(7, ms) + encode_entry(UINT64_MAX, ms + 1)
    w.close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_window_path(tmp_path):
    assert window_path(tmp_path) == tmp_path / "receiver.dedup"
    assert window_path(tmp_path, "r2") == tmp_path / "r2.dedup"


# --------------------------------------------------------------------------------------------
# seen / record / commit / reopen
# --------------------------------------------------------------------------------------------


def test_seen_after_record_before_commit(path, clock):
    with DedupWindow(path, clock=clock) as w:
        assert not w.seen(1)
        w.record(1)
        assert w.seen(1)  # in memory at once: a repeat in the same batch is recognised
        assert not w.seen(2)
        assert w.pending == 1
        assert len(w) == 1


def test_record_of_a_key_in_the_window_changes_nothing(path, clock):
    w = DedupWindow(path, clock=clock)
    w.record(1)
    clock.advance(10)
    w.record(1)
    assert w.pending == 1
    assert w.oldest_age() == 10.0  # the window counts from the first delivery
    w.commit()
    assert file_keys(path) == [1]
    w.close()


def test_committed_keys_survive_reopen(path, clock):
    w = DedupWindow(path, clock=clock)
    for key in (1, 2, 3):
        w.record(key)
    w.commit()
    w.close()
    w = DedupWindow(path, clock=clock)
    assert [w.seen(k) for k in (1, 2, 3, 4)] == [True, True, True, False]
    assert w.problems == []
    w.close()


def test_uncommitted_keys_are_lost_by_a_crash_but_kept_by_close(path, clock):
    w = DedupWindow(path, clock=clock)
    w.record(1)
    w.commit()
    w.record(2)  # put, recorded, never committed ...
    w.close(commit=False)  # ... and the process dies: the buffered entry was never written
    assert file_keys(path) == [1]
    w = DedupWindow(path, clock=clock)
    assert w.seen(1) and not w.seen(2)  # 2 would be put again: the documented window
    w.record(3)
    w.close()  # a clean close commits
    w = DedupWindow(path, clock=clock)
    assert w.seen(1) and w.seen(3)
    w.close()


def test_crash_of_a_real_process(path):
    """A process that is killed (no close, no atexit) keeps exactly what it committed."""
    script = textwrap.dedent(f"""
        import os
        from rqp.storage.dedup import DedupWindow
        w = DedupWindow({str(path)!r})
        for k in range(1, 101):
            w.record(k)
        w.commit()
        for k in range(101, 151):
            w.record(k)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    w = DedupWindow(path)
    assert all(w.seen(k) for k in range(1, 101))
    assert not any(w.seen(k) for k in range(101, 151))
    assert w.problems == []
    w.close()


def test_in_memory_window(clock):
    w = DedupWindow(None, clock=clock, max_keys=2)
    for key in (1, 2, 3):
        w.record(key)
    w.commit()
    assert [w.seen(k) for k in (1, 2, 3)] == [False, True, True]
    w.close()


def test_disabled_window_touches_no_file(path, clock):
    for kwargs in ({"max_keys": 0}, {"max_age": 0}):
        w = DedupWindow(path, clock=clock, **kwargs)
        w.record(1)
        w.commit()
        assert not w.seen(1)
        w.close()
        assert not path.exists()


def test_bad_arguments(path):
    with pytest.raises(ValueError):
        DedupWindow(path, max_keys=-1)
    with pytest.raises(ValueError):
        DedupWindow(path, max_age=-1.0)
    with pytest.raises(ValueError):
        DedupWindow(path, max_age=float("nan"))
    w = DedupWindow(None)
    for bad in (-1, UINT64_MAX + 1, "1", 1.0):
        with pytest.raises(ValueError):
            w.record(bad)
    assert len(w) == 0


def test_use_after_close(path):
    w = DedupWindow(path)
    w.close()
    w.close()  # twice is fine
    with pytest.raises(DedupError):
        w.record(1)
    with pytest.raises(DedupError):
        w.commit()


def test_missing_directory_is_a_dedup_error(tmp_path):
    with pytest.raises(DedupError, match="cannot create"):
        DedupWindow(tmp_path / "nowhere" / "receiver.dedup")


# --------------------------------------------------------------------------------------------
# The window: by count and by age; expiry persists
# --------------------------------------------------------------------------------------------


def test_window_by_count(path, clock):
    w = DedupWindow(path, clock=clock, max_keys=3)
    for key in range(1, 6):
        w.record(key)
        clock.advance(0.001)
    assert [w.seen(k) for k in range(1, 6)] == [False, False, True, True, True]
    assert len(w) == 3
    w.commit()
    w.close()
    assert file_keys(path) == [1, 2, 3, 4, 5]  # the file still holds them ...
    w = DedupWindow(path, clock=clock, max_keys=3)
    # ... but expiry by count is replayed: keys 1 and 2 are not resurrected
    assert [w.seen(k) for k in range(1, 6)] == [False, False, True, True, True]
    assert len(w) == 3
    w.close()


def test_window_by_age(path, clock):
    w = DedupWindow(path, clock=clock, max_age=60.0)
    w.record(1)
    clock.advance(30)
    w.record(2)
    clock.advance(29.999)
    assert w.seen(1) and w.seen(2)
    clock.advance(0.001)  # key 1 is exactly 60 s old: out
    assert not w.seen(1) and w.seen(2)
    assert len(w) == 2  # still held ...
    assert w.oldest_age() == 60.0
    assert w.expire() == 1  # ... until expire()
    assert len(w) == 1 and w.oldest_age() == 30.0
    assert w.expire() == 0
    w.commit()
    w.close()
    w = DedupWindow(path, clock=clock, max_age=60.0)
    assert not w.seen(1) and w.seen(2)  # expired by age: not resurrected
    assert len(w) == 1
    clock.advance(30)
    w.close()
    w = DedupWindow(path, clock=clock, max_age=60.0)
    assert len(w) == 0 and w.oldest_age() is None
    w.close()


def test_state_says_when_keys_leave_by_count_before_their_age(clock):
    w = DedupWindow(None, clock=clock, max_keys=2, max_age=60.0)
    assert w.state() == {"keys": 0, "max_keys": 2, "max_age": 60.0, "oldest_age": None,
                         "full": False}
    w.record(1)
    clock.advance(5)
    w.record(2)  # full: the next key pushes out the oldest, 5 s old
    assert w.state() == {"keys": 2, "max_keys": 2, "max_age": 60.0, "oldest_age": 5.0,
                         "full": True}
    clock.advance(2)
    w.record(3)
    assert not w.seen(1) and w.state()["oldest_age"] == 2.0
    clock.advance(59)  # key 2 is past its age (key 3, 59 s old, is not): it is not counted
    assert not w.seen(2) and w.state() == {"keys": 1, "max_keys": 2, "max_age": 60.0,
                                           "oldest_age": 59.0, "full": False}
    endless = DedupWindow(None, clock=clock, max_age=math.inf)
    assert endless.state()["max_age"] is None  # (JSON has no infinity)
    off = DedupWindow(None, clock=clock, max_keys=0)
    assert off.state()["full"] is False and off.state()["keys"] == 0


def test_expire_by_age_is_persisted_even_without_expire(path, clock):
    w = DedupWindow(path, clock=clock, max_age=1.0)
    w.record(1)
    w.commit()
    w.close()
    clock.advance(5)
    w = DedupWindow(path, clock=clock, max_age=1.0)
    assert not w.seen(1) and len(w) == 0
    w.close()


def test_key_recorded_again_after_it_expired(path, clock):
    w = DedupWindow(path, clock=clock, max_age=10.0, max_keys=3)
    w.record(1)
    w.record(2)
    clock.advance(10)
    assert not w.seen(1)
    w.record(1)  # a late repeat was put again (outside the window): a new entry
    assert w.seen(1) and w.oldest_age() == 10.0
    w.record(3)
    w.record(4)  # 4 keys held: the oldest (2) goes; 1 is now the newest but two
    assert [w.seen(k) for k in (1, 2, 3, 4)] == [True, False, True, True]
    w.commit()
    w.close()
    assert file_keys(path) == [1, 2, 1, 3, 4]
    clock.advance(5)
    w = DedupWindow(path, clock=clock, max_age=10.0, max_keys=3)
    assert [w.seen(k) for k in (1, 2, 3, 4)] == [True, False, True, True]
    assert w.oldest_age() == 5.0  # the later entry of key 1 counts
    w.close()


def test_smaller_limits_at_reopen_apply(path, clock):
    w = DedupWindow(path, clock=clock)
    for key in range(10):
        w.record(key)
        clock.advance(1)
    w.close()
    w = DedupWindow(path, clock=clock, max_keys=4)
    assert [k for k in range(10) if w.seen(k)] == [6, 7, 8, 9]
    w.close()
    w = DedupWindow(path, clock=clock, max_age=3.5)
    assert [k for k in range(10) if w.seen(k)] == [7, 8, 9]
    w.close()


# --------------------------------------------------------------------------------------------
# Group commit
# --------------------------------------------------------------------------------------------


def test_group_commit_one_fsync_per_commit(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock)
    fsyncs, writes = [], []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: writes.append(len(data))
                        or real_pwrite(fd, data, off))
    for key in range(1000):
        w.record(key)
    assert fsyncs == [] and writes == []  # record() only buffers
    w.commit()
    assert len(fsyncs) == 1 and writes == [1000 * DEDUP_ENTRY_SIZE]
    w.commit()  # nothing new: no write, no fsync
    assert len(fsyncs) == 1 and len(writes) == 1
    w.record(5)  # in the window already: nothing to commit either
    w.commit()
    assert len(fsyncs) == 1
    w.record(1000)
    w.commit()
    assert len(fsyncs) == 2
    monkeypatch.undo()
    w.close()
    assert file_keys(path) == list(range(1001))


def test_no_fsync_mode_writes_at_commit(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock, fsync=False)
    monkeypatch.setattr(os, "fsync", lambda fd: pytest.fail("fsync with fsync=False"))
    w.record(1)
    w.commit()
    assert file_keys(path) == [1]
    w.close()


# --------------------------------------------------------------------------------------------
# Damaged files
# --------------------------------------------------------------------------------------------


def _write_window(path, keys, clock):
    w = DedupWindow(path, clock=clock)
    for key in keys:
        w.record(key)
    w.close()
    return window_bytes(path)


@pytest.mark.parametrize("reserve", [0, 100], ids=["file-ends", "zeros-follow"])
@pytest.mark.parametrize("kept", range(DEDUP_ENTRY_SIZE))
def test_torn_tail_at_every_length_of_the_last_entry(tmp_path, clock, kept, reserve):
    """A commit's write torn by a crash: the file ends inside the entry, or (the window
    reserves space ahead of its appends) zero bytes follow the part that reached the disk."""
    path = tmp_path / "w.dedup"
    data = _write_window(path, [10, 11, 12], clock)
    good_end = DEDUP_HEADER_SIZE + 2 * DEDUP_ENTRY_SIZE
    path.write_bytes(data[:good_end + kept] + bytes(reserve))
    # (the bytes not written may have been zeros anyway: then the entry is whole)
    whole = reserve > 0 and not any(data[good_end + kept:good_end + DEDUP_ENTRY_SIZE])
    w = DedupWindow(path, clock=clock)
    assert [w.seen(k) for k in (10, 11, 12)] == [True, True, whole]
    if whole:
        assert w.problems == []
        good_end += DEDUP_ENTRY_SIZE
    elif any(data[good_end:good_end + kept]):
        assert len(w.problems) == 1 and f"offset {good_end}" in w.problems[0]
        assert ("torn" if reserve == 0 else "crc32") in w.problems[0]
        assert path.stat().st_size == good_end  # cut, so that new entries follow good ones
    else:
        assert w.problems == []  # a clean cut between two entries is no problem
    written(path, good_end)
    w.record(13)
    w.close()
    w = DedupWindow(path, clock=clock)
    assert [w.seen(k) for k in (10, 11, 12, 13)] == [True, True, whole, True]
    assert w.problems == []
    w.close()


@pytest.mark.parametrize("reserve", [0, 100], ids=["file-ends", "zeros-follow"])
def test_torn_write_of_a_whole_batch(tmp_path, clock, reserve):
    path = tmp_path / "w.dedup"
    data = _write_window(path, range(10), clock)
    for cut in range(DEDUP_HEADER_SIZE, len(data) + 1):
        path.write_bytes(data[:cut] + bytes(reserve))
        whole = (cut - DEDUP_HEADER_SIZE) // DEDUP_ENTRY_SIZE
        if reserve and whole < 10 and not any(data[cut:DEDUP_HEADER_SIZE + (whole + 1) * 20]):
            whole += 1  # (the bytes not written were zeros anyway: the entry is whole)
        w = DedupWindow(path, clock=clock)
        assert [k for k in range(10) if w.seen(k)] == list(range(whole))
        w.close()


def test_data_after_zeros_in_the_reserved_space_is_damage(path, clock):
    """Zeros where the next entry would start are the end only if nothing but zeros follows."""
    data = _write_window(path, range(3), clock)
    path.write_bytes(data + bytes(5 * DEDUP_ENTRY_SIZE) + encode_entry(9, 1) + bytes(300))
    w = DedupWindow(path, clock=clock)
    assert [k for k in (0, 1, 2, 9) if w.seen(k)] == [0, 1, 2]
    assert len(w.problems) == 1 and f"offset {len(data)}: entry 3 has crc32" in w.problems[0]
    assert f"the {5 * DEDUP_ENTRY_SIZE} bytes after it" in w.problems[0]
    assert path.read_bytes() == data  # cut, so that new entries follow good ones
    w.close()


def test_bad_crc_in_the_middle(path, clock):
    data = bytearray(_write_window(path, range(10), clock))
    bad_offset = DEDUP_HEADER_SIZE + 5 * DEDUP_ENTRY_SIZE
    data[bad_offset + 9] ^= 0x40  # a bit of entry 5's key
    path.write_bytes(bytes(data))
    w = DedupWindow(path, clock=clock)
    assert [k for k in range(10) if w.seen(k)] == [0, 1, 2, 3, 4]  # earlier entries kept
    assert len(w.problems) == 1
    problem = w.problems[0]
    assert f"offset {bad_offset}" in problem and "entry 5" in problem and "crc32" in problem
    assert f"{4 * DEDUP_ENTRY_SIZE} bytes after it" in problem
    assert path.stat().st_size == bad_offset
    w.record(99)
    w.close()
    w = DedupWindow(path, clock=clock)
    assert [k for k in (0, 4, 5, 9, 99) if w.seen(k)] == [0, 4, 99]
    assert w.problems == []
    w.close()


def test_bad_crc_field(path, clock):
    data = bytearray(_write_window(path, range(3), clock))
    data[DEDUP_HEADER_SIZE] ^= 0xFF  # entry 0's crc32 itself
    path.write_bytes(bytes(data))
    w = DedupWindow(path, clock=clock)
    assert len(w) == 0 and "offset 8: entry 0" in w.problems[0]
    w.close()


def test_not_a_window_file_is_refused_and_left_alone(path, clock):
    for content in (b"RQPX\x01\x00\x00\x00", b"hello world, not a window", b"xy"):
        path.write_bytes(content)
        with pytest.raises(DedupError, match="not a de-duplication window"):
            DedupWindow(path, clock=clock)
        assert path.read_bytes() == content


def test_newer_version_is_refused(path, clock):
    path.write_bytes(b"RQPD\x02\x00\x00\x00" + encode_entry(1, 1))
    with pytest.raises(DedupError, match="version 2"):
        DedupWindow(path, clock=clock)


@pytest.mark.parametrize("kept", range(DEDUP_HEADER_SIZE))
def test_empty_file_or_torn_header_is_an_empty_window(path, clock, kept):
    path.write_bytes(HEADER[:kept])
    w = DedupWindow(path, clock=clock)
    assert len(w) == 0
    assert bool(w.problems) == bool(kept)
    assert path.read_bytes() == HEADER
    w.record(1)
    w.close()
    assert file_keys(path) == [1]


def test_reserved_header_bytes_are_ignored(path, clock):
    path.write_bytes(b"RQPD\x01\xAA\xBB\xCC" + encode_entry(5, int(T0 * 1000)))
    w = DedupWindow(path, clock=clock)
    assert w.seen(5) and w.problems == []
    w.close()


# --------------------------------------------------------------------------------------------
# Compaction and leftovers
# --------------------------------------------------------------------------------------------


def test_compaction_keeps_exactly_the_live_keys(path, clock):
    w = DedupWindow(path, clock=clock, max_keys=5, max_age=100.0, compact_min_bytes=0)
    for key in range(1, 6):
        w.record(key)
        clock.advance(1)
    w.commit()
    assert file_keys(path) == [1, 2, 3, 4, 5]  # 5 entries for 5 keys: no compaction yet
    for key in range(6, 12):
        w.record(key)
        clock.advance(1)
    w.commit()  # 11 entries > 2 x 5 keys: compacted
    assert entries_of(window_bytes(path)) == [
        (k, int(T0 * 1000) + (k - 1) * 1000) for k in range(7, 12)]
    clock.advance(97.5)  # keys 7, 8, 9 (recorded at T0 + 6, 7, 8 s) are 100 s old or more
    w.compact()
    assert file_keys(path) == [10, 11]
    assert len(w) == 2
    w.close()
    w = DedupWindow(path, clock=clock, max_keys=5, max_age=100.0)
    assert [k for k in range(12) if w.seen(k)] == [10, 11]
    w.close()


def test_compaction_waits_for_the_minimum_size(path, clock):
    w = DedupWindow(path, clock=clock, max_keys=2, compact_min_bytes=1000)
    for key in range(48):  # 8 + 48 * 20 = 968 bytes: under the minimum
        w.record(key)
        w.commit()
    assert len(file_keys(path)) == 48
    w.record(48)
    w.record(49)
    w.commit()  # 1008 bytes
    assert file_keys(path) == [48, 49]
    w.record(50)
    w.commit()  # appended after the compacted file
    assert file_keys(path) == [48, 49, 50]
    w.close()


def test_compact_is_also_a_commit(path, clock):
    w = DedupWindow(path, clock=clock)
    w.record(1)
    w.compact()
    assert w.pending == 0
    w.close(commit=False)
    w = DedupWindow(path, clock=clock)
    assert w.seen(1)
    w.close()


def test_leftover_temp_file_is_removed_and_not_read(path, clock):
    _write_window(path, [1, 2], clock)
    # What a compaction that crashed before its rename leaves (write_file_atomically's names),
    # with keys in it that must not come back.
    leftover = path.parent / f".{path.name}.k3j4h5.tmp"
    leftover.write_bytes(HEADER + encode_entry(77, int(T0 * 1000)))
    other = path.parent / ".other.dedup.abc.tmp"  # not ours: left alone
    other.write_bytes(b"x")
    w = DedupWindow(path, clock=clock)
    assert w.seen(1) and w.seen(2) and not w.seen(77)
    assert not leftover.exists() and other.exists()
    assert len(w.problems) == 1 and str(leftover) in w.problems[0]
    w.close()


def test_temp_file_of_a_real_interrupted_compaction_is_removed(path, clock, monkeypatch):
    """The temp file that write_file_atomically really leaves when the process dies between
    its fsync and its rename (no cleanup runs) is found and removed at the next open."""
    w = DedupWindow(path, clock=clock)
    for key in (1, 2, 3):
        w.record(key)
    w.commit()

    class Crash(BaseException):
        pass

    def crash(*args):
        raise Crash

    monkeypatch.setattr(os, "replace", crash)
    monkeypatch.setattr(os, "unlink", crash)  # nor does its cleanup run: the process is gone
    with pytest.raises(Crash):
        w.compact()
    monkeypatch.undo()
    leftovers = [p for p in path.parent.iterdir() if p != path]
    assert len(leftovers) == 1
    w2 = DedupWindow(path, clock=clock)
    assert not leftovers[0].exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert w2.seen(1) and w2.seen(3)
    w2.close()
    w.close(commit=False)


def test_directory_fsync_failing_after_the_rename_of_a_compaction(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock, max_keys=2)
    for key in range(5):
        w.record(key)
    w.commit()
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DedupError, match="compaction failed"):
        w.compact()
    monkeypatch.undo()
    assert file_keys(path) == [3, 4]  # the new file is in place ...
    w.record(5)
    with pytest.raises(DedupError, match="earlier fsync failed"):
        w.commit()  # ... but whether it survives a crash is unknown: no more acknowledgements
    assert file_keys(path) == [3, 4]  # and nothing was appended to the old, unlinked file
    w.close(commit=False)
    w = DedupWindow(path, clock=clock, max_keys=2)
    assert [k for k in range(6) if w.seen(k)] == [3, 4]
    w.close()


def test_failed_compaction_does_not_fail_the_commit(path, clock, monkeypatch, caplog):
    w = DedupWindow(path, clock=clock, max_keys=1, compact_min_bytes=0)
    w.record(1)
    w.record(2)
    w.record(3)

    def no_rename(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", no_rename)
    with caplog.at_level(logging.WARNING, logger="rqp.storage.dedup"):
        w.commit()  # durable; the compaction after it failed and is only logged
    assert "compaction failed" in caplog.text
    assert file_keys(path) == [1, 2, 3]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    monkeypatch.undo()
    w.record(4)
    w.close()
    w = DedupWindow(path, clock=clock, max_keys=1)
    assert [k for k in range(5) if w.seen(k)] == [4]
    w.close()


# --------------------------------------------------------------------------------------------
# I/O errors at commit
# --------------------------------------------------------------------------------------------


def test_failed_write_is_retried_by_the_next_commit(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock)
    w.record(1)
    w.commit()
    real_pwrite = os.pwrite

    def short_then_enospc(fd, data, offset):
        real_pwrite(fd, bytes(data[:7]), offset)  # 7 bytes reach the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", short_then_enospc)
    w.record(2)
    w.record(3)
    with pytest.raises(DedupError, match="cannot write"):
        w.commit()
    assert w.pending == 2 and w.seen(2)
    monkeypatch.undo()
    w.commit()  # written again at the same offset, over the torn bytes
    w.close()
    w = DedupWindow(path, clock=clock)
    assert [w.seen(k) for k in (1, 2, 3)] == [True, True, True]
    assert w.problems == []
    w.close()


def test_failed_fsync_fails_every_later_commit(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock)

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    w.record(1)
    with pytest.raises(DedupError, match="fsync failed"):
        w.commit()
    monkeypatch.undo()
    w.record(2)
    with pytest.raises(DedupError, match="earlier fsync failed"):
        w.commit()  # a later fsync may "succeed" without the data: do not trust it
    with pytest.raises(DedupError):
        w.close()
    w = DedupWindow(path, clock=clock)  # reopening reads what really is in the file
    assert w.seen(1) and not w.seen(2)
    w.close()


def test_compact_recovers_from_a_failed_fsync(path, clock, monkeypatch):
    w = DedupWindow(path, clock=clock)
    w.record(1)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(DedupError):
        w.commit()
    monkeypatch.undo()
    w.record(2)
    w.compact()  # a new file from memory, fsynced as a whole
    w.record(3)
    w.commit()
    w.close()
    assert file_keys(path) == [1, 2, 3]


# --------------------------------------------------------------------------------------------
# Random operations against a model
# --------------------------------------------------------------------------------------------

MAX_KEYS = 4
MAX_AGE = 3.0
KEYS = st.integers(1, 8) | st.sampled_from([0, UINT64_MAX])
ALL_KEYS = list(range(0, 9)) + [UINT64_MAX]


def model_window(entries, now_ms: int) -> set[int]:
    """The definition: a key is in the window if its newest entry is among the newest
    MAX_KEYS entries of distinct keys and younger than MAX_AGE."""
    last: dict[int, tuple[int, int]] = {}
    for i, (key, t) in enumerate(entries):
        last[key] = (i, t)
    newest = sorted(last.items(), key=lambda item: item[1][0])[-MAX_KEYS:]
    return {key for key, (_, t) in newest if now_ms - t < MAX_AGE * 1000}


class WindowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "w.dedup")
        self.clock = Clock()
        self.entries: list[tuple[int, int]] = []  # every record() that added an entry
        self.committed = 0  # how many of them are durable
        self.window = None

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    @initialize(compact=st.booleans())
    def open(self, compact):
        self.compact_min = 0 if compact else 1 << 20
        self.window = self._open()

    def _open(self) -> DedupWindow:
        w = DedupWindow(self.path, max_keys=MAX_KEYS, max_age=MAX_AGE, clock=self.clock,
                        fsync=False, compact_min_bytes=self.compact_min)
        assert w.problems == []
        return w

    @rule(key=KEYS)
    def record(self, key):
        if key not in model_window(self.entries, self.now_ms()):
            self.entries.append((key, self.now_ms()))
        self.window.record(key)

    @rule(keys=st.lists(KEYS, min_size=2, max_size=8))
    def record_batch(self, keys):
        for key in keys:
            self.record(key)

    @rule()
    def commit(self):
        self.window.commit()
        self.committed = len(self.entries)

    @rule()
    def compact(self):
        self.window.compact()
        self.committed = len(self.entries)

    @rule()
    def expire(self):
        self.window.expire()
        assert len(self.window) == len(model_window(self.entries, self.now_ms()))

    @rule(ms=st.integers(0, 1000))
    def advance(self, ms):
        self.clock.advance(ms / 1000)

    @rule(crash=st.booleans())
    def reopen(self, crash):
        self.window.close(commit=not crash)
        if crash:
            del self.entries[self.committed:]
        self.committed = len(self.entries)
        self.window = self._open()
        assert len(self.window) == len(model_window(self.entries, self.now_ms()))

    @precondition(lambda self: self.window is not None)
    @invariant()
    def same_window(self):
        expected = model_window(self.entries, self.now_ms())
        assert {k for k in ALL_KEYS if self.window.seen(k)} == expected

    def teardown(self):
        if self.window is not None:
            self.window.close()
        self.dir.cleanup()


WindowMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWindowMachine = WindowMachine.TestCase


def test_resize_applies_new_limits_at_once(tmp_path):
    """SIGHUP reload: the receiver gives the window its new limits (it kept the old ones)."""
    now = [1000.0]
    window = DedupWindow(tmp_path / "w", max_keys=10, max_age=60, clock=lambda: now[0])
    for key in range(1, 9):
        window.record(key)
    assert window.resize(5, 60) == 3  # the three oldest leave
    assert [k for k in range(1, 9) if window.seen(k)] == [4, 5, 6, 7, 8]
    now[0] += 30
    assert window.resize(5, 20) == 5 and len(window) == 0  # all older than 20 s now
    with pytest.raises(ValueError, match="needs a restart"):
        window.resize(0, 20)
    with pytest.raises(ValueError, match="max_keys"):
        window.resize(-1, 20)
    window.close()


def test_scoped_keys_differ_per_peer_and_are_stable():
    from rqp.storage.dedup import scoped_key

    assert scoped_key("10.0.0.1", 7) == scoped_key("10.0.0.1", 7)
    keys = {scoped_key(peer, k) for peer in ("10.0.0.1", "10.0.0.2", "::1") for k in range(1000)}
    assert len(keys) == 3000 and all(0 <= k < 1 << 64 for k in keys)


SMALL_WINDOW = r"""
import os, sys
from rqp.storage.dedup import DedupWindow
w = DedupWindow(os.path.join(sys.argv[1], "receiver.dedup"), max_keys=1000)
for batch in range(200):  # 20,000 keys through a window of 1,000 (20 KB of keys)
    for i in range(100):
        w.record(batch * 100 + i + 1)
    w.commit()
print(os.path.getsize(os.path.join(sys.argv[1], "receiver.dedup")))
"""


def test_a_small_window_compacts_on_a_small_disk():
    """A trial: a window of 1,000 keys (20 KB) on a 1 MiB state_dir filled it with dead entries
    before its first compaction (then at 1 MiB) and closed every connection from then on. A
    real tmpfs of 256 KiB in a private mount namespace (gone with the process)."""
    with tempfile.TemporaryDirectory() as disk:
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             'mount -t tmpfs -o size=256k rqp-test "$1" && exec "$2" -c "$3" "$1"', "sh",
             disk, sys.executable, SMALL_WINDOW], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout) < 256 << 10
