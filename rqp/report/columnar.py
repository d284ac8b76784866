"""The columnar store: the dead-letter archive compacted into Parquet, partitioned by day,
taken incrementally.

The drain keeps writing gzip JSON Lines (its durable format: one fsync'd file per batch, read by
``rqpctl dlq`` and replay). A gzip file cannot be split, and JSON is parsed whole; so each report
run first moves what is new in the archive into the store, and then answers from the store, whose
columns are read only when a query uses them::

    STORE/data/day=2026-11-23/batch=<B>/part-*.parquet
    STORE/batches/<B>.json      the commit record of compaction <B>: the archive files it took
    STORE/.lock                 (a local store) one compaction at a time

``<B>`` is ``YYYYmmddTHHMMSS.ffffffZ-<random>``. The store holds every archive field but the
payload itself (``payload_b64``: it stays in the JSON archive, where replay reads it; the store
keeps ``payload_preview``), plus ``_file`` (the archive file a row came from) and the lines
that were not readable (``_corrupt_record``), so that the report counts them as before.

A compaction:

1. removes what an interrupted one left: ``batch=<B>`` directories that have no commit record,
   and Spark's ``data/_temporary``;
2. lists the input files and leaves out every file a committed batch took (a drain's file by
   its name, unique across hosts and time, so a moved archive is not taken again; another file
   by its URI): the archive files are immutable once the drain has published them (replay only
   removes rows: a file it rewrote is not taken again, the store keeps the history of what was
   dead-lettered);
3. reads the new files once and writes them as batch ``<B>`` (through Spark's commit protocol):
   each read task (a large file, or many small ones packed together) writes one file per day it
   holds, its rows sorted by host and time, so that a query on one host skips the row groups of
   the others by their statistics. Not a ``host=`` partition too: with the ~100 hosts of a
   site, an incremental batch of a few thousand dead letters would add hundreds of tiny files
   (measured: 700 files and 21 s for one 50,000-line file, against 7 files by day);
4. checks the written batch: a file with a line of an archive schema the report does not read
   (a host upgraded before the report) is left out whole (the batch is written again without
   it), and so is a file Spark could not read a line of (not gzip, not text); both are named in
   the run's warnings and ``summary.json``, and not taken: a later run takes them once the
   report reads that schema or the file was put right. A local gzip file cut short (no gzip
   end: a copy still being made) is left out the same way, before Spark reads it, and taken
   once it is whole (read directly, without the store, it gives the lines before the cut);
5. writes ``batches/<B>.json`` (temporary name, rename): from that moment, and not before, the
   batch counts.

Every reader filters on committed batches, so a run killed anywhere before step 5 leaves rows
that nobody counts and that the next compaction deletes before it takes the same files again;
killed after step 5 the batch is complete. No record is counted twice or dropped.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import secrets
import stat
import time
import urllib.parse
import zlib
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DateType, StringType, StructField, StructType

from rqp.report import analysis, files
from rqp.report.common import ReportError, local_path
from rqp.report.schema import (
    CORRUPT_RECORD_COLUMN, READ_SCHEMA, READABLE_SCHEMAS,
)

__all__ = ["FILE_COLUMN", "NOT_STORED", "Store", "Compaction", "STORE_SCHEMA",
           "per_file"]

FILE_COLUMN = "_file"
#: Archive fields the store leaves in the JSON archive.
NOT_STORED = ("payload_b64",)
PARTITIONS = ("day", "batch")
#: A hook for the crash test (tests/test_columnar.py): the name of a step after which the
#: process kills itself with SIGKILL. Not an option: nobody needs it but that test.
_CRASH_AFTER = os.environ.get("RQP_REPORT_CRASH_AFTER")


def _store_schema() -> StructType:
    stored = [f for f in READ_SCHEMA.fields if f.name not in NOT_STORED]
    return StructType([*stored, StructField(FILE_COLUMN, StringType()),
                       StructField("day", DateType()), StructField("batch", StringType())])


STORE_SCHEMA = _store_schema()


@dataclass(frozen=True)
class Compaction:
    """What one run did to the store and what the store holds after it."""

    store: str
    batch: str | None  # the batch this run committed (None: nothing new)
    new_files: int
    new_lines: int
    files: int  # archive files in the store, all batches
    batches: int
    removed_uncommitted: int  # batch directories an interrupted run had left
    left_out: dict  # new files not taken (tried again next run), with why
    seconds: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _crash_point(step: str) -> None:
    if _CRASH_AFTER == step:
        os.kill(os.getpid(), 9)


def _same_as_metadata(uri: str) -> str:
    """A file's URI as Spark lists it (``file:///a/b``) spelled as its rows' ``_metadata``
    name it (``file:/a/b``): the one name by which the store knows what it took."""
    return "file:/" + uri[len("file:///"):] if uri.startswith("file:///") else uri


def _identity(uri: str) -> str:
    """The name by which the store knows an archive file it took: a drain's file by its name
    alone, which is unique across hosts and time, so that an archive moved (``mv /srv/dlq
    /data/dlq``, its ``.columnar/`` with it) or copied elsewhere is not taken again (a trial:
    every file taken twice, lines and duplicates doubled); any other file by its URI."""
    from rqp.storage.archive import is_drain_file_name

    name = urllib.parse.unquote(uri.rstrip("/").rsplit("/", 1)[-1])
    return name if is_drain_file_name(name) else uri


def spark_path(uri: str) -> str:
    """A file's URI as listed (percent-encoded: ``file:/a%20b``) as a path Spark reads (Hadoop
    takes path strings unescaped: a trial's archive under "arch ivé" was not found, as
    ``arch%2520iv%C3%A9``). Its rows' ``_metadata`` name it by the URI again."""
    return urllib.parse.unquote(uri) if uri.startswith("file:") else uri


