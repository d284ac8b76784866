"""The dead-letter archive: gzip-compressed JSON Lines files, schema version 2.

``rqp-dlq-drain`` (:mod:`rqp_agents.drain`) moves dead-letter records off ``DEAD.LETTER.Q``
into an archive directory; ``rqpctl dlq replay`` (:mod:`rqp.tools.replay`) puts them back with rules;
analysis jobs (PySpark: ``spark.read.json("ARCHIVE/*.jsonl.gz")``) read the files directly.

Files
=====

``{archive}/dlq-{host}-{YYYYmmddTHHMMSS.ffffff}Z-{pid}-{n:06d}.jsonl.gz``: ``host`` is the host
name of the drain that wrote it (characters other than ``A-Za-z0-9_.-`` become ``_``), the
time is UTC when the file was named, ``pid`` the writer's process id and ``n`` a counter of
that process. Each file is one gzip member holding UTF-8 (in fact pure ASCII: non-ASCII
characters are ``\\uXXXX`` escapes) JSON Lines: one JSON object per dead letter, in the order
the records had on the queue, each line ending with ``\\n``.

A file is written in ``{archive}/.incoming/`` (same file system), flushed and fsynced, and only
then renamed into ``{archive}/`` (and the directory fsynced): a reader never sees a partial
file, and an archive file, once visible, is complete. A rewrite (``rqpctl dlq replay`` removing
replayed rows) is done the same way and renamed over the old file. Hidden entries
(``.incoming/``, ``.state/``) are not archive files; Spark and Hadoop skip names starting with
``.`` or ``_``.

``{archive}/.state/{host}.last`` (JSON, written atomically) is the drain's memory of its last
batch: ``{"files": [names], "queue": "0x5251dead", "done": false|true}``. See
:mod:`rqp_agents.drain` for how it prevents both loss and duplicates.

Rows (schema 2)
===============

Exactly these keys, always all present (:data:`ROW_KEYS`):

=================  =========  =================================================================
key                type       meaning
=================  =========  =================================================================
schema             int        2 (1: written before the keys marked 2 below existed; a reader
                              takes their defaults: record_version 1, mtype 1, priority 4,
                              expires_at_ms 0)
id                 string     first 32 hex digits of the SHA-256 of the raw record bytes: the
                              record's identity. Two rows with the same id are the same dead
                              letter archived twice: readers drop duplicates by id.
archived_by        string     host name of the drain that archived it
archived_at        string     when, ISO-8601 UTC with microseconds: ``2024-05-01T12:00:00.123456Z``
host               string     host where it was dead-lettered
agent              string     ``api``, ``sender``, ``receiver``, ``tool``, or the number as a
                              string if unknown (``"7"``)
reason             string     :class:`~rqp.protocol.records.ReasonCode` name, ``UNKNOWN_<n>`` for a number
                              this version does not know, ``MALFORMED`` (see below)
reason_code        int        the number (-1 for ``MALFORMED``)
queue_key          int        the original queue key (uint64: may be > 2**32-1)
queue_key_hex      string     ``0x52510001`` (at least 8 hex digits)
queue_name         string     the key's name in the drain's ``.rqprc`` ``queues``, else null
message_key        string     ``0x%016x``: the RQP message key (a uint64 does not fit Spark's
                              signed long, so it is a string)
message_type       string     ``SURE``, ``UNSURE``, ``UNKNOWN`` (255), or ``UNKNOWN_<n>`` for
                              another byte (so that a row always gives back its record)
timestamp          string     when it was dead-lettered, ISO-8601 UTC (microseconds)
timestamp_ns       int        the same, Unix nanoseconds (full precision)
attempts           int        delivery attempts made
original_length    int        length of the original payload
payload_length     int        length of the payload kept (< original_length when truncated)
truncated          bool       the payload was cut; the whole of it is in ``spill_path``
header_only        bool       the payload was never read
source_host        string     host the message came from ('' if local)
destination_host   string     host it was going to ('' if unknown)
detail             string     human-readable detail
spill_path         string     file with the full payload when truncated, else ''
payload_b64        string     the payload kept, base64 (standard alphabet, padded)
payload_preview    string     the first 64 payload bytes for a human: printable ASCII kept
                              (except ``\\``), every other byte as ``\\xNN``; then ``…`` if the
                              payload is longer. Safe in any terminal or viewer.
record_version     int        (2) the dead-letter record's version (1 or 2; 0 for MALFORMED)
mtype              int        (2) the System V type the message was to be put with: a replay
                              puts it with that type (0 for MALFORMED)
priority           int        (2) its priority 0..9 (kept by a replay)
expires_at_ms      int        (2) its expiry, Unix ms, 0 = never (a replay does not expire)
=================  =========  =================================================================

A record that :meth:`DeadLetterRecord.from_bytes` rejects is archived anyway, never dropped:
reason ``MALFORMED``, reason_code -1, its raw bytes in ``payload_b64``, the parse error in
``detail``, ``host`` = the drain's host, ``agent`` ``unknown``, ``message_type`` ``UNKNOWN``,
numbers 0, strings empty, ``timestamp`` = ``archived_at``.

:func:`row_to_record` gives back the :class:`DeadLetterRecord` of a row; its ``to_bytes()`` is
the raw record the ``id`` was computed from (for every record whose flags use only the two
defined bits, which is every record RQP writes). :func:`row_raw_bytes` also works for
``MALFORMED`` rows.

Compatibility: a later schema adds keys and increases ``schema``; it never changes the meaning
or type of a key above.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import fcntl
import gzip
import hashlib
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rqp.protocol import reasons
from rqp.protocol.errors import RecordError, RQPError
from rqp.protocol.records import (
    UNKNOWN_MESSAGE_TYPE, AgentKind, DeadLetterFlags, DeadLetterRecord,
)
from rqp.system.files import fsync_dir

__all__ = [
    "ArchiveError",
    "all_drain_states",
    "ArchiveWriter",
    "DrainState",
    "MALFORMED",
    "MALFORMED_CODE",
    "NOTICE_AGENT",
    "NOTICE_MESSAGE_TYPE",
    "ROW_KEYS",
    "SCHEMA_VERSION",
    "archive_files",
    "archived_ids",
    "find_rows",
    "is_drain_file_name",
    "is_notice",
    "iso_utc",
    "lock_file",
    "no_duplicate_keys",
    "payload_preview",
    "read_archive",
    "read_archive_file",
    "read_drain_state",
    "record_id",
    "record_to_row",
    "rewrite_archive_file",
    "row_extras",
    "row_payload",
    "row_raw_bytes",
    "row_to_record",
    "safe_host",
    "state_path",
    "write_drain_state",
]

SCHEMA_VERSION = 2
#: What a schema-1 row (written before the extras existed) means for the keys schema 2 added.
SCHEMA_1_DEFAULTS = {"record_version": 1, "mtype": 1, "priority": 4, "expires_at_ms": 0}
#: The reason (and its code) of the row of a record the drain cannot read: from the one table.
MALFORMED = reasons.MALFORMED.name
MALFORMED_CODE = reasons.MALFORMED.code
PREVIEW_BYTES = 64
ELLIPSIS = "\u2026"
INCOMING = ".incoming"
STATE = ".state"
SUFFIX = ".jsonl.gz"

ROW_KEYS: tuple[str, ...] = (
    "schema", "id", "archived_by", "archived_at", "host", "agent", "reason", "reason_code",
    "queue_key", "queue_key_hex", "queue_name", "message_key", "message_type", "timestamp",
    "timestamp_ns", "attempts", "original_length", "payload_length", "truncated",
    "header_only", "source_host", "destination_host", "detail", "spill_path", "payload_b64",
    "payload_preview", "record_version", "mtype", "priority", "expires_at_ms",
)

_FILE_RE = re.compile(
    r"dlq-(?P<host>.+)-(?P<time>\d{8}T\d{6}\.\d{6})Z-(?P<pid>\d+)-(?P<n>\d{6,})\.jsonl\.gz")
_AGENT_NAMES = {AgentKind.API: "api", AgentKind.SENDER: "sender",
                AgentKind.RECEIVER: "receiver", AgentKind.TOOL: "tool"}
_AGENT_NUMBERS = {name: int(kind) for kind, name in _AGENT_NAMES.items()}
_TYPE_NAMES = {0: "SURE", 1: "UNSURE", UNKNOWN_MESSAGE_TYPE: "UNKNOWN"}
_TYPE_NUMBERS = {name: number for number, name in _TYPE_NAMES.items()}
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


class ArchiveError(RQPError):
    """An archive file or row cannot be read or written."""


class LockHeld(ArchiveError):
    """Another process holds the lock (:func:`lock_file`): the work is being done."""


# --------------------------------------------------------------------------------------------
# Rows


def record_id(raw: bytes) -> str:
    """The identity of a raw record: the first 32 hex digits of its SHA-256."""
    return hashlib.sha256(raw).hexdigest()[:32]


def iso_utc(ns: int) -> str:
    """Unix nanoseconds as ISO-8601 UTC with microseconds and ``Z``."""
    try:
        when = _EPOCH + _dt.timedelta(microseconds=ns // 1000)
    except OverflowError:  # past year 9999: not a real time stamp
        when = _dt.datetime.max.replace(tzinfo=_dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def payload_preview(payload: bytes, limit: int = PREVIEW_BYTES) -> str:
    """The first ``limit`` bytes: printable ASCII but ``\\`` kept, others ``\\xNN``; ``…`` if cut."""
    text = "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}"
                   for b in payload[:limit])
    return text + (ELLIPSIS if len(payload) > limit else "")


def _names_by_key(queue_names: Mapping[str, int] | None) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, key in (queue_names or {}).items():
        names.setdefault(key, name)
    return names


def _key_hex(key: int) -> str:
    return f"0x{key:08x}"


def record_to_row(raw: bytes, *, archived_by: str, queue_names: Mapping[str, int] | None = None,
                  archived_at_ns: int | None = None) -> dict:
    """The archive row (schema 2) of one raw message taken from ``DEAD.LETTER.Q``.

    ``queue_names``: the ``queues`` map of a ``.rqprc`` (name -> key); the first name of a key
    fills ``queue_name``. Bytes that are not a dead-letter record give a ``MALFORMED`` row.
    """
    raw = bytes(raw)
    now_ns = time.time_ns() if archived_at_ns is None else archived_at_ns
    row = {"schema": SCHEMA_VERSION, "id": record_id(raw), "archived_by": archived_by,
           "archived_at": iso_utc(now_ns)}
    try:
        r = DeadLetterRecord.from_bytes(raw)
    except RecordError as exc:
        row.update(host=archived_by, agent="unknown", reason=MALFORMED,
                   reason_code=MALFORMED_CODE, queue_key=0, queue_key_hex=_key_hex(0),
                   queue_name=None, message_key=f"0x{0:016x}", message_type="UNKNOWN",
                   timestamp=row["archived_at"], timestamp_ns=now_ns, attempts=0,
                   original_length=len(raw), payload_length=len(raw), truncated=False,
                   header_only=False, source_host="", destination_host="",
                   detail=f"not a dead-letter record: {exc}", spill_path="",
                   payload_b64=base64.b64encode(raw).decode("ascii"),
                   payload_preview=payload_preview(raw), record_version=0, mtype=0,
                   priority=0, expires_at_ms=0)
        return row
    reason = reasons.reason_name(r.reason)
    agent = _AGENT_NAMES.get(r.agent, str(int(r.agent)))
    mtype = _TYPE_NAMES.get(r.message_type, f"UNKNOWN_{r.message_type}")
    row.update(
        host=r.host, agent=agent, reason=reason, reason_code=int(r.reason),
        queue_key=r.queue_key, queue_key_hex=_key_hex(r.queue_key),
        queue_name=_names_by_key(queue_names).get(r.queue_key),
        message_key=f"0x{r.message_key:016x}", message_type=mtype,
        timestamp=iso_utc(r.timestamp_ns), timestamp_ns=r.timestamp_ns, attempts=r.attempts,
        original_length=r.original_length, payload_length=len(r.payload),
        truncated=r.truncated, header_only=r.header_only, source_host=r.source_host,
        destination_host=r.destination_host, detail=r.detail, spill_path=r.spill_path,
        payload_b64=base64.b64encode(r.payload).decode("ascii"),
        payload_preview=payload_preview(r.payload), record_version=r.version, mtype=r.mtype,
        priority=r.priority, expires_at_ms=r.expires_at_ms,
    )
    return row


#: A notice's row: a receiving MCA's (``agent``) of a SURE message (``message_type``).
NOTICE_AGENT, NOTICE_MESSAGE_TYPE = "receiver", "SURE"


def is_notice(row: Mapping) -> bool:
    """A receiving MCA's row of a SURE message: a notice (README, reason codes). Its sender
    was answered DELIVERED_ERROR, keeps the message and sends it until a receiver puts it (or
    dead-letters it on its own host, RETRY_BUDGET_EXHAUSTED, when its retry budget runs out):
    put back from here as well, the message would arrive twice (a trial saw it), since a
    receiving MCA knows a repeat only from the peer that sent it first. The report neither
    counts it as likely recoverable (the same test, on columns: ``rqp.report.analysis``)."""
    return row.get("agent") == NOTICE_AGENT and row.get("message_type") == NOTICE_MESSAGE_TYPE


def row_extras(row: Mapping) -> dict:
    """``record_version``, ``mtype``, ``priority``, ``expires_at_ms`` of a row of either
    schema (a schema-1 row: the defaults)."""
    if row.get("schema") == 1:
        return dict(SCHEMA_1_DEFAULTS)
    return {name: int(row[name]) for name in SCHEMA_1_DEFAULTS}


def _decode_payload(row: Mapping) -> bytes:
    try:
        return base64.b64decode(row["payload_b64"], validate=True)
    except (ValueError, TypeError, KeyError) as exc:
        raise ArchiveError(f"row {row.get('id')}: bad payload_b64: {exc}") from None


def row_payload(row: Mapping) -> bytes:
    """The payload kept in a row (for a ``MALFORMED`` row: the raw bytes)."""
    return _decode_payload(row)


def row_to_record(row: Mapping) -> DeadLetterRecord:
    """The dead-letter record a row was made from. :class:`ArchiveError` for a ``MALFORMED``
    row (it holds bytes that were never a record: see :func:`row_raw_bytes`) or a bad row."""
    if row.get("reason") == MALFORMED:
        raise ArchiveError(f"row {row.get('id')} is a MALFORMED record: it has no fields, only "
                           "raw bytes (row_raw_bytes gives them)")
    try:
        extras = row_extras(row)
        agent = row["agent"]
        mtype = row["message_type"]
        flags = (DeadLetterFlags.TRUNCATED if row["truncated"] else 0) | \
                (DeadLetterFlags.HEADER_ONLY if row["header_only"] else 0)
        return DeadLetterRecord(
            reason=int(row["reason_code"]),
            message_type=_TYPE_NUMBERS[mtype] if mtype in _TYPE_NUMBERS
            else int(mtype.removeprefix("UNKNOWN_")),
            flags=int(flags),
            agent=_AGENT_NUMBERS[agent] if agent in _AGENT_NUMBERS else int(agent),
            queue_key=int(row["queue_key"]),
            message_key=int(row["message_key"], 16),
            timestamp_ns=int(row["timestamp_ns"]),
            attempts=int(row["attempts"]),
            original_length=int(row["original_length"]),
            host=row["host"],
            source_host=row["source_host"],
            destination_host=row["destination_host"],
            detail=row["detail"],
            spill_path=row["spill_path"],
            payload=_decode_payload(row),
            version=extras["record_version"], mtype=extras["mtype"],
            priority=extras["priority"], expires_at_ms=extras["expires_at_ms"],
        )
    except KeyError as exc:
        raise ArchiveError(f"row {row.get('id')} is not a schema-{row.get('schema')} dead-letter "
                           f"row: it has no key {exc.args[0]!r}") from None
    except (ValueError, TypeError, AttributeError) as exc:  # a value of the wrong kind
        raise ArchiveError(f"row {row.get('id')} is not a schema-{row.get('schema')} dead-letter "
                           f"row: a bad value ({exc})") from None


def row_raw_bytes(row: Mapping) -> bytes:
    """The raw bytes the row was archived from (``record_id`` of them is ``row["id"]``)."""
    if row.get("reason") == MALFORMED:
        return _decode_payload(row)
    return row_to_record(row).to_bytes()


# --------------------------------------------------------------------------------------------
# Files


def safe_host(host: str) -> str:
    """A host name as it appears in file names."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", host) or "_"


