"""rqp.storage.journal: the sending MCA's durable journal of SURE messages (real files in tmp_path)."""

from __future__ import annotations

import errno
import os
import queue
import re
import tempfile
import threading
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rqp.protocol.errors import RQPError
from rqp.storage.journal import (
    APPEND_FIXED_SIZE,
    ENTRY_PREFIX_SIZE,
    FILE_HEADER_SIZE,
    MAX_ENTRY_LENGTH,
    RELEASE_ENTRY_SIZE,
    Journal,
    JournalEntry,
    JournalError,
    encode_append,
    encode_copies,
    encode_copy_done,
    encode_header,
    encode_release,
)
from tests.logfiles import written


def live(j: Journal) -> dict[int, tuple[int, bytes]]:
    return {e.seq: (e.key, e.record) for e in j.live_entries()}


def recovered(j: Journal) -> dict[int, tuple[int, bytes]]:
    return {e.seq: (e.key, e.record) for e in j.recovered}


def side_files(directory: Path, kind: str) -> list[Path]:
    return sorted(directory.glob(f"*.journal.{kind}-*"))


# --------------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------------


def test_format_vectors():
    assert encode_header(1) == b"RQPJ" + b"\x02" + b"\0\0\0" + (1).to_bytes(8, "big")
    body = b"\x01" + (5).to_bytes(8, "big") + (0x1122334455667788).to_bytes(8, "big") \
        + (3).to_bytes(4, "big") + b"abc"
    assert encode_append(5, 0x1122334455667788, b"abc") == \
        len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body
    assert len(body) == APPEND_FIXED_SIZE + 3
    body = b"\x02" + (9).to_bytes(8, "big")
    assert encode_release(9) == b"\0\0\0\x09" + zlib.crc32(body).to_bytes(4, "big") + body
    assert RELEASE_ENTRY_SIZE == 17 and FILE_HEADER_SIZE == 16 and ENTRY_PREFIX_SIZE == 8


def test_broadcast_entry_vectors():
    body = b"\x03" + (5).to_bytes(8, "big") + (2).to_bytes(2, "big") \
        + (0x10).to_bytes(8, "big") + b"\x0ehostA.lan:7777" + (0x11).to_bytes(8, "big") \
        + b"\x0bhostB:77770"
    assert encode_copies(5, ((0x10, "hostA.lan:7777"), (0x11, "hostB:77770"))) == \
        len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body
    body = b"\x04" + (5).to_bytes(8, "big") + (0x11).to_bytes(8, "big")
    assert encode_copy_done(5, 0x11) == \
        len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body


def test_broadcast_copies_done_one_by_one(tmp_path):
    copies = ((0x10, "a:1"), (0x11, "b:1"), (0x12, "c:1"))
    with Journal(tmp_path) as j:
        assert j.append([(0x10, b"rec", copies), (0x20, b"plain")]) == [1, 2]
        assert j.copy_done([(1, 0x11), (1, 0x11), (1, 0x99), (2, 0x20)]) == []
        assert j.live_entries()[0] == JournalEntry(1, 0x10, b"rec", ((0x10, "a:1"), (0x12, "c:1")))
    with Journal(tmp_path) as j:  # the copies done survive a restart
        assert j.recovered == [JournalEntry(1, 0x10, b"rec", ((0x10, "a:1"), (0x12, "c:1"))),
                               JournalEntry(2, 0x20, b"plain")]
        j.compact()  # and a compaction
    with Journal(tmp_path) as j:
        assert j.recovered[0].copies == ((0x10, "a:1"), (0x12, "c:1"))
        assert j.copy_done([(1, 0x10), (1, 0x12)]) == [1]  # the last one releases it
        assert live(j) == {2: (0x20, b"plain")}
    with Journal(tmp_path) as j:
        assert live(j) == {2: (0x20, b"plain")}
        with pytest.raises(ValueError, match="1..65535 copies"):
            j.append([(1, b"x", ())])


def test_broadcast_release_torn_off_after_last_copy(tmp_path):
    with Journal(tmp_path) as j:
        j.append([(0x10, b"rec", ((0x10, "a:1"),))])
        j.copy_done([(1, 0x10)])
        size = j.file_bytes
    path = tmp_path / "sender.journal"
    path.write_bytes(written(path, size)[:-RELEASE_ENTRY_SIZE])  # a crash between the two
    with Journal(tmp_path) as j:
        assert j.recovered == [] and j.problems == []
    with Journal(tmp_path) as j:
        assert j.recovered == []


def test_version_1_journal_is_read_and_rewritten(tmp_path):
    path = tmp_path / "sender.journal"
    path.write_bytes(b"RQPJ\x01\0\0\0" + (1).to_bytes(8, "big") + encode_append(1, 7, b"old")
                     + encode_append(2, 8, b"gone") + encode_release(2))
    with Journal(tmp_path) as j:
        assert recovered(j) == {1: (7, b"old")}
        assert j.problems == [] and len(j.notes) == 1 and "rewritten as version 2" in \
            j.notes[0]  # (an upgrade, no fault: a trial's was logged at ERROR)
        assert j.append([(9, b"new")]) == [3]
    assert path.read_bytes()[4] == 2
    with Journal(tmp_path) as j:
        assert recovered(j) == {1: (7, b"old"), 3: (9, b"new")} and j.problems == []


def test_new_journal_file(tmp_path):
    with Journal(tmp_path, "x") as j:
        assert j.recovered == [] and j.problems == []
        assert j.file_bytes == FILE_HEADER_SIZE and j.live_count == 0 and j.live_bytes == 0
    assert (tmp_path / "x.journal").read_bytes() == encode_header(1)
    assert not (tmp_path / "x.journal.tmp").exists()
    assert issubclass(JournalError, RQPError)


