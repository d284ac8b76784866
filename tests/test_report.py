"""The dead-letter report (rqp.report): analysis functions, the job end to end, the HTML page in
a real headless browser, and the synthetic data generator.

One SparkSession (local[2], 2 shuffle partitions, no UI) serves the whole run. The input is a
dozen dead letters written out below; every expected table is written out by hand too.

The hand-made archive (times are 2025-03-03, UTC; d02 is archived twice; d00 ties with d03 on
time and has the smaller id)::

    id   time          host   agent     reason                  queue   type    bytes  source
    d01  09:05:00.123  hostb  receiver  QUEUE_FULL              0x1001  SURE      100  hosta
    d02  09:20         hostb  receiver  QUEUE_FULL              0x1001  SURE      300  hosta
    d03  09:40         hostb  receiver  UNKNOWN_QUEUE           0x2002  UNSURE     50  hostc
    d04  10:00         hosta  sender    NO_ROUTE                0x3003  UNSURE     20  -
    d05  10:10         hostb  receiver  QUEUE_FULL              0x1001  SURE      200  hostc
    d06  10:30         hostc  receiver  NOT_AUTHORIZED          0x4004  SURE       80  hosta
    d07  10:45         hosta  sender    RETRY_BUDGET_EXHAUSTED  0x1001  SURE      400  - (to hostb)
    d08  11:00         hostc  receiver  MESSAGE_TOO_BIG         0x4004  SURE   100000  hosta
    d09  11:15         hostb  receiver  QUEUE_FULL              0x1001  UNSURE    500  hosta
    d10  11:30         hostb  receiver  UNKNOWN_QUEUE           0x2002  SURE       60  hosta
    d11  11:50         hostd  api       NO_QUEUE_KEY            0       SURE       10  -
    d00  09:40         hostb  receiver  UNKNOWN_QUEUE           0x2002  UNSURE     70  hostc
"""

from __future__ import annotations

import base64
import collections
import datetime as dt
import gzip
import html.parser
import itertools
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from rqp.report import analysis, generate, job
from rqp.report import html as report_html
from rqp.report.schema import ARCHIVE_FIELDS, ARCHIVE_SCHEMA, ArchiveSchemaError

ROOT = Path(__file__).resolve().parents[1]


# (The one SparkSession, local[2], is the ``spark`` fixture of tests/conftest.py.)

# --------------------------------------------------------------------------------------------
# The hand-made dead letters
# --------------------------------------------------------------------------------------------

_CODES = {"QUEUE_FULL": 22, "UNKNOWN_QUEUE": 20, "NO_ROUTE": 4, "NOT_AUTHORIZED": 21,
          "RETRY_BUDGET_EXHAUSTED": 5, "MESSAGE_TOO_BIG": 23, "NO_QUEUE_KEY": 1}


def dead_letter(id, time, host, agent, reason, queue_key, queue_name, message_type, length,
                source_host, destination_host, preview, *, timestamp_ns=0,
                archived_at="2025-03-03T12:00:00Z", archived_by=None) -> dict:
    """One archive line; the fields not given are the same for every test row."""
    payload = preview.encode()
    return {
        "schema": 1, "id": id, "archived_by": archived_by or f"drain@{host}",
        "archived_at": archived_at, "host": host, "agent": agent, "reason": reason,
        "reason_code": _CODES[reason], "queue_key": queue_key,
        "queue_key_hex": "0x%08x" % queue_key, "queue_name": queue_name,
        "message_key": "0x%016x" % 7, "message_type": message_type,
        "timestamp": f"2025-03-03T{time}Z", "timestamp_ns": timestamp_ns, "attempts": 1,
        "original_length": length, "payload_length": len(payload),
        "truncated": len(payload) < length, "header_only": False,
        "source_host": source_host, "destination_host": destination_host,
        "detail": f"detail of {id}", "spill_path": "",
        "payload_b64": base64.b64encode(payload).decode(), "payload_preview": preview,
    }


D = dead_letter
LINES = [
    D("d01", "09:05:00.123", "hostb", "receiver", "QUEUE_FULL", 0x1001, "ORDERS.Q", "SURE", 100,
      "hosta", "", "order 1", timestamp_ns=1740992700123456789),
    D("d02", "09:20:00", "hostb", "receiver", "QUEUE_FULL", 0x1001, "ORDERS.Q", "SURE", 300,
      "hosta", "", "order 2"),
    D("d03", "09:40:00", "hostb", "receiver", "UNKNOWN_QUEUE", 0x2002, None, "UNSURE", 50,
      "hostc", "", "ghost 3"),
    D("d04", "10:00:00", "hosta", "sender", "NO_ROUTE", 0x3003, None, "UNSURE", 20,
      "", "", "ping"),
    D("d05", "10:10:00", "hostb", "receiver", "QUEUE_FULL", 0x1001, "ORDERS.Q", "SURE", 200,
      "hostc", "", "order 5"),
    D("d06", "10:30:00", "hostc", "receiver", "NOT_AUTHORIZED", 0x4004, "AUDIT.Q", "SURE", 80,
      "hosta", "", "audit 6"),
    D("d07", "10:45:00", "hosta", "sender", "RETRY_BUDGET_EXHAUSTED", 0x1001, None, "SURE", 400,
      "", "hostb", "order 7"),
    D("d08", "11:00:00", "hostc", "receiver", "MESSAGE_TOO_BIG", 0x4004, "AUDIT.Q", "SURE",
      100000, "hosta", "", ""),
    D("d09", "11:15:00", "hostb", "receiver", "QUEUE_FULL", 0x1001, "ORDERS.Q", "UNSURE", 500,
      "hosta", "", "order 9"),
    D("d10", "11:30:00", "hostb", "receiver", "UNKNOWN_QUEUE", 0x2002, None, "SURE", 60,
      "hosta", "", "ghost 10"),
    D("d11", "11:50:00", "hostd", "api", "NO_QUEUE_KEY", 0, None, "SURE", 10, "", "", "nokey"),
    # d02 again: archived a day later by another drain (dropped: the first archiving is kept)
    D("d02", "09:20:00", "hostb", "receiver", "QUEUE_FULL", 0x1001, "ORDERS.Q", "SURE", 300,
      "hosta", "", "order 2", archived_at="2025-03-04T08:00:00Z", archived_by="drain@hostz"),
    D("d00", "09:40:00", "hostb", "receiver", "UNKNOWN_QUEUE", 0x2002, None, "UNSURE", 70,
      "hostc", "", "<script>alert(1)</script><b>tie</b> & more"),
]


def T(clock: str) -> dt.datetime:
    """2025-03-03 at ``clock`` (UTC)."""
    return dt.datetime.fromisoformat(f"2025-03-03T{clock}+00:00")


@pytest.fixture(scope="module")
def raw(spark):
    return spark.createDataFrame(LINES, schema=ARCHIVE_SCHEMA)


