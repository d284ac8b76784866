"""How the dead-letter report scales: first and incremental runs from 1 to 50 million dead
letters, time per phase.

``python -m rqp.tools.report_bench`` (or ``scripts/report-bench``):

1. generates the archives once with :mod:`rqp.report.generate` (seed 1, 200,000 lines per
   file), under a temporary directory or ``--data DIR`` (kept, and reused by a later run: every
   file is a function of the seed and its number only, so the first 5 files are exactly what
   generating 1 million lines writes, and one generation serves every size). One file more than
   the largest size is generated: the incremental runs' new file;
2. starts one SparkSession (``local[2]`` by default, ``spark.driver.memory`` 8g; or
   ``--cluster``: a standalone cluster of one worker started from PySpark's own spark-class,
   :mod:`rqp.tools.spark_standalone`) and runs the job once on a small archive to warm the JVM
   up (not counted);
3. for each size N, with a new columnar store (:mod:`rqp.report.columnar`):

   * **first**: the job on N dead letters (compact all N into Parquet, read, dedupe, check, every
     table as Parquet and CSV, summary.json, report.html);
   * **incremental**: one new archive file (200,000 lines) arrives; the job again (compact the
     new file, then the report over N + 200,000 from the store);
   * with ``--direct``, also the job reading the JSON itself (no store), as before the store;

   and prints the wall time, records/s and the time of each phase (``phases_seconds`` of the
   summary: compact, read_dedupe_check, tables, summary), then the growth ratio
   time(largest) / time(smallest) beside the size ratio (equal when time grows linearly);
4. removes what it wrote (the archive too unless ``--data``), also after an error or Ctrl-C /
   SIGTERM.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time

from rqp.report import generate
from rqp.system import signals

PER_FILE = 200_000
DEFAULT_SIZES = (1_000_000, 5_000_000, 50_000_000)
PHASES = ("compact", "read_dedupe_check", "tables", "summary")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(float(s)) for s in text.split(",") if s.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] <= 0:
        raise argparse.ArgumentTypeError("sizes must be positive numbers, e.g. 1e6,5e6,5e7")
    return sizes


def _on_sigterm(signum, frame):  # let the finally blocks clean up
    raise SystemExit(128 + signum)


def _link_files(directory: str, files: list[str]) -> str:
    """``directory`` holding symbolic links to ``files`` (an archive of exactly those)."""
    os.makedirs(directory, exist_ok=True)
    for f in files:
        link = os.path.join(directory, os.path.basename(f))
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(f), link)
    return directory


def _row(kind: str, lines: int, files: int, summary: dict, seconds: float) -> dict:
    store = summary.get("store") or {}
    return {"run": kind, "records": lines, "files": files, "seconds": round(seconds, 2),
            "records_per_second": round(lines / seconds),
            "new_records": store.get("new_lines", lines),
            "dead_letters": summary["totals"]["dead_letters"],
            "phases": summary.get("phases_seconds", {})}


def _print_row(r: dict) -> None:
    phases = "  ".join(f"{r['phases'].get(p, 0):7.1f}" for p in PHASES)
    print(f"  {r['run']:<11} {r['records']:>11,}  {r['new_records']:>11,}  {r['seconds']:8.1f}  "
          f"{r['records_per_second']:>10,}  {phases}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rqp.tools.report_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                        help="dead letters per run, comma-separated (default 1e6,5e6,5e7)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--cluster", action="store_true",
                        help="start a one-worker standalone cluster (PySpark's spark-class) and "
                             "use it as the master")
    parser.add_argument("--driver-memory", default="8g",
                        help="(default 8g: at 4g the 50 M run ran out of memory)")
    parser.add_argument("--executor-memory", default="4g", help="with --cluster")
    parser.add_argument("--processes", type=int, default=2, help="generator processes")
    parser.add_argument("--data", metavar="DIR",
                        help="keep the generated archive here and reuse what is there")
    parser.add_argument("--direct", action="store_true",
                        help="also time the job reading the JSON archive itself (no store)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    signals.handle(_on_sigterm, (signal.SIGTERM,))
    signals.let_stops_through()

    tmp = tempfile.mkdtemp(prefix="rqp-report-bench-")
    spark = None
    cluster = None
    try:
        # 1. the data, generated once (before Spark starts: the generator forks)
        largest = args.sizes[-1]
        count = -(-largest // PER_FILE) * PER_FILE + PER_FILE  # + the incremental file
        data = args.data or os.path.join(tmp, "archive")
        t0 = time.monotonic()
        files = generate.generate(count, data, seed=1, per_file=PER_FILE,
                                  processes=args.processes, reuse=True)
        gen_seconds = time.monotonic() - t0
        warm = generate.generate(20_000, os.path.join(tmp, "warm-up"), seed=2, processes=1)
        archive_bytes = sum(os.path.getsize(f) for f in files)
        print(f"archive: {count:,} dead letters ({len(files)} files, "
              f"{archive_bytes / 2**20:,.0f} MiB gzip) in {data}, {gen_seconds:.1f} s",
              flush=True)

        # 2. one session, warmed up
        from pyspark.sql import SparkSession

        from rqp.report import compute

        master = args.master
        # (its driver on loopback, as the report's: a trial saw it bind to the host's
        # interface address, which the hostname resolved to)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        if args.cluster:
            from rqp.tools.spark_standalone import StandaloneCluster

            cluster = StandaloneCluster(cores=os.cpu_count() or 2,
                                        memory=args.executor_memory,
                                        workdir=os.path.join(tmp, "cluster")).start()
            master = cluster.url
        t0 = time.monotonic()
        builder = (
            SparkSession.builder.master(master).appName("rqp-dlq-report-bench")
            .config("spark.driver.memory", args.driver_memory)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.local.dir", os.path.join(tmp, "spark-local"))
        )
        if args.cluster:
            builder = builder.config("spark.executor.memory", args.executor_memory)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        start_seconds = time.monotonic() - t0

        def run(inputs: list[str], out: str, store: str | None) -> tuple[dict, float]:
            t = time.monotonic()
            summary = compute.run_report(spark, inputs, out, out=io.StringIO(),
                                         err=io.StringIO(), store=store)
            seconds = time.monotonic() - t
            shutil.rmtree(out, ignore_errors=True)
            return summary, seconds

        t0 = time.monotonic()
        run(warm, os.path.join(tmp, "out-warm-up"), os.path.join(tmp, "store-warm-up"))
        print(f"Spark {spark.version} on {master}, driver memory {args.driver_memory}: session "
              f"started in {start_seconds:.1f} s, warm-up run (20,000) "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        print(f"  {'run':<11} {'records':>11}  {'new':>11}  {'time (s)':>8}  {'records/s':>10}  "
              + "  ".join(f"{p[:7]:>7}" for p in PHASES), flush=True)

        # 3. the runs
        results = []
        for size in args.sizes:
            n_files = -(-size // PER_FILE)
            lines = n_files * PER_FILE
            archive = _link_files(os.path.join(tmp, f"archive-{size}"), files[:n_files])
            store = os.path.join(tmp, f"store-{size}")
            if args.direct:
                summary, seconds = run([archive], os.path.join(tmp, "out"), None)
                results.append(_row("direct", lines, n_files, summary, seconds))
                _print_row(results[-1])
            summary, seconds = run([archive], os.path.join(tmp, "out"), store)
            if summary["totals"]["lines"] != lines:
                raise RuntimeError(f"read {summary['totals']['lines']} lines, expected {lines}")
            results.append(_row("first", lines, n_files, summary, seconds))
            _print_row(results[-1])
            _link_files(archive, files[n_files:n_files + 1])  # a new file arrives
            summary, seconds = run([archive], os.path.join(tmp, "out"), store)
            if summary["store"]["new_files"] != 1 or \
                    summary["totals"]["lines"] != lines + PER_FILE:
                raise RuntimeError(f"the incremental run took {summary['store']['new_files']} "
                                   f"files and counted {summary['totals']['lines']} lines")
            results.append(_row("incremental", lines + PER_FILE, n_files + 1, summary,
                                seconds))
            _print_row(results[-1])
            shutil.rmtree(store, ignore_errors=True)
            shutil.rmtree(archive, ignore_errors=True)

        # 4. growth
        print()
        print(f"rqp-dlq-report, {master}, {os.cpu_count()} CPUs, "
              f"{platform.python_implementation()} {platform.python_version()}")
        growth = {}
        for kind in ("direct", "first", "incremental"):
            rows = [r for r in results if r["run"] == kind]
            if len(rows) > 1:
                first, last = rows[0], rows[-1]
                growth[kind] = round(last["seconds"] / first["seconds"], 2)
                print(f"{kind}: time({last['records'] / 1e6:g}M) / time("
                      f"{first['records'] / 1e6:g}M) = {growth[kind]:.2f} (size ratio "
                      f"{last['records'] / first['records']:.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"master": master, "driver_memory": args.driver_memory,
                           "generate_seconds": gen_seconds, "results": results,
                           "growth_ratio": growth}, f, indent=2)
        return 0
    finally:
        if spark is not None:
            spark.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
