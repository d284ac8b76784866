"""How the dead-letter report scales: the whole job on 1, 2 and 5 million dead letters.

``python -m rqp.tools.report_bench`` (or ``scripts/report-bench``):

1. generates the archives once, under a temporary directory, with
   :mod:`rqp.report.generate` (seed 1, 200,000 lines per file). Every file is a function of the
   seed and its number only, so the first 5 files are exactly what generating 1 million lines
   writes, the first 10 are the 2 million, and so on: one generation serves every size;
2. starts one SparkSession (``local[2]`` by default, ``spark.driver.memory`` 4g) and runs the
   job once on a small archive to warm the JVM up (not counted);
3. runs the full job (:func:`rqp.report.compute.run_report`: read, check, dedupe, every table as
   Parquet and CSV, summary.json, report.html) on each size, and prints the wall time, the
   archive lines per second and the growth ratio time(largest) / time(smallest): with
   linear scaling it equals the size ratio (5.0 for 5M / 1M), below it fixed costs weigh;
4. removes the temporary directory (also after an error or Ctrl-C / SIGTERM).
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

PER_FILE = 200_000
DEFAULT_SIZES = (1_000_000, 2_000_000, 5_000_000)


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(sorted({int(float(s)) for s in text.split(",") if s.strip()}))
    if not sizes or sizes[0] <= 0:
        raise argparse.ArgumentTypeError("sizes must be positive numbers, e.g. 1e6,2e6,5e6")
    return sizes


def _on_sigterm(signum, frame):  # let the finally blocks clean up
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rqp.tools.report_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                        help="dead letters per run, comma-separated (default 1e6,2e6,5e6)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--processes", type=int, default=2, help="generator processes")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)

    tmp = tempfile.mkdtemp(prefix="rqp-report-bench-")
    spark = None
    try:
        # 1. the data, generated once (before Spark starts: the generator forks)
        largest = args.sizes[-1]
        t0 = time.monotonic()
        files = generate.generate(largest, os.path.join(tmp, "archive"), seed=1,
                                  per_file=PER_FILE, processes=args.processes)
        gen_seconds = time.monotonic() - t0
        warm = generate.generate(20_000, os.path.join(tmp, "warm-up"), seed=2,
                                 processes=1)
        archive_bytes = sum(os.path.getsize(f) for f in files)
        print(f"generated {largest:,} dead letters ({len(files)} files, "
              f"{archive_bytes / 2**20:,.0f} MiB gzip) in {gen_seconds:.1f} s", flush=True)

        # 2. one session, warmed up
        from pyspark.sql import SparkSession

        from rqp.report import compute

        t0 = time.monotonic()
        spark = (
            SparkSession.builder.master(args.master).appName("rqp-dlq-report-bench")
            .config("spark.driver.memory", args.driver_memory)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.local.dir", os.path.join(tmp, "spark-local"))
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        start_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        compute.run_report(spark, warm, os.path.join(tmp, "out-warm-up"), out=io.StringIO(),
                       err=io.StringIO())
        warm_seconds = time.monotonic() - t0
        print(f"Spark {spark.version} on {args.master}, driver memory {args.driver_memory}: "
              f"session started in {start_seconds:.1f} s, warm-up run (20,000) "
              f"{warm_seconds:.1f} s", flush=True)

        # 3. the runs
        results = []
        for size in args.sizes:
            inputs = files[:-(-size // PER_FILE)]
            lines = min(size, len(inputs) * PER_FILE)
            out = os.path.join(tmp, f"out-{size}")
            t0 = time.monotonic()
            summary = compute.run_report(spark, inputs, out, out=io.StringIO(), err=io.StringIO())
            seconds = time.monotonic() - t0
            if summary["totals"]["lines"] != lines:
                raise RuntimeError(f"read {summary['totals']['lines']} lines, expected {lines}")
            results.append({"records": lines, "files": len(inputs), "seconds": seconds,
                            "records_per_second": lines / seconds,
                            "dead_letters": summary["totals"]["dead_letters"]})
            print(f"  {lines:>10,} records: {seconds:7.1f} s", flush=True)
            shutil.rmtree(out, ignore_errors=True)

        # 4. the table
        print()
        print(f"rqp-dlq-report, full job, {args.master}, {os.cpu_count()} CPUs, "
              f"{platform.python_implementation()} {platform.python_version()}")
        print(f"{'records':>11}  {'files':>5}  {'unique ids':>11}  {'time (s)':>9}  "
              f"{'records/s':>10}")
        for r in results:
            print(f"{r['records']:>11,}  {r['files']:>5}  {r['dead_letters']:>11,}  "
                  f"{r['seconds']:>9.1f}  {r['records_per_second']:>10,.0f}")
        growth = None
        if len(results) > 1:
            first, last = results[0], results[-1]
            growth = last["seconds"] / first["seconds"]
            print(f"growth ratio time({last['records'] / 1e6:g}M) / time("
                  f"{first['records'] / 1e6:g}M) = {growth:.2f} "
                  f"(size ratio {last['records'] / first['records']:.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"master": args.master, "driver_memory": args.driver_memory,
                           "generate_seconds": gen_seconds, "results": results,
                           "growth_ratio": growth}, f, indent=2)
        return 0
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