#: The first bytes of every gzip file.
GZIP_MAGIC = b"\x1f\x8b"


def unreadable(uri: str) -> str | None:
    """Why this user may not read a local archive file (a re-check: Spark failed the whole
    report over one such file, "File does not exist" and 338 lines of Java); None for a
    file it may read, or one not on this host's disk."""
    if not uri.startswith("file:"):
        return None
    path = _local_path(uri)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a re-check's FIFO named *.jsonl: the
            return "not a regular file (a FIFO? a device?)"  # open below waited for good)
        with open(path, "rb") as f:
            if path.endswith(".gz") and f.read(2) not in (b"", GZIP_MAGIC):
                # (read without the store, Spark skipped it with 40 lines of Java, and
                # counted it as read: a re-check)
                return "not gzip, though named .gz"
            return None
    except PermissionError as exc:
        return f"cannot be read by this user ({exc.strerror}); taken once it can be"
    except OSError:
        return None  # (gone, or odd: Spark's reading judges it, as before)


def _local_path(uri: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(uri).path)


def _not_ready(uri: str) -> str | None:
    """Why a local archive file may not be taken yet: :func:`unreadable`, or, gzip, it ends before its gzip end (a copy still being made, as by rsync from another host): Spark
    reads the lines before the cut, and the store, which takes a file once by name, would
    never count the rest (a trial: 1,083 dead letters short, for good, without a word). None
    for a whole file, one not on this host's disk, or one Spark's reading will judge."""
    if (why := unreadable(uri)) is not None or not uri.startswith("file:"):
        return why
    if not uri.endswith(".gz"):
        return None
    try:
        with gzip.open(_local_path(uri), "rb") as f:
            while f.read(1 << 20):
                pass
    except EOFError:
        return "cut short (no gzip end: a copy still being made?); taken once it is whole"
    except (OSError, zlib.error):
        return None  # (not gzip, or damaged: Spark's reading says which, as before)
    return None


def _empty(uri: str) -> bool:
    """Whether a local archive file holds nothing: no byte, or a whole gzip of no byte."""
    if not uri.startswith("file:"):
        return False
    path = _local_path(uri)
    try:
        if os.path.getsize(path) == 0:
            return True
        if not uri.endswith(".gz"):
            return False
        with gzip.open(path, "rb") as f:
            return f.read(1) == b"" and f.read() == b""
    except (OSError, EOFError, zlib.error):
        return False


#: What logs a file Spark could not read (not gzip) with its stack trace: the store leaves
#: such a file out and says so in one line (a trial's run: ~50 lines of Java a file, each run).
SKIPPED_FILE_LOGGER = "org.apache.spark.sql.execution.datasources.FileScanRDD"


