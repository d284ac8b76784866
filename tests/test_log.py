"""The log store both the journal and the dedup window keep their files in
(rqp.storage.log.LogFile): the operations their own tests exercise through them, directly."""

from __future__ import annotations

import errno
import os

import pytest

from rqp.storage.log import RESERVE, LogFile, ReplaceFailed, written_end
from tests.logfiles import written


@pytest.fixture
def log(tmp_path):
    f = LogFile(tmp_path / "x.log")
    f.create(b"HEAD")
    yield f
    f.close()


def test_append_goes_at_the_end_of_the_good_data(log):
    log.append(b"one")
    log.size = 4  # the user found "one" damaged: the next append overwrites it
    log.append(b"two")
    log.sync()
    assert written(log.path, 7) == b"HEADtwo" and log.size == 7


def test_a_failed_append_is_cut_back(log, monkeypatch):
    log.append(b"one")

    def short_then_enospc(fd, data, offset):
        if len(data) > 2:
            return real(fd, bytes(data[:2]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", short_then_enospc)
    with pytest.raises(OSError, match="No space"):
        log.append(b"three")
    monkeypatch.undo()
    assert log.path.read_bytes() == b"HEADone" and log.size == log.allocated == 7
    log.append(b"two")  # reserves again
    assert written(log.path, 10) == b"HEADonetwo" and log.allocated > 10


def test_replace_says_whether_the_new_file_is_in_place(log, monkeypatch):

    def rename_fails(src, dst):
        raise OSError(errno.EIO, "EIO")
    monkeypatch.setattr(os, "replace", rename_fails)
    with pytest.raises(ReplaceFailed) as failed:
        log.replace(b"NEW")
    assert not failed.value.replaced and log.path.read_bytes() == b"HEAD"
    assert not log.tmp_path.exists()
    monkeypatch.undo()

    def dir_fsync_fails(self):
        raise OSError(errno.EIO, "EIO")
    monkeypatch.setattr(LogFile, "fsync_dir", dir_fsync_fails)
    with pytest.raises(ReplaceFailed) as failed:
        log.replace(b"NEW")
    assert failed.value.replaced and log.path.read_bytes() == b"NEW" and log.size == 3


def test_leftovers_are_removed_and_reported(tmp_path):
    f = LogFile(tmp_path / "x.log")
    f.tmp_path.write_bytes(b"half")
    (tmp_path / ".x.log.abc123.tmp").write_bytes(b"old style")
    (tmp_path / ".y.log.abc123.tmp").write_bytes(b"not ours")
    problems = f.remove_leftovers()
    assert len(problems) == 2 and all("leftover temp file" in p for p in problems)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".y.log.abc123.tmp"]


def test_cut_keeps_a_copy_and_move_aside_never_overwrites(log):
    log.append(b"good" + b"bad!")
    side = log.cut(8, keep_copy="discarded")
    assert side.read_bytes() == b"bad!" and log.path.read_bytes() == b"HEADgood"
    first = log.move_aside("corrupt")
    log.create(b"HEAD")
    second = log.move_aside("corrupt")
    assert first != second and first.exists() and second.exists()


def test_appends_go_into_space_reserved_ahead(tmp_path):
    """The file grows a reserve at a time (so that a sync has no new size to commit), and the
    bytes after the good data are zeros, which a reader takes for the end (written_end)."""
    reserve = 64 << 10
    f = LogFile(tmp_path / "x.log", reserve=reserve)
    f.create(b"HEAD")
    assert f.path.stat().st_size == f.allocated == 4  # (a new file is exact until appended to)
    f.append(b"a" * 10)
    st = f.path.stat()
    assert st.st_size == f.allocated == 4 + 10 + reserve
    assert st.st_blocks * 512 >= st.st_size  # allocated, not a sparse file
    sizes = set()
    for _ in range(9):
        f.append(b"b" * 10)
        sizes.add(f.path.stat().st_size)
    assert sizes == {14 + reserve} and f.size == 104  # all inside the first reserve
    f.append(b"c" * reserve)
    assert f.size == 104 + reserve
    assert f.allocated == f.path.stat().st_size == 104 + 2 * reserve
    data = f.path.read_bytes()
    assert written_end(data, 0) == f.size and written_end(data, f.size) == f.size
    assert written(f.path, f.size) == b"HEAD" + b"a" * 10 + b"b" * 90 + b"c" * reserve
    f.close()
    g = LogFile(f.path)
    assert g.open() == data and g.allocated == len(data) and g.size == 0  # (the user says)
    g.close()


def test_without_space_for_a_reserve_an_append_grows_the_file(log, monkeypatch):
    """A reserve that fails part-way is given back (ext4 keeps the blocks it got before it
    ran out: on a nearly full disk, all that is left), and none is tried again for the next
    RESERVE bytes."""
    real = os.posix_fallocate
    tries = []

    def runs_out_half_way(fd, offset, length):
        tries.append(length)
        real(fd, offset, length // 2)  # what the file system got before it ran out
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", runs_out_half_way)
    log.append(b"one")
    log.append(b"two")
    assert log.path.read_bytes() == b"HEADonetwo" and log.size == log.allocated == 10
    assert len(tries) == 1 and log.path.stat().st_blocks * 512 < RESERVE // 2
    monkeypatch.undo()
    log.append(b"!")  # space again, but the next try is a reserve later
    assert log.allocated == 11 and log.path.read_bytes() == b"HEADonetwo!"
    log.append(b"x" * RESERVE)
    assert log.allocated == 11 + 2 * RESERVE and log.size == 11 + RESERVE
    assert written(log.path, 11 + RESERVE) == b"HEADonetwo!" + b"x" * RESERVE
    monkeypatch.setattr(os, "posix_fallocate", runs_out_half_way)
    log.append(b"y" * (RESERVE + 1))  # past the reserve: fails again ...
    assert log.allocated == log.size == 12 + 2 * RESERVE and len(tries) == 2
    monkeypatch.undo()
    log.replace(b"HEAD")  # ... but a new file (a compaction) tries again at once
    log.append(b"z")
    assert log.allocated == 5 + RESERVE and written(log.path, 5) == b"HEADz"


def test_a_cut_saves_the_written_bytes_not_the_reserve(tmp_path):
    f = LogFile(tmp_path / "x.log", reserve=1000)
    f.create(b"HEAD")
    f.append(b"goodbad!")
    side = f.cut(8, keep_copy="discarded")
    assert side.read_bytes() == b"bad!" and f.path.read_bytes() == b"HEADgood"
    assert f.size == f.allocated == 8
    f.close()


def test_the_zeros_ahead_can_be_given_back(tmp_path):
    """A journal on a disk getting full gives back the zeros allocated ahead of its appends
    before it compacts (trial 16: their room was the copy's); the good data stays."""
    f = LogFile(tmp_path / "x.log", reserve=64 << 10)
    f.create(b"HEAD")
    f.append(b"a" * 10)
    assert f.path.stat().st_size == f.allocated == 14 + (64 << 10)
    f.give_back_zeros()
    assert f.path.stat().st_size == f.allocated == f.size == 14
    f.give_back_zeros()  # (none left: nothing to do)
    f.append(b"b" * 10)  # appends go on, reserving ahead again
    assert written(f.path, f.size) == b"HEAD" + b"a" * 10 + b"b" * 10
    assert f.allocated == 24 + (64 << 10)
    f.close()