def test_file_is_exactly_the_entries(tmp_path):
    with Journal(tmp_path) as j:
        assert j.append([(7, b"rec1"), (8, b"")]) == [1, 2]
        j.release([1])
        size = j.file_bytes
    assert written(tmp_path / "sender.journal", size) == (
        encode_header(1) + encode_append(1, 7, b"rec1") + encode_append(2, 8, b"")
        + encode_release(1))


# --------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------


def test_append_release_reopen(tmp_path):
    with Journal(tmp_path) as j:
        seqs = j.append([(100, b"a"), (101, b"bb"), (102, b"ccc")])
        assert seqs == [1, 2, 3]
        j.release([2])
        j.release([2, 99])  # twice, and an unknown seq: both ignored
        assert j.live_count == 2
        assert j.append([(103, b"d")]) == [4]
    with Journal(tmp_path) as j:
        assert j.problems == []
        assert j.recovered == [JournalEntry(1, 100, b"a"), JournalEntry(3, 102, b"ccc"),
                               JournalEntry(4, 103, b"d")]
        assert j.append([(104, b"e")]) == [5]
        j.release([1, 3, 4, 5])
    with Journal(tmp_path) as j:
        assert j.recovered == []
        assert j.append([(105, b"f")]) == [6]  # released seqs are never given again


def test_live_bytes_and_counts(tmp_path):
    with Journal(tmp_path) as j:
        j.append([(1, b"x" * 10), (2, b"y" * 20)])
        assert j.live_bytes == 2 * (ENTRY_PREFIX_SIZE + APPEND_FIXED_SIZE) + 30
        j.release([1])
        assert j.live_bytes == ENTRY_PREFIX_SIZE + APPEND_FIXED_SIZE + 20
        assert j.live_count == 1
        assert j.file_bytes == FILE_HEADER_SIZE + 2 * 29 + 30 + RELEASE_ENTRY_SIZE


def test_bad_arguments(tmp_path):
    with Journal(tmp_path, fsync=False) as j:
        with pytest.raises(ValueError):
            j.append([(-1, b"")])
        with pytest.raises(ValueError):
            j.append([(1 << 64, b"")])
        with pytest.raises(TypeError):
            j.append([(1, "text")])
        assert j.append([]) == []
        assert j.file_bytes == FILE_HEADER_SIZE
    with pytest.raises(JournalError, match="closed"):
        j.append([(1, b"")])


def test_second_journal_on_same_file_is_refused(tmp_path):
    with Journal(tmp_path, "s"):
        with pytest.raises(JournalError, match="in use"):
            Journal(tmp_path, "s")
        Journal(tmp_path, "other").close()
    Journal(tmp_path, "s").close()


# --------------------------------------------------------------------------------------------
# Group commit
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fsyncs(monkeypatch):
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


def test_group_commit_one_fsync(tmp_path, fsyncs):
    j = Journal(tmp_path)
    fsyncs.clear()
    seqs = j.append([(k, b"r%d" % k) for k in range(100)])
    assert len(seqs) == 100 and len(fsyncs) == 1
    fsyncs.clear()
    j.release(seqs[:50])
    j.release(seqs[50:60])
    assert fsyncs == []
    j.flush()
    assert len(fsyncs) == 1
    j.flush(fsync=False)
    assert len(fsyncs) == 1
    j.close()


def test_fsync_false_never_fsyncs(tmp_path, fsyncs):
    with Journal(tmp_path, fsync=False) as j:
        j.append([(1, b"a")])
        j.release([1])
        j.compact()
    assert fsyncs == []


# --------------------------------------------------------------------------------------------
# Recovery: torn tails and corruption
# --------------------------------------------------------------------------------------------


def _three_entries(directory: Path) -> tuple[bytes, list[int]]:
    """A journal with APPEND 1, APPEND 2, RELEASE 1, APPEND 3; its bytes and entry offsets."""
    with Journal(directory, fsync=False) as j:
        j.append([(11, b"first")])
        j.append([(12, b"second!")])
        j.release([1])
        j.append([(13, b"3")])
        size = j.file_bytes
    data = written(directory / "sender.journal", size)
    offsets = [FILE_HEADER_SIZE]
    for size in (29 + 5, 29 + 7, RELEASE_ENTRY_SIZE, 29 + 1):
        offsets.append(offsets[-1] + size)
    assert offsets[-1] == len(data)
    return data, offsets


def _expected_live_at(cut: int, offsets: list[int]) -> dict[int, tuple[int, bytes]]:
    """The live set of the _three_entries journal cut at ``cut`` bytes."""
    complete = sum(1 for end in offsets[1:] if end <= cut)
    state = {}
    steps = [("a", 1, 11, b"first"), ("a", 2, 12, b"second!"), ("r", 1), ("a", 3, 13, b"3")]
    for step in steps[:complete]:
        if step[0] == "a":
            state[step[1]] = (step[2], step[3])
        else:
            state.pop(step[1])
    return state


@pytest.mark.parametrize("reserve", [0, 100], ids=["file-ends", "zeros-follow"])
def test_torn_tail_every_length(tmp_path, reserve):
    """A write torn by a crash: the file ends inside an entry, or (the journal reserves space
    ahead of its appends) zero bytes follow the part of it that reached the disk."""
    data, offsets = _three_entries(tmp_path / "orig")
    # Every cut inside the last entry, and inside the last two entries (the RELEASE and APPEND 3).
    for cut in range(offsets[-3], len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / "sender.journal").write_bytes(data[:cut] + bytes(reserve))
        good_end = max(o for o in offsets if o <= cut)
        torn = data[good_end:cut].rstrip(b"\0")  # (zero bytes of a torn entry: no data)
        with Journal(d, fsync=False) as j:
            assert recovered(j) == _expected_live_at(cut, offsets), cut
            if not torn:
                assert j.problems == []
            else:
                # (with zeros after it, a torn entry reads as a bad length or checksum)
                word = "torn tail" if reserve == 0 else "torn tail|absurd|checksum"
                assert len(j.problems) == 1 and re.search(word, j.problems[0]), j.problems
                assert f"offset {good_end}" in j.problems[0]
                saved = side_files(d, "discarded")
                assert len(saved) == 1 and saved[0].read_bytes() == torn
                assert (d / "sender.journal").stat().st_size == good_end  # cut
            assert j.file_bytes == good_end
            written(d / "sender.journal", good_end)
            # Appends after recovery follow valid data and survive another reopen.
            seq = j.append([(99, b"after")])[0]
            assert seq > 2
            expected = {**_expected_live_at(cut, offsets), seq: (99, b"after")}
        with Journal(d, fsync=False) as j:
            assert j.problems == []
            assert recovered(j) == expected