@contextmanager
def _quiet(spark: SparkSession, name: str):
    """Logger ``name`` at ERROR for the time of the block, then as it was: a level of its own
    only if it had one (a re-check: restored to the INFO it inherited, as a level of its own,
    it passed the shell's WARN threshold, and each store run logged ~60 INFO lines)."""
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    context = log4j.LogManager.getContext(False)
    config = context.getConfiguration()
    own = config.getLoggerConfig(name)
    before = own.getLevel() if own.getName() == name else None
    log4j.core.config.Configurator.setLevel(name, log4j.Level.ERROR)
    try:
        yield
    finally:
        if before is not None:
            log4j.core.config.Configurator.setLevel(name, before)
        else:
            config.removeLogger(name)
            context.updateLoggers()


def per_file(rows: DataFrame) -> list:
    """Per archive file: ``lines``, ``wrong`` (lines of an archive schema the report does not
    read) and ``versions`` (those schemas); from rows with ``_file``, ``schema`` and
    ``_corrupt_record``. One aggregation: it is how a compaction checks its batch."""
    wrong = (F.col(CORRUPT_RECORD_COLUMN).isNull()
             & ~F.coalesce(F.col("schema").isin(*READABLE_SCHEMAS), F.lit(False)))
    return (
        rows.groupBy(FILE_COLUMN)
        .agg(F.count(F.lit(1)).alias("lines"),
             F.count_if(wrong).alias("wrong"),
             F.array_sort(F.collect_set(F.when(wrong, F.coalesce(
                 F.col("schema").cast("string"), F.lit("missing"))))).alias("versions"))
        .orderBy(FILE_COLUMN).collect()
    )


