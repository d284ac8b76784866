"""The report's columnar store (rqp/report/columnar.py): incremental compaction into Parquet,
and what a kill does to it; answers equal to reading the JSON archive itself."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rqp.report import columnar, compute, job
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


def test_files_it_cannot_read_are_left_out_and_taken_later(spark, generated, tmp_path):
    """A file with a line of a newer schema (a host upgraded first) or that is not gzip at all
    is named and left out, the others reported; a JSON object without a reason, a queue or a
    time is an unreadable line; a later run takes the files once they read."""
    archive = archive_of(tmp_path, generated[:2])
    good = json.loads(gzip.open(generated[0], "rt").readline())
    newer = archive / "dlq-newer.jsonl"  # one line it reads, one of schema 3: left out whole
    newer.write_text(json.dumps(dict(good, id="n1")) + "\n"
                     + json.dumps(dict(good, id="n2", schema=3)) + "\n")
    garbage = archive / "dlq-garbage.jsonl.gz"
    garbage.write_bytes(os.urandom(4096))
    incomplete = archive / "dlq-incomplete.jsonl"
    incomplete.write_text(json.dumps(dict(good, id="i1")) + "\n"
                          + json.dumps({"schema": 2, "id": "abc"}) + "\n")
    # a whole gzip holding nothing: taken, with no line (a trial: left out at every run)
    (archive / "dlq-empty.jsonl.gz").write_bytes(gzip.compress(b""))
    store = tmp_path / "store"
    err = io.StringIO()
    summary = compute.run_report(spark, [str(archive)], str(tmp_path / "out"), out=io.StringIO(),
                                 err=err, store=str(store))
    left_out = {Path(f).name: why for f, why in summary["store"]["left_out"].items()}
    assert set(left_out) == {"dlq-newer.jsonl", "dlq-garbage.jsonl.gz"}
    assert "1 line(s) of archive schema 3" in left_out["dlq-newer.jsonl"]
    assert left_out["dlq-garbage.jsonl.gz"] == "not gzip, though named .gz"
    assert "dlq-newer.jsonl left out" in err.getvalue()
    page = (tmp_path / "out" / "report.html").read_text()  # (a trial: on stderr only)
    assert 'id="left-out">2 archive file(s) left out of this report' in page, page[:3000]
    assert "dlq-newer.jsonl: 1 line(s) of archive schema 3" in page and \
        "dlq-garbage.jsonl.gz: not gzip, though named .gz" in page
    assert summary["store"]["new_files"] == 4  # (the empty one too)
    assert summary["totals"]["lines"] == 2 * PER_FILE + 2  # none of newer's lines
    assert summary["totals"]["unreadable_lines"] == 1  # {"schema": 2, "id": "abc"}

    again = report(spark, archive, tmp_path / "out1", store)  # nothing fixed yet: no batch
    assert again["store"]["batch"] is None and again["store"]["batches"] == 1
    assert set(again["store"]["left_out"]) == set(summary["store"]["left_out"])

    newer.write_text(json.dumps(dict(good, id="n1")) + "\n")  # (the report was upgraded)
    garbage.unlink()
    later = report(spark, archive, tmp_path / "out2", store)
    assert later["store"]["new_files"] == 1 and later["store"]["left_out"] == {}
    assert later["totals"]["lines"] == 2 * PER_FILE + 3


def test_a_file_cut_short_waits_until_whole_and_odd_path_names_are_read(spark, generated,
                                                                         tmp_path):
    """Two trials: a copy still being made (cut short) was taken with the lines before the
    cut and, taken once by name, never counted whole; and an archive under "arch ivé" (or
    with % or #) was not found, the store handing Spark its own percent-encoded names."""
    odd = tmp_path / "arch iv\u00e9 50%41 #1"
    archive = archive_of(odd, generated[:2])
    whole = generated[2].read_bytes()
    copying = archive / generated[2].name
    copying.write_bytes(whole[:len(whole) // 2])
    store = tmp_path / "store"
    first = report(spark, archive, tmp_path / "out1", store)
    [(name, why)] = first["store"]["left_out"].items()
    assert name.endswith(generated[2].name) and why.startswith("cut short"), first["store"]
    assert first["totals"]["lines"] == 2 * PER_FILE  # none of the cut file's lines
    copying.write_bytes(whole)  # the copy is done
    second = report(spark, archive, tmp_path / "out2", store)
    assert second["store"]["new_files"] == 1 and second["store"]["left_out"] == {}
    direct = report(spark, archive, tmp_path / "out3", None)
    assert second["totals"]["lines"] == 3 * PER_FILE and answers(second) == answers(direct)


def test_an_archive_moved_with_its_store_is_not_taken_again(spark, generated, tmp_path):
    """A trial: ``mv`` of an archive (its ``.columnar/`` with it) made every file new again,
    its lines and duplicates counted twice. A drain's file is known by its name; a file of
    another name by its URI, as before."""
    first_dir = tmp_path / "srv" / "dlq"
    first_dir.mkdir(parents=True)
    names = [f"dlq-vm-20261128T0600{i:02d}.000000Z-{100 + i}-000001.jsonl.gz"
             for i in range(2)]
    for f, name in zip(generated[:2], names):
        shutil.copy(f, first_dir / name)
    shutil.copy(generated[2], first_dir / "hand-made.jsonl.gz")
    store = first_dir / ".columnar"
    first = report(spark, first_dir, tmp_path / "out1", store)
    assert first["store"]["new_files"] == 3 and first["totals"]["lines"] == 3 * PER_FILE

    moved = tmp_path / "data" / "dlq"
    moved.parent.mkdir()
    shutil.move(first_dir, moved)
    shutil.copy(generated[3], moved / "dlq-vm-20261128T070000.000000Z-200-000001.jsonl.gz")
    after = report(spark, moved, tmp_path / "out2", moved / ".columnar")
    # the new drain file and the hand-made one (known by its old URI) are taken
    assert after["store"]["new_files"] == 2, after["store"]
    assert after["store"]["files"] == 5 and after["store"]["batches"] == 2
    assert after["totals"]["lines"] == 4 * PER_FILE + PER_FILE  # hand-made's counted twice...
    direct = report(spark, archive_of(tmp_path / "direct", generated[:4]), tmp_path / "d", None)
    assert (after["totals"]["duplicates_dropped"]  # ...and dropped by id
            == direct["totals"]["duplicates_dropped"] + PER_FILE)
    assert answers(after)["by_reason"] == answers(direct)["by_reason"]


@pytest.mark.parametrize("stored", [True, False], ids=["store", "no-store"])
def test_a_file_this_user_cannot_read_is_left_out_not_the_whole_report(generated, stored):
    """A re-check: one archive file the report's user could not read (root's, 0600) failed the
    whole report, Spark saying "File does not exist" in 338 lines of Java (and, a later trial,
    still did with ``--no-store``). It is left out, named, and taken once it can be read. Run
    as uid 65534, as the unit's user would be."""
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="rqp-unreadable-", dir="/tmp"))
    try:
        top.chmod(0o755)
        archive = archive_of(top, generated[:2])
        locked = archive / generated[1].name
        locked.chmod(0o600)  # (root's)
        for d in ("out", "store", "tmp"):
            (top / d).mkdir(mode=0o777)
            (top / d).chmod(0o777)
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT),
                   TMPDIR=str(top / "tmp"), HOME=str(top / "tmp"))
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-m", "rqp.report.job", "--master", "local[2]", "--input", str(archive),
             "--output", str(top / "out"),
             *(["--store", str(top / "store")] if stored else ["--no-store"])],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((top / "out" / "summary.json").read_text())
        [(name, why)] = summary["left_out"].items()
        assert name.endswith(locked.name) and why.startswith("cannot be read by this user"), why
        assert (summary["store"]["left_out"] if stored else summary["store"] is None) in (
            summary["left_out"], True)
        assert f"{locked.name} left out" in done.stderr, done.stderr[-3000:]
        assert summary["totals"]["lines"] == PER_FILE
        assert "\tat org.apache" not in done.stderr, done.stderr[-3000:]
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _job(archive: Path, out: Path, store: Path | None, crash_after: str | None = None,
         no_store: bool = False):
    temp = out.with_name(f"{out.name}-tmp")  # (a job killed -9 leaves its JVM's directory)
    temp.mkdir()
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    env.pop("RQP_REPORT_CRASH_AFTER", None)
    if crash_after:
        env["RQP_REPORT_CRASH_AFTER"] = crash_after
    return subprocess.run(
        [sys.executable, "-m", "rqp.report.job", "--master", "local[2]", "--input",
         str(archive), "--output", str(out), *(["--store", str(store)] if store else []),
         *(["--no-store"] if no_store else [])],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_a_glob_input_is_read_without_a_java_stack_trace(generated, tmp_path):
    """A trial: a glob --input worked, but Spark's FileStreamSink printed a 90-line
    FileNotFoundException first, which reads as a failure in a journal."""
    archive = archive_of(tmp_path, generated[:2])
    done = _job(Path(f"{archive}/*.jsonl.gz"), tmp_path / "out", None)
    assert done.returncode == 0, done.stderr
    assert "Exception" not in done.stderr and "\tat org.apache" not in done.stderr, done.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["totals"]["lines"] == \
        2 * PER_FILE


def test_a_file_the_store_leaves_out_is_said_in_one_line_without_java(generated, tmp_path):
    """A trial: each file that is not gzip gave ~50 lines of a Java stack trace at every
    run, above the store's own line saying it was left out."""
    archive = archive_of(tmp_path, generated[:1])
    (archive / "dlq-garbage.jsonl.gz").write_bytes(os.urandom(4096))
    os.mkfifo(archive / "dlq-fifo.jsonl")  # (a re-check: the report waited on it for good)
    done = _job(archive, tmp_path / "out", tmp_path / "store")
    assert done.returncode == 0, done.stderr
    assert "dlq-garbage.jsonl.gz left out" in done.stderr, done.stderr
    assert "dlq-fifo.jsonl left out (not taken into the store; tried again next run): not a " \
        "regular file" in done.stderr, done.stderr
    assert "\tat " not in done.stderr and "not a gzip file" not in done.stderr, done.stderr
    # (nor the INFO lines a level restored as the reading's own let through: a re-check)
    assert " INFO " not in done.stderr, done.stderr
    # without the store too (a re-check: Spark skipped it with 40 lines of Java, and counted
    # it as read)
    done = _job(archive, tmp_path / "out-direct", None, no_store=True)
    assert done.returncode == 0, done.stderr
    assert "dlq-garbage.jsonl.gz left out (tried again next run): not gzip, though named .gz" \
        in done.stderr and "dlq-fifo.jsonl left out" in done.stderr, done.stderr
    assert "\tat " not in done.stderr and "not a gzip file" not in done.stderr, done.stderr


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


def test_a_store_it_cannot_use_is_a_clear_error(spark, generated, tmp_path, capsys):
    archive = archive_of(tmp_path, generated[:1])
    status = job.main(["--input", str(archive), "--output", str(tmp_path / "out"),
                       "--store", "/proc/rqp-store"])
    err = capsys.readouterr().err
    assert status == 2
    assert "error: --store /proc/rqp-store: cannot use it as the columnar store" in err
    assert "Traceback" not in err
