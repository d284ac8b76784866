"""The one way a dead letter is written, by any agent or tool.

A :class:`~rqp.protocol.records.DeadLetterRecord` is made to fit one System V message
(:func:`fit_dead_letter`: the payload cut, the whole of it spilled to a file first) and put on
``DEAD.LETTER.Q`` by a :class:`DeadLetterWriter`, which creates the queue again if it was
removed, says when it is full (the caller decides how to wait: the sending MCA keeps a backlog,
the receiving MCA retries for a bounded time) and counts what it wrote by reason.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from pathlib import Path

from rqp.protocol.constants import DEFAULT_SPILL_LIMIT
from rqp.protocol.errors import MessageTooBig, RQPError
from rqp.protocol.reasons import reason_name
from rqp.protocol.records import DeadLetterFlags, DeadLetterRecord
from rqp.system.files import write_file_atomically
from rqp.system.queues import (
    LocalQueue, QueueFull, QueueNotFound, QueuePermissionDenied, format_key, kernel_limits,
)

__all__ = ["DeadLetterWriter", "fit_dead_letter"]

log = logging.getLogger("rqp.deadletters")


class DeadLetterWriter:
    """Puts dead-letter records on the dead-letter queue ``queue_key``.

    ``spill_dir`` receives the full payload of a record too big for one System V message
    (created when first needed), up to ``spill_limit`` bytes in all: beyond, the payload is
    only cut (TRUNCATED, no spill file) and the record's detail says why, so that a peer
    sending big messages to a refused queue cannot fill the disk. :attr:`by_reason` counts
    the records written, by reason name.
    """

    def __init__(self, queue_key: int, spill_dir: str | os.PathLike, *,
                 msgmax: int | None = None, spill_limit: int = DEFAULT_SPILL_LIMIT,
                 cut_unspillable: bool = False):
        self.queue_key = queue_key
        #: A spill file that cannot be written (its directory full or broken): False, raise
        #: OSError (the caller holds the record); True, cut the payload as beyond spill_limit,
        #: the detail saying why (for a caller that cannot hold it).
        self.cut_unspillable = cut_unspillable
        #: The last spill file not written, and when (time.time()); records cut for it.
        self.spill_trouble: str | None = None
        self.spill_trouble_at: float | None = None
        self.unspilled = 0
        self.spill_dir = Path(spill_dir)
        self.msgmax = msgmax if msgmax is not None else kernel_limits().msgmax
        self.spill_limit = spill_limit
        self.queue = LocalQueue.create(queue_key)
        self.by_reason: collections.Counter[str] = collections.Counter()
        self._spilled: int | None = None  # bytes in spill_dir (measured on first need)
        #: Records given to try_put and fitted again to a queue made smaller since, until
        #: written (the caller keeps the bytes it gave): fitted once, spilled once.
        self._refitted: dict[bytes, bytes] = {}
        self._too_small_said = False  # (the ERROR line, once until a put succeeds)
        self._denied_said = False  # (the same)
        #: Why DEAD.LETTER.Q, removed, cannot be made again (the system's kernel.msgmni
        #: queues all taken), or None: dead letters wait, as for a full queue, until it can.
        self.unmade: str | None = None

    @property
    def written(self) -> int:
        return sum(self.by_reason.values())

    def encode(self, record: DeadLetterRecord, *, share: float | None = None) -> bytes:
        """The record's bytes, fitted to one System V message (spilling the payload if need
        be and there is room). Raises OSError if the spill file cannot be written,
        MessageTooBig if even the header does not fit. A record that is then not written
        must be given to :meth:`discard`, so that no spill file is left that no record
        names.

        ``share`` (0..1): the record must also leave DEAD.LETTER.Q at most that part full
        (its payload spilled to fit, as above); :class:`QueueFull` if even its header would
        not (nothing written). What the receiving MCA writes for its peers, so that they
        cannot take the rest of the queue from the sending MCA of the host."""
        limit = self._limit()
        if share is not None and (room := self.room_within(share)) < limit:
            # Spilled to fit, what stays in the queue is small, so that the share holds more
            # than one: the header and the payload's first bytes (all of the room if need be).
            fits = (room,) if record.encoded_size() <= room else \
                dict.fromkeys((min(room, SHARE_RECORD_MAX), room))
            for fit in fits:
                try:
                    return self._encode(record, fit)
                except MessageTooBig:  # (nothing written)
                    continue
            raise QueueFull(
                f"DEAD.LETTER.Q {format_key(self.queue_key)} has no room left in the "
                f"{share:.0%} of it this agent may fill: the rest is kept for the sending MCA "
                "of this host", queue_key=self.queue_key)
        try:
            return self._encode(record, limit)
        except MessageTooBig:
            if limit >= self.msgmax:
                raise
            # DEAD.LETTER.Q is smaller than the record without payload: made for msgmax,
            # never written until the queue is made larger (try_put says so)
            return self._encode(record, self.msgmax)

    def _encode(self, record: DeadLetterRecord, limit: int) -> bytes:
        if record.encoded_size() <= limit:
            return record.to_bytes()
        size = len(record.payload)
        try:
            if self._spilled is None or self._spilled + size > self.spill_limit:
                # (measured again before any cut: the drain removes the files it archives)
                self._spilled = _bytes_in(self.spill_dir)
            if self._spilled + size > self.spill_limit:
                return _cut(record, limit, f"{self.spill_dir} holds {self._spilled} bytes, "
                            f"spill limit {self.spill_limit}")
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            spilled = fit_dead_letter(record, limit, self.spill_dir)
        except OSError as exc:
            if not self.cut_unspillable:
                raise
            why = f"cannot write a spill file in {self.spill_dir}: {exc.strerror or exc}"
            if why != self.spill_trouble:
                log.error("%s -- dead letters larger than one message are cut to fit it, "
                          "their payload's end not kept, until it can", why)
            self.spill_trouble, self.spill_trouble_at = why, time.time()
            self.unspilled += 1
            self._spilled = None
            return _cut(record, limit, why)
        self._spilled += size
        return spilled.to_bytes()

    def discard(self, data: bytes) -> None:
        """A record :meth:`encode` made and that was not written: its spill file goes."""
        refitted = self._refitted.pop(data, None)
        if refitted is not None:
            self.discard(refitted)
        try:
            spill = DeadLetterRecord.from_bytes(data).spill_path
        except RQPError:
            return
        if spill:
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(spill).st_size
                os.unlink(spill)
                if self._spilled is not None:
                    self._spilled -= size

    def try_put(self, data: bytes) -> bool:
        """Put one encoded record without waiting: True once it is on the queue, False if the
        queue is full now. A removed queue is created again (and said so in the log). A record
        made for a larger queue than DEAD.LETTER.Q is now (its size was changed) is fitted
        again, once; one that cannot fit even without its payload is not written (False, as
        if full) and an ERROR line says why, until the queue is made larger."""
        given, data = data, self._refitted.get(data, data)
        while True:
            try:
                self.queue.put(data, block=False)
            except QueueFull:
                return False
            except MessageTooBig:
                refitted = self._refit(data)
                if refitted is None:
                    return False
                data = self._refitted[given] = refitted
                continue
            except QueueNotFound:
                if self.unmade is None:
                    log.error("DEAD.LETTER.Q %s was removed: creating it again",
                              format_key(self.queue_key))
                try:
                    self.queue = LocalQueue.create(self.queue_key)
                except RQPError as exc:  # (a trial: msgmni reached; the sending MCA stopped,
                    why = f"DEAD.LETTER.Q was removed and cannot be made again: {exc}"  # 70)
                    if why != self.unmade:
                        log.error("%s -- dead letters wait until it can (kernel.msgmni is the "
                                  "system's number of queues: ipcs -q lists them)", why)
                    self.unmade = why
                    return False
                continue
            except QueuePermissionDenied as exc:  # (a trial: the sending MCA stopped, exit
                if not self._denied_said:  # 70, and again at every start)
                    self._denied_said = True
                    log.error("%s: dead letters wait until this agent may write to DEAD.LETTER.Q "
                              "(its mode and owner: ipcs -q -i ID)", exc)
                return False
            self._refitted.pop(given, None)
            self._too_small_said = self._denied_said = False
            self.unmade = None
            self.by_reason[reason_name(DeadLetterRecord.peek_reason(data))] += 1
            return True

    def look_again(self) -> None:
        """If DEAD.LETTER.Q could not be made (:attr:`unmade`): whether it is there now (made
        by another agent meanwhile), without making it (status: a re-check's said "cannot
        be made again" of a queue the sending MCA had made and written to)."""
        if self.unmade is None:
            return
        try:
            self.queue = LocalQueue.open(self.queue_key)
        except RQPError:
            return
        self.unmade = None

    def _refit(self, data: bytes) -> bytes | None:
        """``data`` fitted to DEAD.LETTER.Q's size now (its payload spilled, as by
        :meth:`encode`, unless a spill file has it already); None if even its header is
        larger than the queue."""
        record = DeadLetterRecord.from_bytes(data)
        limit = self._limit()
        try:
            if record.spill_path:  # (the whole payload is in that file)
                return fit_dead_letter(record, limit).to_bytes()
            return self._encode(record, limit)
        except MessageTooBig as exc:
            if not self._too_small_said:
                self._too_small_said = True
                log.error("DEAD.LETTER.Q %s takes records of at most %d bytes (its msg_qbytes), "
                          "too few for a dead letter (%s): dead letters wait until it is made "
                          "larger (ipcs -q -i shows it; kernel.msgmnb sets it for new queues)",
                          format_key(self.queue_key), limit, exc)
            return None

    def room_within(self, share: float) -> int:
        """Bytes a record may have so that DEAD.LETTER.Q stays at most ``share`` full (one
        ``msgctl`` and a read of /proc/sysvipc/msg: for dead letters, which are few, and for
        the receiving MCA's status)."""
        try:
            size = self.queue.stat().max_size
            used = size - self.queue.room()
        except RQPError:  # (no read permission, or removed: try_put says, or makes it again)
            return self.msgmax
        return max(0, int(size * share) - used)

    def _limit(self) -> int:
        """The largest record DEAD.LETTER.Q takes: msgmax, or its own size (msg_qbytes) when
        that is smaller (a queue made small, or kernel.msgmnb below msgmax): a record larger
        than the queue could never be put (a trial: the sending MCA stopped, and a journaled
        one stopped it at every start)."""
        try:
            return min(self.msgmax, self.queue.stat().max_size)
        except RQPError:  # (no read permission, or removed: try_put says, or makes it again)
            return self.msgmax


#: The receiving MCA's share of DEAD.LETTER.Q: it writes no dead letter that would leave the
#: queue more than this full, so that its peers cannot fill it (spec 7: a trust boundary) and
#: the sending MCA of the host always finds room for the dead letters of its SURE messages.
RECEIVER_SHARE = 0.75
#: The largest record written within that share when its payload must be spilled to fit:
#: the file has it all; the queue keeps the header and the payload's first bytes.
SHARE_RECORD_MAX = 1024


def _cut(record: DeadLetterRecord, limit: int, why: str) -> bytes:
    """``record`` with its payload cut to ``limit`` (no spill file), the detail saying why."""
    record = dataclasses.replace(record, detail=(
        f"{record.detail}; payload cut to fit one message, not spilled: {why}").lstrip("; "))
    return fit_dead_letter(record, limit).to_bytes()


def _bytes_in(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    except FileNotFoundError:
        return 0


def fit_dead_letter(record: DeadLetterRecord, limit: int,
                    spill_dir: str | os.PathLike | None = None) -> DeadLetterRecord:
    """Make ``record`` fit in ``limit`` bytes (one System V message: pass the kernel's msgmax).

    If it already fits it is returned unchanged. Otherwise the payload is cut so that the
    encoded record is exactly ``limit`` bytes and TRUNCATED is set; ``original_length`` keeps
    the full length. With ``spill_dir``, the FULL payload is first written to
    ``spill_dir/dl-{timestamp_ns}-{message_key:016x}-{random hex}.payload`` atomically (a temp
    file in the same directory, fsynced, renamed into place, directory fsynced) and the path is
    recorded in ``spill_path``. A record that already has a ``spill_path`` is not spilled again.

    Raises :class:`MessageTooBig` if even the record without payload is bigger than ``limit``
    (nothing is written then), and ``OSError`` if the spill file cannot be written.
    """
    size = record.encoded_size()
    if size <= limit:
        return record
    spill_path = record.spill_path
    if spill_dir is not None and not spill_path:
        name = f"dl-{record.timestamp_ns}-{record.message_key:016x}-{secrets.token_hex(8)}.payload"
        spill_path = os.path.join(os.path.abspath(os.fspath(spill_dir)), name)
    header_size = dataclasses.replace(record, payload=b"", spill_path=spill_path).encoded_size()
    if header_size > limit:
        raise MessageTooBig(
            f"dead-letter record header is {header_size} bytes, over the limit of {limit} "
            f"bytes even without payload (shorten detail or host names)",
            size=header_size, limit=limit,
        )
    if spill_path != record.spill_path:
        write_file_atomically(spill_path, record.payload, mode=0o600)
    return dataclasses.replace(
        record,
        payload=record.payload[: limit - header_size],
        flags=record.flags | DeadLetterFlags.TRUNCATED,
        original_length=max(record.original_length, len(record.payload)),
        spill_path=spill_path,
    )


