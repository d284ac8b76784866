"""The Spark half of ``rqp-dlq-report``: read and check the archives, build every table, write
the outputs (Parquet and CSV tables, ``summary.json``, ``report.html``).

This module imports PySpark at the top; :mod:`rqp.report.job`, the command, imports this module
only when a report is actually computed, after the checks that need no Spark (``--help``, the
inputs, whether PySpark and Java are installed). See :mod:`rqp.report.job` for the outputs.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from pyspark import SparkConf, SparkContext, StorageLevel
from py4j.protocol import Py4JError
from pyspark.errors import AnalysisException, PySparkException, PySparkRuntimeError
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from rqp.report import analysis, columnar
from rqp.report import html as report_html
from rqp.report import rules, trends
from rqp.protocol.errors import RQPError
from rqp.system import signals
from rqp.system.files import remove_abandoned
from rqp.system.signals import STOP_SIGNALS
from rqp.report.common import PROG, ReportError
from rqp.report.schema import (
    ARCHIVE_FIELDS, ARCHIVE_FILE_GLOB, ARCHIVE_SCHEMA_VERSION, CORRUPT_RECORD_COLUMN, READ_SCHEMA,
    READABLE_SCHEMAS,
    ArchiveSchemaError,
)
from rqp.report.files import join as _join
from rqp.report.files import delete, write_text

__all__ = ["TABLES", "Table", "ArchiveCheck", "read_archives", "prepare", "check_archives",
           "read_traffic", "write_text", "write_table", "run_report", "format_reason_table",
           "get_session", "hush", "quiet_interrupts", "jvm_temp", "launching"]

FILE_COLUMN = columnar.FILE_COLUMN
#: Archive columns the report never looks at (the payload itself is by far the largest: not
#: even parsed, as Spark reads only the columns a query uses).
UNUSED_COLUMNS = ("payload_b64", "reason_code", "message_key", "payload_length", "truncated",
                  "header_only", "spill_path", "record_version", "mtype", "priority",
                  "expires_at_ms")
#: Columns the tables need after normalize (what is kept in memory).
DEAD_COLUMNS = (
    "id", "timestamp", "hour", "host", "agent", "reason", "queue_key", "queue_key_hex",
    "queue_name", "message_type", "attempts", "original_length", "source", "destination",
    "detail", "payload_preview",
)
TOP = 15  # rows of the "top" charts and lists


@dataclass(frozen=True)
class Table:
    name: str
    build: Callable[[DataFrame, DataFrame | None], DataFrame]
    order: Callable[[], list] | None  # the sort of the written rows
    small: bool = True  # written as one file


def _payload_stats_table(dead: DataFrame, _traffic) -> DataFrame:
    overall = analysis.payload_stats(dead).withColumn("reason", F.lit("(all)"))
    per_reason = analysis.payload_stats(dead, by="reason")
    return overall.unionByName(per_reason).select(
        "reason", "count", "min", "max", "avg", "p50", "p95")


def _order(*cols: str) -> Callable[[], list]:
    """A sort of the written rows: column names, "-name" for descending."""
    return lambda: [F.desc(c[1:]) if c.startswith("-") else F.col(c) for c in cols]


def _all_first() -> list:
    return [F.when(F.col("reason") == "(all)", 0).otherwise(1), F.desc("count"), F.col("reason")]


#: Every table the job writes, in order.
TABLES: tuple[Table, ...] = (
    Table("by_reason", lambda d, t: analysis.counts_by(d, "reason"), _order("-count", "reason")),
    Table("by_queue",
          lambda d, t: analysis.counts_by(d, "queue_key", labels=("queue_key_hex", "queue_name")),
          _order("-count", "queue_key")),
    Table("by_source_host", lambda d, t: analysis.counts_by(d, "source"),
          _order("-count", "source")),
    Table("by_destination_host", lambda d, t: analysis.counts_by(d, "destination"),
          _order("-count", "destination")),
    Table("by_message_type", lambda d, t: analysis.counts_by(d, "message_type"),
          _order("-count", "message_type")),
    Table("by_hour", lambda d, t: analysis.counts_by(d, "hour"), _order("hour")),
    Table("by_hour_reason", lambda d, t: analysis.counts_by(d, "hour", "reason"),
          _order("hour", "reason")),
    # what the page's filters narrow (host, queue, reason)
    Table("by_reason_queue_host",
          lambda d, t: analysis.counts_by(d, "reason", "queue_key", "host", "source",
                                          "destination", labels=("queue_key_hex", "queue_name")),
          _order("-count", "reason", "queue_key", "host", "source", "destination")),
    Table("payload_stats", _payload_stats_table, _all_first),
    Table("samples", lambda d, t: analysis.samples(d, "reason"), _order("reason")),
    Table("likely_recoverable", lambda d, t: analysis.likely_recoverable(d, t), None,
          small=False),
)


# ------------------------------------------------------------------------------------------
# Reading and checking
# ------------------------------------------------------------------------------------------

def _read_readable(spark: SparkSession, inputs: Sequence[str]
                   ) -> tuple[DataFrame, int, dict[str, str]]:
    """The archive lines of the ``inputs``' files this user may read, how many files those
    are, and each local file it may not read with why (a trial: one root's 0600 file failed
    the whole ``--no-store`` report in Spark)."""
    raw = read_archives(spark, inputs)
    listed = raw.inputFiles()
    left_out = {f: why for f in listed if (why := columnar.unreadable(f)) is not None}
    if left_out and len(left_out) < len(listed):
        raw = read_archives(spark, [columnar.spark_path(f) for f in listed if f not in left_out])
    return raw, len(listed) - len(left_out), left_out


def read_archives(spark: SparkSession, inputs: Sequence[str]) -> DataFrame:
    """The archive lines of ``inputs`` with the declared schema, the corrupt-record column and
    ``_file`` (the file each line came from)."""
    reader = (
        spark.read.schema(READ_SCHEMA)
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", CORRUPT_RECORD_COLUMN)
        .option("pathGlobFilter", ARCHIVE_FILE_GLOB)
        .option("recursiveFileLookup", "true")
        # a file that is not gzip (or is cut short) ends its own reading, not the job's: the
        # store names such files (no line read) and leaves them out (rqp.report.columnar)
        .option("ignoreCorruptFiles", "true")
    )
    try:
        df = reader.json(list(inputs))
    except AnalysisException as exc:
        raise ReportError(f"cannot read the input: {_first_line(exc)}") from None
    return df.select("*", F.col("_metadata.file_path").alias(FILE_COLUMN))


@dataclass(frozen=True)
class ArchiveCheck:
    files: int
    lines: int
    dead_letters: int
    duplicates: int
    unreadable_lines: int
    unreadable_files: tuple[tuple[str, int], ...]


def prepare(raw: DataFrame) -> DataFrame:
    """The columns the report uses, plus what :func:`check_archives` needs: ``_valid`` (a
    readable line of a schema it reads, with a reason, a queue key and a time), and for the
    other lines ``_file``, ``_schema`` and ``_unreadable`` (not JSON, or a JSON object of a
    schema it reads without those). Lines that are not valid get no id, so that normalize keeps every one of
    them apart from the dead letters."""
    readable_schema = F.coalesce(F.col("schema").isin(*READABLE_SCHEMAS), F.lit(False))
    # A JSON object of a schema we read, but without what makes a dead letter (what failed,
    # where, when), is not one: counted with the unreadable lines, named, left out.
    incomplete = (F.col("reason").isNull() | F.col("queue_key").isNull()
                  | (F.coalesce(F.col("timestamp_ns"), F.lit(0)) <= 0)
                  & F.col("timestamp").isNull())
    corrupt = F.col(CORRUPT_RECORD_COLUMN).isNotNull() | (readable_schema & incomplete)
    valid = ~corrupt & readable_schema
    used = [c for c in ARCHIVE_FIELDS if c not in UNUSED_COLUMNS and c != "schema"]
    return raw.select(
        *[(F.when(valid, F.col("id")) if c == "id" else F.col(c)).alias(c) for c in used],
        valid.alias("_valid"),
        F.when(~valid, F.col(FILE_COLUMN)).alias(FILE_COLUMN),
        F.when(~valid, F.col("schema")).alias("_schema"),
        corrupt.alias("_unreadable"),
    )


def check_archives(rows: DataFrame, files: int) -> ArchiveCheck:
    """Count what :func:`prepare` and normalize made of the archive lines; raise
    :class:`ArchiveSchemaError` naming every file with a line whose ``schema`` is none of
    :data:`READABLE_SCHEMAS`."""
    wrong = ~F.col("_valid") & ~F.col("_unreadable")
    per_file = (
        rows.groupBy(FILE_COLUMN)  # null for every valid line: one group for them all
        .agg(F.count(F.lit(1)).alias("rows"),
             F.sum("copies").alias("lines"),
             F.count_if("_unreadable").alias("unreadable"),
             F.count_if(wrong).alias("wrong"),
             F.array_sort(F.collect_set(F.when(wrong, F.coalesce(
                 F.col("_schema").cast("string"), F.lit("missing"))))).alias("versions"))
        .orderBy(FILE_COLUMN)
        .collect()
    )
    bad = [(r[FILE_COLUMN], r["wrong"], r["versions"]) for r in per_file if r["wrong"]]
    if bad:
        raise ArchiveSchemaError.naming(bad)
    valid = [r for r in per_file if r[FILE_COLUMN] is None]
    dead_letters = valid[0]["rows"] if valid else 0
    valid_lines = valid[0]["lines"] if valid else 0
    return ArchiveCheck(
        files=files,
        lines=sum(r["lines"] for r in per_file),
        dead_letters=dead_letters,
        duplicates=valid_lines - dead_letters,
        unreadable_lines=sum(r["unreadable"] for r in per_file),
        unreadable_files=tuple((r[FILE_COLUMN], r["unreadable"]) for r in per_file
                               if r["unreadable"]),
    )


def read_traffic(spark: SparkSession, path: str) -> DataFrame:
    """Deliveries (``queue_key``, ``timestamp``) from CSV with a header (``*.csv``,
    ``*.csv.gz``) or JSON Lines (anything else)."""
    schema = "queue_key STRING, timestamp STRING"
    try:
        if path.lower().rstrip("/").endswith((".csv", ".csv.gz")):
            return spark.read.schema(schema).option("header", "true").csv(path)
        return spark.read.schema(schema).json(path)
    except AnalysisException as exc:
        raise ReportError(f"cannot read --traffic {path}: {_first_line(exc)}") from None


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------

def write_table(spark: SparkSession, table: Table, df: DataFrame, output: str) -> DataFrame:
    """Write ``df`` as Parquet, then the Parquet as CSV; return the written Parquet."""
    parquet = _join(output, "parquet", table.name)
    csv = _join(output, "csv", table.name)
    if table.small:  # one sorted file (no range-partitioning job for a few rows)
        df = df.coalesce(1)
        if table.order is not None:
            df = df.sortWithinPartitions(*table.order())
    elif table.order is not None:
        df = df.orderBy(*table.order())
    df.write.mode("overwrite").parquet(parquet)
    written = spark.read.parquet(parquet)
    out = written.coalesce(1) if table.small else written
    out.write.mode("overwrite").option("header", "true").csv(csv)
    return written


# ------------------------------------------------------------------------------------------
# The job
# ------------------------------------------------------------------------------------------

def _iso(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:  # pyspark gives local wall-clock times
            value = value.astimezone()
        return value.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value)


def _plain(row) -> dict:
    return {k: (_iso(v) if isinstance(v, _dt.datetime) else v)
            for k, v in row.asDict(recursive=True).items()}


#: Dead-letter times a report takes for a host's clock, not for when it happened: before
#: this, or more than PLAUSIBLE_AHEAD_HOURS after the run.
PLAUSIBLE_FROM = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
PLAUSIBLE_AHEAD_HOURS = 24


def _plausible(ts: Column, now: _dt.datetime) -> Column:
    return ts.between(F.lit(PLAUSIBLE_FROM),
                      F.lit(now + _dt.timedelta(hours=PLAUSIBLE_AHEAD_HOURS)))


def _timeline(by_hour_reason: DataFrame, first, last) -> report_html.Timeline:
    """Dead letters per time bucket and reason, buckets as wide as needed for <= 200 bars."""
    if first is None:
        return report_html.Timeline(bucket_hours=1, rows=())
    span_hours = int((last - first).total_seconds() // 3600) + 1
    width = next((w for w in (1, 2, 3, 6, 12, 24, 48, 168, 336, 720, 1440, 8760)
                  if span_hours / w <= 200), 8760 * ((span_hours // (8760 * 200)) + 1))
    seconds = F.unix_seconds("hour")
    bucket = F.timestamp_seconds(seconds - F.pmod(seconds, F.lit(width * 3600)))
    rows = (
        by_hour_reason.where(F.col("hour").isNotNull())
        .groupBy(bucket.alias("bucket"), "reason")
        .agg(F.sum("count").alias("count"))
        .orderBy("bucket", "reason")
        .collect()
    )
    return report_html.Timeline(
        bucket_hours=width,
        rows=tuple((_iso(r["bucket"]), r["reason"], int(r["count"])) for r in rows))


class _Phases:
    """Wall time of each phase of a run (``summary.json``'s ``phases_seconds``; the benchmark
    reports them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now
        signals.raise_if_stopped()  # (a swallowed stop: before the next phase, summary.json)


def run_report(spark: SparkSession, inputs: Sequence[str], output: str,
               traffic: str | None = None, out=None, err=None,
               store: str | None = None, previous: str | None = None) -> dict:
    """Read, check and analyse the archives; write every output; return the summary. The
    table by reason goes to ``out`` (stdout), warnings to ``err`` (stderr). ``previous``: an
    earlier report's output directory to compare with (``trends`` in the summary and the
    page, see :mod:`rqp.report.trends`)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = time.monotonic()
    phases = _Phases()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # Let adaptive execution size the cached dead letters' partitions like any shuffle output.
    spark.conf.set("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
    traffic_df = read_traffic(spark, traffic) if traffic else None  # fail early if unreadable
    previous_run = read_previous_run(spark, previous) if previous else None  # (early too)
    compaction = None
    if store is not None:  # take what is new into the columnar store, answer from the store
        columnar_store = columnar.Store(spark, store)
        compaction = columnar_store.compact(inputs, read_archives)
        phases.done("compact")
        raw, files, left_out = columnar_store.read(), compaction.files, compaction.left_out
    else:
        raw, files, left_out = _read_readable(spark, inputs)
    for name, why in sorted(left_out.items()):
        err.write(f"{PROG}: warning: {name} left out ("
                  + ("not taken into the store; " if store is not None else "")
                  + f"tried again next run): {why}\n")
    if raw is None or not files:
        where = f" and none in the store {store}" if store is not None else ""
        held = f"; {len(left_out)} left out, each named above" if left_out else ""
        raise ReportError(f"no archive files ({ARCHIVE_FILE_GLOB}) to read in "
                          f"{' '.join(inputs)}{where}{held}")
    # The one pass over the archives: parse, drop duplicate ids, keep the result in memory
    # (spilling to disk if need be) for every table.
    rows = analysis.normalize(prepare(raw)).select(
        *DEAD_COLUMNS, "copies", "_valid", FILE_COLUMN, "_schema", "_unreadable")
    rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        check = check_archives(rows, files)
        phases.done("read_dedupe_check")
        if check.unreadable_lines:
            err.write(f"{PROG}: warning: {check.unreadable_lines} line(s) are not dead-letter "
                      f"records of schema {', '.join(map(str, READABLE_SCHEMAS))}; left out:\n")
            for name, n in check.unreadable_files[:20]:
                err.write(f"  {name}: {n}\n")
        dead = rows.where(F.col("_valid")).select(*DEAD_COLUMNS)
        unique = check.dead_letters
        # From here the output directory is rewritten: without summary.json (written last)
        # it is no finished report, so one stopped half-way is not taken for the last one.
        delete(spark, _join(output, "summary.json"))
        # and without the page of the last one beside tables half rewritten (a trial's stop
        # left the old report.html, read as if it were this run's)
        delete(spark, _join(output, "report.html"))
        written: dict[str, DataFrame] = {}
        for table in TABLES:
            written[table.name] = write_table(
                spark, table, table.build(dead, traffic_df), output)
        phases.done("tables")
    finally:
        rows.unpersist()

    # From here on only the written aggregates are read (small), never the dead letters.
    reason_rows = written["by_reason"].orderBy(F.desc("count"), "reason").collect()
    by_reason = [_plain(r) for r in reason_rows]
    # First and last seen, the timeline and the trends' window, over the times a clock can
    # have given: a host that booted at 1970 (or ran in 2099) stretched every one of them (a
    # trial: 26 dead letters of one day drawn in a bar a year wide, every queue "jumped").
    generated = _dt.datetime.now(_dt.timezone.utc)
    hours = written["by_hour_reason"].where(F.col("hour").isNotNull())
    ok = _plausible(F.col("hour"), generated)
    span = hours.agg(F.sum(F.when(~ok, F.col("count"))).alias("odd"),
                     F.min(F.when(ok, F.col("hour"))).alias("first"),
                     F.max(F.when(ok, F.col("hour"))).alias("last")).first()
    implausible = int(span["odd"] or 0)
    first = min((r["first_seen"] for r in reason_rows if r["first_seen"] is not None),
                default=None)
    last = max((r["last_seen"] for r in reason_rows if r["last_seen"] is not None),
               default=None)
    if implausible:  # (to the hour, then: a reason's first or last may be the odd one)
        first, last = span["first"], span["last"]
        if last is not None:
            last += _dt.timedelta(hours=1, microseconds=-1)
        err.write(f"{PROG}: warning: {implausible} dead letter(s) dated before "
                  f"{PLAUSIBLE_FROM:%Y-%m-%d} or more than {PLAUSIBLE_AHEAD_HOURS} h after this "
                  "run (a host's clock?): counted, but left out of first and last seen, the "
                  "timeline and the trends' window\n")

    def top(name: str, key: str) -> list[dict]:
        return [_plain(r) for r in written[name].orderBy(F.desc("count"), key).limit(TOP)
                .collect()]

    recoverable = written["likely_recoverable"]
    recoverable_by_reason = [
        _plain(r) for r in recoverable.groupBy("reason", "evidence")
        .agg(F.count(F.lit(1)).alias("count")).orderBy(F.desc("count"), "reason").collect()]
    payload = [_plain(r) for r in written["payload_stats"].orderBy(*_all_first()).collect()]
    for r in by_reason:
        r["share"] = round(r["count"] / unique, 6) if unique else 0.0
    summary = {
        "report": PROG,
        "archive_schema": ARCHIVE_SCHEMA_VERSION,
        "generated_at": _iso(generated),
        "inputs": list(inputs),
        "traffic": traffic,
        "spark": {"version": spark.version, "master": spark.sparkContext.master},
        "store": compaction.as_dict() if compaction is not None else None,
        "left_out": dict(sorted(left_out.items())),
        "totals": {
            "files": check.files,
            "lines": check.lines,
            "unreadable_lines": check.unreadable_lines,
            "duplicates_dropped": check.duplicates,
            "dead_letters": unique,
            "reasons": len(by_reason),
            "queues": written["by_queue"].count(),
            "source_hosts": written["by_source_host"].count(),
            # (hosts named: "(unknown)", a record that does not say, is none)
            "destination_hosts": written["by_destination_host"].where(
                F.col("destination") != analysis.UNKNOWN_HOST).count(),
            "likely_recoverable": sum(r["count"] for r in recoverable_by_reason),
            "implausible_times": implausible,
        },
        "first_seen": _iso(first),
        "last_seen": _iso(last),
        "by_reason": by_reason,
        "by_message_type": top("by_message_type", "message_type"),
        "top_queues": top("by_queue", "queue_key"),
        "top_source_hosts": top("by_source_host", "source"),
        "top_destination_hosts": top("by_destination_host", "destination"),
        "payload_stats": payload,
        "likely_recoverable": {
            "evidence": "traffic" if traffic else "transient_reason",
            "by_reason": recoverable_by_reason,
        },
        "outputs": {t.name: {"parquet": _join(output, "parquet", t.name),
                             "csv": _join(output, "csv", t.name)} for t in TABLES},
    }
    for r in by_reason:  # what to do with them: a rule for rqpctl dlq replay
        r["suggested_action"] = rules.suggested_action(r["reason"])
        r["replay_rule"] = rules.replay_rule(r["reason"])
    if previous_run is not None:
        current = trends.RunFacts.from_rows(
            summary, by_reason, *[[_plain(r) for r in written[name].collect()]
                                  for name in ("by_queue", "by_source_host",
                                               "by_destination_host")], output=output)
        summary["trends"] = trends.compare(current, previous_run)
    breakdown_table = written["by_reason_queue_host"]
    breakdown = [_plain(r) for r in breakdown_table.orderBy(
        F.desc("count"), "reason", "queue_key", "host", "source", "destination")
        .limit(report_html.BREAKDOWN_ROWS).collect()]
    samples = [_plain(r) for r in written["samples"].orderBy("reason").collect()]
    timeline = _timeline(hours.where(ok) if implausible else written["by_hour_reason"],
                         first, last)
    phases.done("summary")
    summary["phases_seconds"] = phases.seconds
    summary["elapsed_seconds"] = round(time.monotonic() - started, 3)
    write_text(spark, _join(output, "summary.json"),
               json.dumps(summary, indent=2, sort_keys=False) + "\n")
    write_text(spark, _join(output, "report.html"),
               report_html.render(summary, timeline, samples, breakdown,
                                  breakdown_total=breakdown_table.count()))
    out.write(format_reason_table(summary))
    out.write(f"outputs under {output}: report.html, summary.json, parquet/, csv/\n")
    out.flush()
    return summary


def read_previous_run(spark: SparkSession, previous: str) -> trends.RunFacts:
    """An earlier report's output directory as :mod:`rqp.report.trends` compares it: its
    ``summary.json`` (required: a run without one did not finish) and its ``by_queue``,
    ``by_source_host`` and ``by_destination_host`` tables, or, when they are gone, the
    summary's top lists (then ``partial``)."""
    from rqp.report.files import read_text

    where = _join(previous, "summary.json")
    try:
        summary = json.loads(read_text(spark, where))
        by_reason = summary["by_reason"]
    except Exception as exc:  # (a local OSError, a Hadoop one through py4j, bad JSON)
        raise ReportError(f"cannot compare with the previous run: {where} is not a finished "
                          f"report's summary ({_first_line(exc)})") from None
    try:
        tables = [[_plain(r) for r in spark.read.parquet(_join(previous, "parquet", name))
                   .collect()] for name in ("by_queue", "by_source_host", "by_destination_host")]
        partial = False
    except AnalysisException:
        tables = [summary.get(k, []) for k in ("top_queues", "top_source_hosts",
                                               "top_destination_hosts")]
        partial = True
    return trends.RunFacts.from_rows(summary, by_reason, *tables, output=previous,
                                     partial=partial)


def format_reason_table(summary: dict) -> str:
    """The short table for stdout: dead letters by reason."""
    totals = summary["totals"]
    rows = [(r["reason"] or "(none)", f"{r['count']:,}", f"{100 * r['share']:.1f}%")
            for r in summary["by_reason"]]
    rows.append(("TOTAL", f"{totals['dead_letters']:,}", "100.0%" if totals["dead_letters"]
                 else "-"))
    w0 = max(len("reason"), *(len(r[0]) for r in rows))
    w1 = max(len("dead letters"), *(len(r[1]) for r in rows))
    lines = [f"{'reason':<{w0}}  {'dead letters':>{w1}}  {'share':>6}",
             f"{'-' * w0}  {'-' * w1}  {'-' * 6}"]
    for i, (a, b, c) in enumerate(rows):
        if i == len(rows) - 1:
            lines.append(f"{'-' * w0}  {'-' * w1}  {'-' * 6}")
        lines.append(f"{a:<{w0}}  {b:>{w1}}  {c:>6}")
    extra = (f"{totals['lines']:,} lines in {totals['files']} files; "
             f"{totals['duplicates_dropped']:,} duplicate ids dropped; "
             f"{totals['unreadable_lines']:,} unreadable lines; "
             f"first {summary['first_seen'] or '-'}, last {summary['last_seen'] or '-'}")
    return "\n".join(lines) + "\n" + extra + "\n"


# ------------------------------------------------------------------------------------------
# The Spark session
# ------------------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    """The first line of what ``exc`` says: for a Java exception through Py4J, the Java one's
    (the Python text of a Py4J error may not be fetchable any more)."""
    java = getattr(exc, "java_exception", None)
    try:
        text = str(java.toString() if java is not None else exc).strip()
    except Exception:
        text = ""
    return text.splitlines()[0] if text else type(exc).__name__


def _master_configured() -> bool:
    """Does Spark's own configuration name a master (spark-submit --master, spark.master in
    spark-defaults.conf, MASTER)? Starts the JVM (or joins spark-submit's) to find out."""
    SparkContext._ensure_initialized()
    return SparkConf().contains("spark.master")


def _loopback_master(url: str) -> bool:
    """Is ``url`` a ``spark://`` master on this machine's loopback?"""
    host = urlparse(url).hostname if url.startswith("spark://") else None
    return host in ("localhost", "::1") or (host or "").startswith("127.")


def get_session(master: str | None) -> tuple[SparkSession, bool]:
    """The SparkSession to use and whether this call created it (then the caller stops it)."""
    url = master or os.environ.get("MASTER") or "local"
    if url.startswith("local") or _loopback_master(url):
        # a run on this machine stays on loopback (set before anything here starts the JVM):
        # else the driver binds to the host name's address, which executors on this machine
        # reach through a network interface
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    existing = SparkContext._active_spark_context is not None
    # Python workers (if any are started) run this interpreter, the one with the project's
    # packages, unless the operator chose another.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    def make() -> SparkSession:  # (every step that may start the JVM)
        builder = (SparkSession.builder.appName(PROG)
                   .config("spark.sql.session.timeZone", "UTC")
                   .config("spark.ui.showConsoleProgress", "false"))
        if master:
            builder = builder.master(master)
        elif not existing and not _master_configured():
            builder = builder.master("local[*]")
        session = builder.getOrCreate()
        session.conf.get("spark.sql.session.timeZone")  # (the session's SQL state, made on
        # first use, and with it its UI tab: here, where a Ctrl-C waits for it)
        _quiet_loggers(session)
        return session

    try:
        with launching():
            return _made_aside(make), not existing
    except PySparkRuntimeError as exc:  # the JVM did not start (no Java, a Java too old, ...)
        text = _first_line(exc)
        hint = ("PySpark needs a Java 17 or later runtime" if "JAVA_GATEWAY" in text
                or "Java gateway" in text else _MASTER_HINT)
        raise ReportError(f"Spark did not start: {text} (Spark's own words are above; "
                          f"{hint})") from None
    except Py4JError as exc:  # the JVM started, the cluster did not take the application
        hint = ("is a Spark master running at that address, reachable from here, with a worker "
                "free? Spark's log above says what it tried" if url.startswith("spark://")
                else _MASTER_HINT)
        raise ReportError(f"Spark did not start with --master {url}: {_first_line(exc)} "
                          f"({hint})") from None


_MASTER_HINT = "a master is local[N], spark://HOST:PORT, yarn or k8s://https://HOST:PORT"

#: Spark's loggers whose warnings say nothing about the report's input, at ERROR: for a glob
#: --input, FileStreamSink looks for a streaming sink's metadata under the glob as a path and
#: warns with a 90-line FileNotFoundException (a trial read it as a failure in the journal);
#: a plan too long to print is no news either.
QUIET_LOGGERS = ("org.apache.spark.sql.execution.streaming.sinks.FileStreamSink",
                 "org.apache.spark.util.SparkStringUtils")


def _quiet_loggers(spark: SparkSession) -> None:
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    for name in QUIET_LOGGERS:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.ERROR)


