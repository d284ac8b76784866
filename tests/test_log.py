"""The log store both the journal and the dedup window keep their files in
(rqp.storage.log.LogFile): the operations their own tests exercise through them, directly."""

from __future__ import annotations

import errno
import os

import pytest

from rqp.storage.log import LogFile, ReplaceFailed


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
    assert log.path.read_bytes() == b"HEADtwo" and log.size == 7


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
    assert log.path.read_bytes() == b"HEADone" and log.size == 7


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
