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
    f = LogFile(tmp_path / "x.log", reserve=100)
    f.create(b"HEAD")
    assert f.path.stat().st_size == f.allocated == 4  # (a new file is exact until appended to)
    f.append(b"a" * 10)
    assert f.path.stat().st_size == f.allocated == 4 + 10 + 100
    assert f.path.stat().st_blocks > 0
    sizes = set()
    for _ in range(9):
        f.append(b"b" * 10)
        sizes.add(f.path.stat().st_size)
    assert sizes == {114} and f.size == 104  # all inside the first reserve
    f.append(b"c" * 20)
    assert f.size == 124 and f.allocated == f.path.stat().st_size == 224
    data = f.path.read_bytes()
    assert written_end(data, 0) == 124 and written_end(data, 124) == 124
    assert written(f.path, 124) == b"HEAD" + b"a" * 10 + b"b" * 90 + b"c" * 20
    f.close()
    g = LogFile(f.path)
    assert g.open() == data and g.allocated == 224 and g.size == 0  # (the user says where)
    g.close()


def test_without_space_for_a_reserve_an_append_grows_the_file(log, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    log.append(b"one")
    log.append(b"two")
    assert log.path.read_bytes() == b"HEADonetwo" and log.size == log.allocated == 10
    monkeypatch.undo()
    log.append(b"!")
    assert log.allocated == 11 + RESERVE and written(log.path, 11) == b"HEADonetwo!"


def test_a_cut_saves_the_written_bytes_not_the_reserve(tmp_path):
    f = LogFile(tmp_path / "x.log", reserve=1000)
    f.create(b"HEAD")
    f.append(b"goodbad!")
    side = f.cut(8, keep_copy="discarded")
    assert side.read_bytes() == b"bad!" and f.path.read_bytes() == b"HEADgood"
    assert f.size == f.allocated == 8
    f.close()