def _made_aside(make: Callable[[], SparkSession]) -> SparkSession:
    """``make()`` in a thread of its own, waited for here. Ctrl-C stays the caller's: a
    SparkContext made in the main thread takes SIGINT, with a handler that asks the JVM to
    cancel every job over the py4j connection the main thread is in the middle of a call on,
    and so breaks that call (a Ctrl-C of a report gave two screens of py4j tracebacks and exit
    -2). Made in another thread, it takes no signal: Ctrl-C raises KeyboardInterrupt in the
    main thread; ``spark.stop()`` (the caller's ``finally``) cancels what runs in the JVM,
    which ignores SIGINT itself.

    A Ctrl-C while the session is being made waits for it to be made, then stops it: a JVM
    left half-started outlives us for good (it watches its stdin, and so ends with us, only
    once it is up; a trial found one running with no parent). A second Ctrl-C ends the
    processes the making started and does not wait."""
    made: list = []
    done = threading.Event()  # (not Thread.join: one that KeyboardInterrupt broke, Python 3.11
    #                            takes the thread for ended, and a second join returns at once)

    def run() -> None:
        # The stop signals held in this thread, and so in the child PySpark forks for the JVM
        # (with a preexec_fn: Python runs there before exec, and a Ctrl-C in that moment
        # raised in its at-fork hook, a traceback on the terminal; CI). The main thread takes
        # them; the JVM lets them through itself (and ignores SIGINT: PySpark's preexec_fn).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            made.append(make())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            made.append(exc)
        finally:
            done.set()

    before = _children_of(os.getpid())
    threading.Thread(target=run, name="rqp-spark-session", daemon=True).start()
    try:
        done.wait()
    except KeyboardInterrupt:
        try:  # (the line said first inside: a second Ctrl-C as it was written, the moment an
            # operator who reads it presses it, went by the clean-up below; a trial's test)
            again = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (rqp-demo
            # takes one stop only, and cleans up after it)
            print(f"{PROG}: stopping once Spark has started" + (
                " (Ctrl-C or SIGTERM again: end it now)" if again else ""),
                file=sys.stderr, flush=True)
            done.wait()
        except KeyboardInterrupt:
            # The making ends with the processes it started, and its clean-up runs (PySpark's
            # connection directory was left in /tmp: a trial, 3 times of 4). Those that a
            # SIGTERM does not end soon, or that started as it was sent, are killed: a JVM
            # half-started outlives us for good.
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in _children_of(os.getpid()) - before:
                    for each in (pid, *_children_of(pid, deep=True)):
                        try:
                            os.kill(each, sig)
                        except ProcessLookupError:
                            pass
                deadline = time.monotonic() + ABANDON_WAIT
                while not done.is_set() and time.monotonic() < deadline:
                    try:  # (a third Ctrl-C changes nothing: it left the directory, a trial)
                        done.wait(max(0.0, deadline - time.monotonic()))
                    except KeyboardInterrupt:
                        pass
                if done.is_set():
                    break
            raise
        if made and not isinstance(made[0], BaseException):
            made[0].stop()
        raise
    for name in _PY4J_LOGGERS:  # (a logger's filters see only what is logged on it)
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Py4JInterrupted) for f in logger.filters):
            logger.addFilter(_Py4JInterrupted())
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


