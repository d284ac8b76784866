"""The sending MCA's journal of SURE messages: an append-only log file, declared with ``construct``.

A SURE transmission record taken off the transmission queue is appended here (and made durable
with ``fsync``) before anything else happens to it; it is released when it has been delivered or
dead-lettered. At start the journal is replayed first: every record appended and not released is
sent again (the receiver de-duplicates by message key).

The journal is one file, ``{state_dir}/{name}.journal``: a 16-byte file header, then entries one
after the other. Every integer is an unsigned big-endian number; there is no padding between
entries. After the last entry the file holds zero bytes: space allocated ahead of the appends
(:mod:`rqp.storage.log`), so that a sync need not write the file's size each time. A reader
stops where an entry would start and only zero bytes are left (no entry is all zeros: its
length is at least 9).

File header
===========

======  ====  ==========  ====================================================================
offset  size  field       meaning
======  ====  ==========  ====================================================================
0       4     magic       the bytes ``"RQPJ"`` (0x52 0x51 0x50 0x4A)
4       1     version     2 (a version-1 file, which cannot hold broadcast entries, is read
                          and rewritten as version 2 at open)
5       3     reserved    0 0 0
8       8     base_seq    the first seq this file may contain: 1 for a new journal; after a
                          compaction the smallest live seq, or the next seq if none is live
======  ====  ==========  ====================================================================

Entry
=====

======  ====  ==============  ================================================================
offset  size  field           meaning
======  ====  ==============  ================================================================
0       4     length          L: the number of bytes after the crc, from ``kind`` to the end of
                              the entry (9 for RELEASE, 21 + n for APPEND); at most 64 MiB
4       4     crc32           ``zlib.crc32`` of those L bytes (offsets 8 .. 8+L-1)
8       1     kind            1 = APPEND, 2 = RELEASE, 3 = COPIES, 4 = COPY_DONE
9       8     seq             journal sequence number (see below)
------  ----  --------------  ---- APPEND only ---------------------------------------------
17      8     key             the RQP unique message key given to the message
25      4     record_length   n = L - 21
29      n     record          the transmission record exactly as taken from the queue
------  ----  --------------  ---- COPIES only ---------------------------------------------
17      2     count           c: the copies of a broadcast message (spec section 6), one per
                              host of ``.rqprc`` when it was taken; then c times:
+0      8     key             the copy's own RQP key
+8      1     host_length     h
+9      h     host            the host, as written in ``.rqprc`` (``host:port``), UTF-8
------  ----  --------------  ---- COPY_DONE only -------------------------------------------
17      8     key             the copy with this key is finished (delivered, declined by its
                              host with QUEUE_NO, or dead-lettered)
======  ====  ==============  ================================================================

An APPEND entry is 29 + n bytes, a RELEASE entry 17 bytes, a COPY_DONE entry 25 bytes. A COPIES
entry follows the APPEND of its seq in the same write; a COPIES or COPY_DONE of a seq that is
not live is ignored. A broadcast message is released when all its copies are done.

Sequence numbers
================

Every APPEND gets the next seq; seqs are strictly increasing over the whole life of the journal,
across compactions and restarts, and never repeat. A RELEASE names the seq of an earlier APPEND.
On replay, the *live* messages are the APPENDs without a later RELEASE of the same seq (with
their copies not done, for a broadcast message), and
numbering continues after the largest seq seen in the file, released ones included. So that a
compaction does not forget the largest seq when it was released, the compacted file ends with a
RELEASE of that seq (a "high-water mark": it releases nothing, it only carries the number).

Recovery at open
================

* A leftover ``{name}.journal.tmp`` (a compaction or creation that did not finish) is deleted:
  it is never taken for the journal, because the journal is only ever replaced by a renamed,
  complete, fsynced temp file.
* A file whose header is unreadable (too short, bad magic, reserved bytes not zero) is never
  overwritten: it is renamed ``{name}.journal.corrupt-{UTC timestamp}`` and a new journal is
  started. A header with the right magic but another *version* raises :class:`JournalError`
  instead (probably a journal of a newer program: it is valid data we cannot read, so the agent
  must not start without it).
* Entries are read in order. Reading stops at the first entry that is torn (the file ends inside
  it), has an absurd length (< 9 or > 64 MiB), a wrong crc, an unknown kind, or a length that
  does not match its kind; unless everything from there on is zero bytes (reserved space: the
  clean end of the journal). Everything before it is kept. Everything from it to the last
  written (non-zero) byte is **discarded**: a log cannot find the start of the next entry safely
  once one is damaged (the length of the damaged entry cannot be trusted). Nothing is destroyed,
  though: the discarded bytes are first copied to ``{name}.journal.discarded-{UTC timestamp}``
  (fsynced) for an operator; then the journal is truncated to the end of the last good entry
  (and fsynced), so that new appends follow valid data. After a crash the torn tail is a write
  whose ``append`` never returned, so nothing acknowledged is lost.
* Every such finding is reported, with its byte offset, in :attr:`Journal.problems`.
* An APPEND of a seq that is still live (only a bug could write one: the crc is valid) raises
  :class:`JournalError`; the file is not touched.

Compaction
==========

The live entries (keeping seq and key) are written to ``{name}.journal.tmp`` in the same
directory, which is fsynced and renamed over the journal (``os.replace``, atomic), then the
directory is fsynced and appends go on in the new file. A crash at any point leaves either the
old complete journal or the new complete one. With nothing live, the file is cut back to its
header in place instead (no room needed). It compacts when less than half of it is live and it
is at least ``compact_min_bytes`` (32 MiB), or, on a disk with less free room than the file's
size, from 256 KiB of dead entries (so that a small disk keeps room for the live entries' copy),
or when a write finds the disk full.

Durability and threads
======================

:meth:`Journal.append` writes all its entries with one ``pwrite`` and makes them durable with
one ``fsync`` (group commit: the caller passes everything that arrived meanwhile).
:meth:`Journal.release` is not fsynced by itself: a release lost in a crash only means a message
is sent again, which the receiver de-duplicates; releases become durable with the next
``append``'s fsync, :meth:`Journal.flush` or :meth:`Journal.close`.

``append`` is called from one thread (the reader) and ``release`` / ``maybe_compact`` from
another (the event loop). One lock protects the file descriptor, the file size and the map of
live entries; every write is done under it. The ``fsync`` of ``append`` (and ``flush``) is done
*outside* the lock, so that releases are not held up by the disk: ``append`` writes under the
lock, notes the descriptor and counts itself as a syncer, drops the lock, fsyncs. A release
written meanwhile is simply made durable too. A compaction that runs meanwhile (it holds the lock
for its whole duration) copies the just-written entries into the new file and fsyncs that, so
they are durable either way; the old descriptor is not closed while a syncer still uses it (it is
"retired" and closed by the last syncer), so an fsync never hits a closed or reused descriptor.

Writes go straight to the kernel (``os.pwrite``, no user-space buffer), so a crash of the
*process* never loses a written entry; only a crash of the machine can lose what was not fsynced.

Errors
======

:class:`JournalError` says the journal cannot be used or an operation failed. If a write fails
(e.g. the disk is full) the file is cut back to where it was and the operation has no effect;
the journal stays usable. If an ``fsync`` fails, the state of the data on disk is unknown (Linux
may drop the dirty pages and report the error once only), so the journal is marked failed and
every later operation raises :class:`JournalError`: the agent must stop; reopening recovers what
is on disk. Decoding errors of single entries are :class:`rqp.protocol.errors.RecordError` internally and
end up in :attr:`Journal.problems`. A second :class:`Journal` on the same file (in this or
another process) is refused: the journal holds an exclusive ``flock`` on ``{name}.journal.lock``.

``fsync=False`` skips every fsync (data, temp file, directory): for tests and benchmarks only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import construct
from construct import (
    Array, Bytes, Const, Int8ub, Int16ub, Int32ub, Int64ub, PascalString, Rebuild, Struct, len_,
    this,
)

from rqp.protocol.codec import struct_of
from rqp.protocol.constants import UINT64_MAX
from rqp.protocol.errors import RecordError, RQPError
from rqp.storage.log import RESERVE_LEAST, LogFile, ReplaceFailed, written_end
from rqp.system.files import out_of_space

log = logging.getLogger("rqp.journal")


#: Seconds between tries of a compaction that found no room for its copy (maybe_compact).
COMPACT_AGAIN = 10.0
#: Least seconds between two WARNING lines about compacting on a full disk.
SAY_AGAIN = 60.0
#: Dead bytes from which a journal on a disk with less free room than its size compacts.
SMALL_DISK_DEAD = 256 << 10

#: How a sending MCA's status begins to say that its journal's disk is full.
FULL = "the journal cannot take SURE records"


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (a JournalError) is a write that found the disk full: the journal is
    fine, and an append may succeed once messages in flight are released (or room is made)."""
    cause = exc.__cause__
    return isinstance(exc, JournalError) and out_of_space(cause)

