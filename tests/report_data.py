"""What the report's store and cluster tests share: a small generated archive, copies of it,
and what a report says (its answers, not how it got there)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

from rqp.report import compute, generate

PER_FILE = 1500


def generate_archive(root: Path, files: int = 5) -> list[Path]:
    return [Path(p) for p in generate.generate(files * PER_FILE, str(root), seed=11,
                                               per_file=PER_FILE, processes=1)]


def archive_of(tmp_path: Path, files: list[Path]) -> Path:
    """``tmp_path/archive`` holding copies of ``files``."""
    archive = tmp_path / "archive"
    archive.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(f, archive / f.name)
    return archive


def report(spark, archive: Path, out: Path, store: Path | None) -> dict:
    return compute.run_report(spark, [str(archive)], str(out), out=io.StringIO(),
                              err=io.StringIO(), store=str(store) if store else None)


def answers(summary: dict) -> dict:
    return {k: summary[k] for k in ("totals", "by_reason", "first_seen", "last_seen",
                                    "top_queues", "top_source_hosts", "payload_stats")}


def csv_lines(out: Path, table: str) -> list[str]:
    (part,) = (out / "csv" / table).glob("part-*.csv")
    return part.read_text().splitlines()
