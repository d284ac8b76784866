"""Dated report runs kept in one directory: ``rqp-dlq-report --reports DIR [--keep N]``.

::

    DIR/20261123T060012Z/        one run: what --output would hold, and .lock
    DIR/20261124T060007Z/
    DIR/latest -> 20261124T060007Z

Each run is written into a directory of its own, named by its UTC start time (``-2``, ``-3``
... if two start in the same second). A run is **complete** once its ``summary.json``
exists (the job writes it after every table, see :mod:`rqp.report.compute`). At the end of a
run ``DIR/latest`` is pointed at it (a new symlink renamed over the old one: a reader sees
the old run or the new one, never no ``latest``), unless a newer run already took it, and
the complete runs beyond the newest ``keep`` are deleted, with the failed ones (incomplete,
older than this run and abandoned).

Runs under way and runs being read are never deleted. Every run directory has a ``.lock``
file: the job writing a run holds an exclusive ``flock`` on it from before the directory has
its name until the job ends (the directory is made and locked under a hidden name and renamed,
all under ``DIR/.lock``, so no run is ever visible unlocked while it is written); a job
comparing with a run holds a shared lock on it while it reads; the pruning job (under
``DIR/.lock`` too, so that two jobs that end together do not both decide) deletes only a run
whose exclusive lock it gets without waiting, and a reader that got its lock checks again that
the run is still complete. Locks are released by the kernel when a job dies: its run is then an
incomplete one that a later run deletes.

``DIR`` must be a local directory (``flock`` and symlinks); ``--output`` takes Hadoop URIs.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field

from rqp.report.common import ReportError

__all__ = ["DEFAULT_KEEP", "LATEST", "LOCK", "SUMMARY", "Run", "run_names", "is_complete",
           "start"]

#: How many complete runs ``--keep`` keeps unless told.
DEFAULT_KEEP = 14
LATEST = "latest"
LOCK = ".lock"
SUMMARY = "summary.json"

_NAME = re.compile(r"(?P<stamp>[0-9]{8}T[0-9]{6}Z)(?:-(?P<n>[0-9]+))?")


def _order(name: str) -> tuple[str, int]:
    m = _NAME.fullmatch(name)
    return m["stamp"], int(m["n"] or 1)


def run_names(reports: str) -> list[str]:
    """The runs in ``reports``, oldest first (names that are not runs are left alone)."""
    try:
        names = os.listdir(reports)
    except FileNotFoundError:
        return []
    return sorted((n for n in names if _NAME.fullmatch(n)
                   and os.path.isdir(os.path.join(reports, n))
                   and not os.path.islink(os.path.join(reports, n))), key=_order)


def is_complete(run: str) -> bool:
    return os.path.isfile(os.path.join(run, SUMMARY))


def _lock(path: str, kind: int, wait: bool = True) -> int | None:
    """An open descriptor of ``path`` holding a ``flock`` of ``kind``; None when the file is
    gone or (``wait`` False) another holds a lock that excludes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, kind if wait else kind | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Run:
    """One run under way: its directory (locked), and the previous complete run it compares
    with (locked shared until :meth:`finish` or :meth:`close`)."""

    reports: str
    name: str
    previous: str | None
    _fd: int | None = field(default=None, repr=False)
    _previous_fd: int | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return os.path.join(self.reports, self.name)

    def _release_previous(self) -> None:
        if self._previous_fd is not None:
            os.close(self._previous_fd)
            self._previous_fd = None

    def close(self) -> None:
        """Release the locks (a run that failed stays, incomplete, until a later run)."""
        self._release_previous()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self, keep: int = DEFAULT_KEEP) -> list[str]:
        """Point ``latest`` at this run (unless a newer one has it) and delete the complete
        runs beyond the newest ``keep`` and the abandoned incomplete ones older than this;
        return the deleted runs' names. Then release the locks."""
        if keep < 1:
            raise ValueError("keep must be at least 1")
        if not is_complete(self.path):
            raise ReportError(f"{self.path} has no {SUMMARY}: the run is not complete")
        self._release_previous()  # read: it may go now like any other
        deleted = []
        guard = _lock_file(os.path.join(self.reports, LOCK))
        try:
            self._point_latest()
            complete = [n for n in reversed(run_names(self.reports))
                        if is_complete(os.path.join(self.reports, n))]
            doomed = complete[keep:] + [
                n for n in run_names(self.reports)
                if _order(n) < _order(self.name)
                and not is_complete(os.path.join(self.reports, n))]
            for name in doomed:
                if name != self.name and self._delete(name):
                    deleted.append(name)
            for name in os.listdir(self.reports):  # jobs that died before their run had a
                if name.startswith(".new-") and self._delete(name):  # name (see start)
                    deleted.append(name)
        finally:
            os.close(guard)
            self.close()
        return deleted

    def _point_latest(self) -> None:
        latest = os.path.join(self.reports, LATEST)
        current = os.readlink(latest) if os.path.islink(latest) else None
        if os.path.lexists(latest) and current is None:
            raise ReportError(f"{latest} is not a symlink: move it away (the reports' "
                              f"'{LATEST}' is a symlink to the newest run)")
        if current is not None and _NAME.fullmatch(current) \
                and _order(current) > _order(self.name) \
                and is_complete(os.path.join(self.reports, current)):
            return  # a newer run finished first: it stays the latest
        tmp = os.path.join(self.reports, f".{LATEST}.{uuid.uuid4().hex}")
        os.symlink(self.name, tmp)
        try:
            os.replace(tmp, latest)
        except BaseException:
            os.unlink(tmp)
            raise

    def _delete(self, name: str) -> bool:
        """Delete a run if nobody holds its lock (not under way, not being read)."""
        path = os.path.join(self.reports, name)
        fd = _lock(os.path.join(path, LOCK), fcntl.LOCK_EX, wait=False)
        if fd is None and os.path.exists(os.path.join(path, LOCK)):
            return False  # held: written or read now
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)
        return not os.path.exists(path)


