"""Files that a reader never sees half-written (seed 000's rule): written elsewhere, fsynced,
renamed into place, and the directory fsynced so the rename itself survives a crash. And the
room an agent keeps on its disk for its own start (:class:`SpaceReserve`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["NO_SPACE_ERRNOS", "SpaceReserve", "fsync_dir", "out_of_space", "remove_abandoned",
           "write_file_atomically"]

#: Write errors that say the disk (a quota, or the file's size limit) is full.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found the disk (or a quota) full."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_abandoned(prefix: str, temp: str | os.PathLike | None = None) -> None:
    """Remove the directories ``PREFIX PID-*`` in ``temp`` (default: the temporary directory)
    that runs of this user ended by ``kill -9`` left behind, those whose process no longer
    runs: a run names its own so (the benchmarks' working directories, the report's JVM's).
    One whose process id runs again (another process) stays, as does another user's."""
    for path in Path(temp or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.lstat().st_uid != os.geteuid() or \
                    not path.is_dir() or path.is_symlink():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # (runs, as another user: not ours to judge)


def write_file_atomically(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path``: a reader sees the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # (a write: ENOSPC says no file)
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise
    fsync_dir(path.parent)


class SpaceReserve:
    """A file of ``size`` bytes an agent keeps in its state directory, freed at its start, so
    that the start's own small writes (a key incarnation, a journal entry) find room on a
    disk that filled while it ran: a trial's sending MCA, killed while its journal filled the
    disk, could not start again until someone made room. Made again (:meth:`make`) once the
    agent has started and whenever it can after that.

    The bytes are random, so that a compressing or deduplicating file system really keeps
    their room. Thread-safe.
    """

    def __init__(self, path: str | os.PathLike, size: int) -> None:
        self.path = Path(path)
        self.size = size
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self._lock = threading.Lock()
        #: Why the last :meth:`make` failed (None: the file is there, or not tried yet).
        self.missing: str | None = None

    def there(self) -> bool:
        """Whether the file is there, whole (someone may have removed it)."""
        try:
            return os.stat(self.path).st_size == self.size
        except OSError:
            return False

    def free(self) -> bool:
        """Remove the file (and a temporary one a kill left); whether there was one."""
        with self._lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp_path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return False
            return True

    def make(self) -> bool:
        """Make the file if it is not there (durably). Returns whether it is there now; when
        not, :attr:`missing` says why (a full disk, or any other error writing it)."""
        with self._lock:
            if self.there():
                self.missing = None
                return True
            try:
                # (a fixed temporary name: one a kill leaves is removed by the next free)
                fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                             0o600)
                try:
                    data = memoryview(os.urandom(self.size))
                    while data:
                        data = data[os.write(fd, data):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(self.tmp_path, self.path)
                fsync_dir(self.path.parent)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp_path)
                self.missing = exc.strerror or str(exc)
                return False
            self.missing = None
            return True
