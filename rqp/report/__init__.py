"""rqp-dlq-report: the dead-letter report, a PySpark job over the drain's archives.

* :mod:`rqp.report.schema`: the archive format (versions 1 and 2) as an explicit Spark schema;
* :mod:`rqp.report.analysis`: pure DataFrame -> DataFrame functions (counts, payload sizes,
  samples, likely recoverable dead letters);
* :mod:`rqp.report.job`: the ``rqp-dlq-report`` command (also ``spark-submit``-able): its
  options and the checks that need no Spark (the inputs, PySpark and Java installed);
* :mod:`rqp.report.compute`: the job's Spark half: reads the archives, writes every table as
  Parquet and CSV, ``summary.json`` and ``report.html``;
* :mod:`rqp.report.columnar`: the columnar store (Parquet by day) the archive is compacted
  into, incrementally, and read from;
* :mod:`rqp.report.files`: the driver's own files on a local path or a Hadoop URI;
* :mod:`rqp.report.html`: the self-contained HTML page with inline SVG charts and filters;
* :mod:`rqp.report.rules`: the ready ``rqpctl dlq replay`` rule for each reason;
* :mod:`rqp.report.trends`: what changed since the previous run (rates defined there);
* :mod:`rqp.report.history`: dated runs under ``--reports DIR`` (latest link, pruning, locks);
* :mod:`rqp.report.generate`: synthetic archives with realistic skew, for tests and benchmarks;
* :mod:`rqp.tools.report_bench`: the job's first and incremental runs at 1, 5 and 50 million dead
  letters, time per phase;
* :mod:`rqp.tools.spark_standalone`: a standalone cluster from PySpark's own spark-class.

Importing this package does not import pyspark, nor does the command before it computes a
report; the modules that need it (compute, analysis, bench) do.
"""