def test_data_after_zeros_in_the_reserved_space_is_damage(tmp_path):
    """Zeros where the next entry would start are the end only if nothing but zeros follows:
    bytes further on (a write whose first block did not reach the disk) are a damaged tail,
    cut and kept aside like any other."""
    data, offsets = _three_entries(tmp_path)
    junk = encode_append(5, 55, b"never acknowledged")
    (tmp_path / "sender.journal").write_bytes(data + bytes(5000) + junk + bytes(3000))
    with Journal(tmp_path) as j:
        assert recovered(j) == _expected_live_at(len(data), offsets)
        assert len(j.problems) == 1 and f"offset {len(data)}" in j.problems[0]
        assert f"the {5000 + len(junk)} bytes written" in j.problems[0]
        saved = side_files(tmp_path, "discarded")
        assert len(saved) == 1 and saved[0].read_bytes() == bytes(5000) + junk
        assert (tmp_path / "sender.journal").read_bytes() == data  # cut
        assert j.append([(14, b"new")]) == [4]


@pytest.mark.parametrize("damage", ["crc", "kind", "length", "record_length", "huge"])
def test_damaged_middle_entry(tmp_path, damage):
    data, offsets = _three_entries(tmp_path)
    middle = offsets[1]  # APPEND 2
    entry = bytearray(data[middle:offsets[2]])
    if damage == "crc":
        entry[-1] ^= 0x40  # a bit flip in the record
    elif damage == "kind":
        entry[8] = 7
        entry[4:8] = zlib.crc32(entry[8:]).to_bytes(4, "big")
    elif damage == "length":
        entry[0:4] = (3).to_bytes(4, "big")
    elif damage == "record_length":
        entry[25:29] = (99).to_bytes(4, "big")
        entry[4:8] = zlib.crc32(entry[8:]).to_bytes(4, "big")
    else:
        entry[0:4] = (MAX_ENTRY_LENGTH + 1).to_bytes(4, "big")
    damaged = data[:middle] + bytes(entry) + data[offsets[2]:]
    (tmp_path / "sender.journal").write_bytes(damaged)
    with Journal(tmp_path) as j:
        # Entries before the damaged one are kept; it and everything after it are discarded.
        assert j.recovered == [JournalEntry(1, 11, b"first")]
        assert len(j.problems) == 1 and f"offset {middle}" in j.problems[0]
        word = {"crc": "checksum", "kind": "unknown entry kind", "length": "absurd",
                "record_length": "record", "huge": "absurd"}[damage]
        assert word in j.problems[0]
        assert (tmp_path / "sender.journal").read_bytes() == data[:middle]
        saved = side_files(tmp_path, "discarded")
        assert len(saved) == 1 and saved[0].read_bytes() == damaged[middle:]
        assert j.append([(14, b"new")]) == [2]
    with Journal(tmp_path) as j:
        assert j.problems == []
        assert recovered(j) == {1: (11, b"first"), 2: (14, b"new")}


def test_duplicate_live_seq_refuses_to_open(tmp_path):
    data = encode_header(1) + encode_append(1, 5, b"a") + encode_append(1, 6, b"b")
    (tmp_path / "sender.journal").write_bytes(data)
    with pytest.raises(JournalError, match="seq 1 appended again"):
        Journal(tmp_path)
    assert (tmp_path / "sender.journal").read_bytes() == data
    with pytest.raises(JournalError, match="appended again"):  # not "in use": lock let go
        Journal(tmp_path)


def test_out_of_order_append_is_kept_and_reported(tmp_path):
    (tmp_path / "sender.journal").write_bytes(
        encode_header(1) + encode_append(5, 50, b"a") + encode_append(3, 30, b"b"))
    with Journal(tmp_path) as j:
        assert [e.seq for e in j.recovered] == [3, 5]
        assert len(j.problems) == 1 and "out of order" in j.problems[0]
        assert j.append([(1, b"")]) == [6]


# --------------------------------------------------------------------------------------------
# Bad header
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"RQP", b"garbage, not a journal at all",
                                     b"RQPJ\x01\x00\x00\x01" + bytes(8)])
def test_bad_header_moved_aside(tmp_path, content):
    (tmp_path / "sender.journal").write_bytes(content)
    with Journal(tmp_path) as j:
        assert j.recovered == []
        assert len(j.problems) == 1 and "moved aside" in j.problems[0]
        aside = side_files(tmp_path, "corrupt")
        assert len(aside) == 1 and aside[0].read_bytes() == content
        assert aside[0].name in j.problems[0]
        j.append([(1, b"x")])
    with Journal(tmp_path) as j:
        assert recovered(j) == {1: (1, b"x")} and j.problems == []
    (tmp_path / "sender.journal").write_bytes(content)
    Journal(tmp_path).close()
    assert len(side_files(tmp_path, "corrupt")) == 2  # a second one does not overwrite the first