__all__ = [
    "APPEND_BODY",
    "COPIES_BODY",
    "COPY_DONE_BODY",
    "APPEND_FIXED",
    "APPEND_FIXED_SIZE",
    "ENTRY_PREFIX",
    "ENTRY_PREFIX_SIZE",
    "FILE_HEADER",
    "FILE_HEADER_SIZE",
    "JOURNAL_MAGIC",
    "JOURNAL_VERSION",
    "KIND_APPEND",
    "KIND_COPIES",
    "KIND_COPY_DONE",
    "MAX_COPIES",
    "KIND_RELEASE",
    "MAX_ENTRY_LENGTH",
    "MAX_RECORD_SIZE",
    "RELEASE_BODY",
    "RELEASE_ENTRY_SIZE",
    "Journal",
    "JournalEntry",
    "JournalError",
    "encode_append",
    "encode_copies",
    "encode_copy_done",
    "encode_header",
    "encode_release",
]

JOURNAL_MAGIC = b"RQPJ"
JOURNAL_VERSION = 2
#: Versions this program reads (1 has no COPIES/COPY_DONE; it is rewritten as 2 at open).
READABLE_VERSIONS = (1, 2)
KIND_APPEND = 1
KIND_RELEASE = 2
KIND_COPIES = 3
KIND_COPY_DONE = 4
#: The largest ``length`` an entry may have; anything larger is taken for corruption.
MAX_ENTRY_LENGTH = 64 << 20

# --------------------------------------------------------------------------------------------
# Declarations
# --------------------------------------------------------------------------------------------

#: The 16-byte file header.
FILE_HEADER = Struct(
    "magic" / Const(JOURNAL_MAGIC),
    "version" / Int8ub,  # not a Const: another version is reported differently from bad magic
    "reserved" / Const(bytes(3)),
    "base_seq" / Int64ub,
)
FILE_HEADER_SIZE: int = FILE_HEADER.sizeof()

#: What starts every entry: the length of the rest (after the crc) and its crc32.
ENTRY_PREFIX = Struct(
    "length" / Int32ub,
    "crc" / Int32ub,
)
ENTRY_PREFIX_SIZE: int = ENTRY_PREFIX.sizeof()

