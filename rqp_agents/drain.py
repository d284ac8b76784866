"""rqp-dlq-drain: move dead letters from DEAD.LETTER.Q into an archive of JSON Lines files.

Usage::

    rqp-dlq-drain --archive DIR [--queue KEY_OR_NAME] [--rqprc FILE] [--receiver-config FILE]
                  [--once | --interval SECONDS] [--batch N] [--max-file-records N]

The archive format is described in :mod:`rqp.storage.archive`. Each record is archived exactly once,
whatever moment the drain is killed at:

1. **copy** up to ``--batch`` records off the queue with ``msgrcv(MSG_COPY)`` (nothing taken);
2. **note** the names of the file(s) about to be written in ``{archive}/.state/{host}.last``
   (``"done": false``), atomically;
3. **write** them in ``{archive}/.incoming/``, fsync, rename into ``{archive}/``, fsync the
   directory (at most ``--max-file-records`` rows per file);
4. **take** the records off the queue (``msgrcv`` without ``MSG_COPY``), checking that each one
   taken is the one copied;
5. mark the state ``"done": true``;
6. remove the spill files of the records taken off: before step 3 each was copied (fsynced,
   renamed into place) to ``{archive}/spill/`` under its own name, where ``rqpctl dlq
   replay`` finds it. A spill file whose copy is in the archive is removed by any later batch
   that sees its directory, so a kill before step 6 leaves nothing behind for long.

Killed before 3 completes: the records are still on the queue, the next run archives them (a
half-written file in ``.incoming`` is removed at start). Killed between 3 and 5: the records are
both archived and still (some of them) at the head of the queue; at start, and before each
batch, a drain whose state is not ``done`` takes off the head of the queue every record whose
``id`` is in the file(s) the state names, without writing them again. Because the state is
written *before* the rename, a file that reached the archive is always named by it. So: no
record lost, none archived twice (but for a record longer than the kernel's msgmax, put before
it was lowered: it cannot be copied, so it is taken first and archived after, with a warning).
Nothing else may take records from ``DEAD.LETTER.Q`` meanwhile
(only put them: agents append at the tail, the drain works at the head). A lock
(``{archive}/.state/{host}.lock``) keeps a second drain of the same host out of the archive,
and the semaphore of the queue's marker (:func:`rqp.system.service.drain_lock`) a second drain
of the queue into another archive. A drain that meets another exits EXIT_ANOTHER_RUNS
(75, EX_TEMPFAIL), which its unit counts as success: the other one drains.

Records that are not dead-letter records are archived as ``MALFORMED`` (raw bytes kept), never
dropped. ``--once`` drains until the queue is empty and exits 0; otherwise the drain polls every
``--interval`` seconds until SIGTERM or SIGINT (it finishes the batch in hand, exits 0; a second
signal exits at once, which is safe too).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from rqp.cli import add_log_level, add_version, positive_int, positive_seconds
from rqp.config import (
    QUEUE_NAME_RE, ReceiverConfig, SenderConfig, load_names_config, parse_queue_key,
)
from rqp.protocol.constants import DEAD_LETTER_QUEUE_NAME, DEFAULT_DEAD_LETTER_QUEUE
from rqp.protocol.errors import ConfigError, QueueError, QueueNotFound, RQPError
from rqp.storage.archive import (
    ArchiveError, ArchiveWriter, DrainState, LockHeld, archived_ids, archived_spill, lock_file,
    read_drain_state, record_id, record_to_row, safe_host, write_drain_state,
)
from rqp.system import signals
from rqp.system.files import write_file_atomically
from rqp.system.queues import LocalQueue, QueueEmpty, format_key
from rqp.system.service import (
    EXIT_ANOTHER_RUNS, DrainRuns, drain_lock, host_name, setup_logging,
)
from rqp_agents.daemon import RateLimitedLog, flush_held_lines

log = logging.getLogger("rqp.drain")

#: The names rqp.storage.deadletters.fit_dead_letter gives spill files, in a "spill" directory.
_SPILL_NAME = re.compile(r"dl-[0-9]+-[0-9a-f]{16}-[0-9a-f]{16}\.payload")


def _is_spill_file(path: Path) -> bool:
    return path.parent.name == "spill" and bool(_SPILL_NAME.fullmatch(path.name))


DEFAULT_BATCH = 10_000
#: Seconds between two lines of one kind about a failure that repeats (the rest are counted
#: in the next line).
LOG_EVERY = 60.0
DEFAULT_INTERVAL = 5.0


class Drain:
    """Moves records from one queue into one archive directory (see the module doc)."""

    def __init__(self, archive: str | os.PathLike, queue_key: int, *, host: str | None = None,
                 queue_names: Mapping[str, int] | None = None, batch: int = DEFAULT_BATCH,
                 max_file_records: int | None = None, out=print) -> None:
        self.archive = Path(archive)
        self.queue_key = queue_key
        self.host = host or host_name()
        self.queue_names = queue_names
        self.batch = batch
        self.max_file_records = max_file_records or batch
        self.writer = ArchiveWriter(self.archive, host=self.host)
        self.queue: LocalQueue | None = None
        self.out = out
        #: (a trial's second reader gave 1,099 such lines, one per record)
        self.other_reader = RateLimitedLog(log, LOG_EVERY, what="lines about another reader")

    def _open(self) -> LocalQueue | None:
        if self.queue is None:
            try:
                self.queue = LocalQueue.open(self.queue_key)
            except QueueNotFound:
                return None
        return self.queue

    def _state(self, files: list[str], done: bool) -> None:
        write_drain_state(self.archive, self.host, DrainState(tuple(files), self.queue_key, done))

    # -- the two halves of a batch -----------------------------------------------------------

    def recover(self) -> int:
        """Take off the head of the queue the records the last batch archived but did not take
        off (killed in between). Returns how many."""
        state = read_drain_state(self.archive, self.host)
        if state is None or state.done:
            return 0
        if state.queue != self.queue_key:
            raise ArchiveError(
                f"the last batch of host {self.host} into {self.archive} came from queue "
                f"{format_key(state.queue)} and was not finished: run the drain for that queue "
                f"first (--queue {format_key(state.queue)})")
        queue = self._open()
        taken = 0
        if queue is not None:
            ids = archived_ids([self.archive / name for name in state.files])
            extras = []
            # (a record too long to copy was never copied, so never archived: the end)
            while ids and (head := queue.copy_head(1)[0]) and record_id(item := head[0]) in ids:
                got = queue.get(block=False)
                taken += 1
                if got != item:
                    extras.append(self._mismatch(got))
            self._save_extras(extras)
        if taken:
            log.info("took %d record(s) off %s that the last batch had archived in %s but not "
                     "taken off (it was stopped in between)", taken, format_key(self.queue_key),
                     ", ".join(state.files))
        self._state(list(state.files), True)
        return taken

    def _copy(self, queue: LocalQueue) -> tuple[list[bytes], bool]:
        """Copies of the next records, and False; or the next one taken off (longer than
        the kernel's msgmax, it cannot be copied), and True."""
        batch, too_long = queue.copy_or_take_head(self.batch)
        if too_long is not None:
            log.warning("%s -- taken off before it is archived (a kill now would lose it), so "
                        "that the records behind it move", too_long)
        return batch, too_long is not None

    def _mismatch(self, got: bytes) -> bytes:
        self.other_reader.report("queue %s has another reader: a record taken off it was not "
                                 "the one copied; archiving it at once", logging.ERROR,
                                 format_key(self.queue_key))
        return got

    def _save_extras(self, extras: list[bytes]) -> None:
        """Records taken that were not archived (another reader interfered): archive them now,
        they are no longer on the queue."""
        if extras:
            rows = [record_to_row(raw, archived_by=self.host, queue_names=self.queue_names)
                    for raw in extras]
            path = self.writer.write(rows)
            self.out(f"drained {len(rows)} record(s) into {path}")

    def _take_off(self, queue: LocalQueue, batch: list[bytes]) -> None:
        expected = collections.Counter(batch)
        extras = []
        for _ in batch:
            try:
                got = queue.get(block=False)
            except QueueEmpty:
                self.other_reader.report("queue %s has another reader: it took records the "
                                         "drain had copied (they are archived)", logging.ERROR,
                                         format_key(self.queue_key))
                break
            if expected[got] > 0:
                expected[got] -= 1
            else:
                extras.append(self._mismatch(got))
        self._save_extras(extras)

    def run_batch(self) -> list[tuple[Path, int]] | None:
        """One batch: copy, write (fsync, rename), take off. None if the queue is empty."""
        self.recover()
        queue = self._open()
        if queue is None:
            return None
        batch, taken = self._copy(queue)
        if not batch:
            return None
        rows = [record_to_row(raw, archived_by=self.host, queue_names=self.queue_names)
                for raw in batch]
        spills = self._keep_spills(rows)
        step = self.max_file_records
        chunks = [rows[i:i + step] for i in range(0, len(rows), step)]
        names = [self.writer.next_name() for _ in chunks]
        self._state(names, False)  # before the rename: a visible file is always named here
        written = [(self.writer.write(chunk, name), len(chunk))
                   for chunk, name in zip(chunks, names)]
        if not taken:
            self._take_off(queue, batch)
        self._state(names, True)
        self._remove_spills(spills)
        return written

    def _keep_spills(self, rows: list[dict]) -> list[Path]:
        """Copy each row's spill file into the archive (once); the originals, to remove once
        their records are off the queue."""
        originals = []
        for row in rows:
            spill = row.get("spill_path")
            if not spill:
                continue
            source, copy = Path(spill), archived_spill(self.archive, spill)
            if source == copy or not _is_spill_file(source):
                continue  # (a record may name any path: only spill files are touched)
            if not copy.exists():
                try:
                    data = source.read_bytes()
                except FileNotFoundError:
                    continue  # gone already: replay will say the payload is lost
                except OSError as exc:
                    log.warning("spill file %s cannot be read (%s): the archive keeps the "
                                "record's cut payload only, and the file stays", spill,
                                exc.strerror or exc)
                    continue
                copy.parent.mkdir(parents=True, exist_ok=True)
                write_file_atomically(copy, data, mode=0o640)
            originals.append(source)
        return originals

    def _remove_spills(self, originals: list[Path]) -> None:
        """Remove spill files whose copies are in the archive: those of this batch, and any
        left in the same directories by a drain stopped before this step."""
        for directory in {path.parent for path in originals}:
            try:
                files = list(directory.iterdir())
            except OSError:
                files = []
            for path in set(originals) | set(files):
                if path.parent == directory and _is_spill_file(path) and \
                        archived_spill(self.archive, str(path)).exists():
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        log.warning("spill file %s is archived but cannot be removed: %s",
                                    path, exc.strerror or exc)

    def run_until_empty(self, stop: threading.Event | None = None) -> int:
        """Batches until the queue is empty (or ``stop`` is set); returns records archived."""
        total = 0
        while stop is None or not stop.is_set():
            try:
                written = self.run_batch()
            except QueueNotFound:
                self.queue = None  # removed (and maybe created again): open it next time
                raise
            if written is None:
                break
            for path, count in written:
                total += count
                self.out(f"drained {count} record(s) into {path}")
        return total


# --------------------------------------------------------------------------------------------
# Command line


def resolve_queue(value: str | None, config: SenderConfig | ReceiverConfig | None) -> int:
    """The queue of ``--queue`` (a key, or a name of the config), else the config's
    ``dead_letter_queue`` (:func:`load_names_config`), else the default ``DEAD.LETTER.Q``."""
    if value is None:
        return config.dead_letter_queue if config else DEFAULT_DEAD_LETTER_QUEUE
    try:
        if config is not None:
            return config.resolve_queue(value)
        return parse_queue_key(value, {DEAD_LETTER_QUEUE_NAME: DEFAULT_DEAD_LETTER_QUEUE})
    except ConfigError as exc:
        hint = ""
        if config is None and QUEUE_NAME_RE.fullmatch(value.strip()):
            hint = (" (no .rqprc or receiver config was found to look names up in: give "
                    "--rqprc, or the queue's key)")
        raise ConfigError(f"--queue: {exc}{hint}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rqp-dlq-drain", description=__doc__.splitlines()[0],
        epilog="Each record is archived exactly once even if the drain is killed at any "
        "moment; see the README, section 'Dead-letter archive'.")
    add_version(parser)
    parser.add_argument("--archive", metavar="DIR", required=True,
                        help="archive directory (created if missing)")
    parser.add_argument("--queue", metavar="KEY_OR_NAME",
                        help="queue to drain (default: the .rqprc's dead_letter_queue, else, "
                        "with no .rqprc or only the installed template, that of "
                        "/etc/rqp/receiver.yaml if it exists, else 0x5251DEAD)")
    parser.add_argument("--rqprc", metavar="FILE",
                        help="the .rqprc (queue names, dead_letter_queue); default: $RQPRC, "
                        "./.rqprc, ~/.rqprc, /etc/rqp/rqprc if one exists")
    parser.add_argument("--receiver-config", metavar="FILE",
                        help="the receiving MCA's config, read for the same where there is no "
                        ".rqprc or only the installed template (a host that only receives); "
                        "default: /etc/rqp/receiver.yaml if it exists")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="drain until empty, then exit")
    mode.add_argument("--interval", metavar="SECONDS", type=positive_seconds,
                      default=DEFAULT_INTERVAL,
                      help=f"wait between polls (default {DEFAULT_INTERVAL:g})")
    parser.add_argument("--batch", metavar="N", type=positive_int, default=DEFAULT_BATCH,
                        help=f"records copied per batch (default {DEFAULT_BATCH})")
    parser.add_argument("--max-file-records", metavar="N", type=positive_int,
                        help="rows per archive file at most (default: --batch)")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level, "rqp.drain", log_format=args.log_format)
    stop = threading.Event()

    def on_signal(sig, _frame):
        if stop.is_set():
            os._exit(0)  # safe at any moment: see the module doc
        log.info("%s: stopping after the batch in hand", signal.Signals(sig).name)
        stop.set()

    signals.handle(on_signal, (signal.SIGTERM, signal.SIGINT))
    signals.let_stops_through()  # (SIGHUP: its default action)
    out = lambda text: print(text, flush=True)  # noqa: E731
    try:
        config = load_names_config(args.rqprc, args.receiver_config, say=log.info)
        queue_key = resolve_queue(args.queue, config)
        archive = Path(args.archive)
        if archive.exists() and not archive.is_dir():  # (mkdir said "File exists": a trial)
            raise ConfigError(f"--archive {archive}: is not a directory (the archive is a "
                              "directory, its files are made in it)")
        try:
            archive.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--archive {archive}: cannot create the directory: "
                              f"{exc.strerror or exc}") from None
        host = host_name()
        drain = Drain(archive, queue_key, host=host,
                      queue_names=config.queues if config else None, batch=args.batch,
                      max_file_records=args.max_file_records, out=out)
        lock = archive / ".state" / f"{safe_host(host)}.lock"
        dead_letter_queues = {DEFAULT_DEAD_LETTER_QUEUE} | (
            {config.dead_letter_queue} if config is not None else set())
        with drain_lock(queue_key, mark=queue_key in dead_letter_queues), \
                lock_file(lock, f"an rqp-dlq-drain of host {host} into {archive}"):
            for leftover in drain.writer.clean_incoming():
                log.info("removed %s, left half-written by a drain that was stopped", leftover)
            if args.once:
                total = drain.run_until_empty(stop)
                if total == 0:
                    out(f"drained 0 record(s): queue {format_key(queue_key)} is empty"
                        + ("" if LocalQueue.exists(queue_key) else " (it does not exist)"))
                return 0
            log.info("draining queue %s into %s every %gs", format_key(queue_key), archive,
                     args.interval)
            # (a trial's full archive disk: one line every 0.2 s, the poll interval)
            failed = RateLimitedLog(log, LOG_EVERY, what="failed rounds")
            while not stop.is_set():
                try:
                    drain.run_until_empty(stop)
                except QueueNotFound:
                    pass  # removed meanwhile: nothing to drain until it is created again
                except (QueueError, ArchiveError, OSError) as exc:
                    failed.report("%s (records stay on the queue; trying again every %gs)",
                                  logging.ERROR, exc, args.interval)
                stop.wait(args.interval)
            log.info("stopped")
            return 0
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except (DrainRuns, LockHeld) as exc:  # (the other drain does the work: no failure for
        # a timer's drain that meets the handler's, a trial's unit 'failed' each time)
        log.warning("%s: nothing done", exc)
        return EXIT_ANOTHER_RUNS
    except (RQPError, OSError) as exc:
        log.error("%s", exc)
        return 1
    finally:  # (every way out, --once too: what the limits held back is said, once)
        flush_held_lines()


if __name__ == "__main__":
    sys.exit(main())