def test_other_version_is_refused_untouched(tmp_path):
    content = b"RQPJ\x03\x00\x00\x00" + (1).to_bytes(8, "big") + b"future entries"
    (tmp_path / "sender.journal").write_bytes(content)
    with pytest.raises(JournalError, match="version 3"):
        Journal(tmp_path)
    assert (tmp_path / "sender.journal").read_bytes() == content
    assert list(tmp_path.glob("*corrupt*")) == []


# --------------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------------


def test_compaction(tmp_path):
    j = Journal(tmp_path, fsync=False, compact_min_bytes=10_000, compact_ratio=0.5)
    model = {}
    for batch in range(50):
        items = [(batch * 100 + i, os.urandom(40)) for i in range(20)]
        seqs = j.append(items)
        model.update(zip(seqs, items))
        done = [s for s in seqs if s % 7]
        j.release(done)
        for s in done:
            del model[s]
    last = j.next_seq - 1
    assert last not in model  # the largest seq was released: the high-water mark must keep it
    before = j.file_bytes
    assert j.live_bytes / before < 0.5
    assert j.maybe_compact() is True
    assert j.file_bytes < before / 3
    assert live(j) == model
    assert (tmp_path / "sender.journal").stat().st_size == j.file_bytes
    assert not (tmp_path / "sender.journal.tmp").exists()
    assert j.maybe_compact() is False  # mostly live now
    assert j.append([(1, b"z")]) == [last + 1]
    model[last + 1] = (1, b"z")
    j.close()
    with Journal(tmp_path, fsync=False) as j:
        assert j.problems == []
        assert recovered(j) == model
        assert j.next_seq == last + 2
        # All released, compact: an empty journal that still knows the next seq.
        j.release(list(model))
        j.compact()
        assert j.file_bytes == FILE_HEADER_SIZE
    with Journal(tmp_path, fsync=False) as j:
        assert j.recovered == [] and j.next_seq == last + 2


def test_compaction_keeps_seq_after_released_high(tmp_path):
    with Journal(tmp_path) as j:
        j.append([(1, b"keep"), (2, b"go"), (3, b"go")])
        j.release([2, 3])
        j.compact()
    assert (tmp_path / "sender.journal").read_bytes() == (
        encode_header(1) + encode_append(1, 1, b"keep") + encode_release(3))
    with Journal(tmp_path) as j:
        assert recovered(j) == {1: (1, b"keep")}
        assert j.append([(4, b"")]) == [4]


def test_maybe_compact_thresholds(tmp_path):
    with Journal(tmp_path, fsync=False, compact_min_bytes=1000, compact_ratio=0.5) as j:
        seqs = j.append([(i, b"x" * 10) for i in range(10)])  # 16 + 390 bytes: too small
        j.release(seqs)
        assert j.maybe_compact() is False
        seqs = j.append([(i, b"x" * 10) for i in range(30)])
        assert j.maybe_compact() is False  # big enough, but mostly live
        j.release(seqs[:25])
        assert j.maybe_compact() is True
        assert j.live_count == 5


def test_leftover_tmp_is_removed(tmp_path):
    with Journal(tmp_path) as j:
        j.append([(1, b"one"), (2, b"two")])
        j.release([1])
    original = (tmp_path / "sender.journal").read_bytes()
    # A half-written compaction, and then one that is a complete (but unrenamed) journal.
    for tmp_content in (encode_header(2) + encode_append(2, 2, b"tw"),
                        encode_header(5) + encode_append(5, 9, b"other")):
        (tmp_path / "sender.journal.tmp").write_bytes(tmp_content)
        with Journal(tmp_path) as j:
            assert recovered(j) == {2: (2, b"two")}
            assert len(j.problems) == 1 and "leftover temp file" in j.problems[0]
        assert not (tmp_path / "sender.journal.tmp").exists()
        assert (tmp_path / "sender.journal").read_bytes() == original
    # A leftover tmp and no journal: a new creation crashed before its rename.
    (tmp_path / "sender.journal").unlink()
    (tmp_path / "sender.journal.tmp").write_bytes(encode_header(1)[:5])
    with Journal(tmp_path) as j:
        assert j.recovered == [] and len(j.problems) == 1