@pytest.fixture(scope="module")
def dead(raw):
    return analysis.normalize(raw).cache()


COUNT_COLUMNS = "count BIGINT, first_seen TIMESTAMP, last_seen TIMESTAMP"


# --------------------------------------------------------------------------------------------
# Analysis functions
# --------------------------------------------------------------------------------------------

def test_normalize_derives_columns_and_drops_duplicate_ids(spark, dead):
    expected = spark.createDataFrame([
        ("d01", T("09:05:00.123456"), "hosta", "hostb", T("09:00"), 1, "drain@hostb"),
        ("d02", T("09:20:00"), "hosta", "hostb", T("09:00"), 2, "drain@hostb"),
        ("d03", T("09:40:00"), "hostc", "hostb", T("09:00"), 1, "drain@hostb"),
        ("d04", T("10:00:00"), "hosta", "(unknown)", T("10:00"), 1, "drain@hosta"),
        ("d05", T("10:10:00"), "hostc", "hostb", T("10:00"), 1, "drain@hostb"),
        ("d06", T("10:30:00"), "hosta", "hostc", T("10:00"), 1, "drain@hostc"),
        ("d07", T("10:45:00"), "hosta", "hostb", T("10:00"), 1, "drain@hosta"),
        ("d08", T("11:00:00"), "hosta", "hostc", T("11:00"), 1, "drain@hostc"),
        ("d09", T("11:15:00"), "hosta", "hostb", T("11:00"), 1, "drain@hostb"),
        ("d10", T("11:30:00"), "hosta", "hostb", T("11:00"), 1, "drain@hostb"),
        ("d11", T("11:50:00"), "hostd", "(unknown)", T("11:00"), 1, "drain@hostd"),
        ("d00", T("09:40:00"), "hostc", "hostb", T("09:00"), 1, "drain@hostb"),
    ], "id STRING, timestamp TIMESTAMP, source STRING, destination STRING, hour TIMESTAMP, "
       "copies BIGINT, archived_by STRING")
    actual = dead.select("id", "timestamp", "source", "destination", "hour", "copies",
                         "archived_by")
    assertDataFrameEqual(actual, expected)


def test_normalize_keeps_rows_without_id_apart(spark, raw):
    no_id = raw.where("id = 'd04' or id = 'd11'").withColumn("id", F.lit(None))
    actual = analysis.normalize(no_id).select("reason", "copies")
    expected = spark.createDataFrame([("NO_ROUTE", 1), ("NO_QUEUE_KEY", 1)],
                                     "reason STRING, copies BIGINT")
    assertDataFrameEqual(actual, expected)


HOSTS = [  # (host, agent, source_host, destination_host) -> (host, source, destination)
    # issue 16: one machine was two hosts, 127.0.0.1 (its receiver's peer) and vm
    (("vm", "receiver", "127.0.0.1", "vm"), ("vm", "vm", "vm")),
    (("vm", "sender", "vm", "127.0.0.1:7460"), ("vm", "vm", "vm")),
    (("vm", "sender", "vm", "[::1]:7460"), ("vm", "vm", "vm")),
    (("vm", "receiver", "::1", "vm"), ("vm", "vm", "vm")),
    (("vm", "sender", "vm", "localhost:7460"), ("vm", "vm", "vm")),
    (("vm", "receiver", "127.0.1.1", "vm"), ("vm", "vm", "vm")),    # Debian's own-name address
    (("vm", "receiver", "::ffff:127.0.0.1", "vm"), ("vm", "vm", "vm")),
    # case, a trailing dot and a port are spellings
    (("VM.Example.", "sender", "VM.example", "Recv.Example:7460"),
     ("vm.example", "vm.example", "recv.example")),
    (("vm", "receiver", "10.0.0.5:41234", "vm"), ("vm", "10.0.0.5", "vm")),
    (("vm", "receiver", "::ffff:10.0.0.5", "vm"), ("vm", "10.0.0.5", "vm")),
    (("vm", "receiver", "[fe80::1]:5000", "vm"), ("vm", "fe80::1", "vm")),
    (("vm", "sender", "vm", "fe80::1"), ("vm", "vm", "fe80::1")),   # a bare v6 has no port
    # what the record cannot tell stays apart: another address, a TLS identity
    (("vm", "receiver", "sender-1.prod.example", "vm"), ("vm", "sender-1.prod.example", "vm")),
    (("vm", "receiver", "10.0.0.7", "vm"), ("vm", "10.0.0.7", "vm")),
    # loopback without a host to say whose: left as it is
    (("", "sender", "127.0.0.1", ""), ("", "127.0.0.1", "(unknown)")),
]


def test_one_host_one_name(spark):
    rows = [dict(LINES[0], id=f"h{i:02d}", host=host, agent=agent, source_host=src,
                 destination_host=dst)
            for i, ((host, agent, src, dst), _) in enumerate(HOSTS)]
    dead = analysis.normalize(spark.createDataFrame(rows, schema=ARCHIVE_SCHEMA))
    actual = {r.id: (r.host, r.source, r.destination)
              for r in dead.select("id", "host", "source", "destination").collect()}
    assert actual == {f"h{i:02d}": want for i, (_, want) in enumerate(HOSTS)}
    # the machine is one source host in the counts
    first_seven = dead.where(F.col("id") < "h07")
    assert [(r.source, r["count"]) for r in analysis.counts_by(first_seven, "source")
            .collect()] == [("vm", 7)]


def test_counts_by_reason(spark, dead):
    expected = spark.createDataFrame([
        ("QUEUE_FULL", 4, T("09:05:00.123456"), T("11:15:00")),
        ("UNKNOWN_QUEUE", 3, T("09:40:00"), T("11:30:00")),
        ("NO_ROUTE", 1, T("10:00:00"), T("10:00:00")),
        ("NOT_AUTHORIZED", 1, T("10:30:00"), T("10:30:00")),
        ("RETRY_BUDGET_EXHAUSTED", 1, T("10:45:00"), T("10:45:00")),
        ("MESSAGE_TOO_BIG", 1, T("11:00:00"), T("11:00:00")),
        ("NO_QUEUE_KEY", 1, T("11:50:00"), T("11:50:00")),
    ], f"reason STRING, {COUNT_COLUMNS}")
    assertDataFrameEqual(analysis.counts_by(dead, "reason"), expected)


def test_counts_by_queue_with_labels(spark, dead):
    # d07 has no queue name: the key still makes one row, named from the other records
    expected = spark.createDataFrame([
        (0x1001, "0x00001001", "ORDERS.Q", 5, T("09:05:00.123456"), T("11:15:00")),
        (0x2002, "0x00002002", None, 3, T("09:40:00"), T("11:30:00")),
        (0x3003, "0x00003003", None, 1, T("10:00:00"), T("10:00:00")),
        (0x4004, "0x00004004", "AUDIT.Q", 2, T("10:30:00"), T("11:00:00")),
        (0, "0x00000000", None, 1, T("11:50:00"), T("11:50:00")),
    ], f"queue_key BIGINT, queue_key_hex STRING, queue_name STRING, {COUNT_COLUMNS}")
    actual = analysis.counts_by(dead, "queue_key", labels=("queue_key_hex", "queue_name"))
    assertDataFrameEqual(actual, expected)


