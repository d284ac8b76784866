"""rqp-dlq-report: the dead-letter report, a PySpark job over the drain's archives.

::

    rqp-dlq-report --input PATH_OR_GLOB [PATH_OR_GLOB ...] --output DIR [--master URL]
                   [--traffic PATH] [--drain --archive DIR] [--previous DIR]
                   [--store DIR | --no-store]
    rqp-dlq-report --input ... --reports DIR [--keep N] [...]
    rqp-dlq-report ... [--allow-empty] [--metrics-file FILE.prom]
    spark-submit [--master URL ...] rqp/report/job.py --input ... --output ...

Inputs are archive files (``*.jsonl.gz``, ``*.jsonl``), directories (searched recursively for
those; other files, and hidden ones such as a drain's ``.tmp`` files, are left alone) or globs.
Paths and URIs (``hdfs://``, ``s3a://``, ``file://``) go to Spark as they are. Every line is
read with the explicit schema of :mod:`rqp.report.schema`; a file with a line whose ``schema``
is not 1 stops the job with an error naming the file (exit status 2); lines that are not JSON
objects of that shape are counted (``unreadable_lines``), named on stderr and left out.

The archive is first compacted into a columnar store (:mod:`rqp.report.columnar`: Parquet by
day; each run takes only the files no earlier run took) and the report answers from the store:
``--store DIR`` (a path or a Hadoop URI), by default ``.columnar`` inside the input when the
input is one local directory; with other inputs and no ``--store``, or with ``--no-store``,
the JSON is read itself, every run.

Under ``--output``:

* ``parquet/<table>/`` and ``csv/<table>/`` (CSV with a header) for every table of
  :data:`TABLES`, written through Spark's commit protocol (a table's files appear when its
  write commits, marked by ``_SUCCESS``; a failed write leaves no partial table behind);
* ``summary.json``: totals, first and last seen, reasons, top queues and hosts (aggregates
  only: the dead letters never come to the driver);
* ``report.html``: one self-contained page (inline SVG charts, no scripts, no external files).

``summary.json`` and ``report.html`` are written to a temporary name and renamed.

``--previous DIR`` (an earlier report's output directory) adds what changed since then
(:mod:`rqp.report.trends`). ``--reports DIR [--keep N]`` instead of ``--output`` keeps dated
runs: this one in ``DIR/<UTC time>/``, compared with the latest earlier complete run there,
then ``DIR/latest`` pointed at it and the runs beyond the newest N (default 14) deleted
(:mod:`rqp.report.history`: never a run under way or being read).

``--master``: when it is not given the master is whatever Spark is configured with
(``spark-submit --master``, ``spark.master`` in ``spark-defaults.conf``, ``MASTER``); only
when none of them sets one does the job use ``local[*]``.

``likely_recoverable`` rests on the evidence there is: with ``--traffic PATH`` (deliveries:
``queue_key``, ``timestamp``; CSV with a header, or JSON Lines) the dead letters whose queue
received a delivery later; without it the dead letters with a transient reason. Its
``evidence`` column says which (see :mod:`rqp.report.analysis`).

``--drain`` first runs the drain tool once (``python -m rqp_agents.drain --once --archive
DIR``), so that the report includes what is on ``DEAD.LETTER.Q`` now; with ``--archive`` and
no ``--input`` the archive directory is the input.

The command itself needs no PySpark: ``--help``, the options and the local inputs are checked
first, and only then is the Spark half (:mod:`rqp.report.compute`) imported. Without PySpark
(the ``spark`` extra) or Java the command says what to install; an archive with no files in it
is reported without starting Spark (exit 2: nothing was written; with ``--allow-empty``, 0).

``--metrics-file FILE`` (for node_exporter's textfile collector) is written at the end of
every run, whatever its outcome: when it ended, its exit status, how long it took, and when a
run last succeeded; the rules RQPDeadLetterReportFailed and RQPDeadLetterReportStale of
``config/prometheus-rules.yaml`` watch them.
"""

from __future__ import annotations

import os
import sys