def _compact_in_child(directory: Path, point: str) -> int:
    """Fork; the child opens the journal and compacts, dying with os._exit(17) at ``point``."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            j = Journal(directory)
            real_replace, real_fsync = os.replace, os.fsync

            def die():
                os._exit(17)

            if point == "before_rename":
                os.replace = lambda src, dst: die()
            elif point == "after_rename":
                def replace(src, dst):
                    real_replace(src, dst)
                    die()
                os.replace = replace
            elif point == "before_tmp_fsync":
                os.fsync = lambda fd: die()
            elif point == "before_dir_fsync":
                def fsync(fd):
                    if Path(f"/proc/self/fd/{fd}").resolve() == directory.resolve():
                        die()
                    real_fsync(fd)
                os.fsync = fsync
            j.compact()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("point", ["before_tmp_fsync", "before_rename", "after_rename",
                                   "before_dir_fsync", "completed"])
def test_kill_during_compaction(tmp_path, point):
    with Journal(tmp_path) as j:
        seqs = j.append([(i, b"m%03d" % i) for i in range(200)])
        j.release(seqs[::2] + [seqs[-1]])
        model = live(j)
        old_size = j.file_bytes
        next_seq = j.next_seq
    assert _compact_in_child(tmp_path, point) == (0 if point == "completed" else 17)
    with Journal(tmp_path) as j:
        assert recovered(j) == model
        assert j.next_seq == next_seq
        renamed = point in ("after_rename", "before_dir_fsync", "completed")
        assert (j.file_bytes < old_size) == renamed
        assert not (tmp_path / "sender.journal.tmp").exists()
        assert bool(j.problems) == (point in ("before_tmp_fsync", "before_rename"))
        assert j.append([(1, b"after")]) == [next_seq]


# --------------------------------------------------------------------------------------------
# Failures while running
# --------------------------------------------------------------------------------------------


def test_failed_write_is_undone(tmp_path, monkeypatch):
    j = Journal(tmp_path)
    j.append([(1, b"kept")])
    size = j.file_bytes
    real_pwrite = os.pwrite
    calls = []

    def short_then_enospc(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 1:  # the first write is short, the next one fails
            return real_pwrite(fd, bytes(data[:5]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", short_then_enospc)
    with pytest.raises(JournalError, match="No space"):
        j.append([(2, b"lost")])
    assert (tmp_path / "sender.journal").stat().st_size == size
    calls.clear()
    j.release([1])  # (no room for its RELEASE: released in memory, as one lost in a crash)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert j.file_bytes == size == (tmp_path / "sender.journal").stat().st_size
    assert live(j) == {} and j.failed is None
    assert j.append([(3, b"ok")]) == [2]
    j.close()
    with Journal(tmp_path) as j:  # the RELEASE not written: "kept" is sent again (its key)
        assert j.problems == [] and recovered(j) == {1: (1, b"kept"), 2: (3, b"ok")}


def test_failed_fsync_makes_journal_unusable(tmp_path, monkeypatch):
    j = Journal(tmp_path)

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(JournalError, match="fsync"):
        j.append([(1, b"x")])
    assert j.failed
    for op in (lambda: j.append([(2, b"")]), lambda: j.release([1]), j.compact, j.flush):
        with pytest.raises(JournalError, match="unusable"):
            op()
    j.close()
    monkeypatch.undo()
    with Journal(tmp_path) as j:  # reopening recovers what is on disk
        assert recovered(j) == {1: (1, b"x")}


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


def test_fsync_outside_lock_with_release_and_compaction(tmp_path, monkeypatch):
    """While append's fsync is blocked, releases and a compaction go on; the old descriptor
    stays open until that fsync is done."""
    j = Journal(tmp_path)
    first = j.append([(1, b"a"), (2, b"b")])
    in_fsync, go_on = threading.Event(), threading.Event()
    real_fsync = os.fsync
    blocked_fds = []

    def slow_fsync(fd):
        if threading.current_thread().name == "appender":
            blocked_fds.append(fd)
            in_fsync.set()
            assert go_on.wait(5)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    result = []
    t = threading.Thread(target=lambda: result.append(j.append([(3, b"c")])), name="appender")
    t.start()
    assert in_fsync.wait(5)
    j.release(first[:1])  # not held up by the fsync in progress
    j.compact()
    os.fstat(blocked_fds[0])  # the replaced file's descriptor is still open for that fsync
    go_on.set()
    t.join(5)
    assert result == [[3]]
    with pytest.raises(OSError):
        os.fstat(blocked_fds[0])  # closed by the last syncer
    assert live(j) == {2: (2, b"b"), 3: (3, b"c")}
    j.close()
    with Journal(tmp_path) as j:
        assert recovered(j) == {2: (2, b"b"), 3: (3, b"c")}


def test_append_and_release_from_two_threads(tmp_path):
    j = Journal(tmp_path, fsync=True, compact_min_bytes=20_000, compact_ratio=0.5)
    handed: queue.Queue = queue.Queue()
    kept = {}
    compactions = []
    errors = []

    def guarded(target):
        def run():
            try:
                target()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                handed.put(None)
        return run

    def appender():
        for batch in range(150):
            items = [(batch * 10 + i, b"%d-%d" % (batch, i) * 3) for i in range(10)]
            seqs = j.append(items)
            for seq, item in zip(seqs, items):
                handed.put((seq, item))
        handed.put(None)

    def releaser():
        while (got := handed.get()) is not None:
            seq, item = got
            if item[0] % 9 == 0:
                kept[seq] = item
            else:
                j.release([seq])
            compactions.append(j.maybe_compact())

    threads = [threading.Thread(target=guarded(appender)),
               threading.Thread(target=guarded(releaser))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert any(compactions)
    assert live(j) == kept and len(kept) == 167
    j.close()
    with Journal(tmp_path) as j:
        assert j.problems == [] and recovered(j) == kept
        assert j.next_seq == 1501


# --------------------------------------------------------------------------------------------
# Property: random operations against a model
# --------------------------------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(
            st.tuples(st.integers(0, 2**64 - 1), st.binary(max_size=40)), min_size=1, max_size=5)),
        st.tuples(st.just("release"), st.lists(st.integers(0, 30), max_size=4)),
        st.tuples(st.just("compact"), st.none()),
        st.tuples(st.just("reopen"), st.none()),
        st.tuples(st.just("torn_reopen"), st.integers(1, 60)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops)
def test_random_operations_match_model(ops):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model: dict[int, tuple[int, bytes]] = {}
        last_seq = 0
        j = Journal(directory, fsync=False)
        try:
            for op, arg in ops:
                if op == "append":
                    seqs = j.append(arg)
                    assert seqs == list(range(last_seq + 1, last_seq + 1 + len(arg)))
                    last_seq = seqs[-1]
                    model.update(zip(seqs, arg))
                elif op == "release":
                    live_seqs = sorted(model)
                    chosen = [live_seqs[i % len(live_seqs)] for i in arg] if live_seqs else []
                    chosen += [last_seq + 100]  # never appended: ignored
                    j.release(chosen)
                    for seq in chosen:
                        model.pop(seq, None)
                elif op == "compact":
                    j.compact()
                else:
                    end = j.file_bytes
                    j.close()
                    torn = encode_append(last_seq + 1, 1, b"never acknowledged" * 3)[:arg]
                    if op == "torn_reopen":  # a crash in the middle of an unfinished append
                        with open(directory / "sender.journal", "r+b") as f:
                            f.seek(end)  # (into the space reserved after the entries)
                            f.write(torn)
                    j = Journal(directory, fsync=False)
                    assert recovered(j) == model
                    # (the first bytes of a torn entry may be zeros: the length's high bytes)
                    assert bool(j.problems) == (op == "torn_reopen" and any(torn))
                    assert j.next_seq == last_seq + 1
                assert live(j) == model
        finally:
            j.close()


@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.binary(max_size=200))
def test_the_struct_append_and_the_construct_declaration_agree(seq, key, record):
    """Issue 14: the hot path's APPEND (structs derived from ENTRY_PREFIX and APPEND_FIXED) is
    byte for byte what the construct declarations build."""
    from rqp.storage.journal import APPEND_BODY, ENTRY_PREFIX
    body = APPEND_BODY.build({"seq": seq, "key": key, "record": record})
    assert encode_append(seq, key, record) == \
        ENTRY_PREFIX.build({"length": len(body), "crc": zlib.crc32(body)}) + body


@given(st.integers(0, (1 << 64) - 1))
def test_the_struct_release_and_the_construct_declaration_agree(seq):
    from rqp.storage.journal import ENTRY_PREFIX, RELEASE_BODY
    body = RELEASE_BODY.build({"seq": seq})
    assert encode_release(seq) == \
        ENTRY_PREFIX.build({"length": len(body), "crc": zlib.crc32(body)}) + body


FULL_OF_RELEASED = r"""
import json, resource, sys
from rqp.storage.journal import Journal, JournalError
j = Journal(sys.argv[1])
for i in range(40):  # delivered and released: dead bytes, far below compact_min_bytes
    [seq] = j.append([(i + 1, bytes(8000))])
    j.release([seq])