#: The fixed part of an APPEND body (kind, seq, key, record_length): 21 bytes.
APPEND_FIXED = Struct(
    "kind" / Const(KIND_APPEND, Int8ub),
    "seq" / Int64ub,
    "key" / Int64ub,
    "record_length" / Int32ub,
)
APPEND_FIXED_SIZE: int = APPEND_FIXED.sizeof()

#: The checksummed part of an APPEND entry: the fixed part, then the record.
APPEND_BODY = Struct(
    *APPEND_FIXED.subcons[:-1],
    "record_length" / Rebuild(Int32ub, len_(this.record)),
    "record" / Bytes(this.record_length),
)

#: The checksummed part of a RELEASE entry (9 bytes).
RELEASE_BODY = Struct(
    "kind" / Const(KIND_RELEASE, Int8ub),
    "seq" / Int64ub,
)
_RELEASE_BODY_SIZE: int = RELEASE_BODY.sizeof()
RELEASE_ENTRY_SIZE: int = ENTRY_PREFIX_SIZE + _RELEASE_BODY_SIZE

#: The checksummed part of a COPIES entry: the copies of a broadcast message, key and host each.
COPIES_BODY = Struct(
    "kind" / Const(KIND_COPIES, Int8ub),
    "seq" / Int64ub,
    "count" / Rebuild(Int16ub, len_(this.copies)),
    "copies" / Array(this.count, Struct("key" / Int64ub, "host" / PascalString(Int8ub, "utf8"))),
)

#: The checksummed part of a COPY_DONE entry (17 bytes).
COPY_DONE_BODY = Struct(
    "kind" / Const(KIND_COPY_DONE, Int8ub),
    "seq" / Int64ub,
    "key" / Int64ub,
)
_COPY_DONE_BODY_SIZE: int = COPY_DONE_BODY.sizeof()
#: Most copies one message may have (the count is a uint16).
MAX_COPIES = 0xFFFF

#: The largest transmission record an APPEND can hold.
MAX_RECORD_SIZE = MAX_ENTRY_LENGTH - APPEND_FIXED_SIZE

# Compiled structs. Parsing with them is safe here because every body is checked first: the
# prefix is parsed from exactly 8 bytes, a body only after its full length is present and its
# crc matches, and an APPEND's record_length is compared with the entry length before use.
_HEADER_C = FILE_HEADER.compile()
_PREFIX_C = ENTRY_PREFIX.compile()
_APPEND_C = APPEND_BODY.compile()
_RELEASE_C = RELEASE_BODY.compile()
_PACK_PREFIX = struct_of(ENTRY_PREFIX).pack
_PACK_APPEND_FIXED = struct_of(APPEND_FIXED).pack
_PACK_RELEASE = struct_of(RELEASE_BODY).pack
_COPIES_C = COPIES_BODY.compile()
_COPY_DONE_C = COPY_DONE_BODY.compile()

#: A broadcast message's copies still to be done: ``((key, host), ...)``.
Copies = tuple


def encode_header(base_seq: int) -> bytes:
    """The file header of a journal whose first seq may be ``base_seq``."""
    return _HEADER_C.build({"version": JOURNAL_VERSION, "base_seq": base_seq})


def _entry(body: bytes) -> bytes:
    return _PACK_PREFIX(len(body), zlib.crc32(body)) + body


def encode_append(seq: int, key: int, record: bytes) -> bytes:
    """One whole APPEND entry (prefix and body): the hot path of every SURE message, so with
    the structs derived from ENTRY_PREFIX and APPEND_FIXED (tests check they agree)."""
    body = _PACK_APPEND_FIXED(KIND_APPEND, seq, key, len(record)) + record
    return _PACK_PREFIX(len(body), zlib.crc32(body)) + body


def encode_release(seq: int) -> bytes:
    """One whole RELEASE entry (prefix and body): one per SURE message delivered, so with the
    struct derived from RELEASE_BODY (tests check it agrees)."""
    return _entry(_PACK_RELEASE(KIND_RELEASE, seq))


def encode_copies(seq: int, copies: Copies) -> bytes:
    """One whole COPIES entry: ``copies`` is ``((key, host), ...)``."""
    return _entry(_COPIES_C.build({"seq": seq, "copies": [{"key": k, "host": h}
                                                          for k, h in copies]}))


def encode_copy_done(seq: int, key: int) -> bytes:
    """One whole COPY_DONE entry."""
    return _entry(_COPY_DONE_C.build({"seq": seq, "key": key}))


def _encode_live(seq: int, key: int, record: bytes, copies) -> bytes:
    """An APPEND, with the COPIES of a broadcast message (``copies``: ``{key: host}`` or pairs)."""
    data = encode_append(seq, key, record)
    if copies is not None:
        data += encode_copies(seq, tuple(copies.items()) if isinstance(copies, dict) else copies)
    return data


def _describe(exc: BaseException) -> str:
    """An error for a message: an OSError's text ("[Errno 28] No space left on device"), else
    what it is (KeyboardInterrupt has no text of its own)."""
    return str(exc) if isinstance(exc, OSError) else repr(exc)


def _append_size(record: bytes) -> int:
    return ENTRY_PREFIX_SIZE + APPEND_FIXED_SIZE + len(record)