if not __package__:
    # Run as a script (``spark-submit rqp/report/job.py``): Python put this directory first on
    # sys.path, where html.py would hide the standard library's html. Replace it with the
    # checkout's root, so that the imports below find the package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

import argparse
import contextlib
import errno
import fnmatch
import glob
import importlib
import importlib.util
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from rqp import VERSION_TEXT
from rqp.report import history
from rqp.report.common import JAVA, PROG, SPARK_EXTRA, ReportError, local_path
from rqp.report.schema import ARCHIVE_FILE_GLOB, ArchiveSchemaError
from rqp.system import signals
from rqp.system.files import write_file_atomically
from rqp.system.service import EXIT_ANOTHER_RUNS

__all__ = ["PROG", "ReportError", "ArchiveSchemaError", "EmptyArchive", "METRICS",
           "check_metrics_file", "write_metrics_file", "check_local_inputs",
           "check_local_output", "default_store", "load_compute", "run_drain", "parse_args", "main"]

# ------------------------------------------------------------------------------------------
# Checks that need no Spark
# ------------------------------------------------------------------------------------------

class EmptyArchive(ReportError):
    """The local inputs hold no archive file: nothing to report (``--allow-empty``: not an
    error)."""


def check_local_inputs(inputs: Sequence[str]) -> None:
    """Before Spark starts (seconds): local inputs that do not exist, or a directory of them
    this user cannot read (a trial's unreadable archive was "empty", and with --allow-empty,
    as the daily unit runs, a success every day: no report, no alert), or that hold no
    archive file at all (an empty archive: :class:`EmptyArchive`), are an error naming them.
    An archive file the user cannot read is left out later, named (taken once it can be).
    URIs are left to Spark."""
    local = [local_path(p) for p in inputs]
    if any(p is None for p in local):
        return
    found = False
    for path in local:
        if glob.has_magic(path):
            _check_glob_directories(path)  # (glob passes over those it cannot read)
            matches = glob.glob(path)
        else:
            try:
                os.stat(path)
            except FileNotFoundError:
                raise ReportError(f"cannot read the input: {path} does not exist") from None
            except OSError as exc:
                raise _cannot_read(path, exc) from None
            matches = [path]
        for match in matches:
            found = _holds_archive_files(match) or found
    if not found:
        raise EmptyArchive(f"no archive files ({ARCHIVE_FILE_GLOB}) in {' '.join(inputs)}: "
                          "the archive is empty, there are no dead letters to report (Spark "
                          "was not started, nothing was written)")


def _holds_archive_files(path: str) -> bool:
    """Whether ``path`` is a file, or a directory holding an archive file outside hidden
    directories (``.incoming``, ``.state``), symbolic links followed as Spark follows them; a
    ReportError for a directory in it that this user cannot read, or that a link leads to
    twice (a re-check: a link to the host's directory made the archive look empty, and a
    loop had Spark read one file 41 times)."""
    if not os.path.isdir(path):
        return True

    def unreadable(exc: OSError) -> None:
        raise _cannot_read(exc.filename or path, exc)
    found, seen = False, {}
    for root, dirs, files in os.walk(path, onerror=unreadable, followlinks=True):
        _searchable(root)
        st = os.stat(root)
        if (first := seen.setdefault((st.st_dev, st.st_ino), root)) != root:
            raise ReportError(f"cannot read the input: {root} is {first} again, through a "
                              "symbolic link: Spark would read its files twice or more (a "
                              "loop: for ever); remove the link, or give the directories apart")
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found = found or any(not f.startswith(".") and f.endswith((".jsonl", ".jsonl.gz"))
                             for f in files)
    return found