class Store:
    """The columnar store at ``path`` (a local directory or a Hadoop URI)."""

    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark = spark
        self.path = path.rstrip("/") or path
        self.data = files.join(self.path, "data")
        self.batches_dir = files.join(self.path, "batches")

    # -- commit records --------------------------------------------------------------------

    def committed(self) -> dict[str, dict]:
        """Every committed batch's record, by batch id."""
        out = {}
        for name in files.list_names(self.spark, self.batches_dir):
            if name.endswith(".json") and not name.startswith("."):
                record = json.loads(files.read_text(self.spark,
                                                    files.join(self.batches_dir, name)))
                out[record["batch"]] = record
        return out

    def taken(self, committed: dict[str, dict] | None = None) -> set[str]:
        """The archive files committed batches took, by identity (``_identity``: records
        written before it was used hold URIs, which give the same identities)."""
        committed = self.committed() if committed is None else committed
        return {_identity(f) for record in committed.values() for f in record["files"]}

    # -- compaction ------------------------------------------------------------------------

    @contextmanager
    def _lock(self):
        """One compaction at a time (a local store); the store's directory made if need be."""
        local = local_path(self.path)
        with ExitStack() as held:
            if local is not None:  # (a shared store: one job at a time is the operator's part)
                from rqp.storage.archive import ArchiveError, lock_file

                try:
                    os.makedirs(local, exist_ok=True)
                    held.enter_context(lock_file(os.path.join(local, ".lock"),
                                                 f"a compaction of {self.path}"))
                except OSError as exc:
                    raise ReportError(f"--store {self.path}: cannot use it as the columnar "
                                      f"store: {exc.strerror or exc}") from None
                except ArchiveError as exc:
                    raise ReportError(f"--store {self.path}: {exc}") from None
            yield

    def _remove_uncommitted(self, committed: dict[str, dict]) -> int:
        removed = 0
        files.delete(self.spark, files.join(self.data, "_temporary"))
        for day in files.list_names(self.spark, self.data):
            if not day.startswith("day="):
                continue
            for batch in files.list_names(self.spark, files.join(self.data, day)):
                if batch.startswith("batch=") and batch[6:] not in committed:
                    files.delete(self.spark, files.join(self.data, day, batch))
                    removed += 1
        return removed

    def compact(self, inputs: Sequence[str], read_archives) -> Compaction:
        """Take the input files no committed batch has taken (see the module doc).
        ``read_archives(spark, paths)`` reads archive files as the report does (with
        ``_file``)."""
        started = time.monotonic()
        with self._lock():
            committed = self.committed()
            removed = self._remove_uncommitted(committed)
            taken = self.taken(committed)
            listed = [_same_as_metadata(f) for f in read_archives(self.spark, inputs)
                      .inputFiles()]
            new = sorted(f for f in listed if _identity(f) not in taken)
            batch = None
            new_lines = 0
            left_out: dict[str, str] = {}
            took: dict[str, int] = {}
            if new:
                batch = (_dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
                         + "-" + secrets.token_hex(4))
                took, left_out = self._write_batch(batch, new, read_archives)
                new_lines = sum(took.values())
                _crash_point("write")
            if not took:  # nothing new, or only files left out: no batch (a record a day for
                batch = None  # a file that stays unreadable would only pile up)
            else:
                record = {"batch": batch, "files": sorted(took), "lines": new_lines,
                          "left_out": left_out,
                          "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat()}
                files.write_text(self.spark, files.join(self.batches_dir, f"{batch}.json"),
                                 json.dumps(record, indent=1) + "\n")
                committed[batch] = record
                _crash_point("commit")
                taken |= {_identity(f) for f in took}
        return Compaction(store=self.path, batch=batch, new_files=len(new) - len(left_out),
                          new_lines=new_lines, files=len(taken), batches=len(committed),
                          removed_uncommitted=removed, left_out=left_out,
                          seconds=time.monotonic() - started)

    def _write_batch(self, batch: str, new: list[str],
                     read_archives) -> tuple[dict[str, int], dict[str, str]]:
        """Write ``new`` as ``batch`` and check it: the lines taken per file, and the files
        left out with why. A file with a line of a schema the report does not read (a host
        upgraded first) is left out whole, and so is one Spark cannot read at all (not gzip,
        not text: it yields no line): neither is taken, so a later run takes it once the report
        reads its schema or the file was put right. Leaving out a file of the first kind
        writes the batch again without it (its other lines must not count twice)."""
        left_out = {f: why for f in new if (why := _not_ready(f)) is not None}
        # an empty file (a gzip holding nothing, whole) is taken, with no line (a trial: left
        # out as unreadable, and said so, at every run)
        empty = {f: 0 for f in new if f not in left_out and _empty(f)}
        new = [f for f in new if f not in left_out and f not in empty]
        while new:
            with _quiet(self.spark, SKIPPED_FILE_LOGGER):  # (left out below, in one line)
                self._write(batch, read_archives(self.spark, [spark_path(f) for f in new]))
            checked = {r[FILE_COLUMN]: r for r in per_file(self._read([batch]))}
            wrong = {f: r for f, r in checked.items() if r["wrong"]}
            for f in new:
                if f not in checked:
                    left_out[f] = "no line could be read (not gzip, or not text)"
            if not wrong:
                return ({**empty, **{f: checked[f]["lines"] for f in new if f in checked}},
                        left_out)
            for f, r in wrong.items():
                left_out[f] = (f"{r['wrong']} line(s) of archive schema "
                               f"{', '.join(r['versions'])}, which this report does not read "
                               f"({', '.join(map(str, READABLE_SCHEMAS))})")
            self._delete_batch(batch)
            new = [f for f in new if f not in left_out]
        return empty, left_out

    def _write(self, batch: str, raw: DataFrame) -> None:
        columns = [f.name for f in STORE_SCHEMA.fields if f.name not in PARTITIONS]
        rows = raw.select(
            *columns,
            F.to_date(analysis.dead_lettered_at()).alias("day"),
            F.lit(batch).alias("batch"),
        )
        (rows.sortWithinPartitions("day", "host", "timestamp_ns")
         .write.mode("append").partitionBy(*PARTITIONS).parquet(self.data))

    def _delete_batch(self, batch: str) -> None:
        for day in files.list_names(self.spark, self.data):
            files.delete(self.spark, files.join(self.data, day, f"batch={batch}"))

    # -- reading ---------------------------------------------------------------------------

    def _read(self, batches: Sequence[str]) -> DataFrame:
        return (self.spark.read.schema(STORE_SCHEMA).option("basePath", self.data)
                .parquet(self.data).where(F.col("batch").isin(list(batches))))

    def read(self) -> DataFrame | None:
        """Every row of every committed batch (the archive columns the store keeps, ``_file``,
        ``day``, ``batch``); None when nothing was committed yet."""
        committed = self.committed()
        if not committed or not any(name.startswith("day=") for name in
                                    files.list_names(self.spark, self.data)):
            return None  # (nothing, or empty files only: no row yet)
        return self._read(sorted(committed))
