"""The one append-only log store of the agents: a file of a header and CRC-checked entries.

Two users keep their state in one: the sending MCA's journal of SURE messages
(:mod:`rqp.storage.journal`) and the receiving MCA's de-duplication window
(:mod:`rqp.storage.dedup`). Each declares its own header and entries (with construct) and
decides what is live; :class:`LogFile` does what both need of the file, the same way:

* **append** at the end of the good data only (``pwrite`` at an offset, so a retry after a
  short or failed write overwrites its bytes; a failed write is cut back);
* **group commit**: a batch of entries is one write and one ``fsync``; a failed ``fsync``
  leaves the outcome unknown, so the user stops writing until the file is replaced;
* **space reserved ahead** (``fallocate``, :data:`RESERVE` bytes at a time, at most a quarter
  of the disk's free room: a trial's 2 MiB disk had half of it taken by zeros ahead of the
  journal, and no room left to compact it): an append lands
  in space the file already has and counts in its size, so the file's size changes once a
  reserve, not once a batch, and the ``fsync`` of a batch has no new size to commit: on ext4
  here a small append and ``fsync`` took ~135 µs into reserved space against ~200 µs when each
  append grew the file (``fdatasync`` instead of ``fsync`` made no difference then). The file
  therefore ends in zero bytes after the good data; a reader that finds only zero bytes where
  the next entry would start has reached the end (:func:`written_end`): an entry of either user
  is never all zero bytes (a journal entry's length is at least 9, a window entry's crc32 of
  zeros is not zero);
* **recovery**: the user replays the bytes and says where the good entries end; a damaged
  tail is cut there (:meth:`LogFile.cut`), optionally after saving a copy beside the file;
  a file that is not the user's at all is moved aside, never overwritten;
* **compaction** by atomic replacement (:meth:`LogFile.replace`): the live entries are written
  to ``<file>.tmp``, fsynced, renamed over the file, and the directory fsynced. A crash at any
  point leaves the old file or the new one, never a mix; a leftover temp file is removed (and
  reported) at the next open.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

__all__ = ["LogFile", "RESERVE", "RESERVE_LEAST", "ReplaceFailed", "pwrite_all", "read_all",
           "written_end"]

#: Bytes of file allocated ahead of the appends at a time (see the module docstring), at most
#: a quarter of the disk's free room, and none if that is less than RESERVE_LEAST.
RESERVE = 1 << 20
RESERVE_LEAST = 64 << 10


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def read_all(fd: int) -> bytes:
    """The whole file behind ``fd``, read from offset 0."""
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 24, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def written_end(data: bytes, offset: int) -> int:
    """Where the written bytes of ``data`` (a whole file) end: after its last non-zero byte,
    and not before ``offset`` (the end of the good entries). ``written_end(data, offset) ==
    offset`` means that everything after the good entries is reserved space, not damage.
    Only the bytes after ``offset`` are looked at (and copied): not the whole file again."""
    return offset + len(data[offset:].rstrip(b"\0"))


def _utc_stamp() -> str:
    ns = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


class ReplaceFailed(OSError):
    """:meth:`LogFile.replace` failed; ``replaced`` says whether the new file is in place
    already (the rename happened and the directory fsync failed: whether the rename survives
    a crash is unknown)."""

    def __init__(self, cause: OSError, replaced: bool):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.cause = cause
        self.replaced = replaced


class LogFile:
    """The file at ``path``: its descriptor, where the good data ends (:attr:`size`) and the
    operations above. Not thread-safe: the user holds its own lock around the calls."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True,
                 reserve: int = RESERVE) -> None:
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.fsync_enabled = fsync
        self.reserve = reserve
        self.fd = -1
        self.size = 0       # where the good data ends: the next append goes here
        self.allocated = 0  # the file's length (its size on disk): zero bytes after ``size``
        self._retry_reserve = 0  # after a failed reserve, none again before this offset

    # --- opening -------------------------------------------------------------------------------

    def remove_leftovers(self) -> list[str]:
        """Remove the temp file of a compaction or creation that did not finish (also those
        of earlier versions, ``.<name>.<random>.tmp``); what was removed, in words."""
        problems = []
        legacy = sorted(self.path.parent.glob(f".{self.path.name}.*.tmp")) \
            if self.path.parent.is_dir() else []
        for tmp in (self.tmp_path, *legacy):
            try:
                size = tmp.lstat().st_size
                tmp.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                problems.append(f"{tmp}: cannot remove a leftover temp file: {exc}")
                continue
            problems.append(f"leftover temp file {tmp} ({size} bytes) from an unfinished "
                            f"compaction or creation removed; it is never used")
        if problems:
            self.fsync_dir()
        return problems

    def open(self) -> bytes | None:
        """Open the existing file for appending and return all its bytes, or None if there is
        none. :attr:`size` is left at 0: the user sets it to where its good entries end, and
        cuts the file there (:meth:`cut`) if anything but zero bytes follows
        (:func:`written_end`)."""
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            data = read_all(self.fd)
        except BaseException:
            self.close()
            raise
        self.allocated = len(data)
        return data

    def create(self, data: bytes) -> None:
        """A new file holding ``data`` (a header, maybe entries), atomically."""
        self.replace(data)

    def move_aside(self, what: str) -> Path:
        """Rename the file (not the user's, or unreadable) to ``<file>.<what>-<UTC time>``,
        never over an existing one; the descriptor is closed."""
        self.close()
        aside = self._unused(f"{self.path.name}.{what}-{_utc_stamp()}")
        os.rename(self.path, aside)
        return aside

    def cut(self, offset: int, *, keep_copy: str | None = None) -> Path | None:
        """Cut the file at ``offset`` (a damaged tail), durably. With ``keep_copy``, the bytes
        cut off (up to the last written one: not the reserved space after it) are first saved
        to ``<file>.<keep_copy>-<UTC time>``; its path is returned."""
        side = None
        if keep_copy is not None:
            data = read_all(self.fd)
            written = written_end(data, offset)
            tail = data[offset:written]
            self.give_back_zeros(written)  # (their room first: the copy may need it)
            side = self._unused(f"{self.path.name}.{keep_copy}-{_utc_stamp()}")
            fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                try:
                    pwrite_all(fd, tail, 0)
                    if self.fsync_enabled:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException as exc:
                # A part of a copy (a full disk) would take the room a retry needs (a trial:
                # each start on a full disk left one more, and never started).
                with contextlib.suppress(OSError):
                    os.unlink(side)
                if isinstance(exc, OSError):
                    raise OSError(exc.errno, f"cannot save the {len(tail)} damaged bytes of "
                                  f"{self.path} from offset {offset} before cutting them off "
                                  f"({exc.strerror}): make room for them", str(side)) from exc
                raise
            self.fsync_dir()
        os.ftruncate(self.fd, offset)
        if self.fsync_enabled:
            os.fsync(self.fd)
        self.size = self.allocated = offset
        return side

    def _unused(self, name: str) -> Path:
        candidate, n = self.path.with_name(name), 1
        while candidate.exists() or candidate.is_symlink():
            n += 1
            candidate = self.path.with_name(f"{name}-{n}")
        return candidate

    # --- writing -------------------------------------------------------------------------------

    def append(self, data: bytes) -> None:
        """Write ``data`` at the end of the good data, in reserved space (reserving more first
        if it does not fit). On failure the file is cut back to where the good data ended (if
        even that fails, OSError with ``cut_back_failed`` set) and the error raised; :attr:`size`
        moves only on success."""
        start = self.size
        end = start + len(data)
        if end > self.allocated and end >= self._retry_reserve:
            self._reserve(end)
        try:
            pwrite_all(self.fd, data, start)
        except BaseException as exc:
            try:
                os.ftruncate(self.fd, start)
                self.allocated = start
            except OSError as exc2:
                exc.cut_back_failed = exc2
            raise
        self.size = end
        self.allocated = max(self.allocated, end)

    def give_back_zeros(self, end: int | None = None) -> None:
        """Cut the zeros allocated ahead of the appends, after :attr:`size` or the written
        ``end`` (their room is wanted elsewhere: a compaction's copy, or a damaged tail's, on
        a full disk). A crash meanwhile leaves the same data, with fewer zeros."""
        end = self.size if end is None else end
        if self.allocated > end:
            os.ftruncate(self.fd, end)
            self.allocated = end

    def _reserve(self, end: int) -> None:
        """Allocate the file up to :attr:`reserve` bytes past ``end``. Without the space (or
        with a file system that cannot), nothing is reserved and nothing is tried again for
        the next :attr:`reserve` bytes: the writes grow the file, only the syncs cost more."""
        before = self.allocated
        ahead = self.reserve
        try:
            st = os.fstatvfs(self.fd)
            ahead = min(ahead, st.f_bavail * st.f_frsize // 4)
        except OSError:
            pass
        if ahead < min(RESERVE_LEAST, self.reserve):  # (a small disk: its room is for data)
            self._retry_reserve = end + self.reserve
            return
        try:
            os.posix_fallocate(self.fd, before, end + ahead - before)
        except OSError:  # ENOSPC, EOPNOTSUPP: the write itself says whether the data fits
            self._retry_reserve = end + self.reserve
            try:  # ext4 keeps what it allocated before it ran out: on a nearly full disk
                os.ftruncate(self.fd, before)  # that is all the space left, give it back
            except OSError:
                with contextlib.suppress(OSError):  # (zeros: harmless after ``size``)
                    self.allocated = os.fstat(self.fd).st_size
            return
        self.allocated = end + ahead

    def sync(self, fd: int | None = None) -> None:
        """fsync the file (or ``fd``, a descriptor of it taken earlier): the group commit."""
        if self.fsync_enabled:
            os.fsync(self.fd if fd is None else fd)

    def replace(self, data: bytes, *, keep_old: bool = False) -> int:
        """Make ``data`` the whole file atomically: write ``<file>.tmp``, fsync it, rename it
        over the file, fsync the directory. The new descriptor becomes :attr:`fd`; the old
        one is closed, or returned with ``keep_old`` (another thread may be fsyncing it).
        Raises :class:`ReplaceFailed` saying whether the new file is in place."""
        fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            pwrite_all(fd, data, 0)
            if self.fsync_enabled:
                os.fsync(fd)
            os.replace(self.tmp_path, self.path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_path)
            raise ReplaceFailed(exc, replaced=False) from exc
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_path)
            raise
        old, self.fd, self.size, self.allocated = self.fd, fd, len(data), len(data)
        self._retry_reserve = 0  # (a new file: worth a reserve again)
        if old >= 0 and not keep_old:
            os.close(old)
            old = -1
        try:
            self.fsync_dir()
        except OSError as exc:
            failed = ReplaceFailed(exc, replaced=True)
            failed.old_fd = old  # still the caller's to close
            raise failed from exc
        return old

    def reset(self, header: bytes) -> None:
        """Make ``header`` (no entries) the whole file in place, freeing its space: for a file
        whose entries are all dead, on a disk too full for :meth:`replace`'s temporary file.
        Cut to the old header first (a crash then leaves a valid, empty file), then the new
        one written over it and fsynced. Raises OSError."""
        os.ftruncate(self.fd, len(header))
        self.size = self.allocated = len(header)
        pwrite_all(self.fd, header, 0)
        self.sync()
        self._retry_reserve = 0

    def fsync_dir(self) -> None:
        if not self.fsync_enabled:
            return
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