def test_counts_by_hosts_and_message_type(spark, dead):
    assertDataFrameEqual(analysis.counts_by(dead, "source"), spark.createDataFrame([
        ("hosta", 8, T("09:05:00.123456"), T("11:30:00")),
        ("hostc", 3, T("09:40:00"), T("10:10:00")),
        ("hostd", 1, T("11:50:00"), T("11:50:00")),
    ], f"source STRING, {COUNT_COLUMNS}"))
    assertDataFrameEqual(analysis.counts_by(dead, "destination"), spark.createDataFrame([
        ("hostb", 8, T("09:05:00.123456"), T("11:30:00")),
        ("hostc", 2, T("10:30:00"), T("11:00:00")),
        ("(unknown)", 2, T("10:00:00"), T("11:50:00")),
    ], f"destination STRING, {COUNT_COLUMNS}"))
    assertDataFrameEqual(analysis.counts_by(dead, "message_type"), spark.createDataFrame([
        ("SURE", 8, T("09:05:00.123456"), T("11:50:00")),
        ("UNSURE", 4, T("09:40:00"), T("11:15:00")),
    ], f"message_type STRING, {COUNT_COLUMNS}"))


def test_counts_by_hour_and_hour_reason(spark, dead):
    assertDataFrameEqual(analysis.counts_by(dead, "hour"), spark.createDataFrame([
        (T("09:00"), 4, T("09:05:00.123456"), T("09:40:00")),
        (T("10:00"), 4, T("10:00:00"), T("10:45:00")),
        (T("11:00"), 4, T("11:00:00"), T("11:50:00")),
    ], f"hour TIMESTAMP, {COUNT_COLUMNS}"))
    assertDataFrameEqual(analysis.counts_by(dead, "hour", "reason"), spark.createDataFrame([
        (T("09:00"), "QUEUE_FULL", 2, T("09:05:00.123456"), T("09:20:00")),
        (T("09:00"), "UNKNOWN_QUEUE", 2, T("09:40:00"), T("09:40:00")),
        (T("10:00"), "NO_ROUTE", 1, T("10:00:00"), T("10:00:00")),
        (T("10:00"), "QUEUE_FULL", 1, T("10:10:00"), T("10:10:00")),
        (T("10:00"), "NOT_AUTHORIZED", 1, T("10:30:00"), T("10:30:00")),
        (T("10:00"), "RETRY_BUDGET_EXHAUSTED", 1, T("10:45:00"), T("10:45:00")),
        (T("11:00"), "MESSAGE_TOO_BIG", 1, T("11:00:00"), T("11:00:00")),
        (T("11:00"), "QUEUE_FULL", 1, T("11:15:00"), T("11:15:00")),
        (T("11:00"), "UNKNOWN_QUEUE", 1, T("11:30:00"), T("11:30:00")),
        (T("11:00"), "NO_QUEUE_KEY", 1, T("11:50:00"), T("11:50:00")),
    ], f"hour TIMESTAMP, reason STRING, {COUNT_COLUMNS}"))


STATS = "count BIGINT, min BIGINT, max BIGINT, avg DOUBLE, p50 BIGINT, p95 BIGINT"


def test_payload_stats_overall_and_per_reason(spark, dead):
    # sizes: 10 20 50 60 70 80 100 200 300 400 500 100000 (sum 101790)
    assertDataFrameEqual(analysis.payload_stats(dead), spark.createDataFrame(
        [(12, 10, 100000, 8482.5, 80, 100000)], STATS))
    assertDataFrameEqual(analysis.payload_stats(dead, by="reason"), spark.createDataFrame([
        ("QUEUE_FULL", 4, 100, 500, 275.0, 200, 500),
        ("UNKNOWN_QUEUE", 3, 50, 70, 60.0, 60, 70),
        ("NO_ROUTE", 1, 20, 20, 20.0, 20, 20),
        ("NOT_AUTHORIZED", 1, 80, 80, 80.0, 80, 80),
        ("RETRY_BUDGET_EXHAUSTED", 1, 400, 400, 400.0, 400, 400),
        ("MESSAGE_TOO_BIG", 1, 100000, 100000, 100000.0, 100000, 100000),
        ("NO_QUEUE_KEY", 1, 10, 10, 10.0, 10, 10),
    ], f"reason STRING, {STATS}"))


def test_samples_are_the_earliest_per_group(spark, dead):
    # UNKNOWN_QUEUE: d03 and d00 are both at 09:40; d00 has the smaller id
    actual = analysis.samples(dead, "reason").select(
        "reason", "id", "timestamp", "queue_key_hex", "source", "destination",
        "payload_preview")
    expected = spark.createDataFrame([
        ("QUEUE_FULL", "d01", T("09:05:00.123456"), "0x00001001", "hosta", "hostb", "order 1"),
        ("UNKNOWN_QUEUE", "d00", T("09:40:00"), "0x00002002", "hostc", "hostb",
         "<script>alert(1)</script><b>tie</b> & more"),
        ("NO_ROUTE", "d04", T("10:00:00"), "0x00003003", "hosta", "(unknown)", "ping"),
        ("NOT_AUTHORIZED", "d06", T("10:30:00"), "0x00004004", "hosta", "hostc", "audit 6"),
        ("RETRY_BUDGET_EXHAUSTED", "d07", T("10:45:00"), "0x00001001", "hosta", "hostb",
         "order 7"),
        ("MESSAGE_TOO_BIG", "d08", T("11:00:00"), "0x00004004", "hosta", "hostc", ""),
        ("NO_QUEUE_KEY", "d11", T("11:50:00"), "0x00000000", "hostd", "(unknown)", "nokey"),
    ], "reason STRING, id STRING, timestamp TIMESTAMP, queue_key_hex STRING, source STRING, "
       "destination STRING, payload_preview STRING")
    assertDataFrameEqual(actual, expected)


RECOVERABLE = "id STRING, reason STRING, evidence STRING, evidence_at TIMESTAMP"


def test_likely_recoverable_without_traffic_uses_transient_reasons(spark, dead):
    """Never a notice (a receiving MCA's row of a SURE message: d01, d02, d05, d10 here): its
    sender keeps the message and sends it again itself (a trial's report counted 49 notices
    of 164 dead letters as likely recoverable, which a replay then kept)."""
    actual = analysis.likely_recoverable(dead).select("id", "reason", "evidence", "evidence_at")
    expected = spark.createDataFrame([
        ("d09", "QUEUE_FULL", "transient_reason", None),
        ("d03", "UNKNOWN_QUEUE", "transient_reason", None),
        ("d00", "UNKNOWN_QUEUE", "transient_reason", None),
        ("d04", "NO_ROUTE", "transient_reason", None),
    ], RECOVERABLE)
    assertDataFrameEqual(actual, expected)
    assert analysis.likely_recoverable(dead).columns == list(analysis.RECOVERABLE_COLUMNS)