live = j.append([(99, b"still to send")])
size = j.file_bytes  # (the written end: space is allocated ahead of it)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1000, resource.RLIM_INFINITY))
try:  # (EFBIG past the limit, as ENOSPC on a full disk; Python ignores SIGXFSZ)
    j.append([(100, bytes(8000))])
    print(json.dumps({"ok": True, "size": j.file_bytes, "before": size,
                      "live": sorted(e.key for e in j.live_entries())}))
except JournalError as exc:
    print(json.dumps({"ok": False, "error": str(exc)}))
"""


def test_a_full_disk_of_released_entries_is_compacted_and_the_append_goes_on(tmp_path):
    """A trial: a sending MCA whose small state_dir filled with its own delivered entries
    (below compact_min_bytes: never compacted) stopped with 'cannot journal SURE records' at
    every start. Now an append that finds no room compacts the journal and writes again."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FULL_OF_RELEASED, str(tmp_path)], check=True,
                         capture_output=True, text=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["ok"], got
    assert got["size"] < got["before"] and got["live"] == [99, 100]
    assert "compacting it" in out.stderr and "File too large" in out.stderr


def test_a_file_that_cannot_be_written_is_named_in_the_error(tmp_path):
    """A trial: a sending MCA started on a full disk said only 'cannot start: [Errno 28] No
    space left on device' (a failed write names no file)."""
    import subprocess
    import sys

    code = ("import resource, sys\nfrom rqp.system.files import write_file_atomically\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (10, resource.RLIM_INFINITY))\n"
            "try:\n    write_file_atomically(sys.argv[1], bytes(100))\n"
            "except OSError as exc:\n    print(exc)\n")
    target = tmp_path / "sender-52510000.pid"
    out = subprocess.run([sys.executable, "-c", code, str(target)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out == f"[Errno 27] File too large: '{target}'\n"
    assert list(tmp_path.iterdir()) == []  # (its temporary file removed)


ON_A_SMALL_DISK = r"""
import os, sys
from rqp.storage.journal import Journal
disk = sys.argv[1]
j = Journal(disk)
for i in range(300):  # 2.4 MB through a 256 KiB file system, each released once delivered
    [seq] = j.append([(i + 1, bytes(8000))])
    j.release([seq])
    st = os.statvfs(disk)
    if st.f_bavail * st.f_frsize < 16384:  # the last pages taken by other files (a trial:
        fd = os.open(os.path.join(disk, "other"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:  # (its pid file): none left
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass
        os.close(fd)
print(j.file_bytes)
"""


def test_a_small_disk_full_of_released_entries_frees_itself(tmp_path):
    """A trial: a sending MCA on a 2 MiB state_dir filled it with its own delivered entries,
    and then had no room even for a compaction's new file: it stopped at every start. With
    nothing live, the journal is now cut back in place. A real tmpfs of 256 KiB, mounted in a
    private mount namespace (gone with the process)."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         'mount -t tmpfs -o size=256k rqp-test "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(disk), sys.executable, ON_A_SMALL_DISK],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) < 256 << 10
    # (cut back before the disk is full now, as a journal on a small disk compacts early; or
    # when a write finds it full)
    assert "cannot compact" not in out.stderr, out.stderr


def _on_a_tmpfs(tmp_path, code: str, size: str = "256k"):
    """Run ``code`` (its argv[1]: the mount point) on a real tmpfs of ``size``, mounted in a
    private mount namespace (gone with the process)."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         f'mount -t tmpfs -o size={size} rqp-test "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(disk), sys.executable, code],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


FILL = r"""
def fill(path, leave=0):
    st = os.statvfs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
"""

RESERVE_ON_A_FULL_DISK = r"""
import json, os, sys
from rqp.system.files import SpaceReserve
""" + FILL + r"""
disk = sys.argv[1]
r = SpaceReserve(os.path.join(disk, "a.reserve"), 64 << 10)
said = [r.make(), r.missing, os.path.getsize(r.path)]
fill(os.path.join(disk, "other"))
said += [r.make(), r.missing, r.free(), r.free()]  # there: still made; then freed, once
fill(os.path.join(disk, "more"), leave=16 << 10)
said += [r.make(), r.missing, sorted(os.listdir(disk))]  # no room: not made, nothing left
os.unlink(os.path.join(disk, "other"))
os.unlink(os.path.join(disk, "more"))
open(r.tmp_path, "wb").write(b"left by a kill")
said += [r.free(), sorted(os.listdir(disk)), r.make(), r.missing, os.path.getsize(r.path)]
print(json.dumps(said))
"""


def test_the_start_reserve_is_made_only_where_there_is_room(tmp_path):
    """The sending MCA's start reserve (rqp.system.files.SpaceReserve) on a real, full
    tmpfs: not made, saying why, leaving nothing behind; a temporary file a kill left is
    removed by the next free."""
    import json

    said = json.loads(_on_a_tmpfs(tmp_path, RESERVE_ON_A_FULL_DISK).stdout)
    assert said == [True, None, 65536,
                    True, None, True, False,
                    False, "No space left on device", ["more", "other"],
                    False, [], True, None, 65536]


JOURNAL_ON_A_FULL_DISK = r"""
import json, logging, resource, sys
from rqp.storage.journal import Journal
logging.basicConfig(level=logging.WARNING)
j = Journal(sys.argv[1])
[a] = j.append([(1, bytes(20000), ((1, "h1:7460"), (2, "h2:7460")))])
[b] = j.append([(3, bytes(20000))])
# no byte more: EFBIG past the limit, as ENOSPC on a full disk (Python ignores SIGXFSZ)
resource.setrlimit(resource.RLIMIT_FSIZE, (j.file_bytes, resource.RLIM_INFINITY))
said = [j.copy_done([(a, 1)]), j.copy_done([(a, 2)])]  # no room: kept in memory
j.release([b])
said.append(j.live_count)
before = j.file_bytes
said += [j.cut_back_if_empty(), j.file_bytes < before, j.cut_back_if_empty()]
j.close()
said.append([e.seq for e in Journal(sys.argv[1]).recovered])
print(json.dumps(said))
"""


def test_copies_done_on_a_full_disk_are_kept_in_memory_and_the_journal_cut_back(tmp_path):
    """Trial 10's left-over: a broadcast copy confirmed while the disk was full raised out of
    copy_done (a RELEASE is kept in memory then, as one lost in a crash). Now COPY_DONE is
    too; with nothing live the journal is cut back in place, freeing its room."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", JOURNAL_ON_A_FULL_DISK, str(tmp_path)],
                         check=True, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == [[], [1], 0, True, True, False, []]
    assert "1 COPY_DONE/RELEASE entries not written (File too large)" in out.stderr
    assert "2 COPY_DONE/RELEASE entries not written (File too large)" in out.stderr


NO_ROOM_TO_COMPACT = r"""
import json, logging, resource, sys
from rqp.storage.journal import Journal
logging.basicConfig(level=logging.WARNING)
j = Journal(sys.argv[1], compact_min_bytes=4096)
seqs = j.append([(i + 1, bytes(2000)) for i in range(10)])
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))  # (EFBIG: no room)
j.release(seqs[:8])  # (not written: kept in memory) -- a fifth live: worth a compaction
said = [j.maybe_compact(), j.maybe_compact(), j.live_count, j.failed]
print(json.dumps(said))
"""


def test_a_compaction_that_finds_no_room_is_not_an_error(tmp_path):
    """A sending MCA releases entries and compacts its journal after a batch is delivered; on
    a disk too full for the compacted copy that raised out of the release (the agent would
    stop). Now it is a warning, and the next try waits COMPACT_AGAIN seconds."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_ROOM_TO_COMPACT, str(tmp_path)],
                         check=True, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == [False, False, 2, None]
    assert out.stderr.count("no room to compact it (File too large;") == 1, out.stderr