#: How long a second Ctrl-C while Spark starts waits for the making to end, once it has
#: sent SIGTERM to the processes it started, and again after a SIGKILL.
ABANDON_WAIT = 2.0

#: How long :func:`end_jvm` waits for the JVM to end before it kills it.
JVM_END_WAIT = 30.0


def end_jvm() -> None:
    """End the Spark JVM this process started, if one runs, and wait for it: after this,
    nothing it was doing writes any more. It ends by itself only once it sees its stdin
    closed, when this process has exited: a demo stopped during its report removed its
    directory while its JVM still ran for 0.3 s, and a trial found Spark's ``_temporary``
    made again there. Its own shutdown (SparkContext stopped) runs; after JVM_END_WAIT, it is
    killed. A session made afterwards in this process starts a new JVM."""
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:  # (none started here, or one this process was given)
        return
    with SparkContext._lock:
        SparkContext._gateway = SparkContext._jvm = None
        SparkContext._active_spark_context = None
    # py4j's side first: its finalizer thread tells the JVM of every object collected here,
    # and one told after the JVM ended logged its failure with a traceback (a fresh machine's
    # demo, once in three); shut down, it tells nothing more
    gateway.shutdown()
    try:
        proc.stdin.close()
    except OSError:
        pass  # (gone already)
    try:
        proc.wait(JVM_END_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: The directory :func:`jvm_temp` made for the JVM about to start (None: none).
_jvm_tmpdir: str | None = None


@contextlib.contextmanager
def jvm_temp():
    """While a report runs: the Spark JVM it starts keeps its temporary files (Spark's scratch
    space, ``spark.local.dir`` unless the operator sets it, and its other ``spark-*`` and
    ``artifacts-*`` directories) in a directory of the run's own under ``TMPDIR``, removed when
    the run ends, the JVM ended first (:func:`end_jvm`). The JVM ignores ``TMPDIR`` and wrote
    them in /tmp, where a JVM a second Ctrl-C killed, or a ``kill -9``, left them for good. A
    JVM already running (a caller's session) is left alone. The JVM is started in
    :func:`launching`. Yields the directory (None: a JVM already runs)."""
    global _jvm_tmpdir
    if SparkContext._gateway is not None:
        yield None
        return
    remove_abandoned(f"{PROG}-jvm-")  # (what runs ended by kill -9 left: a trial's)
    path = _jvm_tmpdir = tempfile.mkdtemp(prefix=f"{PROG}-jvm-{os.getpid()}-")
    try:
        yield path
    finally:
        _jvm_tmpdir = None
        try:
            end_jvm()  # (nothing of it writes there any more)
        finally:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def launching():
    """Around what may start the JVM, inside :func:`jvm_temp`: its ``java.io.tmpdir`` is that
    directory (``SPARK_SUBMIT_OPTS``, for this launch only: the processes a caller starts
    later must not inherit it, a test's job wrote into its test session's). An operator's own
    ``-Djava.io.tmpdir`` (``spark.driver.extraJavaOptions``, ``SPARK_SUBMIT_OPTS``) comes
    after it, and so wins."""
    if _jvm_tmpdir is None or SparkContext._gateway is not None:
        yield
        return
    before = os.environ.get("SPARK_SUBMIT_OPTS")
    os.environ["SPARK_SUBMIT_OPTS"] = f"-Djava.io.tmpdir={_jvm_tmpdir} {before or ''}".rstrip()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARK_SUBMIT_OPTS", None)
        else:
            os.environ["SPARK_SUBMIT_OPTS"] = before


def _children_of(pid: int, deep: bool = False) -> set[int]:
    """The processes whose parent is ``pid`` (and theirs, if ``deep``), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # (gone meanwhile)
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.add(child)
            if deep:
                todo.append(child)
    return found


#: Where py4j logs: on its module loggers, and on the root logger (``logging.exception``).
_PY4J_LOGGERS = ("", "py4j.clientserver", "py4j.java_gateway")


class _Py4JInterrupted(logging.Filter):
    """py4j logs a call that Ctrl-C broke, with its traceback, on the root logger, and then
    lets the KeyboardInterrupt go on to the caller, which says it once in a line: drop that
    record, and once :func:`hush` was called every py4j record (a connection it closes under
    the broken call fails to shut down: BrokenPipeError)."""

    hushed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}py4j{os.sep}" not in record.pathname:
            return True
        return not (self.hushed or record.exc_info and any(
            isinstance(e, KeyboardInterrupt) for e in (record.exc_info[1],
                                                       record.exc_info[1].__context__)))


#: How long a Ctrl-C waits for :func:`hush` (a JVM that does not answer: no longer).
HUSH_WAIT = 2.0

@contextlib.contextmanager
def quiet_interrupts(spark: SparkSession):
    """While the report runs: a Ctrl-C first turns Spark's logging off, then goes on to the
    handler there was (KeyboardInterrupt). Off afterwards was too late: the JVM logs the work
    the broken call leaves (an aborted write, its tasks' InterruptedException) at once, and a
    trial's interrupted report printed up to 470 lines of it. The main thread is in the middle
    of a call into the JVM: the level is set from a thread of its own (its own connection),
    waited for at most HUSH_WAIT."""
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(before):
        yield  # (ignored, or the default action: nothing of ours to run)
        return

    def handler(signum, frame):
        quiet = threading.Thread(target=hush, args=(spark,), name="rqp-hush", daemon=True)
        quiet.start()
        quiet.join(HUSH_WAIT)
        try:
            before(signum, frame)
        except KeyboardInterrupt as exc:  # (raised in a py4j finalizer, Python only prints it:
            raise signals.raising(exc)  # a demo's report ran on to its end, twice in nine runs)

    signal.signal(signal.SIGINT, handler)
    try:
        with signals.raised_for_sure():
            yield
    finally:
        signal.signal(signal.SIGINT, before)


def hush(spark: SparkSession) -> None:
    """After a Ctrl-C: what Spark and py4j log of the work it broke (aborted jobs, stack
    traces of interrupted tasks, a connection closed mid-call) is no news to the operator
    who pressed it: a trial's interrupted report printed up to 470 lines of it."""
    _Py4JInterrupted.hushed = True
    try:
        spark.sparkContext.setLogLevel("OFF")  # (the root logger, and spark-shell's threshold)
        # every logger with a level of its own too: Spark's defaults give Jetty's two, and a
        # Ctrl-C while the session built its UI tab printed a screen of Jetty's WARN (CI)
        log4j = spark.sparkContext._jvm.org.apache.logging.log4j
        log4j.core.config.Configurator.setAllLevels(log4j.LogManager.ROOT_LOGGER_NAME,
                                                    log4j.Level.OFF)
    except Exception:  # noqa: BLE001 - a JVM that no longer answers logs nothing more either
        pass


class SparkFailed(RQPError):
    """The job failed inside Spark (exit status 1): what Spark said, in one line."""


def explain_failure(spark: SparkSession, exc: BaseException, master: str | None) -> RQPError:
    """A failure raised by Spark during a run, as one :class:`SparkFailed` line: a context
    that stopped on its own means the cluster went away or never answered."""
    try:
        stopped = spark.sparkContext._jsc is None or spark.sparkContext._jsc.sc().isStopped()
    except Exception:
        stopped = True
    if stopped:
        return SparkFailed(
            f"the Spark context stopped during the run (master "
            f"{master or spark.sparkContext.master}): no master answered at that address, the "
            f"cluster had no worker with the cores and memory asked for, or the driver ran out "
            f"of memory; Spark's log above says which ({_first_line(exc)})")
    root = _root_cause(exc)
    cause = f"; at its root: {root}" if root else ""
    return SparkFailed(f"Spark failed: {_first_line(exc)}{cause} (Spark's log is above)")


def _root_cause(exc: BaseException) -> str | None:
    """The first line of the deepest Java cause under ``exc``, if it has one (a trial's full
    disk: the line said TASK_WRITE_FAILED, and "No space left on device" was only in the
    359 lines of stack traces above it)."""
    java = getattr(exc, "java_exception", None)
    try:
        cause = java.getCause() if java is not None else None
        for _ in range(32):  # (a loop of causes is possible in Java: bounded)
            deeper = cause.getCause() if cause is not None else None
            if deeper is None or deeper.equals(cause):
                break
            cause = deeper
        text = str(cause.toString()).strip() if cause is not None else ""
    except Exception:
        return None
    return text.splitlines()[0] if text else None


def is_spark_failure(exc: BaseException) -> bool:
    return isinstance(exc, (Py4JError, PySparkException))