def _searchable(directory: str) -> None:
    """A ReportError if this user may list ``directory`` but not reach what is in it (mode
    r without x: a re-check's files were found, then Spark read none)."""
    if not os.access(directory, os.R_OK | os.X_OK, effective_ids=True):
        raise _cannot_read(directory, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def _check_glob_directories(pattern: str) -> None:
    """Every directory a glob ``pattern`` goes through can be read (glob passes over those it
    cannot, and a re-check's archive behind one was "empty": with --allow-empty a success)."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    level = [os.path.join(*parts[:first]) if first else "."]
    for i in range(first, len(parts)):
        below = []
        for directory in level:
            try:
                with os.scandir(directory) as entries:
                    names = [e.name for e in entries]
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise _cannot_read(directory, exc) from None
            _searchable(directory)
            below += [os.path.join(directory, n) for n in names
                      if fnmatch.fnmatch(n, parts[i]) and os.path.isdir(os.path.join(directory, n))
                      and (not n.startswith(".") or parts[i].startswith("."))]
        level = below


def _cannot_read(path: str, exc: OSError) -> ReportError:
    if exc.errno == errno.ELOOP:  # (a re-check: told to let the user read a link loop)
        return ReportError(f"cannot read the input: {path}: {exc.strerror} (a symbolic link "
                           "loop): remove the link")
    import pwd
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = f"uid {os.geteuid()}"
    return ReportError(f"cannot read the input: {path}: {exc.strerror or exc} (this report runs "
                       f"as {user}): the dead letters in it would be missed; let that user "
                       "read it (the group rqp, on an installed host)")


def load_compute():
    """The Spark half of the report (:mod:`rqp.report.compute`), once PySpark imports and a
    Java runtime is there; else a :class:`ReportError` that says what to install."""
    try:
        compute = importlib.import_module("rqp.report.compute")
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in ("pyspark", "py4j"):
            raise
        raise ReportError(
            f"the report runs on PySpark (3.5 or later), which cannot be imported here ({exc}): "
            f"{SPARK_EXTRA} into the environment rqp is installed in ({sys.prefix}), and "
            f"install {JAVA}") from None
    home = os.environ.get("JAVA_HOME")
    if home and not os.access(os.path.join(home, "bin", "java"), os.X_OK):
        raise ReportError(f"Spark runs $JAVA_HOME/bin/java, and JAVA_HOME={home} has none: set "
                          f"JAVA_HOME to a Java installation, or unset it and install {JAVA}")
    if not home and shutil.which("java") is None:
        raise ReportError(
            "Spark needs a Java runtime and none was found (no java on PATH, no JAVA_HOME): "
            f"install {JAVA}")
    return compute


def check_local_output(output: str, option: str = "--output") -> None:
    """Before Spark starts: a local ``--output`` (or ``--store``) must be a directory, or
    creatable as one."""
    path = local_path(output)
    if path is None:
        return
    target = Path(path).absolute()
    while not target.exists():
        target = target.parent
    hint = (" (the store is kept in the archive by default: give --store DIR elsewhere, or "
            "--no-store)") if option == "--store" else ""
    if not target.is_dir():
        raise ReportError(f"{option} {output}: {target} is not a directory{hint}")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ReportError(f"{option} {output}: no permission to write in {target}{hint}")


#: The file in a local --output a run holds an exclusive flock on, while it writes there.
OUTPUT_LOCK = ".rqp-dlq-report.lock"


@contextlib.contextmanager
def output_lock(output: str):
    """One run at a time into a local ``--output`` (a trial: two runs at once overwrote each
    other's tables, one failing with 40 lines of Spark errors); Hadoop URIs: the operator's
    part. Held from before Spark starts to the end of the run."""
    path = local_path(output)
    if path is None:
        yield
        return
    from rqp.storage.archive import ArchiveError, lock_file

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(lock_file(os.path.join(path, OUTPUT_LOCK),
                                         f"another {PROG} into {output}"))
        except ArchiveError as exc:
            raise ReportError(f"--output {output}: {exc}: wait for it, or give another "
                              "--output") from None
        yield


# ------------------------------------------------------------------------------------------
# The run's outcome for monitoring
# ------------------------------------------------------------------------------------------

#: What ``--metrics-file`` holds: a daily batch job is watched by when it last succeeded
#: (the alerts RQPDeadLetterReportFailed and RQPDeadLetterReportStale).
LAST_SUCCESS = "rqp_dlq_report_last_success_timestamp_seconds"
METRICS = (
    ("rqp_dlq_report_last_run_timestamp_seconds", "When the last run of rqp-dlq-report ended "
     "(Unix time)."),
    ("rqp_dlq_report_last_run_exit_status", "The last run's exit status: 0 done (or nothing "
     "to report), 1 Spark failed, 2 an error it named, 130 interrupted, 143 SIGTERM."),
    ("rqp_dlq_report_last_run_duration_seconds", "How long the last run took."),
    (LAST_SUCCESS, "When a run last ended with exit status 0 (Unix time; 0: never)."),
)


def check_metrics_file(path: str) -> None:
    """Before Spark starts: ``--metrics-file``'s directory exists and can be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ReportError(f"--metrics-file {path}: is a directory (give a file name, e.g. "
                          f"{os.path.join(path, 'rqp-dlq-report.prom')})")
    if not os.path.isdir(directory):
        raise ReportError(f"--metrics-file {path}: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ReportError(f"--metrics-file {path}: no permission to write in {directory}")
    if not path.endswith(".prom"):  # (a typo would never alert: a warning, it may be meant)
        print(f"{PROG}: warning: --metrics-file {path} does not end in .prom: node_exporter's "
              "textfile collector reads only *.prom files", file=sys.stderr)


def _last_success(path: str) -> float:
    """The last success a previous run recorded in ``path`` (0 when none can be read)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == LAST_SUCCESS:
                    return float(value)
    except (OSError, ValueError):
        pass
    return 0.0


def write_metrics_file(path: str, status: int, started: float) -> None:
    """The run's outcome in Prometheus' text format, for node_exporter's textfile collector
    (written whole under a hidden temporary name, readable by all: the collector runs as
    another user). A failed run keeps the time of the last success."""
    ended = time.time()
    values = (ended, status, ended - started, ended if status == 0 else _last_success(path))
    text = "".join(f"# HELP {name} {doc}\n# TYPE {name} gauge\n{name} {value:.17g}\n"
                   for (name, doc), value in zip(METRICS, values))
    write_file_atomically(path, text.encode("ascii"), 0o644)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------

def run_drain(archive: str) -> None:
    """Run the drain tool once into ``archive`` (small on purpose: the drain is its own
    command, ``rqp-dlq-drain``)."""
    try:
        found = importlib.util.find_spec("rqp_agents.drain") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ReportError(
            "--drain: the drain tool is not installed (no module rqp_agents.drain, the "
            "rqp-dlq-drain command); install it, or drain separately and run without --drain")
    cmd = [sys.executable, "-m", "rqp_agents.drain", "--once", "--archive", archive]
    status = subprocess.run(cmd).returncode
    if status == EXIT_ANOTHER_RUNS:  # (another drain is at it: what it archived is read)
        return
    if status != 0:
        raise ReportError(f"--drain: {' '.join(cmd)} failed (exit status {status})")


#: The master URLs Spark takes (checked before Spark starts: Spark's own answer to a typo is
#: that its Java gateway exited).
MASTER_RE = re.compile(r"local(\[(\*|[1-9][0-9]*)(,[1-9][0-9]*)?\])?|spark://\S+|yarn|k8s://\S+")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Report on archived RQP dead letters: tables (Parquet and CSV), "
                    "summary.json and a self-contained report.html.")
    parser.add_argument("--version", action="version",  # (as rqp.cli.add_version: the
                        version=f"%(prog)s (rqp) {VERSION_TEXT}")  # report does not import it)
    parser.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB",
                        help="archive files, directories or globs (local paths or Hadoop URIs)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--output", metavar="DIR",
                       help="where the outputs go (a local path or a Hadoop URI)")
    where.add_argument("--reports", metavar="DIR",
                       help="keep dated runs in DIR (a local directory): this run goes into "
                            "DIR/<UTC time>/ and is compared with the latest earlier complete "
                            "run there; then DIR/latest points at it and runs beyond --keep "
                            "are deleted")
    parser.add_argument("--keep", type=int, metavar="N",
                        help=f"with --reports: how many complete runs to keep (default "
                             f"{history.DEFAULT_KEEP})")
    parser.add_argument("--previous", metavar="DIR",
                        help="an earlier report's output directory to compare with (default "
                             "with --reports: the latest earlier complete run)")
    parser.add_argument("--master", metavar="URL",
                        help="Spark master (default: Spark's configuration, else local[*])")
    parser.add_argument("--traffic", metavar="PATH",
                        help="deliveries (queue_key, timestamp) as CSV with a header or JSON "
                             "Lines: evidence for likely_recoverable")
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--store", metavar="DIR",
                       help="the columnar store (Parquet) the archive is compacted into and "
                            "read from (a local path or a Hadoop URI; default: .columnar in "
                            "the input when it is one local directory)")
    store.add_argument("--no-store", action="store_true",
                       help="read the JSON Lines archive itself, keep no columnar store")
    parser.add_argument("--drain", action="store_true",
                        help="first run the drain tool once into --archive")
    parser.add_argument("--archive", metavar="DIR",
                        help="the drain's archive directory (the input when --input is not "
                             "given)")
    parser.add_argument("--allow-empty", action="store_true",
                        help="an archive with no files is nothing to report: exit 0 (not 2), "
                             "without starting Spark")
    parser.add_argument("--metrics-file", metavar="FILE",
                        help="after every run, write its outcome there for node_exporter's "
                             "textfile collector (FILE ending .prom): when it ended and how, "
                             "and when a run last succeeded")
    args = parser.parse_args(argv)
    if args.master is not None and not MASTER_RE.fullmatch(args.master):
        parser.error(f"--master {args.master}: not a Spark master URL (local, local[N], "
                     "local[*], spark://HOST:PORT, yarn, k8s://https://HOST:PORT)")
    if args.keep is not None and not args.reports:
        parser.error("--keep needs --reports DIR")
    if args.keep is None:
        args.keep = history.DEFAULT_KEEP
    if args.keep < 1:
        parser.error("--keep must be at least 1")
    if args.reports and local_path(args.reports) is None:
        parser.error("--reports needs a local directory (it keeps locks and a 'latest' "
                     "symlink); give a Hadoop URI to --output instead")
    if args.drain and not args.archive:
        parser.error("--drain needs --archive DIR")
    if not args.input:
        if not args.archive:
            parser.error("--input is required (or --archive)")
        args.input = [args.archive]
    if args.store is None and not args.no_store:
        args.store = default_store(args.input)
    return args


def default_store(inputs: Sequence[str]) -> str | None:
    """``.columnar`` inside the input when it is one local directory (a hidden directory: the
    drain and Spark's listing of the archive leave it alone); else None (no store)."""
    if len(inputs) != 1:
        return None
    path = local_path(inputs[0])
    if path is None or glob.has_magic(path) or not os.path.isdir(path):
        return None
    return os.path.join(path, ".columnar")


def run_dated(compute, spark, args: argparse.Namespace) -> None:
    """``--reports DIR``: this run into DIR/<UTC time>/, compared with the latest earlier
    complete run (or ``--previous``); then DIR/latest and the pruning (:mod:`.history`)."""
    run = history.start(local_path(args.reports))
    try:
        compute.run_report(spark, args.input, run.path, traffic=args.traffic,
                           store=args.store, previous=args.previous or run.previous)
        deleted = run.finish(args.keep)
    finally:
        run.close()
    print(f"{args.reports}/{history.LATEST} -> {run.name}; compared with "
          f"{args.previous or run.previous or 'nothing (the first run)'}; deleted "
          f"{len(deleted)} older run(s), keeping {args.keep}", flush=True)


def _metrics_file_in(argv: Sequence[str]) -> str | None:
    """--metrics-file as given on a command line that may not parse."""
    for i, arg in enumerate(argv):
        if arg == "--metrics-file" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--metrics-file="):
            return arg.split("=", 1)[1]
    return None


def _stop_on_sigterm(signum, _frame) -> None:
    """SIGTERM (systemctl stop, the unit's time-out, a shutdown) ends the run as Ctrl-C does:
    its outcome written in --metrics-file (a re-check: killed at once, the file still said
    the last run had succeeded), the JVM's temporary files removed (a trial's stayed)."""
    raise signals.raising(KeyboardInterrupt("signal SIGTERM"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.time()
    try:
        args = parse_args(argv)  # (--help ends here: nothing of Spark is imported before this)
    except SystemExit as exc:  # (a usage error is a failed run too: a typo in the unit's
        metrics = _metrics_file_in(argv)  # options would fail every day without an alert)
        if exc.code not in (0, None) and metrics is not None:
            with contextlib.suppress(OSError, ReportError):
                check_metrics_file(metrics)
                write_metrics_file(metrics, 2, started)
        raise
    signals.let_stops_through()
    signals.handle(_stop_on_sigterm, (signal.SIGTERM,))
    if args.metrics_file is None:
        return _run(args)
    try:
        check_metrics_file(args.metrics_file)
    except ReportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    status = 1  # (an exception the run did not expect)
    try:
        status = _run(args)
    finally:
        try:
            write_metrics_file(args.metrics_file, status, started)
        except OSError as exc:
            print(f"{PROG}: error: --metrics-file {args.metrics_file}: cannot write it: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            status = status or 2
    return status


def _run(args: argparse.Namespace) -> int:
    try:
        if args.drain:
            run_drain(args.archive)
        try:
            check_local_inputs(args.input)
        except EmptyArchive as exc:
            if not args.allow_empty:
                raise
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 0
        check_local_output(args.reports or args.output,
                           "--reports" if args.reports else "--output")
        if args.store is not None:
            check_local_output(args.store, "--store")
        with output_lock(args.output) if not args.reports else contextlib.nullcontext():
            compute = load_compute()
            with compute.jvm_temp():
                return _report(compute, args)
    except (ReportError, ArchiveSchemaError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # (Ctrl-C, or the stop a caller such as rqp-demo took)
        print(f"{PROG}: interrupted ({str(exc) or 'Ctrl-C'}); this run's report is not "
              "finished (its summary.json is written last)", file=sys.stderr)
        return 143 if str(exc) == "signal SIGTERM" else 130


def _report(compute, args) -> int:
    """The report in Spark, once the inputs are checked: 0, or 1 when Spark failed."""
    spark, created = compute.get_session(args.master)
    print(f"{PROG}: Spark {spark.version} ({spark.sparkContext.master}) started; reading "
          f"{' '.join(args.input)}", file=sys.stderr, flush=True)
    interrupted = None
    try:
        with compute.quiet_interrupts(spark):
            if args.reports:
                run_dated(compute, spark, args)
            else:
                compute.run_report(spark, args.input, args.output, traffic=args.traffic,
                                   store=args.store, previous=args.previous)
    except KeyboardInterrupt as exc:
        interrupted = exc
        raise
    except Exception as exc:
        # A call into the JVM after Ctrl-C broke one (a finally's) failed: the Ctrl-C is
        # what happened (a trial's report said "Spark failed", exit 1).
        interrupted = _interrupt_behind(exc)
        if interrupted is not None:
            raise interrupted from None
        if not compute.is_spark_failure(exc):
            raise
        failure = compute.explain_failure(spark, exc, args.master)
        print(f"{PROG}: error: {failure}", file=sys.stderr)
        return 1
    finally:
        if interrupted is not None:
            compute.hush(spark)  # (what the JVM logs of the work it broke is no news)
        if created:
            try:
                spark.stop()
            except Exception:  # noqa: BLE001 - after a Ctrl-C: the JVM ends with us
                if interrupted is None:
                    raise
    return 0


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that ``exc`` was raised while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


#: The Spark half's names that callers reach through this module (``job.run_report``).
_COMPUTE_NAMES = frozenset({"TABLES", "read_archives", "prepare", "check_archives",
                            "run_report", "get_session"})


def __getattr__(name: str):
    """The Spark half's names (``job.run_report``, ``job.TABLES``, ...), imported on first use
    so that importing this module never imports PySpark."""
    if name in _COMPUTE_NAMES:
        return getattr(importlib.import_module("rqp.report.compute"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    # Run as a file (spark-submit rqp/report/job.py): run the package's own module, so that the
    # Spark half raises the very ReportError that main catches (not a second copy of it).
    from rqp.report.job import main as _main

    sys.exit(_main())