TORN_ON_A_FULL_DISK = r"""
import json, os, sys
from rqp.storage.journal import Journal
""" + FILL + r"""
disk, zeros = sys.argv[1], sys.argv[2] == "zeros"
j = Journal(disk)
j.append([(1, b"x" * 30000)])  # (not zeros: the written end is the last byte not zero)
first = j.file_bytes
j.append([(2, b"x" * 30000)])
end = j.file_bytes
j.close()
path = os.path.join(disk, "sender.journal")
with open(path, "r+b") as f:  # the last entry damaged: cut short, or its last byte changed
    f.truncate(end - 2) if not zeros else (f.seek(end - 1), f.write(b"\xff"))
said = [end - first, os.path.getsize(path) > end]  # (room allocated ahead: zeros)
fill(os.path.join(disk, "other"))
try:
    j = Journal(disk)
except OSError as exc:
    said.append(str(exc))
    os.unlink(os.path.join(disk, "other"))  # room made
    j = Journal(disk)
said.append([e.key for e in j.recovered])
said.append(sorted(os.path.getsize(os.path.join(disk, n)) for n in os.listdir(disk)
                   if ".discarded-" in n))
print(json.dumps(said))
"""


@pytest.mark.parametrize("disk", ["256k", "4m"])
def test_a_damaged_tail_on_a_full_disk_is_saved_or_the_open_says_what_room_it_needs(
        tmp_path, disk):
    """Trial 11: a journal whose last entry a kill tore, on a full disk, could not be opened
    (its damaged bytes are saved to a side file before they are cut off), and each try left a
    part of that copy, taking the room made for the next. Now the room allocated ahead of the
    appends is given back first (on the 4 MiB disk: then the copy fits), and where it still
    does not fit the error says what room it needs and leaves nothing behind."""
    import json

    zeros = "zeros" if disk == "4m" else "cut"
    said = json.loads(_on_a_tmpfs(tmp_path, TORN_ON_A_FULL_DISK.replace(
        'sys.argv[2] == "zeros"', f"{zeros == 'zeros'}"), size=disk).stdout)
    entry = said.pop(0)
    if disk == "4m":
        assert said == [True, [1], [entry]]  # opened at once, the copy saved
    else:
        assert said[0] is False and said[2:] == [[1], [entry - 2]]
        assert said[1].startswith(f"[Errno 28] cannot save the {entry - 2} damaged bytes of ") \
            and "(No space left on device): make room for them: '" in said[1], said[1]