TRAFFIC = [  # deliveries: queue key as hex or decimal text, ISO time
    ("0x1001", "2025-03-03T10:00:00Z"),
    ("4097", "2025-03-03T11:20:00Z"),       # 0x1001 again, the latest delivery
    ("16388", "2025-03-03T11:40:00Z"),      # 0x4004: after d06 and d08 (too big: left out)
    ("0x3003", "2025-03-03T09:00:00Z"),     # before d04: no evidence
    ("not a key", "2025-03-03T12:00:00Z"),  # ignored
]


def test_likely_recoverable_with_traffic_needs_a_later_delivery(spark, dead):
    traffic = spark.createDataFrame(TRAFFIC, "queue_key STRING, timestamp STRING")
    actual = analysis.likely_recoverable(dead, traffic).select(
        "id", "reason", "evidence", "evidence_at")
    expected = spark.createDataFrame([  # (no notice: d01, d02, d05, d06 are)
        ("d07", "RETRY_BUDGET_EXHAUSTED", "traffic", T("11:20:00")),
        ("d09", "QUEUE_FULL", "traffic", T("11:20:00")),
    ], RECOVERABLE)
    assertDataFrameEqual(actual, expected)


# --------------------------------------------------------------------------------------------
# The job end to end
# --------------------------------------------------------------------------------------------

def _write_gz(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    """The hand-made dead letters as a drain would leave them, plus things to ignore."""
    d = tmp_path_factory.mktemp("archive")
    as_json = [json.dumps(line) for line in LINES]
    _write_gz(d / "dlq-0001.jsonl.gz", as_json[0:6])            # d01..d06
    _write_gz(d / "dlq-0002.jsonl.gz", as_json[6:12])           # d07..d11, d02 again
    (d / "sub").mkdir()
    (d / "sub" / "dlq-0003.jsonl").write_text(as_json[12] + "\nthis line is not JSON\n")
    (d / "notes.txt").write_text("not an archive\n")            # not *.jsonl(.gz)
    (d / ".dlq-0004.jsonl.gz.tmp").write_text("{half a line")  # a drain's file in progress
    return d


@pytest.fixture(scope="module")
def traffic_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traffic") / "deliveries.csv"
    path.write_text("queue_key,timestamp\n" + "".join(f"{k},{t}\n" for k, t in TRAFFIC))
    return path


@pytest.fixture(scope="module")
def report(spark, archive, traffic_csv, tmp_path_factory):
    """Run rqp-dlq-report (in this process, with the test session) once for the tests below."""
    out = tmp_path_factory.mktemp("report")
    import contextlib
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = job.main(["--input", str(archive), "--output", str(out),
                           "--traffic", str(traffic_csv)])
    assert status == 0, stderr.getvalue()
    return out, stdout.getvalue(), stderr.getvalue()


def test_job_writes_every_output(spark, report):
    out, stdout, stderr = report
    for table in [t.name for t in job.TABLES]:
        parquet, csv = out / "parquet" / table, out / "csv" / table
        assert (parquet / "_SUCCESS").exists(), table
        assert (csv / "_SUCCESS").exists(), table
        parts = sorted(csv.glob("part-*.csv"))
        assert parts, table
        header = parts[0].read_text().splitlines()[0].split(",")
        assert header == spark.read.parquet(str(parquet)).columns, table
    assert (out / "summary.json").exists() and (out / "report.html").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")
                and p.name != job.OUTPUT_LOCK]  # no temporary files left (the lock stays)
    # the small tables are one file each, sorted
    by_reason = spark.read.parquet(str(out / "parquet" / "by_reason"))
    assert [(r.reason, r["count"]) for r in by_reason.collect()] == [
        ("QUEUE_FULL", 4), ("UNKNOWN_QUEUE", 3), ("MESSAGE_TOO_BIG", 1), ("NOT_AUTHORIZED", 1),
        ("NO_QUEUE_KEY", 1), ("NO_ROUTE", 1), ("RETRY_BUDGET_EXHAUSTED", 1)]
    csv_lines = next((out / "csv" / "by_reason").glob("part-*.csv")).read_text().splitlines()
    assert csv_lines[0] == "reason,count,first_seen,last_seen"
    assert csv_lines[1] == "QUEUE_FULL,4,2025-03-03T09:05:00.123Z,2025-03-03T11:15:00.000Z"
    recoverable = spark.read.parquet(str(out / "parquet" / "likely_recoverable"))
    assert sorted(r.id for r in recoverable.collect()) == ["d07", "d09"]  # (no notice)