def _decode_entry(data: bytes, offset: int) -> tuple[int, int, int, object, int]:
    """Decode the entry at ``offset``: ``(kind, seq, key, record, end offset)``.

    ``key`` and ``record`` are 0 and ``b""`` for a RELEASE; for COPIES ``record`` is the
    copies, ``((key, host), ...)``. Raises :class:`RecordError` saying what is wrong (a torn
    tail: the file ends inside an entry; or a bad entry).
    """
    available = len(data) - offset
    if available < ENTRY_PREFIX_SIZE:
        raise RecordError(f"torn tail: the file ends {available} bytes into an entry's "
                          f"{ENTRY_PREFIX_SIZE}-byte length and crc")
    prefix = _PREFIX_C.parse(data[offset:offset + ENTRY_PREFIX_SIZE])
    length = prefix.length
    if not _RELEASE_BODY_SIZE <= length <= MAX_ENTRY_LENGTH:
        raise RecordError(f"absurd entry length {length} (must be {_RELEASE_BODY_SIZE}.."
                          f"{MAX_ENTRY_LENGTH})")
    end = offset + ENTRY_PREFIX_SIZE + length
    if end > len(data):
        raise RecordError(f"torn tail: the entry needs {ENTRY_PREFIX_SIZE + length} bytes, "
                          f"the file has {available} left")
    body = data[offset + ENTRY_PREFIX_SIZE:end]
    crc = zlib.crc32(body)
    if crc != prefix.crc:
        raise RecordError(f"bad checksum: crc32 {prefix.crc:#010x} stored, {crc:#010x} computed "
                          f"over {length} bytes")
    kind = body[0]
    if kind == KIND_APPEND:
        if length < APPEND_FIXED_SIZE:
            raise RecordError(f"APPEND entry of length {length} is shorter than its "
                              f"{APPEND_FIXED_SIZE}-byte fixed part")
        c = _APPEND_C.parse(body)
        if c.record_length != length - APPEND_FIXED_SIZE:
            raise RecordError(f"APPEND entry of length {length} says its record is "
                              f"{c.record_length} bytes (expected {length - APPEND_FIXED_SIZE})")
        return kind, c.seq, c.key, bytes(c.record), end
    if kind == KIND_RELEASE:
        if length != _RELEASE_BODY_SIZE:
            raise RecordError(f"RELEASE entry of length {length} (must be {_RELEASE_BODY_SIZE})")
        return kind, _RELEASE_C.parse(body).seq, 0, b"", end
    if kind == KIND_COPY_DONE:
        if length != _COPY_DONE_BODY_SIZE:
            raise RecordError(f"COPY_DONE entry of length {length} (must be "
                              f"{_COPY_DONE_BODY_SIZE})")
        c = _COPY_DONE_C.parse(body)
        return kind, c.seq, c.key, b"", end
    if kind == KIND_COPIES:
        try:
            c = COPIES_BODY.parse(body)
        except (construct.ConstructError, UnicodeDecodeError) as exc:
            raise RecordError(f"COPIES entry of length {length} is malformed: {exc}") from None
        if len(COPIES_BODY.build(c)) != length:
            raise RecordError(f"COPIES entry of length {length} has bytes after its "
                              f"{c.count} copies")
        return kind, c.seq, 0, tuple((x.key, x.host) for x in c.copies), end
    raise RecordError(f"unknown entry kind {kind}")


# --------------------------------------------------------------------------------------------
# The journal
# --------------------------------------------------------------------------------------------


class JournalError(RQPError):
    """The journal cannot be opened or used, or an operation on it failed."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A live message: appended and not released."""

    seq: int       #: journal sequence number
    key: int       #: the RQP unique message key given to the message
    record: bytes  #: the transmission record exactly as taken from the queue
    #: A broadcast message's copies not done yet, ``((key, host), ...)``; None: not broadcast.
    copies: Copies | None = None


#: A journal is compacted when it is at least this large and less than half of it is live. At
#: 4 MiB a sending MCA with 4 KiB SURE messages rewrote ~0.9 MB of live messages (two fsyncs
#: and a rename, on its event loop) every ~1,000 messages; at 32 MiB that is every ~8,000,
#: and a restart reads at most about 32 MiB plus what is live.
COMPACT_MIN_BYTES = 32 << 20