SMALL_DISK_WITH_ONE_WAITING = r"""
import json, logging, os, sys
from rqp.storage.journal import Journal
logging.basicConfig(level=logging.WARNING)
disk = sys.argv[1]
j = Journal(disk)
j.append([(1, b"w" * 8000)])  # a message whose route is down: live all along
most = 0
for i in range(400):  # 3.2 MB delivered through a 2 MiB disk, as the sending MCA does
    [seq] = j.append([(i + 2, b"d" * 8000)])
    j.release([seq])
    j.maybe_compact()
    most = max(most, j.file_bytes)
print(json.dumps([j.live_count, most < 1536 << 10]))
"""


def test_a_journal_on_a_small_disk_compacts_while_it_has_room_for_the_copy(tmp_path):
    """Trial 12: a journal on a 2 MiB disk grew to 2 MB of delivered entries (compaction
    starts at 32 MiB, or when a write finds the disk full); once full it could not be
    compacted (no room for the copy of the few messages whose route was down) and took no
    SURE record. Now, on a disk with less free room than its size, it compacts from 256 KiB
    of delivered entries."""
    import json

    out = _on_a_tmpfs(tmp_path, SMALL_DISK_WITH_ONE_WAITING, size="2m")
    assert json.loads(out.stdout) == [1, True], out.stderr
    assert "compact" not in out.stderr  # (never at the last moment)


TRICKLES_THEN_A_ROUTE_DOWN = r"""
import json, logging, os, sys
from rqp.storage.journal import Journal, JournalError
logging.basicConfig(level=logging.WARNING)
disk = sys.argv[1]
j = Journal(disk)
key, before = 0, []
for _ in range(10):  # trickles of 20, each delivered while the next is sent
    seqs = []
    for _ in range(20):
        key += 1
        seqs += j.append([(key, b"d" * 8000)])
    j.release(before)
    j.maybe_compact()
    before = seqs
first_ahead = os.path.getsize(os.path.join(disk, "sender.journal")) - j.file_bytes
taken = 0
try:  # the route is down: nothing released any more
    for _ in range(200):
        key += 1
        j.append([(key, b"w" * 8000)])
        taken += 1
except JournalError as exc:
    pass
print(json.dumps([taken, first_ahead <= 1 << 19]))
"""


def test_a_route_down_on_a_small_disk_finds_the_delivered_entries_compacted(tmp_path):
    """Trial 13: on a 2 MiB disk, trickles of messages left 746 KB of delivered entries in the
    journal (compacted only at a release, and 1 MiB of zeros allocated ahead of the appends
    hid how little room was left); a route then went down, nothing was released, and the
    journal took 156 messages of 8 KB and then none (no room to compact). Now the zeros ahead
    are at most a quarter of the free room, and a journal on a disk getting full compacts
    before an append too: it takes as many as the disk holds beside the live ones."""
    import json

    taken, small_ahead = json.loads(_on_a_tmpfs(tmp_path, TRICKLES_THEN_A_ROUTE_DOWN,
                                                size="2m").stdout)
    assert small_ahead
    # (2 MiB hold 260 entries of 8,040 bytes; 20 are live from the last trickle)
    assert taken == 200, taken


DELIVERED_THEN_DOWN = r"""
import json, logging, sys
from rqp.storage.journal import Journal, JournalError
logging.basicConfig(level=logging.WARNING)
disk, delivered = sys.argv[1], int(sys.argv[2])
j = Journal(disk)
key, taken = 0, {}
for _ in range(delivered):  # before the outage: delivered and released
    key += 1
    j.release(j.append([(key, b"d" * 8000)]))
    j.maybe_compact()
for name, backlog, flowing in (("down", 10 ** 6, 0), ("beside", 70, 2000)):
    if name == "beside":  # a fresh disk: one route down (a backlog), another flowing
        j.close()
        for f in __import__("os").listdir(disk):
            __import__("os").unlink(__import__("os").path.join(disk, f))
        j = Journal(disk)
    n = 0
    try:
        for i in range(backlog):
            key += 1
            j.append([(key, b"w" * 8000)])
            n += 1
        for i in range(flowing):
            key += 1
            j.release(j.append([(key, b"f" * 8000)]))
            j.maybe_compact()
            n += 1
    except JournalError:
        pass
    taken[name] = n
print(json.dumps(taken))
"""


@pytest.mark.parametrize("delivered", [20, 40, 60])
def test_delivered_entries_do_not_shorten_an_outage_on_a_small_disk(tmp_path, delivered):
    """Trial 14: on a 2 MiB disk, delivered entries left from before a route went down were
    not compacted while more than half of the journal was live (the 0.5 ratio), and by then
    the copy did not fit: 196-209 messages of 8 KB journaled instead of 261. And a backlog of
    70 messages for a route down (27 % of the disk) stopped another queue's flow after 190.
    Now a journal on a small disk compacts whatever part of it is live, while the copy
    fits."""
    import json

    out = _on_a_tmpfs(tmp_path, DELIVERED_THEN_DOWN.replace(
        "int(sys.argv[2])", str(delivered)), size="2m")
    taken = json.loads(out.stdout)
    assert taken["down"] >= 255, (taken, out.stderr[-1500:])  # (2 MiB: 261 entries of 8,040)
    assert taken["beside"] == 70 + 2000, (taken, out.stderr[-1500:])