def test_a_run_that_fails_while_writing_leaves_no_earlier_summary_beside_its_tables(
        spark, archive, tmp_path, capsys):
    """summary.json is written last, so a directory with one is a finished report: a run
    that stops half-way (a failure, Ctrl-C) into an earlier run's directory must not leave
    that run's summary.json beside tables it has half rewritten (--previous would take the
    mix for a finished report)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"by_reason": []}\n')  # an earlier run's
    (out / "report.html").write_text("<p>an earlier run's page</p>\n")  # (a trial read it
    # as the stopped run's)
    (out / "parquet").write_text("in the way\n")  # (a file: the first table cannot be written)
    assert job.main(["--input", str(archive), "--output", str(out)]) != 0
    capsys.readouterr()
    assert not (out / "summary.json").exists() and not (out / "report.html").exists()


def test_job_summary_totals(report):
    out, stdout, stderr = report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["archive_schema"] == 2
    assert summary["totals"] == {
        "files": 3, "lines": 14, "unreadable_lines": 1, "duplicates_dropped": 1,
        "dead_letters": 12, "reasons": 7, "queues": 5, "source_hosts": 3,
        "destination_hosts": 2, "likely_recoverable": 2,  # ("(unknown)" is none)
        "implausible_times": 0,
    }
    assert summary["first_seen"] == "2025-03-03T09:05:00.123456Z"
    assert summary["last_seen"] == "2025-03-03T11:50:00.000000Z"
    assert [(r["reason"], r["count"]) for r in summary["by_reason"]] == [
        ("QUEUE_FULL", 4), ("UNKNOWN_QUEUE", 3), ("MESSAGE_TOO_BIG", 1), ("NOT_AUTHORIZED", 1),
        ("NO_QUEUE_KEY", 1), ("NO_ROUTE", 1), ("RETRY_BUDGET_EXHAUSTED", 1)]
    assert [(q["queue_key_hex"], q["queue_name"], q["count"]) for q in summary["top_queues"]] == [
        ("0x00001001", "ORDERS.Q", 5), ("0x00002002", None, 3), ("0x00004004", "AUDIT.Q", 2),
        ("0x00000000", None, 1), ("0x00003003", None, 1)]
    assert [(h["source"], h["count"]) for h in summary["top_source_hosts"]] == [
        ("hosta", 8), ("hostc", 3), ("hostd", 1)]
    assert [(h["destination"], h["count"]) for h in summary["top_destination_hosts"]] == [
        ("hostb", 8), ("(unknown)", 2), ("hostc", 2)]
    assert summary["likely_recoverable"]["evidence"] == "traffic"
    # stdout: the short table by reason; stderr names the file with the unreadable line
    assert "QUEUE_FULL" in stdout and "TOTAL" in stdout
    assert [line.split()[:2] for line in stdout.splitlines() if line.startswith("TOTAL")] == [
        ["TOTAL", "12"]]
    assert "1 line(s)" in stderr and "dlq-0003.jsonl" in stderr


def test_dead_letters_dated_by_a_wrong_clock_are_counted_and_kept_out_of_the_time_span(
        spark, tmp_path, capsys):
    """A trial: two rows dated 1970 and 2099 among a day's: first and last seen were 1970 and
    2099, the timeline's bars a year wide, every queue "jumped" in the trends. They are
    counted, said, and kept out of first/last seen, the timeline and the trends' window."""
    archive = tmp_path / "archive"
    archive.mkdir()
    lines = [json.dumps(line) for line in LINES[:11]]
    lines += [json.dumps(dict(LINES[1], id="old", timestamp="1970-01-01T00:00:05Z")),
              json.dumps(dict(LINES[1], id="far", timestamp="2099-01-01T00:00:00Z"))]
    _write_gz(archive / "dlq-0001.jsonl.gz", lines)
    out = tmp_path / "out"
    assert job.main(["--input", str(archive), "--output", str(out), "--no-store"]) == 0
    err = capsys.readouterr().err
    assert "warning: 2 dead letter(s) dated before 2000-01-01 or more than 24 h after this " \
        "run (a host's clock?)" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["dead_letters"] == 13 and summary["totals"]["implausible_times"] == 2
    assert summary["first_seen"] == "2025-03-03T09:00:00.000000Z"  # (to the hour, then)
    assert summary["last_seen"] == "2025-03-03T11:59:59.999999Z"
    page = (out / "report.html").read_text()
    assert 'id="implausible-times">2 dead letter(s) dated before 2000' in page
    assert "Dead letters from 2025-03-03 09:00:00Z to 2025-03-03 11:59:59Z" in page
    assert "by reason (1 h buckets, UTC)" in page  # (8760 h before)
    # (the tables by reason, queue, ... still say each group's own first and last: the data)


def test_job_rejects_a_schema_3_file_naming_it(spark, archive, tmp_path, capsys):
    newer = tmp_path / "newer"
    newer.mkdir()
    line = dict(LINES[0], schema=3, id="e01")
    (newer / "dlq-from-the-future.jsonl").write_text(json.dumps(line) + "\n")
    status = job.main(["--input", str(archive), str(newer / "*.jsonl"),
                       "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2
    assert "dlq-from-the-future.jsonl" in err and "schema 3" in err
    assert "dlq-0001" not in err  # only the offending file is named
    assert not (tmp_path / "out" / "summary.json").exists()
    with pytest.raises(ArchiveSchemaError, match="dlq-from-the-future.jsonl"):
        job.run_report(spark, [str(newer)], str(tmp_path / "out2"))


def test_job_input_errors_are_clear(tmp_path, capsys):
    assert job.main(["--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o")]) == 2
    assert "cannot read the input" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert job.main(["--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o")]) == 2
    assert "no archive files" in capsys.readouterr().err


