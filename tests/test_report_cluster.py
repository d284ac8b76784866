"""The report on a real Spark standalone cluster (master and worker started from the installed
PySpark's own spark-class, rqp/tools/spark_standalone.py): the same answer as local[2]."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rqp.report import compute
from rqp.tools.spark_standalone import StandaloneCluster
from tests.report_data import PER_FILE, answers, archive_of, csv_lines, generate_archive

ROOT = compute.__file__.rsplit("/rqp/", 1)[0]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[Path]:
    return generate_archive(tmp_path_factory.mktemp("generated"))


def test_the_report_runs_unchanged_on_a_standalone_cluster(spark, generated, tmp_path):
    archive = archive_of(tmp_path, generated)
    with StandaloneCluster(cores=2, memory="1g", workdir=str(tmp_path / "cluster")) as cluster:
        assert cluster.url.startswith("spark://127.0.0.1:")
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("SPARK_LOCAL_IP", None)  # the job itself keeps a loopback master on loopback
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "rqp.report.job", "--master", cluster.url, "--input",
             str(archive), "--output", str(tmp_path / "cluster-out")],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        cluster_seconds = time.monotonic() - started
        assert result.returncode == 0, result.stderr[-3000:]
        # the work ran on the worker's executor, not in the driver
        app_dirs = list((tmp_path / "cluster" / "work").glob("app-*/*/stderr"))
        assert app_dirs, "no executor ran on the worker"
    on_cluster = json.loads((tmp_path / "cluster-out" / "summary.json").read_text())
    assert on_cluster["spark"]["master"] == cluster.url
    assert on_cluster["store"]["new_files"] == len(generated)  # the columnar store, on executors

    started = time.monotonic()
    local = compute.run_report(spark, [str(archive_of(tmp_path / "local", generated))],
                               str(tmp_path / "local-out"), out=io.StringIO(),
                               err=io.StringIO(), store=str(tmp_path / "local-store"))
    local_seconds = time.monotonic() - started
    assert local["spark"]["master"] == "local[2]"
    assert answers(on_cluster) == answers(local)
    assert on_cluster["totals"]["lines"] == len(generated) * PER_FILE
    for table in ("by_reason", "by_queue", "by_source_host", "by_hour_reason", "payload_stats",
                  "samples"):
        assert csv_lines(tmp_path / "cluster-out", table) == csv_lines(tmp_path / "local-out", table)
    print(f"cluster {cluster_seconds:.1f} s (with its driver's start), local[2] "
          f"{local_seconds:.1f} s (the test session, started)")


@pytest.mark.parametrize("master", ["bogus", "local[0]", "spark:/x", "local[two]"])
def test_a_master_that_is_not_a_url_is_refused_before_spark_starts(master, tmp_path, capsys):
    from rqp.report import job

    with pytest.raises(SystemExit) as exit_:
        job.parse_args(["--input", str(tmp_path), "--output", str(tmp_path / "o"),
                        "--master", master])
    assert exit_.value.code == 2
    assert f"--master {master}: not a Spark master URL" in capsys.readouterr().err


@pytest.mark.parametrize("master", ["local", "local[*]", "local[2]", "local[2,3]",
                                    "spark://a:7077,b:7077", "yarn", "k8s://https://k:6443"])
def test_the_master_urls_spark_takes_are_taken(master, tmp_path):
    from rqp.report import job

    args = job.parse_args(["--input", str(tmp_path), "--output", str(tmp_path / "o"),
                           "--master", master])
    assert args.master == master