def _encode_rows(rows: Iterable[Mapping]) -> Iterator[bytes]:
    for row in rows:
        raw = getattr(row, "raw", None)  # (a line read from a file: kept as it was)
        if raw is not None:
            yield raw if raw.endswith(b"\n") else raw + b"\n"
            continue
        yield json.dumps(row, separators=(",", ":")).encode("ascii") + b"\n"


def _write_gzip(path: Path, rows: Iterable[Mapping]) -> int:
    """Write ``rows`` to a new file ``path`` (must not exist), flushed and fsynced."""
    count = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=6, mtime=0) as gz:
            for line in _encode_rows(rows):
                gz.write(line)
                count += 1
        f.flush()
        os.fsync(f.fileno())
    return count


def _publish(tmp: Path, final: Path) -> None:
    """Rename a complete, fsynced file into place and make the rename durable."""
    os.rename(tmp, final)
    fsync_dir(final.parent)


class ArchiveWriter:
    """Writes batches of rows as archive files, atomically (see the module doc).

    ``next_name()`` picks the name of the next file (so that a caller can record it before
    writing, as the drain does); ``write(rows, name)`` writes it and returns its path.
    """

    _counter = itertools.count(1)
    _lock = threading.Lock()

    def __init__(self, archive_dir: str | os.PathLike, *, host: str | None = None) -> None:
        self.dir = Path(archive_dir)
        self.host = host or socket.gethostname()
        self.incoming = self.dir / INCOMING
        self.incoming.mkdir(parents=True, exist_ok=True)

    def next_name(self) -> str:
        with self._lock:
            n = next(self._counter)
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
        return f"dlq-{safe_host(self.host)}-{stamp}Z-{os.getpid()}-{n:06d}{SUFFIX}"

    def write(self, rows: Iterable[Mapping], name: str | None = None) -> Path:
        name = name or self.next_name()
        tmp = self.incoming / name
        final = self.dir / name
        if final.exists():
            raise ArchiveError(f"{final} exists already")
        try:
            _write_gzip(tmp, rows)
            _publish(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return final

    def clean_incoming(self) -> list[Path]:
        """Remove files this host's writers left half-written in ``.incoming`` (call it only
        while holding the host's drain lock, so that none is being written)."""
        removed = []
        for entry in self.incoming.iterdir():
            match = _FILE_RE.fullmatch(entry.name)
            if match and match["host"] == safe_host(self.host):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry)
        return removed


