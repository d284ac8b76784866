"""The receiving MCA's de-duplication window for SURE messages, kept in a file in ``state_dir``.

A sending MCA sends a SURE message again, with the same unique 64-bit key (spec 5.6), when the
``DELIVERED_YES`` for it was lost or when it restarted and replayed its journal. The receiving
MCA remembers the key of every SURE message it has put, for a while (NATS JetStream's
``duplicate_window`` is the model), and answers a repeat ``DELIVERED_YES`` without putting it
again. Keys are unique over all senders (``incarnation << 32 | counter`` with a random first
incarnation), so one window serves every sender.

How the receiver uses it
========================

For each SURE ``MESSAGE`` of a batch, in order::

    if window.seen(key):          # a repeat: already put
        answer DELIVERED_YES
    else:
        put it on the queue       # only when the put succeeded:
        window.record(key)
        answer DELIVERED_YES
    ...
    window.commit()               # ONE fsync for the whole batch ...
    write the batch's answers     # ... BEFORE any of its DELIVERED_YES leaves the host

The receiving MCA splits ``commit()`` in two so that the fsync does not stop its event loop:
``begin_commit()`` takes the recorded entries (memory only), ``finish_commit()`` writes and
fsyncs them in a writer thread, and the batch's answers are written when that is done, while
the loop goes on reading and putting the next requests (group commit with pipelining, as
databases do it). Commits finish in the order they began; an answer batch with no new entry
waits for the last commit begun (a repeat may be confirmed by it).

``seen`` and ``record`` touch memory only (O(1)); ``record`` buffers the entry and ``commit``
writes every buffered entry and fsyncs once (group commit). A repeat whose original is still
uncommitted is recognised too (the window is in memory), and the ``commit`` before the answers
makes its original durable. For one key, ``seen``, the put and ``record`` must not interleave
with another ``seen`` of the same key (the receiver must not yield to another connection
between them), or both copies are put.

What is still put twice
=======================

The window is exact against lost ``DELIVERED_YES`` frames and sender restarts, within its
size. A message is put a second time only in these cases:

1. **Receiver crash between a put and the end of the** ``commit()`` **that covers it.** The
   key was not durable, but no ``DELIVERED_YES`` was sent for the message either (answers are
   written only after ``commit()`` returned), so the sender sends it again and the restarted
   receiver puts it again. At most the messages put since the last completed ``commit()`` are
   affected: one uncommitted batch. (The same holds for a crash between the put and
   ``record()``.) With ``fsync=False`` the entries of a completed ``commit()`` survive a crash
   of the process but not a crash of the operating system or a power cut: then every batch
   whose entries the kernel had not yet written back is affected.
2. **A repeat that comes after its key left the window**: recorded ``max_age`` seconds ago or
   more, or more than ``max_keys`` other keys were recorded after it. The sender's retry budget
   (``retry_max_age``) must be well inside ``dedup_window_age``, and ``max_keys`` must cover
   that time at the peak message rate. A wall clock stepped forward shortens the window by the
   step (stepped back, it lengthens it).
3. **A damaged file**: at open, entries from the first bad one on are dropped (see below).
   After a crash only the last ``commit()``'s write can be torn, and its messages are in case 1
   already; damage anywhere else (a bad disk, an edited or lost file) loses those keys.
4. **After** ``commit()`` **raised**: the entries stay in memory (``seen`` still answers for
   them) but may not be durable. The receiver must not answer ``DELIVERED_YES`` for the batch;
   a failed write is retried by the next ``commit()``; after a failed ``fsync`` (whose outcome
   is unknown) every ``commit()`` raises until the window is reopened or ``compact()``
   succeeds (it writes a new file from memory).

A key is only recorded after its message was put, so the window never makes the receiver drop
a message that was not delivered: remembering a key too long is harmless, forgetting it too
early is a duplicate.

The window
==========

``seen(key)`` is true when the newest entry for ``key`` is among the newest ``max_keys``
entries of distinct keys and is younger than ``max_age`` (``now_ms - time_ms < max_age_ms``,
both in whole milliseconds of ``clock()``). ``record(key)`` of a key that is in the window
does nothing (the window counts from the first delivery); of any other key it adds an entry
with the time now. Reopening the file gives exactly the window that was committed (with the
same ``max_keys``): expiry is a function of the entries' order and times, so a key that had
expired is not brought back. A larger ``max_keys`` at reopen may bring back keys the old limit
dropped if their entries were not yet compacted away; those were delivered, so that is
harmless. In memory the keys are an ``OrderedDict`` key -> ``time_ms`` in record order:
``record`` drops the oldest key when there are more than ``max_keys``, ``expire()`` drops
keys past ``max_age`` from the front. ``max_keys == 0`` (or ``max_age == 0``) disables the
window: nothing is remembered and the file is not touched.

The file
========

All integers are unsigned big-endian; there is no padding. A file header, then entries of 20
bytes each, appended in record order:

======  ====  ========  ==================================================================
offset  size  field     meaning
======  ====  ========  ==================================================================
0       4     magic     the bytes ``"RQPD"`` (0x52 0x51 0x50 0x44)
4       1     version   1
5       3     reserved  written as 0, ignored when read
======  ====  ========  ==================================================================

Entry *i* starts at offset ``8 + 20 * i``:

======  ====  ========  ==================================================================
offset  size  field     meaning
======  ====  ========  ==================================================================
0       4     crc32     CRC-32 (zlib / ISO-HDLC, as ``zlib.crc32``) of the 16 bytes 4..19
4       8     key       the RQP unique message key
12      8     time_ms   unix time in milliseconds when the key was recorded
======  ====  ========  ==================================================================

A key may have several entries (recorded again after it expired); the last one counts.
After the last entry the file holds zero bytes: space allocated ahead of the appends
(:mod:`rqp.storage.log`), so that a commit's sync need not write the file's size each time.

**Reading** (at open) stops at the first entry whose crc32 does not match (an entry of zeros
never does: the crc32 of 16 zero bytes is 0xecbb4b55), or at a last entry shorter than 20
bytes (a torn write); every entry before it is kept. If only zero bytes follow, that is the
reserved space and the clean end of the file. Otherwise the file is cut there (and fsynced)
so that new entries follow good ones, and ``problems`` says what was dropped, at which offset.
A file that does not start with the magic is refused (:class:`DedupError`), as is an unknown
version; an empty file or a torn header is taken as an empty window and rewritten.

**Compaction**: when, after a ``commit()``, the file holds more than twice as many entries as
there are keys in the window and is larger than ``compact_min_bytes`` (64 KiB), the keys of the
window are written to a temporary file ``<name>.tmp`` in the same directory, which is
fsynced and renamed over the file, and the directory is fsynced (:meth:`LogFile.replace
<rqp.storage.log.LogFile.replace>`, the log store the journal uses too). A crash leaves either
the old file or the new one; a temporary file found at open is a leftover of such a crash and is
deleted, never read.
Compaction costs O(keys in the window) once per at least as many ``record()`` calls.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from construct import Bytes, Const, Int8ub, Int32ub, Int64ub, Struct

from rqp.protocol.codec import struct_of
from rqp.protocol.constants import UINT64_MAX
from rqp.protocol.errors import RQPError
from rqp.storage.log import LogFile, ReplaceFailed, written_end

__all__ = [
    "scoped_key",
    "DEDUP_ENTRY",
    "DEDUP_ENTRY_SIZE",
    "DEDUP_HEADER",
    "DEDUP_HEADER_SIZE",
    "DEDUP_MAGIC",
    "DEDUP_VERSION",
    "DedupError",
    "DedupWindow",
    "encode_entry",
    "window_path",
]

log = logging.getLogger("rqp.storage.dedup")

DEDUP_MAGIC = b"RQPD"
DEDUP_VERSION = 1

#: The 8-byte file header.
DEDUP_HEADER = Struct(
    "magic" / Const(DEDUP_MAGIC),
    "version" / Const(DEDUP_VERSION, Int8ub),
    "reserved" / Bytes(3),
)
DEDUP_HEADER_SIZE: int = DEDUP_HEADER.sizeof()
_HEADER_BYTES: bytes = DEDUP_HEADER.build({"reserved": bytes(3)})

#: One 20-byte entry; ``crc32`` covers the 16 bytes of ``key`` and ``time_ms``.
DEDUP_ENTRY = Struct(
    "crc32" / Int32ub,
    "key" / Int64ub,
    "time_ms" / Int64ub,
)
DEDUP_ENTRY_SIZE: int = DEDUP_ENTRY.sizeof()

# DEDUP_ENTRY as a ``struct`` derived from it (rqp.protocol.codec), for speed: a window of a
# million keys is read at open and written at compaction, where construct (even compiled)
# costs several times more. _BODY is the part its crc32 covers. The tests check both agree.
_ENTRY = struct_of(DEDUP_ENTRY)
_BODY = struct_of(Struct(*DEDUP_ENTRY.subcons[1:]))
assert _ENTRY.size == DEDUP_ENTRY_SIZE and DEDUP_HEADER_SIZE == 8

#: Compaction does not run on files smaller than this (1 MiB before a trial's window of 1,000
#: keys, 20 KB, filled a 1 MiB state_dir with dead entries before its first compaction).
DEFAULT_COMPACT_MIN_BYTES = 64 << 10


class DedupError(RQPError):
    """The de-duplication file cannot be read or written (the message names the file)."""


def scoped_key(peer: str, key: int) -> int:
    """The window's key for message ``key`` from ``peer`` (its source address; its TLS
    identity once there is one): 64 bits of BLAKE2b over both. Message keys are only unique
    per sender, and run in sequence, so a window keyed by the message key alone let one peer
    make another's next SURE messages look like repeats (answered, never put). Windows
    written before scoping hold plain keys: a repeat of a message delivered before the
    upgrade is put once more (a duplicate, never a loss)."""
    hasher = _peer_hashers.get(peer)
    if hasher is None:  # a keyed BLAKE2b costs a compression to start: one per peer, copied
        if len(_peer_hashers) >= 4096:
            _peer_hashers.clear()
        hasher = _peer_hashers[peer] = hashlib.blake2b(
            digest_size=8, key=peer.encode("utf-8", "surrogatepass")[:64])
    hasher = hasher.copy()
    hasher.update(key.to_bytes(8, "big"))
    return int.from_bytes(hasher.digest(), "big")


_peer_hashers: dict[str, "hashlib._Hash"] = {}


def window_path(state_dir: str | os.PathLike, name: str = "receiver") -> Path:
    """Where the window of the agent called ``name`` lives in ``state_dir``."""
    return Path(state_dir) / f"{name}.dedup"


def encode_entry(key: int, time_ms: int) -> bytes:
    """The 20 bytes of one entry, with its crc32."""
    body = _BODY.pack(key, time_ms)
    return _ENTRY.pack(zlib.crc32(body), key, time_ms)


def _encode_entries(items) -> bytes:
    pack_body, pack = _BODY.pack, _ENTRY.pack
    crc32 = zlib.crc32
    return b"".join([pack(crc32(pack_body(k, t)), k, t) for k, t in items])


class DedupWindow:
    """The keys of the SURE messages put recently; see the module documentation.

    ``path`` None keeps the window in memory only. ``clock`` gives unix time in seconds (it is
    kept to the millisecond). ``fsync=False`` writes at ``commit()`` without fsync (tests,
    or a host where the receiver's durability does not matter). Problems found while reading
    the file are in ``problems`` (one line each, with the offset); the caller logs them.

    Raises :class:`DedupError` if the file cannot be read or created, or is not a window file;
    ``ValueError`` for a negative ``max_keys`` or ``max_age``. One thread uses the window;
    only ``finish_commit`` and ``finish_compact`` may run in another (one writer thread, in
    the order their ``begin_`` halves were called). One process owns the file.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        max_keys: int = 1_000_000,
        max_age: float = 24 * 3600.0,
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
        compact_min_bytes: int = DEFAULT_COMPACT_MIN_BYTES,
    ) -> None:
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 0:
            raise ValueError(f"max_keys must be an integer >= 0, got {max_keys!r}")
        if not max_age >= 0:
            raise ValueError(f"max_age must be >= 0 seconds, got {max_age!r}")
        if not isinstance(compact_min_bytes, int) or compact_min_bytes < 0:
            raise ValueError(f"compact_min_bytes must be an integer >= 0, "
                             f"got {compact_min_bytes!r}")
        self.path: Path | None = None if path is None else Path(path)
        self.max_keys = max_keys
        self.max_age = float(max_age)
        self.compact_min_bytes = compact_min_bytes
        self.problems: list[str] = []
        # An infinite max_age: keys leave the window by count only.
        self._max_age_ms = 1 << 64 if math.isinf(self.max_age) else round(self.max_age * 1000)
        self._clock = clock
        self._fsync = fsync
        self._enabled = self.max_keys > 0 and self._max_age_ms > 0
        self._keys: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pending: list[tuple[int, int]] = []
        self._unwritten: list[tuple[int, int]] = []  # a commit's entries whose write failed
        self._lock = threading.Lock()  # finish_commit / finish_compact / close, one at a time
        self._file = LogFile(self.path, fsync=fsync) if self.path is not None else None
        self._file_entries = 0
        self._compact_floor = compact_min_bytes
        self._failed: BaseException | None = None  # an fsync failed: commit() refuses
        self._closed = False
        if self.path is not None and self._enabled:
            self._open()

    # ---------------------------------------------------------------------------------------
    # The hot path: memory only

    def _now_ms(self) -> int:
        return max(0, int(self._clock() * 1000))

    def seen(self, key: int) -> bool:
        """Whether ``key`` was recorded within the window (committed or not). No I/O."""
        t = self._keys.get(key)
        return t is not None and self._now_ms() - t < self._max_age_ms

    def recorded_at(self, key: int) -> float | None:
        """When ``key`` was recorded (Unix seconds), if it is in the window; else None."""
        t = self._keys.get(key)
        if t is None or self._now_ms() - t >= self._max_age_ms:
            return None
        return t / 1000.0

    def record(self, key: int) -> None:
        """Remember ``key``, whose message was just put. Buffered: ``commit()`` makes it durable.

        A key already in the window is left as it is. O(1): when the window holds more than
        ``max_keys`` keys, the oldest one is dropped here.
        """
        if not self._enabled:
            return
        if self._closed:
            raise DedupError(f"{self._name()}: record() after close()")
        keys = self._keys
        now = self._now_ms()
        t = keys.get(key)
        if t is not None:
            if now - t < self._max_age_ms:
                return
            del keys[key]
        elif not (isinstance(key, int) and 0 <= key <= UINT64_MAX):
            raise ValueError(f"a message key is an integer in 0..2**64-1, got {key!r}")
        keys[key] = now
        self._pending.append((key, now))
        if len(keys) > self.max_keys:
            keys.popitem(last=False)

    # ---------------------------------------------------------------------------------------
    # Durability

    def commit(self) -> None:
        """Make every ``record()`` so far durable: one write and ONE fsync for all of them.

        Nothing to do (no write, no fsync) if nothing was recorded since the last commit.
        Raises :class:`DedupError` if the entries could not be written or fsynced; they stay
        in memory, and a failed write is retried by the next commit. After a failed fsync
        every commit raises (the outcome of that fsync is unknown, and Linux may report the
        next one as a success) until the window is reopened or ``compact()`` succeeds.
        ``commit()`` is :meth:`begin_commit` and :meth:`finish_commit` in one thread.
        """
        entries = self.begin_commit()
        if entries is not None:
            self.finish_commit(entries)
            if self.compaction_due():
                try:
                    self.compact()
                except DedupError as exc:  # the commit itself is done; try again later
                    log.warning("%s", exc)

    def begin_commit(self) -> list[tuple[int, int]] | None:
        """The first half of a commit, in memory only: hands over the entries recorded since
        the last one (None when there is nothing to write) for :meth:`finish_commit`, which
        may run in another thread (the receiving MCA's writer thread) while ``seen`` and
        ``record`` go on. Raises :class:`DedupError` after a failed fsync (see ``commit``)."""
        if self._closed:
            raise DedupError(f"{self._name()}: commit() after close()")
        failed = self._failed
        if failed is not None:
            raise DedupError(
                f"{self.path}: an earlier fsync failed ({failed}); reopen the window"
            ) from failed
        if self.path is None or not self._enabled:
            self._pending.clear()
            return None
        if not self._pending and not self._unwritten:
            return None
        entries, self._pending = self._pending, []
        return entries

    def finish_commit(self, entries: list[tuple[int, int]]) -> None:
        """The second half: write ``entries`` (after those of a commit whose write failed)
        and fsync, once. Calls must come one at a time, in the order of ``begin_commit``
        (one writer thread); a lock keeps them apart from compaction and ``close``. Raises
        :class:`DedupError` as ``commit`` does: then none of these entries may be answered
        for, and a failed write is retried by the next commit."""
        with self._lock:
            if self._failed is not None:
                raise DedupError(f"{self.path}: an earlier fsync failed ({self._failed}); "
                                 "reopen the window") from self._failed
            batch = self._unwritten + entries if self._unwritten else entries
            data = _encode_entries(batch)
            try:
                self._file.append(data)  # at the end of the good data: a retry overwrites
            except OSError as exc:
                self._unwritten = batch
                raise DedupError(f"{self.path}: cannot write {len(data)} bytes: {exc}") from exc
            self._unwritten = []
            try:
                self._file.sync()
            except OSError as exc:
                self._failed = exc
                raise DedupError(f"{self.path}: fsync failed: {exc}") from exc
            self._file_entries += len(batch)

    def compaction_due(self) -> bool:
        """Whether the file holds more than twice the window's keys (and is large enough)."""
        return (self._file is not None and self._file_entries > 2 * len(self._keys)
                and self._file.size > self._compact_floor)

    def compact(self) -> None:
        """Rewrite the file with the keys of the window only (atomically; also a commit)."""
        if self._closed:
            raise DedupError(f"{self._name()}: compact() after close()")
        snapshot = self.begin_compact()
        if snapshot is not None:
            self.finish_compact(snapshot)
        self._pending.clear()  # in the snapshot

    def begin_compact(self) -> tuple[bytes, int] | None:
        """In memory: the new file's bytes and entry count (every key of the window,
        committed or not), for :meth:`finish_compact` in the writer thread. Keys recorded
        after it are committed after it, into the new file."""
        self.expire()
        if self.path is None or not self._enabled:
            self._pending.clear()
            return None
        now = self._now_ms()
        age = self._max_age_ms
        live = [(k, t) for k, t in self._keys.items() if now - t < age]
        return _HEADER_BYTES + _encode_entries(live), len(live)

    def finish_compact(self, snapshot: tuple[bytes, int]) -> None:
        """Replace the file with ``snapshot`` (atomically); on failure the old file stays and
        compaction is tried again later (DedupError)."""
        data, entries = snapshot
        with self._lock:
            try:
                self._file.replace(data)
            except ReplaceFailed as exc:
                if exc.replaced:
                    # Renamed, but the directory fsync failed: the new file is in place,
                    # whether the rename survives a crash is unknown. Like a failed fsync.
                    if exc.old_fd >= 0:
                        os.close(exc.old_fd)
                    self._adopt(data, entries)
                    self._failed = exc
                self._compact_floor = self._file.size + self.compact_min_bytes
                raise DedupError(f"{self.path}: compaction failed: {exc.cause}") from exc
            self._adopt(data, entries)
            self._failed = None  # the new file was fsynced as a whole, and its directory

    def _adopt(self, data: bytes, entries: int) -> None:
        """The file is now ``data`` (a compaction), which holds every key recorded before it."""
        self._unwritten = []
        self._file_entries = entries
        self._compact_floor = self.compact_min_bytes

    # ---------------------------------------------------------------------------------------
    # Housekeeping

    def resize(self, max_keys: int, max_age: float) -> int:
        """New limits (a SIGHUP reload): keys now beyond them leave the window at once (the
        number is returned). Turning the window on or off needs a restart (ValueError)."""
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 0:
            raise ValueError(f"max_keys must be an integer >= 0, got {max_keys!r}")
        if not max_age >= 0:
            raise ValueError(f"max_age must be >= 0 seconds, got {max_age!r}")
        age_ms = 1 << 64 if math.isinf(max_age) else round(max_age * 1000)
        if (max_keys > 0 and age_ms > 0) != self._enabled:
            raise ValueError("turning the de-duplication window on or off needs a restart")
        self.max_keys, self.max_age, self._max_age_ms = max_keys, float(max_age), age_ms
        return self.expire()

    def expire(self) -> int:
        """Drop the keys beyond ``max_keys`` and those ``max_age`` old, oldest first.

        Returns how many were dropped. O(dropped): it stops at the first key still in the
        window (with a clock that went back, a later key past its age may stay in memory;
        ``seen`` is false for it all the same).
        """
        keys = self._keys
        dropped = 0
        while len(keys) > self.max_keys:
            keys.popitem(last=False)
            dropped += 1
        cutoff = self._now_ms() - self._max_age_ms  # expired: time_ms <= cutoff
        while keys:
            if keys[next(iter(keys))] > cutoff:
                break
            keys.popitem(last=False)
            dropped += 1
        return dropped

    def __len__(self) -> int:
        """Keys held in memory (exact after ``expire()``)."""
        return len(self._keys)

    def state(self) -> dict:
        """The window as status and metrics show it, once the keys past ``max_age`` are
        dropped (they recognise nothing any more: counted, they made a window look full
        whose keys were only old): ``keys`` held, the limits ``max_keys`` and ``max_age``
        (seconds; None for no age limit), ``oldest_age`` (seconds; None when empty) and
        ``full``: ``max_keys`` keys are held, all younger than ``max_age``, so each new one
        pushes out the oldest before its age, and a key stays only about ``oldest_age`` (a
        repeat arriving later is put again)."""
        if self._enabled:
            self.expire()
        held = len(self._keys)
        return {"keys": held, "max_keys": self.max_keys,
                "max_age": None if math.isinf(self.max_age) else self.max_age,
                "oldest_age": self.oldest_age(),
                "full": self._enabled and held >= self.max_keys}

    def oldest_age(self) -> float | None:
        """Age in seconds of the oldest key held (None if none; past ``max_age`` until
        ``expire()`` runs)."""
        if not self._keys:
            return None
        return (self._now_ms() - self._keys[next(iter(self._keys))]) / 1000.0

    @property
    def unwritten(self) -> bool:
        """A commit's write failed (a full disk) and no write since has taken its entries:
        keys recorded now may not become durable. The next commit retries them."""
        return bool(self._unwritten)

    @property
    def broken(self) -> bool:
        """An fsync failed: no commit can succeed until the window is reopened."""
        return self._failed is not None

    @property
    def pending(self) -> int:
        """Entries recorded but not yet committed."""
        return len(self._pending) + len(self._unwritten)

    def close(self, *, commit: bool = True) -> None:
        """Commit (unless ``commit=False``: the buffered entries are dropped, as by a crash)
        and close the file. Closing twice is allowed."""
        if self._closed:
            return
        try:
            if commit:
                self.commit()
        finally:
            self._pending.clear()
            with self._lock:
                self._unwritten = []
                if self._file is not None:
                    self._file.close()
                self._closed = True

    def __enter__(self) -> "DedupWindow":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DedupWindow({self._name()}, keys={len(self._keys)}, "
                f"pending={len(self._pending)}, max_keys={self.max_keys}, "
                f"max_age={self.max_age})")

    # ---------------------------------------------------------------------------------------
    # The file

    def _name(self) -> str:
        return str(self.path) if self.path is not None else "<memory>"

    def _open(self) -> None:
        path, file = self.path, self._file
        self.problems.extend(file.remove_leftovers())
        try:
            data = file.open()
        except OSError as exc:
            raise DedupError(f"{path}: cannot open or read the de-duplication window: "
                             f"{exc}") from exc
        if data is None:
            self._create()
            return
        if len(data) < DEDUP_HEADER_SIZE:
            file.close()
            if data != _HEADER_BYTES[: len(data)]:
                raise DedupError(f"{path}: not a de-duplication window file "
                                 f"(starts with {bytes(data[:4])!r}, expected {DEDUP_MAGIC!r})")
            if data:
                self.problems.append(f"{path}: offset 0: torn header of {len(data)} bytes; "
                                     f"taken as an empty window")
            self._create()
            return
        if data[:4] != DEDUP_MAGIC:
            file.close()
            raise DedupError(f"{path}: not a de-duplication window file "
                             f"(starts with {bytes(data[:4])!r}, expected {DEDUP_MAGIC!r})")
        if data[4] != DEDUP_VERSION:
            file.close()
            raise DedupError(f"{path}: unsupported de-duplication file version {data[4]} "
                             f"(this program reads version {DEDUP_VERSION})")
        good_end, damaged = self._load(data)
        file.size = good_end
        if damaged:  # (only zeros after the good entries: reserved space, nothing to cut)
            try:
                file.cut(good_end)
            except OSError as exc:
                file.close()
                raise DedupError(f"{path}: cannot cut the damaged tail at offset {good_end}: "
                                 f"{exc}") from exc

    def _load(self, data: bytes) -> tuple[int, bool]:
        """Replay the entries of ``data`` (a whole file); return where the good ones end, and
        whether anything but zeros follows them."""
        body = memoryview(data)[DEDUP_HEADER_SIZE:]
        size = DEDUP_ENTRY_SIZE
        whole = len(body) // size * size
        keys: collections.OrderedDict[int, int] = collections.OrderedDict()
        max_keys = self.max_keys
        crc32 = zlib.crc32
        count = 0
        bad = None
        for offset, (crc, key, t) in zip(range(0, whole, size), _ENTRY.iter_unpack(body[:whole])):
            if crc32(body[offset + 4: offset + size]) != crc:
                bad = (crc, crc32(body[offset + 4: offset + size]))
                break
            if key in keys:
                del keys[key]
            keys[key] = t
            if len(keys) > max_keys:
                keys.popitem(last=False)
            count += 1
        end = DEDUP_HEADER_SIZE + count * size
        written = written_end(data, end)  # then to the end of its entry (may end in zeros):
        written = min(len(data), written + (DEDUP_HEADER_SIZE - written) % size)
        if written == end:
            pass  # the clean end: nothing, or only the reserved space, after the last entry
        elif bad is not None:
            stored, computed = bad
            self.problems.append(
                f"{self.path}: offset {end}: entry {count} has crc32 {stored:#010x}, its bytes "
                f"give {computed:#010x}; it and the {max(0, written - end - size)} bytes "
                f"after it are dropped (the file is cut at offset {end})")
        else:
            self.problems.append(
                f"{self.path}: offset {end}: torn last entry of {len(body) - whole} bytes "
                f"(an entry is {size}); dropped (the file is cut at offset {end})")
        now = self._now_ms()
        age = self._max_age_ms
        self._keys = collections.OrderedDict(
            (k, t) for k, t in keys.items() if now - t < age)
        self._file_entries = count
        return end, written > end

    def _create(self) -> None:
        try:
            self._file.create(_HEADER_BYTES)
        except OSError as exc:
            raise DedupError(f"{self.path}: cannot create the de-duplication window: "
                             f"{exc}") from exc
        self._file_entries = 0
