"""The report's columnar store (rqp/report/columnar.py): incremental compaction into Parquet,
and what a kill does to it; answers equal to reading the JSON archive itself."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rqp.report import columnar, job
from rqp.report.schema import ArchiveSchemaError
from tests.report_data import (
    PER_FILE, answers, archive_of, csv_lines, generate_archive, report,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[Path]:
    return generate_archive(tmp_path_factory.mktemp("generated"))


def _store_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "data").rglob("*.parquet"))


def test_later_runs_take_only_new_files_and_answer_like_the_json(spark, generated, tmp_path):
    archive = archive_of(tmp_path, generated[:3])
    store = tmp_path / "store"
    first = report(spark, archive, tmp_path / "out1", store)
    assert first["store"]["new_files"] == 3 and first["store"]["new_lines"] == 3 * PER_FILE
    assert first["totals"]["lines"] == 3 * PER_FILE
    # partitioned by day: every data file sits in day=.../batch=<the batch>/
    batch = first["store"]["batch"]
    assert {p.parent.name for p in _store_files(store)} == {f"batch={batch}"}
    assert all(p.parent.parent.name.startswith("day=2025-") for p in _store_files(store))

    # An archive file already taken is not read again: overwrite one with garbage (same name).
    # Were it read, its lines would count as unreadable.
    taken = archive / generated[0].name
    with gzip.open(taken, "wt") as f:
        f.write("not json\n" * 10)
    for f in generated[3:]:
        shutil.copy(f, archive / f.name)
    second = report(spark, archive, tmp_path / "out2", store)
    assert second["store"]["new_files"] == 2
    assert second["store"]["new_lines"] == 2 * PER_FILE
    assert second["store"]["files"] == 5 and second["store"]["batches"] == 2
    assert second["totals"]["unreadable_lines"] == 0
    assert second["totals"]["lines"] == 5 * PER_FILE

    # the same answers as the report read straight from the JSON archive (the original files)
    direct = report(spark, archive_of(tmp_path / "direct", generated), tmp_path / "out3", None)
    assert direct["store"] is None
    assert answers(second) == answers(direct)
    for table in ("by_reason", "by_queue", "by_hour_reason", "payload_stats", "samples"):
        assert csv_lines(tmp_path / "out2", table) == csv_lines(tmp_path / "out3", table), table

    # nothing new: no batch, same answers
    third = report(spark, archive, tmp_path / "out4", store)
    assert third["store"]["new_files"] == 0 and third["store"]["batch"] is None
    assert answers(third) == answers(second)


def test_a_file_of_another_schema_takes_nothing(spark, generated, tmp_path):
    archive = archive_of(tmp_path, generated[:2])
    bad = archive / "zz-future.jsonl"
    bad.write_text(json.dumps({"schema": 3, "id": "x"}) + "\n")
    store = tmp_path / "store"
    with pytest.raises(ArchiveSchemaError, match=r"zz-future\.jsonl: 1 line\(s\) with schema 3"):
        report(spark, archive, tmp_path / "out", store)
    assert not list((store / "batches").glob("*.json"))  # nothing was taken...
    assert _store_files(store) == []  # ... and the batch's rows are gone
    bad.unlink()
    summary = report(spark, archive, tmp_path / "out", store)
    assert summary["store"]["new_files"] == 2 and summary["totals"]["lines"] == 2 * PER_FILE


def _job(archive: Path, out: Path, store: Path | None, crash_after: str | None = None):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT))
    env.pop("RQP_REPORT_CRASH_AFTER", None)
    if crash_after:
        env["RQP_REPORT_CRASH_AFTER"] = crash_after
    return subprocess.run(
        [sys.executable, "-m", "rqp.report.job", "--master", "local[2]", "--input",
         str(archive), "--output", str(out), *(["--store", str(store)] if store else [])],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_a_kill_between_writing_and_recording_counts_nothing_twice(spark, generated, tmp_path):
    archive = archive_of(tmp_path, generated[:2])
    store = tmp_path / "store"
    killed = _job(archive, tmp_path / "out-killed", store, crash_after="write")
    assert killed.returncode == -9, killed.stderr[-2000:]
    written = _store_files(store)
    assert written, "the kill was meant to come after the Parquet write"
    assert not list((store / "batches").glob("*.json"))  # ...and before the commit record
    assert not (tmp_path / "out-killed" / "summary.json").exists()

    # The next run (a new file arrived meanwhile) removes the orphan rows and takes all three.
    shutil.copy(generated[2], archive / generated[2].name)
    after = report(spark, archive, tmp_path / "out", store)
    assert after["store"]["removed_uncommitted"] >= 1
    assert after["store"]["new_files"] == 3
    assert not any(p.exists() for p in written)
    assert after["totals"]["lines"] == 3 * PER_FILE  # none counted twice, none dropped
    direct = report(spark, archive_of(tmp_path / "direct", generated[:3]), tmp_path / "d", None)
    assert answers(after) == answers(direct)


def test_a_kill_after_the_record_keeps_the_batch(spark, generated, tmp_path):
    """Also: rqp-dlq-report --input DIR keeps its store in DIR/.columnar (hidden: the archive's
    readers skip it)."""
    archive = archive_of(tmp_path, generated[:2])
    store = archive / ".columnar"
    assert job.default_store([str(archive)]) == str(store)
    killed = _job(archive, tmp_path / "out-killed", None, crash_after="commit")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(list((store / "batches").glob("*.json"))) == 1
    after = report(spark, archive, tmp_path / "out", store)
    assert after["store"]["new_files"] == 0 and after["store"]["removed_uncommitted"] == 0
    assert after["totals"]["lines"] == 2 * PER_FILE


def test_store_schema_keeps_every_archive_field_but_the_payload():
    names = {f.name for f in columnar.STORE_SCHEMA.fields}
    assert "payload_b64" not in names
    assert {"id", "host", "reason", "message_key", "payload_preview", "_corrupt_record",
            "_file", "day", "batch"} <= names