def rewrite_archive_file(path: str | os.PathLike, rows: Iterable[Mapping]) -> int:
    """Replace archive file ``path`` by one holding ``rows`` (atomically: written in
    ``.incoming``, fsynced, renamed over it). With no rows left the file is removed. Returns
    the number of rows written."""
    path = Path(path)
    rows = list(rows)
    if not rows:
        path.unlink()
        fsync_dir(path.parent)
        return 0
    incoming = path.parent / INCOMING
    incoming.mkdir(exist_ok=True)
    tmp = incoming / f"rewrite-{os.getpid()}-{next(ArchiveWriter._counter)}-{path.name}"
    try:
        count = _write_gzip(tmp, rows)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return count


def is_drain_file_name(name: str) -> bool:
    """Whether ``name`` is an archive file's name as a drain makes it: unique across hosts
    and time (host, microseconds, pid, counter), so it names the file wherever it is moved."""
    return _FILE_RE.fullmatch(name) is not None


def _file_sort_key(path: Path) -> tuple:
    match = _FILE_RE.fullmatch(path.name)
    if match:
        return (match["time"], path.name)
    return ("", path.name)


#: The archive's subdirectory for the spill files of the records it holds.
SPILL = "spill"


def archived_spill(archive_dir: str | os.PathLike, spill_path: str) -> Path:
    """Where the drain keeps its copy of a record's spill file (``spill_path`` as the record
    names it, on the host that wrote it): ``{archive}/spill/{file name}``. Spill file names
    are unique (time, message key, random part), so the copies of many hosts share it."""
    return Path(archive_dir) / SPILL / Path(spill_path).name