def test_a_second_run_into_the_same_output_is_refused_while_one_writes(archive, tmp_path,
                                                                        capsys):
    """A trial started two runs into one --output: they overwrote each other's tables, one
    failing with 40 lines of Spark errors. The second is refused before Spark starts."""
    import fcntl
    out = tmp_path / "out"
    out.mkdir()
    with open(out / job.OUTPUT_LOCK, "w") as held:  # a run writing there
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        assert job.main(["--input", str(archive), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--output {out}: another rqp-dlq-report into {out} already runs (pid 4242" in err \
        and "give another --output" in err, err
    assert sorted(p.name for p in out.iterdir()) == [job.OUTPUT_LOCK]  # nothing written


def test_job_uses_the_running_session(spark):
    session, created = job.get_session(None)
    assert session is spark and not created


def test_drain_missing_is_reported(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "rqp_agents.drain" else real(name, *a))
    status = job.main(["--drain", "--archive", str(tmp_path), "--output", str(tmp_path / "o")])
    assert status == 2
    assert "drain tool is not installed" in capsys.readouterr().err


def test_job_file_runs_as_a_script():
    """spark-submit runs rqp/report/job.py as a file: its directory (with html.py in it) must
    not hide the standard library."""
    result = subprocess.run([sys.executable, str(ROOT / "rqp" / "report" / "job.py"), "--help"],
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "--input" in result.stdout and "--traffic" in result.stdout


# --------------------------------------------------------------------------------------------
# Dated runs and trends (issue 16): --reports DIR --keep N, --previous DIR
# --------------------------------------------------------------------------------------------

def burst_line(n: int) -> str:
    """A QUEUE_FULL dead letter on the new queue 0x5005, dead-lettered by hostb's receiver
    from a sender on the same machine (127.0.0.1: hostb itself)."""
    return json.dumps(D(f"b{n:02d}", f"11:{n:02d}:00", "hostb", "receiver", "QUEUE_FULL",
                        0x5005, "BURST.Q", "SURE", 10, "127.0.0.1", "", "burst"))


def run_job(*argv: str) -> str:
    import contextlib
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = job.main(list(argv))
    assert status == 0, stderr.getvalue()
    return stdout.getvalue()


@pytest.fixture(scope="module")
def dated(archive, tmp_path_factory):
    """Three runs into one --reports directory, keeping 2: the first over d01..d06 only, the
    second and third over everything plus a burst of 30 dead letters on a new queue."""
    base = tmp_path_factory.mktemp("dated")
    early, burst = base / "early", base / "burst"
    early.mkdir()
    burst.mkdir()
    shutil.copy(archive / "dlq-0001.jsonl.gz", early)
    _write_gz(burst / "dlq-burst.jsonl.gz", [burst_line(n) for n in range(30)])
    reports = base / "reports"
    outs = [run_job("--input", str(early), "--reports", str(reports), "--keep", "2",
                    "--no-store")]
    for _ in range(2):
        outs.append(run_job("--input", str(archive), str(burst), "--reports", str(reports),
                            "--keep", "2", "--no-store"))
    return reports, outs


def test_reports_keep_dated_runs_compare_and_point_latest(dated):
    reports, outs = dated
    runs = sorted((p for p in reports.iterdir() if p.name != "latest" and
                   not p.name.startswith(".")), key=lambda p: p.name)
    assert len(runs) == 2  # --keep 2: the first run is gone
    second, third = runs
    assert (reports / "latest").is_symlink() and (reports / "latest").resolve() == third
    assert "compared with nothing (the first run)" in outs[0]
    assert f"compared with {second}" in outs[2] and "deleted 1 older run(s)" in outs[2]
    later = json.loads((third / "summary.json").read_text())
    assert later["trends"]["previous"]["output"] == str(second)
    assert later["trends"]["new_reasons"] == [] and later["trends"]["queues_jumped"] == []

    trends = json.loads((second / "summary.json").read_text())["trends"]
    assert trends["previous"]["dead_letters"] == 6 and trends["dead_letters"]["count"] == 42
    assert [r["reason"] for r in trends["new_reasons"]] == [
        "MESSAGE_TOO_BIG", "NO_QUEUE_KEY", "RETRY_BUDGET_EXHAUSTED"]
    # the burst: 30 over 2.75 h (09:05:00.123 .. 11:50), a new queue
    assert [(q["queue_key_hex"], q["queue_name"], q["count"], q["previous_count"])
            for q in trends["queues_jumped"]] == [("0x00005005", "BURST.Q", 30, 0)]
    assert trends["queues_jumped"][0]["rate_per_hour"] == pytest.approx(30 / 2.7497, rel=1e-3)
    # hostb received 4 of 6 then, 38 of 42 now; and is the burst's source (127.0.0.1 there)
    assert [(h["host"], h["role"], h["count"], h["previous_count"])
            for h in trends["growing_hosts"]] == [("hostb", "destination", 38, 4),
                                                  ("hostb", "source", 30, 0)]
    assert "127.0.0.1" not in (second / "report.html").read_text()


def test_previous_names_an_earlier_output_and_must_be_a_finished_one(dated, archive, tmp_path,
                                                                    capsys):
    reports, _ = dated
    second = sorted(p for p in reports.iterdir() if p.name[0].isdigit())[0]
    early = tmp_path / "early"
    early.mkdir()
    shutil.copy(archive / "dlq-0001.jsonl.gz", early)
    run_job("--input", str(early), "--output", str(tmp_path / "out"), "--previous",
            str(second), "--no-store")
    trends = json.loads((tmp_path / "out" / "summary.json").read_text())["trends"]
    assert trends["previous"]["output"] == str(second) and trends["previous"]["partial"] is False
    assert trends["new_reasons"] == [] and trends["dead_letters"]["count"] == 6
    # a previous run whose tables are gone: its summary's top lists, said to be partial
    bare = tmp_path / "bare"
    shutil.copytree(second, bare, ignore=shutil.ignore_patterns("parquet", ".lock"))
    run_job("--input", str(early), "--output", str(tmp_path / "out3"), "--previous", str(bare),
            "--no-store")
    trends = json.loads((tmp_path / "out3" / "summary.json").read_text())["trends"]
    assert trends["previous"]["partial"] is True and trends["previous"]["dead_letters"] == 42
    assert "only its top lists" in (tmp_path / "out3" / "report.html").read_text()
    status = job.main(["--input", str(early), "--output", str(tmp_path / "out2"), "--previous",
                       str(tmp_path / "nowhere"), "--no-store"])
    assert status == 2 and "is not a finished report's summary" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "summary.json").exists()
    with pytest.raises(SystemExit):
        job.parse_args(["--input", str(early), "--output", str(tmp_path), "--keep", "3"])
    with pytest.raises(SystemExit):
        job.parse_args(["--input", str(early), "--reports", "hdfs://nn/reports"])


def test_trends_in_a_real_browser(dated, tmp_path):
    reports, _ = dated
    second = sorted(p for p in reports.iterdir() if p.name[0].isdigit())[0]
    dom = _dump_dom((second / "report.html").resolve().as_uri(), tmp_path / "profile")
    assert dom.bars["chart-queues-jumped"] == 1 and dom.bars["chart-hosts-growing"] == 2
    assert "BURST.Q" in dom.text and "trends-previous" in dom.ids


# --------------------------------------------------------------------------------------------
# The HTML page in a real browser
# --------------------------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed; the report's browser test needs it: "
                    "apt-get install chromium (or run scripts/test, which installs it)")
    return path


class _Dom(html.parser.HTMLParser):
    """Counts what the test looks for in the rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.svg: str | None = None
        self.table: str | None = None
        self.bars: collections.Counter = collections.Counter()
        self.series: dict[str, list[str]] = collections.defaultdict(list)
        self.ids: dict[str, str] = {}
        self.tags: collections.Counter = collections.Counter()
        self.attrs: dict[str, dict] = {}  # of the first html, form and svg#chart-timeline
        #: every element with a data-f: where (svg or table id), its dimensions, hidden or not
        self.filtered: list[dict] = []
        #: the timeline's bars: (series reason, hidden series, y, height)
        self.timeline: list[tuple[str, bool, float, float]] = []
        self.rules: dict[str, str] = {}  # div.rule id -> the text of its pre elements
        self.script = ""
        self.text = ""  # the whole DOM
        self._text_of: str | None = None
        self._series: tuple[str, bool] | None = None
        self._rule: str | None = None
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        self.tags[tag] += 1
        self._in = tag
        if tag in ("html", "form") or a.get("id") == "chart-timeline":
            self.attrs.setdefault(a.get("id") or tag, a)
        if tag == "svg":
            self.svg = a.get("id")
        if tag == "table":
            self.table = a.get("id")
        if "data-f" in a:
            self.filtered.append({"in": self.svg or self.table, "tag": tag, "id": a.get("id"),
                                  "f": json.loads(a["data-f"]), "off": "off" in classes,
                                  "class": classes, "count": a.get("data-count")})
        if self.svg and tag == "rect" and "bar" in classes:
            self.bars[self.svg] += 1
            if self.svg == "chart-timeline":
                self.timeline.append((*self._series, float(a["y"]), float(a["height"])))
        if self.svg and tag == "g" and "series" in classes:
            self._series = (a.get("data-reason"), "off" in classes)
            if classes == ["series"]:
                self.series[self.svg].append(a.get("data-reason"))
        if tag == "div" and "rule" in classes:
            self._rule = a["id"]
            self.rules[self._rule] = ""
        if "id" in a and tag in ("dd", "p", "span"):
            self._text_of = a["id"]
            self.ids[a["id"]] = ""

    def handle_endtag(self, tag):
        self._in = None
        if tag == "svg":
            self.svg = None
        if tag == "table":
            self.table = None
        if tag == "div":
            self._rule = None
        if tag in ("dd", "p", "span"):
            self._text_of = None

    def handle_data(self, data):
        if self._text_of:
            self.ids[self._text_of] += data
        if self._rule and self._in == "pre":
            self.rules[self._rule] += data
        if self._in == "script":
            self.script += data

    def shown(self, where: str) -> list[dict]:
        return [e for e in self.filtered if e["in"] == where and not e["off"]]


def _dump_dom(page: str, profile: Path, *flags: str) -> _Dom:
    """The DOM of ``page`` after its scripts ran (or not, with the flags to turn them off)."""
    dom = subprocess.run([_chromium(), *CHROMIUM_FLAGS, *flags, f"--user-data-dir={profile}",
                          "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Dom()
    parsed.feed(dom.stdout)
    parsed.text = dom.stdout
    return parsed


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """A tiny PNG decoder (8-bit, not interlaced, no Pillow): width, height and a sample of the
    pixels (every 4th pixel of every 4th row)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, header
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    low = int.from_bytes(b"\x7f" * stride, "big")
    high = int.from_bytes(b"\x80" * stride, "big")

    def add(x: bytes, y: bytes) -> bytes:  # bytewise (x + y) mod 256 of whole rows at once
        a, b = int.from_bytes(x, "big"), int.from_bytes(y, "big")
        return (((a & low) + (b & low)) ^ ((a ^ b) & high)).to_bytes(stride, "big")

    rows, prev = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], raw[start + 1:start + 1 + stride]
        if kind == 2:  # Up
            line = add(line, prev)
        elif kind == 1:  # Sub: a running sum per channel
            out = bytearray(line)
            for k in range(bpp):
                out[k::bpp] = bytes(itertools.accumulate(line[k::bpp],
                                                         lambda s, v: (s + v) & 255))
            line = bytes(out)
        elif kind in (3, 4):  # Average, Paeth
            out = bytearray(line)
            for i in range(stride):
                a = out[i - bpp] if i >= bpp else 0
                b = prev[i]
                if kind == 3:
                    out[i] = (out[i] + (a + b) // 2) & 255
                else:
                    c = prev[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    out[i] = (out[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) \
                        & 255
            line = bytes(out)
        rows.append(line)
        prev = line
    return width, height, [r[i:i + bpp] for r in rows[::4] for i in range(0, stride, bpp * 4)]


def test_report_html_renders_in_a_real_browser(report, tmp_path):
    chromium = _chromium()
    out, _, _ = report
    page = (out / "report.html").resolve().as_uri()
    profile = tmp_path / "profile"
    parsed = _dump_dom(page, profile)
    # over time: 7 reasons (series), 10 (hour, reason) bars
    assert parsed.series["chart-timeline"] == [
        "QUEUE_FULL", "UNKNOWN_QUEUE", "MESSAGE_TOO_BIG", "NOT_AUTHORIZED", "NO_QUEUE_KEY",
        "NO_ROUTE", "RETRY_BUDGET_EXHAUSTED"]
    assert parsed.bars["chart-timeline"] == 10
    assert parsed.bars["chart-queues"] == 5
    assert parsed.bars["chart-source-hosts"] == 3
    assert parsed.bars["chart-destination-hosts"] == 3
    assert parsed.ids["total-dead-letters"] == "12"
    assert parsed.ids["total-duplicates"] == "1"
    assert parsed.ids["first-seen"] == "2025-03-03 09:05:00Z"
    assert "traffic" in parsed.ids["recoverable-evidence"]
    # the samples, the hostile preview shown as text: no script or b element came from it
    assert "d00" in parsed.text and "d08" in parsed.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;b&gt;tie&lt;/b&gt; &amp; more" in parsed.text
    assert parsed.tags["b"] == 0
    # one script, the page's own: the Content-Security-Policy let it run (by its hash), and
    # with nothing chosen it hid nothing
    assert parsed.tags["script"] == 1 and parsed.script == report_html.SCRIPT
    assert parsed.attrs["html"].get("data-filters") == "on"
    assert "hidden" not in parsed.attrs["filters"]
    assert not [e for e in parsed.filtered if e["off"]]
    # each reason: a link to its sample (the sample row is that reason's) and a replay rule
    reasons = [e for e in parsed.filtered if e["in"] == "table-reasons"]
    samples = {e["id"]: e["f"]["reason"] for e in parsed.filtered if e["in"] == "table-samples"}
    assert len(reasons) == 7
    for row in reasons:
        n = row["id"].removeprefix("reason-")
        assert samples[f"sample-{n}"] == row["f"]["reason"]
        assert f'href="#sample-{n}"' in parsed.text and f'href="#rule-{n}"' in parsed.text
        rule = yaml.safe_load(parsed.rules[f"rule-{n}"].split("rqpctl")[0])
        action = "discard" if row["f"]["reason"] in ("MESSAGE_TOO_BIG", "NO_QUEUE_KEY") \
            else "retry"
        limits = {"retries": 5, "interval": "10m"} if action == "retry" else {}
        assert rule == {"rules": [{"reason": row["f"]["reason"], "action": action, **limits}]}

    shot = tmp_path / "report.png"
    result = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                             f"--screenshot={shot}", "--window-size=1200,2000", page],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 2000)
    colors = collections.Counter(pixels)
    assert len(colors) > 20, "the screenshot is (nearly) one colour"
    background, n = colors.most_common(1)[0]
    assert n < 0.97 * len(pixels), "the screenshot is (nearly) blank"


#: The dead letters hostc has a part in (dead-lettered there, sent from or to it): d00, d03,
#: d05 (from hostc), d06, d08 (dead-lettered on hostc).
HOSTC = 5


def test_report_filters_in_a_real_browser(report, tmp_path):
    """Issue 16: no way to narrow the page to one host or queue. Chosen through the address
    (as a reader's link would), the filters hide the other hosts' rows and bars."""
    out, _, _ = report
    page = (out / "report.html").resolve().as_uri()
    dom = _dump_dom(f"{page}#host=hostc", tmp_path / "profile")
    assert dom.attrs["html"].get("data-filters") == "on"
    for where in ("table-breakdown", "table-samples", "chart-source-hosts",
                  "chart-destination-hosts"):
        shown = dom.shown(where)
        assert shown and all("hostc" in e["f"]["host"] for e in shown), where
        hidden = [e for e in dom.filtered if e["in"] == where and e["off"]]
        assert hidden and not [e for e in hidden if "hostc" in e["f"]["host"]], where
    assert [e["f"]["host"] for e in dom.shown("chart-source-hosts")] == [["hostc"]]
    assert sum(int(e["count"]) for e in dom.shown("table-breakdown")) == HOSTC
    assert dom.ids["filter-count"] == f"{HOSTC} of 12 dead letters in the breakdown match"
    # tables without a host (the reasons) are not narrowed by it
    assert len(dom.shown("table-reasons")) == 7

    # a reason and a host: the timeline keeps that reason's series, stacked from the axis
    dom = _dump_dom(f"{page}#reason=UNKNOWN_QUEUE&host=hostc", tmp_path / "profile")
    assert dom.ids["filter-count"] == "2 of 12 dead letters in the breakdown match"  # d00, d03
    assert [e["f"]["reason"] for e in dom.shown("chart-timeline") if e["tag"] == "g"] == [
        "UNKNOWN_QUEUE"]
    y0 = float(dom.attrs["chart-timeline"]["data-y0"])
    bars = [(y, h) for reason, off, y, h in dom.timeline if not off]
    assert len(bars) == 2 and all(abs(y + h - y0) < 0.01 for y, h in bars)
    assert [e["f"]["reason"] for e in dom.shown("table-reasons")] == ["UNKNOWN_QUEUE"]
    assert [e["id"] for e in dom.filtered if e["tag"] == "div" and not e["off"]] == [
        dom.shown("table-reasons")[0]["id"].replace("reason", "rule")]  # its rule alone

    # as the report names things: case, a trailing dot, a port do not matter
    dom = _dump_dom(f"{page}#reason=unknown_queue&host=HOSTC.:7460", tmp_path / "profile")
    assert dom.ids["filter-count"] == "2 of 12 dead letters in the breakdown match"
    # a value that is not among the choices is not applied, and the page says so
    dom = _dump_dom(f"{page}#host=nosuchhost", tmp_path / "profile")
    assert dom.ids["filter-count"] == " host nosuchhost is not among the choices: not applied."
    assert not [e for e in dom.filtered if e["in"] == "table-breakdown" and e["off"]]

    # a queue: its bar and rows only
    dom = _dump_dom(f"{page}#queue=0x00004004", tmp_path / "profile")
    assert [e["f"]["queue"] for e in dom.shown("chart-queues")] == ["0x00004004"]
    assert {e["f"]["queue"] for e in dom.shown("table-breakdown")} == {"0x00004004"}
    assert dom.ids["filter-count"] == "2 of 12 dead letters in the breakdown match"  # d06, d08

    # Without its script (here: the policy names another hash, so the browser refuses to run
    # it, which also shows the policy is enforced) the page shows everything, no controls.
    # (Chromium's --dump-dom needs scripts itself: they cannot simply be turned off.)
    refused = tmp_path / "refused.html"
    text = (out / "report.html").read_text()
    assert text.count(report_html.SCRIPT_HASH) == 1
    refused.write_text(text.replace(report_html.SCRIPT_HASH, "sha256-" + "A" * 43 + "="))
    dom = _dump_dom(f"{refused.as_uri()}#host=hostc", tmp_path / "profile")
    assert "data-filters" not in dom.attrs["html"] and "hidden" in dom.attrs["filters"]
    assert not [e for e in dom.filtered if e["off"] and "tail" not in e["class"]]
    assert len(dom.shown("table-breakdown")) == len(
        [e for e in dom.filtered if e["in"] == "table-breakdown"]) > HOSTC


# --------------------------------------------------------------------------------------------
# The synthetic data generator
# --------------------------------------------------------------------------------------------

def _lines(directory: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("*.jsonl.gz"))
            for line in gzip.open(p, "rt")]


def test_generate_is_deterministic(tmp_path):
    a = generate.generate(3000, str(tmp_path / "a"), seed=7, per_file=1000, processes=2)
    b = generate.generate(3000, str(tmp_path / "b"), seed=7, per_file=1000, processes=1)
    c = generate.generate(3000, str(tmp_path / "c"), seed=8, per_file=1000, processes=1)
    assert [Path(p).name for p in a] == ["dlq-7-00000.jsonl.gz", "dlq-7-00001.jsonl.gz",
                                         "dlq-7-00002.jsonl.gz"]
    assert [Path(p).read_bytes() for p in a] == [Path(p).read_bytes() for p in b]
    assert Path(a[0]).read_bytes() != Path(c[0]).read_bytes()


def test_generate_has_realistic_skew(tmp_path):
    generate.generate(20000, str(tmp_path), seed=3, per_file=10000, processes=2)
    lines = _lines(tmp_path)
    assert len(lines) == 20000
    named = collections.Counter(d["queue_key"] for d in lines if d["queue_name"])
    counts = sorted(named.values())
    assert counts[-1] >= 20 * counts[len(counts) // 2], counts[-5:]
    hosts = sorted(collections.Counter(d["host"] for d in lines).values())
    assert hosts[-1] >= 5 * hosts[len(hosts) // 2]
    reasons = collections.Counter(d["reason"] for d in lines)
    assert 0.32 < reasons["QUEUE_FULL"] / 20000 < 0.38
    assert 0.22 < reasons["UNKNOWN_QUEUE"] / 20000 < 0.28
    assert reasons.most_common(3)[2][0] == "NO_ROUTE"
    by_hour = collections.Counter(d["timestamp"][11:13] for d in lines)
    assert by_hour["14"] > 3 * by_hour["03"]  # busy afternoons, quiet nights
    assert len({d["id"] for d in lines}) < 20000  # some ids archived twice


def test_generate_writes_schema_valid_rows(spark, tmp_path):
    generate.generate(2000, str(tmp_path), seed=5, per_file=1000, processes=1)
    types = {f.name: f.dataType.typeName() for f in ARCHIVE_SCHEMA.fields}
    python_types = {"integer": int, "long": int, "string": str, "boolean": bool}
    for d in _lines(tmp_path):
        assert tuple(d) == ARCHIVE_FIELDS
        for name, value in d.items():
            if name == "queue_name" and value is None:
                continue
            assert type(value) is python_types[types[name]], (name, value)
        assert d["schema"] == 2
        payload = base64.b64decode(d["payload_b64"], validate=True)
        assert len(payload) == d["payload_length"] <= d["original_length"]
        assert d["truncated"] == (d["payload_length"] < d["original_length"] and
                                  not d["header_only"])
        when = dt.datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00"))
        epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
        assert (when - epoch) // dt.timedelta(microseconds=1) == d["timestamp_ns"] // 1000
        assert d["queue_key_hex"] == "0x%08x" % d["queue_key"]
    # and Spark reads every line with the declared schema
    raw = job.read_archives(spark, [str(tmp_path)])
    check = job.check_archives(analysis.normalize(job.prepare(raw)), files=2)
    assert (check.lines, check.unreadable_lines) == (2000, 0)
    assert check.dead_letters + check.duplicates == 2000 and check.duplicates > 0


def test_a_long_file_name_left_out_keeps_its_end_on_the_page():
    """A re-check: the page cut a left-out file's name at 300 characters from its start, so
    a long path lost the file name."""
    from rqp.report.html import _middle

    name = "file:/archive/" + "deep/" * 80 + "dlq-host-IMPORTANT-TAIL.jsonl.gz"
    cut = _middle(name, 300)
    assert len(cut) == 300 and cut.startswith("file:/archive/deep/") and \
        cut.endswith("/dlq-host-IMPORTANT-TAIL.jsonl.gz") and "\u2026" in cut
    assert _middle("file:/a.jsonl", 300) == "file:/a.jsonl"