class Journal:
    """The durable journal of SURE messages of one sending MCA (see the module docstring).

    Opening it recovers the file: :attr:`recovered` holds the live entries found (in seq order)
    and :attr:`problems` what recovery had to repair. Use it as a context manager or call
    :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, name: str = "sender", *, fsync: bool = True,
                 compact_min_bytes: int = COMPACT_MIN_BYTES, compact_ratio: float = 0.5) -> None:
        self.directory = Path(directory)
        self.name = name
        self.path = self.directory / f"{name}.journal"
        self._file = LogFile(self.path, fsync=fsync)
        self.tmp_path = self._file.tmp_path
        self.lock_path = self.directory / f"{name}.journal.lock"
        self.compact_min_bytes = compact_min_bytes
        self.compact_ratio = compact_ratio
        self.recovered: list[JournalEntry] = []
        self.problems: list[str] = []
        #: What opening it did that is no fault (an older version rewritten): for an INFO line.
        self.notes: list[str] = []
        self._fsync = fsync
        self._cond = threading.Condition(threading.Lock())
        self._live: dict[int, tuple[int, bytes]] = {}  # seq -> (key, record), in seq order
        self._copies: dict[int, dict[int, str]] = {}  # live broadcast seq -> {key: host} not done
        self._live_bytes = 0
        self._next_seq = 1
        self._retired: list[int] = []  # descriptors of replaced files still used by a syncer
        self._syncers = 0
        self._failed: str | None = None
        self._closed = False
        self._compact_again = 0.0  # (monotonic time: see maybe_compact)
        self._said_compacting = -SAY_AGAIN  # (when the last line said so: monotonic)
        self._room_checked_size = -SMALL_DISK_DEAD  # (file size at the last statvfs)
        self._room_free: int | None = None  # (free bytes on its disk then)
        self._room_short = False  # (then less than the file takes: see _small_disk_worth)
        self._copy_failed_until = 0.0  # (monotonic: see _write_or_compact)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._open()
        except BaseException:
            self._file.close()
            os.close(self._lock_fd)
            self._closed = True
            raise
        self.recovered = self._entries()

    # --- opening ---------------------------------------------------------------------------

    def _take_lock(self) -> int:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalError(f"journal {self.path} is in use (another Journal holds "
                               f"{self.lock_path})") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _report(self, text: str) -> None:
        self.problems.append(f"{self.path}: {text}")

    def _open(self) -> None:
        for problem in self._file.remove_leftovers():
            self._report(problem)
        data = self._file.open()
        if data is None:
            self._create(1)
            return
        version = data[4] if len(data) > 4 else None
        try:
            header = _HEADER_C.parse(data[:FILE_HEADER_SIZE]) if len(data) >= FILE_HEADER_SIZE \
                else None
        except construct.ConstructError:
            header = None
        if header is not None and header.version not in READABLE_VERSIONS:
            raise JournalError(f"journal {self.path} has version {header.version}; this program "
                               f"reads versions {', '.join(map(str, READABLE_VERSIONS))} (left "
                               f"untouched)")
        if header is None:
            aside = self._file.move_aside("corrupt")
            what = (f"{len(data)} bytes, shorter than the {FILE_HEADER_SIZE}-byte header"
                    if len(data) < FILE_HEADER_SIZE else
                    f"bad header {data[:FILE_HEADER_SIZE].hex()} (magic {data[:4]!r}, version "
                    f"{version}, expected magic {JOURNAL_MAGIC!r} and zero reserved bytes)")
            self._report(f"not a journal: {what}; moved aside to {aside.name} (not overwritten) "
                         f"and a new, empty journal started: messages in it are NOT replayed")
            self._create(1)
            return
        self._replay(data, header.base_seq)
        finished = [seq for seq, left in self._copies.items() if not left]
        if finished:  # every copy done, the RELEASE torn off: released now
            self._write(b"".join(encode_release(seq) for seq in finished))
            for seq in finished:
                self._live_bytes -= _append_size(self._live.pop(seq)[1])
                del self._copies[seq]
        if header.version != JOURNAL_VERSION:
            self._compact_locked()  # nothing else uses it yet; a version-1 reader would drop
            self.notes.append(f"{self.path}: version-{header.version} journal rewritten as "
                              f"version {JOURNAL_VERSION} ({len(self._live)} live message(s) "
                              "kept)")  # (kinds 3, 4; an upgrade, no fault: a trial's was
            # logged at ERROR, which alerting on the log takes for one)

    def _replay(self, data: bytes, base_seq: int) -> None:
        live = self._live
        max_seq = 0
        offset = FILE_HEADER_SIZE
        bad: str | None = None
        while offset < len(data):
            try:
                kind, seq, key, record, end = _decode_entry(data, offset)
            except RecordError as exc:
                bad = str(exc)
                break
            if kind == KIND_APPEND:
                if seq in live:
                    raise JournalError(f"journal {self.path} is inconsistent: seq {seq} appended "
                                       f"again at offset {offset} while still live (file left "
                                       f"untouched; move it aside to start without it)")
                if seq <= max_seq or seq < base_seq:
                    self._report(f"APPEND of seq {seq} at offset {offset} is out of order "
                                 f"(largest seq before it {max_seq}, base_seq {base_seq}); kept")
                live[seq] = (key, record)
                self._live_bytes += _append_size(record)
            elif kind == KIND_COPIES:
                if seq in live:
                    self._copies[seq] = dict(record)
            elif kind == KIND_COPY_DONE:
                self._copies.get(seq, {}).pop(key, None)
                offset = end
                continue  # (names an APPEND's seq: not a seq of its own)
            else:
                # A RELEASE of a seq that is not live is the high-water mark of a compaction.
                if seq in live:
                    self._live_bytes -= _append_size(live.pop(seq)[1])
                    self._copies.pop(seq, None)
            max_seq = max(max_seq, seq)
            offset = end
        self._file.size = offset
        written = written_end(data, offset) if bad is not None else offset
        if written > offset:  # (only zeros after the good entries: reserved space)
            self._discard_tail(offset, written, bad)
        if len(live) > 1 and list(live) != sorted(live):
            self._live = dict(sorted(live.items()))
        self._next_seq = max(base_seq, max_seq + 1, 1)

    def _discard_tail(self, offset: int, written: int, reason: str) -> None:
        """Save the written bytes from ``offset`` on (to ``written``) to a side file, then cut
        the journal at ``offset``."""
        side = self._file.cut(offset, keep_copy="discarded")
        self._report(f"{reason} at offset {offset}; the {written - offset} "
                     f"bytes written from offset {offset} on were discarded (entries after a "
                     f"damaged one cannot be found safely; copy saved in {side.name}) and the "
                     f"file truncated to {offset} bytes")

    def _create(self, base_seq: int) -> None:
        self._file.create(encode_header(base_seq))
        self._next_seq = base_seq

    # --- state -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")
        if self._failed is not None:
            raise JournalError(f"journal {self.path} is unusable: {self._failed}")

    @property
    def live_count(self) -> int:
        """Number of live entries."""
        with self._cond:
            return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes the live APPEND entries take in the file (what a compaction would keep)."""
        with self._cond:
            return self._live_bytes

    @property
    def file_bytes(self) -> int:
        """Where the journal's entries end (header included): the file's length less the
        space reserved after them."""
        with self._cond:
            return self._file.size

    @property
    def next_seq(self) -> int:
        """The seq the next appended entry will get."""
        with self._cond:
            return self._next_seq

    @property
    def failed(self) -> str | None:
        """Why the journal became unusable (a failed fsync), or None."""
        return self._failed

    def live_entries(self) -> list[JournalEntry]:
        """The live entries now, in seq order."""
        with self._cond:
            return self._entries()

    def _entries(self) -> list[JournalEntry]:
        copies = self._copies
        return [JournalEntry(s, k, r, tuple(copies[s].items()) if s in copies else None)
                for s, (k, r) in self._live.items()]

    # --- writing ---------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Write ``data`` at the end of the valid data (lock held); on failure cut it back."""
        try:
            self._file.append(data)
        except BaseException as exc:
            stuck = getattr(exc, "cut_back_failed", None)
            if stuck is not None:
                self._failed = (f"a write failed ({_describe(exc)}) and cutting the file back "
                                f"to {self._file.size} bytes failed too ({_describe(stuck)})")
            if isinstance(exc, OSError):
                raise JournalError(f"writing to journal {self.path} failed: {exc}") from exc
            raise

    def _write_or_compact(self, data: bytes) -> None:
        """:meth:`_write`; if the disk is full and the file holds entries no longer live,
        compact it first and write again (a trial: a sending MCA whose small disk was full of
        its own delivered entries, below ``compact_min_bytes``, stopped at every start). A
        compaction that found no room for its copy is not tried again within a second (a
        reader halving its batch tried ten in a row)."""
        try:
            self._write(data)
        except JournalError as exc:
            cause = exc.__cause__
            if self._failed is not None or not no_space(exc) or \
                    self._file.size <= FILE_HEADER_SIZE + self._live_bytes or \
                    (self._live and time.monotonic() < self._copy_failed_until):
                raise
            loud = self._say_now()
            log.log(logging.WARNING if loud else logging.DEBUG, "journal %s: %s; compacting it "
                    "(%d bytes, %d of them live) and writing again", self.path, cause.strerror,
                    self._file.size, self._live_bytes)
            try:
                self._drop_dead_locked()
            except JournalError as failed:
                if no_space(failed):
                    self._copy_failed_until = time.monotonic() + 1.0
                log.log(logging.WARNING if loud else logging.DEBUG,
                        "journal %s: cannot compact it: %s", self.path, failed)
                raise exc  # (its cause, the full disk, kept: see no_space)
            self._write(data)

    def _say_now(self) -> bool:
        """Whether a line about compacting on a full disk is logged at WARNING now: one a
        minute (a full disk may stay so for hours; a trial logged 20 in 1.2 s), the others at
        DEBUG."""
        now = time.monotonic()
        if now - self._said_compacting < SAY_AGAIN:
            return False
        self._said_compacting = now
        return True

    def _drop_dead_locked(self) -> None:
        """Free the room of the entries no longer live: with none live, cut the file back in
        place (no new file); else compact it, the zeros ahead of its appends given back first
        on a disk getting full (trial 16: they held the copy's room). Raises JournalError."""
        try:
            if not self._cut_back_locked():
                if self._room_short:
                    self._file.give_back_zeros()
                self._compact_locked()
        except OSError as exc:  # (a cut back: ftruncate, a header, fsync)
            raise JournalError(f"cutting journal {self.path} back failed: {exc}") from exc

    def _cut_back_locked(self) -> bool:
        """With nothing live, cut the file back to its header in place (a trial's disk had no
        room even for a compaction's new file). Returns whether it held more."""
        if self._live or self._file.size <= FILE_HEADER_SIZE and \
                self._file.allocated <= FILE_HEADER_SIZE:
            return False
        self._file.reset(encode_header(self._next_seq))
        return True

    def cut_back_if_empty(self) -> bool:
        """Free the file's room when no entry in it is live (see :meth:`_cut_back_locked`):
        what a sending MCA does to make room for its reserve on a full disk. Raises OSError
        if the cut fails."""
        with self._cond:
            self._check_usable()
            return self._cut_back_locked()

    def _sync(self, fd: int) -> None:
        """fsync ``fd`` outside the lock; the caller counted itself in ``_syncers`` under it."""
        try:
            self._file.sync(fd)
        except OSError as exc:
            with self._cond:
                # A retired descriptor belongs to a file replaced by a compaction that ran after
                # our write and fsynced everything live in the new file: the error is moot.
                if fd not in self._retired:
                    self._failed = f"fsync failed: {exc}"
                    raise JournalError(f"fsync of journal {self.path} failed: {exc}; the journal "
                                       f"is now unusable") from exc
        finally:
            with self._cond:
                self._syncers -= 1
                if not self._syncers:
                    for old in self._retired:
                        os.close(old)
                    self._retired.clear()
                    self._cond.notify_all()

    def append(self, entries: Iterable[tuple]) -> list[int]:
        """Append one APPEND per ``(key, record)`` and make them all durable with one fsync.

        A broadcast message is ``(key, record, copies)``, ``copies`` = ``((key, host), ...)``:
        its COPIES entry is written with it. Returns their seqs. When it returns, the entries survive a crash of the machine.
        Raises :class:`JournalError` if the write or the fsync fails (after a failed write
        nothing was appended; after a failed fsync the journal is unusable), ``ValueError`` or
        ``TypeError`` for a bad key or record.
        """
        items: list[tuple[int, bytes, Copies | None]] = []
        for key, record, *more in entries:
            copies = tuple(more[0]) if more and more[0] is not None else None
            if copies is not None and not 0 < len(copies) <= MAX_COPIES:
                raise ValueError(f"a broadcast message has 1..{MAX_COPIES} copies, got "
                                 f"{len(copies)}")
            if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= UINT64_MAX:
                raise ValueError(f"key must be an integer in 0..{UINT64_MAX}, got {key!r}")
            if not isinstance(record, (bytes, bytearray, memoryview)):
                raise TypeError(f"record must be bytes, got {type(record).__name__}")
            record = bytes(record)
            if len(record) > MAX_RECORD_SIZE:
                raise ValueError(f"record of {len(record)} bytes is over the journal's limit of "
                                 f"{MAX_RECORD_SIZE}")
            items.append((key, record, copies))
        if not items:
            return []
        with self._cond:
            self._check_usable()
            first = self._next_seq
            if first + len(items) - 1 > UINT64_MAX:
                raise JournalError(f"journal {self.path} has run out of sequence numbers")
            seqs = list(range(first, first + len(items)))
            self._maybe_compact_locked(at_append=True)
            self._write_or_compact(b"".join(_encode_live(seq, key, record, copies)
                                            for seq, (key, record, copies) in zip(seqs, items)))
            self._next_seq = first + len(items)
            for seq, (key, record, copies) in zip(seqs, items):
                self._live[seq] = (key, record)
                self._live_bytes += _append_size(record)
                if copies is not None:
                    self._copies[seq] = dict(copies)
            fd = self._file.fd
            self._syncers += 1
        self._sync(fd)
        return seqs

    def release(self, seqs: Iterable[int]) -> None:
        """Write a RELEASE for every given seq that is live; others are ignored (so releasing
        twice is harmless). Not fsynced: see the module docstring. Raises
        :class:`JournalError` if the write fails (then nothing was released)."""
        wanted = list(seqs)
        with self._cond:
            self._check_usable()
            todo = [seq for seq in dict.fromkeys(wanted) if seq in self._live]
            if not todo:
                return
            try:
                self._write_or_compact(b"".join(encode_release(seq) for seq in todo))
            except JournalError as exc:
                if not no_space(exc) or self._failed is not None:
                    raise
                # Released in memory all the same, as a RELEASE lost in a crash (a re-send,
                # recognised by its key): so that the journal empties as the messages in
                # flight are confirmed, and its next append can cut it back in place.
                log.warning("journal %s: %d RELEASE entries not written (%s): after a crash "
                            "their messages would be sent again", self.path, len(todo),
                            exc.__cause__.strerror)
            for seq in todo:
                self._live_bytes -= _append_size(self._live.pop(seq)[1])
                self._copies.pop(seq, None)

    def copy_done(self, done: Iterable[tuple[int, int]]) -> list[int]:
        """A COPY_DONE for every ``(seq, copy key)`` of a live broadcast message, and a RELEASE
        for each message whose copies are then all done (returned). Not fsynced, like
        :meth:`release` (a copy sent again is recognised by its key). Others are ignored."""
        with self._cond:
            self._check_usable()
            parts, released, pending = [], [], {}
            for seq, key in done:
                left = pending.setdefault(seq, dict(self._copies.get(seq, {})))
                if key in left:
                    del left[key]
                    parts.append(encode_copy_done(seq, key))
                    if not left:
                        parts.append(encode_release(seq))
                        released.append(seq)
            if not parts:
                return []
            try:
                self._write_or_compact(b"".join(parts))
            except JournalError as exc:
                if not no_space(exc) or self._failed is not None:
                    raise
                log.warning("journal %s: %d COPY_DONE/RELEASE entries not written (%s): "
                            "after a crash those copies would be sent again", self.path,
                            len(parts), exc.__cause__.strerror)  # (as release() does)
            for seq, left in pending.items():
                if seq in self._copies:
                    self._copies[seq] = left
            for seq in released:
                self._live_bytes -= _append_size(self._live.pop(seq)[1])
                del self._copies[seq]
            return released

    def flush(self, fsync: bool = True) -> None:
        """Make everything written so far durable (releases included).

        Writes are never buffered in this process, so there is nothing to do without ``fsync``.
        """
        if not fsync:
            with self._cond:
                self._check_usable()
            return
        with self._cond:
            self._check_usable()
            fd = self._file.fd
            self._syncers += 1
        self._sync(fd)

    # --- compaction ------------------------------------------------------------------------

    def _should_compact(self, *, at_append: bool = False) -> bool:
        """Whether to compact now (see maybe_compact); ``at_append``: only for a disk that
        is getting full (compact_min_bytes is for releases: a compaction before an append
        delays it)."""
        size, live = self._file.size, self._live_bytes
        if not at_append and size >= self.compact_min_bytes and live < self.compact_ratio * size:
            return True
        if not self._room_short and self._room_looked_at(size):
            return False  # (a disk with room, looked at lately: the hot path)
        if size - live < min(RESERVE_LEAST, self.compact_min_bytes):
            return False
        return self._small_disk_worth(size, live)

    def _small_disk_worth(self, size: int, live: int) -> bool:
        """Whether the disk has less free room than the file takes (with the zeros allocated
        ahead of its appends) and still room for a copy of the live entries (none needed
        when none is live): then the file compacts long before compact_min_bytes, whatever
        part of it is live, from SMALL_DISK_DEAD dead bytes, or RESERVE_LEAST when the copy
        will soon not fit (trial 12: a journal of 2 MB on a 2 MiB disk, 96 % of it
        delivered entries, could not be compacted once full, and took no SURE record while a
        route was down; trial 14: with more than half of it live it waited for that, and by
        then the copy did not fit). The free room is looked up (statvfs) each time the file
        has grown by SMALL_DISK_DEAD/4 since, or shrunk."""
        if not self._room_looked_at(size):
            self._room_checked_size = size
            try:
                st = os.fstatvfs(self._file.fd)
                self._room_free = st.f_bavail * st.f_frsize
            except OSError:
                self._room_free = None
            self._room_short = self._room_free is not None and \
                self._room_free < max(size, self._file.allocated)
        free = self._room_free
        if not self._room_short:
            return False
        if not self._live:
            return True  # (cut back in place: no room needed)
        copy = live + FILE_HEADER_SIZE + RESERVE_LEAST
        free += max(0, self._file.allocated - size)  # (the zeros ahead: given back first)
        # from SMALL_DISK_DEAD dead bytes on, or any (RESERVE_LEAST) while a copy still fits
        # but will not for long (trial 14: 160 KB of them cost 20 messages of 8 KB)
        return copy < free and (size - live >= SMALL_DISK_DEAD or free < copy + SMALL_DISK_DEAD)

    def _room_looked_at(self, size: int) -> bool:
        """Whether the disk's free room was looked up since the file (now ``size`` bytes) last
        shrank or grew by SMALL_DISK_DEAD/4."""
        return 0 <= size - self._room_checked_size < SMALL_DISK_DEAD // 4

    def maybe_compact(self) -> bool:
        """Compact if less than ``compact_ratio`` of the file is live and it is at least
        ``compact_min_bytes``, or holds SMALL_DISK_DEAD dead bytes on a disk with less free
        room than it takes and room for the copy (:meth:`_small_disk_worth`). Returns
        whether it compacted. On a disk too full for the compacted copy it does not (logged),
        and tries again no sooner than COMPACT_AGAIN seconds later (each try writes the live
        entries until the disk is full); with nothing live it cuts the file back at once."""
        with self._cond:
            self._check_usable()
            return self._maybe_compact_locked()

    def _maybe_compact_locked(self, *, at_append: bool = False) -> bool:
        """:meth:`maybe_compact`, the lock held; ``at_append``: before an append, for a disk
        that is getting full only (trial 13: with a route down nothing was released, and the
        delivered entries of before were never compacted on a disk that was getting full)."""
        if not self._should_compact(at_append=at_append) or \
                (self._live and time.monotonic() < self._compact_again):  # (a cut: no room)
            return False
        try:
            self._drop_dead_locked()
        except JournalError as exc:
            if not no_space(exc) or self._failed is not None:
                raise
            self._compact_again = time.monotonic() + COMPACT_AGAIN
            log.log(logging.WARNING if self._say_now() else logging.DEBUG,
                    "journal %s: no room to compact it (%s; %d bytes, %d of them live): "
                    "tried again in %gs", self.path, exc.__cause__.strerror,
                    self._file.size, self._live_bytes, COMPACT_AGAIN)
            return False
        if at_append:
            log.debug("journal %s compacted before an append (its disk is getting full): %d "
                      "live message(s), %d bytes", self.path, len(self._live), self._file.size)
        return True

    def compact(self) -> None:
        """Rewrite the journal with only the live entries (see the module docstring).

        The lock is held throughout (appends and releases wait; the work is proportional to
        the live data). If it fails before the rename, the journal is unchanged and usable.
        """
        with self._cond:
            self._check_usable()
            self._compact_locked()

    def _compact_locked(self) -> None:
        live = list(self._live.items())
        base_seq = live[0][0] if live else self._next_seq
        parts = [encode_header(base_seq)]
        parts.extend(_encode_live(seq, key, record, self._copies.get(seq))
                     for seq, (key, record) in live)
        high = self._next_seq - 1
        if live and high > live[-1][0]:
            parts.append(encode_release(high))  # high-water mark: seqs never repeat
        data = b"".join(parts)
        try:
            old = self._file.replace(data, keep_old=True)
        except ReplaceFailed as exc:
            if not exc.replaced:
                raise JournalError(f"compaction of journal {self.path} failed: {exc.cause}; the "
                                   f"journal is unchanged") from exc
            self._retire(exc.old_fd)
            self._failed = f"fsync of the directory after compaction failed: {exc.cause}"
            raise JournalError(f"compaction of journal {self.path}: {self._failed}") from exc
        self._retire(old)

    def _retire(self, fd: int) -> None:
        """The descriptor of a replaced file: closed now, or when the fsyncs using it end."""
        if fd < 0:
            return
        if self._syncers:
            self._retired.append(fd)
        else:
            os.close(fd)

    # --- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """fsync (making releases durable) and close. Waits for an fsync in progress."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._syncers:
                self._cond.wait()
            error: OSError | None = None
            try:
                if self._failed is None and self._file.fd >= 0:
                    self._file.sync()
            except OSError as exc:
                error = exc
            finally:
                for fd in (*self._retired, self._lock_fd):
                    if fd >= 0:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                with contextlib.suppress(OSError):
                    self._file.close()
                self._retired.clear()
            if error is not None:
                raise JournalError(f"fsync of journal {self.path} at close failed: {error}")

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failed else "open"
        return (f"<Journal {str(self.path)!r} {state} live={len(self._live)} "
                f"size={self._file.size} next_seq={self._next_seq}>")