def archive_files(archive_dir: str | os.PathLike) -> list[Path]:
    """The archive files of a directory (``*.jsonl.gz``, not hidden), oldest first (by the
    time in their names)."""
    directory = Path(archive_dir)
    files = [p for p in directory.iterdir()
             if p.name.endswith(SUFFIX) and not p.name.startswith((".", "_")) and p.is_file()]
    return sorted(files, key=_file_sort_key)


def _expand(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        out.extend(archive_files(p) if p.is_dir() else [p])
    return out


class ArchiveRow(dict):
    """A row read from an archive file (:func:`read_archive_lines`): the JSON object, with
    the ``number`` of its line in the file and its ``raw`` bytes, which a rewrite of the file
    writes back as they were (a trial's rows came back re-encoded: a duplicate key lost,
    1e400 as Infinity, which is no JSON)."""

    __slots__ = ("number", "raw")


@dataclass(frozen=True)
class UnreadableLine:
    """A line of an archive file that is not a JSON object (:func:`read_archive_lines`):
    its ``number`` in the file, its bytes, and what is wrong with it."""

    number: int
    raw: bytes
    problem: str


def no_duplicate_keys(pairs: list) -> dict:
    """A JSON object whose keys are each given once (a trial's row with a second "mtype" was
    put with it, its id no longer that of its content)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {twice!r} is given twice")
    return row


def read_archive_lines(path: str | os.PathLike) -> Iterator[ArchiveRow | UnreadableLine]:
    """The rows of one archive file, in order, each with its line's number and bytes (a tool
    that rewrites the file keeps them as they were); a line that is no JSON object as an
    :class:`UnreadableLine`. Raises :class:`ArchiveError` if the file cannot be read (not
    gzip, cut short)."""
    path = Path(path)
    try:
        with gzip.open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=no_duplicate_keys)
                except ValueError as exc:
                    yield UnreadableLine(number, line, f"not JSON: {exc}")
                    continue
                except RecursionError:  # (a re-check's: a traceback from dlq list)
                    yield UnreadableLine(number, line, "nested too deeply")
                    continue
                if not isinstance(row, dict):
                    yield UnreadableLine(number, line, "not a JSON object")
                    continue
                row = ArchiveRow(row)
                row.number, row.raw = number, line
                yield row
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ArchiveError(f"{path}: cannot read: {exc}") from None


def read_archive_file(path: str | os.PathLike) -> Iterator[dict]:
    """The rows of one archive file, in order; :class:`ArchiveError` at a line that is no
    JSON object, or if the file cannot be read."""
    for row in read_archive_lines(path):
        if isinstance(row, UnreadableLine):
            raise ArchiveError(f"{path}: line {row.number}: {row.problem}")
        yield row


def read_archive(paths) -> Iterator[dict]:
    """Every row of the given archive files; a directory stands for its archive files."""
    for path in _expand(paths):
        yield from read_archive_file(path)


def archived_ids(path_or_files) -> set[str]:
    """The ``id`` of every row in the given files (a directory: all its archive files).
    Missing files count as empty."""
    ids: set[str] = set()
    for path in _expand(path_or_files):
        if path.exists():
            ids.update(row["id"] for row in read_archive_file(path))
    return ids


#: ``rqpctl dlq show`` / ``resubmit`` take an id's first digits, as git takes a commit's.
MIN_ID_PREFIX = 6


def id_problem(given: str) -> str | None:
    """Why ``given`` cannot name a dead letter (an id in full, or its first digits), or None."""
    if re.fullmatch(f"[0-9a-f]{{{MIN_ID_PREFIX},32}}", given.strip().lower()):
        return None
    return (f"{given!r} is not a dead letter's id: {MIN_ID_PREFIX} to 32 hex digits (rqpctl dlq "
            "list shows them)")


def find_rows(archive_dir: str | os.PathLike,
              ids: Iterable[str]) -> dict[str, list[tuple[Path, int, dict]]]:
    """Where the rows of these ids are: each id (in full, or its first :data:`MIN_ID_PREFIX`
    or more hex digits) -> ``[(file, index in the file, row), ...]``, every copy of it (the
    same dead letter archived twice). :class:`ArchiveError` names an id that is not one, that
    no row has, or a prefix that several ids share."""
    wanted = {}
    for given in ids:
        problem = id_problem(given)
        if problem:
            raise ArchiveError(problem)
        wanted[given] = given.strip().lower()
    found: dict[str, list[tuple[Path, int, dict]]] = {given: [] for given in wanted}
    unreadable = []  # (a bad line or file elsewhere hid every row of the archive: a trial)
    for path in archive_files(archive_dir):
        try:
            rows = list(read_archive_lines(path))
        except ArchiveError as exc:
            unreadable.append(str(exc))
            continue
        for index, row in enumerate(rows):
            if isinstance(row, UnreadableLine):
                continue
            row_id = str(row.get("id", ""))
            for given, text in wanted.items():
                if row_id.startswith(text):
                    found[given].append((path, index, row))
    for given, places in found.items():
        if not places:
            raise ArchiveError(f"no dead letter with id {given} in {archive_dir}" + (
                f" (and {len(unreadable)} file(s) cannot be read: {unreadable[0]})"
                if unreadable else ""))
        ids_found = sorted({row["id"] for _, _, row in places})
        if len(ids_found) > 1:
            raise ArchiveError(f"id {given} is ambiguous: {', '.join(ids_found)} (give more "
                               "digits)")
    return found


# --------------------------------------------------------------------------------------------
# The drain's state and locks


@dataclass(frozen=True)
class DrainState:
    """What ``{archive}/.state/{host}.last`` says about the drain's last batch."""

    files: tuple[str, ...]
    queue: int
    done: bool