def _lock_file(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _stamp(now: _dt.datetime | None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.astimezone(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def start(reports: str, now: _dt.datetime | None = None) -> Run:
    """Make this run's directory (locked) and find the previous complete run (locked shared).
    """
    os.makedirs(reports, exist_ok=True)
    stamp = _stamp(now)
    # Under DIR/.lock (as the pruning is): a run appears under its name already locked.
    guard = _lock_file(os.path.join(reports, LOCK))
    try:
        tmp = os.path.join(reports, f".new-{uuid.uuid4().hex}")
        os.mkdir(tmp)
        with open(os.path.join(tmp, LOCK), "x"):
            pass
        fd = _lock(os.path.join(tmp, LOCK), fcntl.LOCK_EX, wait=False)
        try:
            n = 1
            while True:  # rename fails onto a run of that name (it is not empty: .lock)
                name = stamp if n == 1 else f"{stamp}-{n}"
                try:
                    os.rename(tmp, os.path.join(reports, name))
                    break
                except OSError:
                    if not os.path.lexists(os.path.join(reports, name)):
                        raise
                    n += 1
        except BaseException:
            os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(guard)
    run = Run(reports, name, None, _fd=fd)
    # Not under DIR/.lock: waiting for a run's writer to let go while holding it would stop
    # that writer's own last step.
    for earlier in reversed([n for n in run_names(reports) if _order(n) < _order(name)]):
        path = os.path.join(reports, earlier)
        if not is_complete(path):
            continue
        held = _lock(os.path.join(path, LOCK), fcntl.LOCK_SH)
        if held is None and os.path.exists(os.path.join(path, LOCK)):
            continue
        if is_complete(path):  # (still: it may have been deleted while we waited)
            run.previous, run._previous_fd = path, held
            break
        if held is not None:
            os.close(held)
    return run