def state_path(archive_dir: str | os.PathLike, host: str) -> Path:
    return Path(archive_dir) / STATE / f"{safe_host(host)}.last"


def read_drain_state(archive_dir: str | os.PathLike, host: str) -> DrainState | None:
    path = state_path(archive_dir, host)
    try:
        data = json.loads(path.read_text())
        return DrainState(tuple(data["files"]), int(data["queue"], 16), bool(data["done"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArchiveError(f"{path}: unreadable drain state: {exc}") from None


def all_drain_states(archive_dir: str | os.PathLike) -> dict[str, DrainState]:
    """Every host's drain state in the archive, by state file name."""
    out = {}
    directory = Path(archive_dir) / STATE
    if directory.is_dir():
        for path in directory.glob("*.last"):
            out[path.name] = read_drain_state(archive_dir, path.name[:-len(".last")])
    return out


def write_drain_state(archive_dir: str | os.PathLike, host: str, state: DrainState) -> None:
    from rqp.system.service import write_file_atomically

    path = state_path(archive_dir, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"files": list(state.files), "queue": _key_hex(state.queue), "done": state.done}
    write_file_atomically(path, (json.dumps(data) + "\n").encode())


@contextlib.contextmanager
def lock_file(path: str | os.PathLike, what: str, *, wait: float = 0.0):
    """Hold an exclusive ``flock`` on ``path`` (created) or raise :class:`ArchiveError`
    (after trying for ``wait`` seconds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)  # (flock has no time-out of its own)
                    continue
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise LockHeld(f"{what} already runs (pid {holder}; lock {path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
