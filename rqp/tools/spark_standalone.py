"""A Spark standalone cluster on this machine, started from the installed PySpark's own
``bin/spark-class`` (``org.apache.spark.deploy.master.Master`` and ``...worker.Worker``): what
the tests and ``scripts/report-bench --cluster`` run the report on, to show that it runs
unchanged with ``--master spark://...``.

Not a launcher of our own making: the two processes are Spark's, with Spark's options; this
module only starts them as its children on loopback with ports the kernel picks, waits until the
worker has registered (read from their logs, not guessed with a sleep), and stops them (and the
executors the worker started) on exit. An operator's cluster is started by its own tooling
(``sbin/start-master.sh`` of a Spark distribution, Kubernetes, ...); see the README.

::

    python -m rqp.tools.spark_standalone [--cores N] [--memory 2g]   # prints the master URL,
                                                                     # runs until Ctrl-C
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rqp.system import signals

__all__ = ["StandaloneCluster", "ClusterError", "spark_home"]

START_TIMEOUT = 90.0
_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")
_ALIVE = re.compile(r"I have been elected leader! New state: ALIVE")
_REGISTERED = re.compile(r"Successfully registered with master")


class ClusterError(RuntimeError):
    """The cluster did not start (the message carries the log's last lines)."""


def spark_home() -> Path:
    """The installed PySpark's home (its ``bin/spark-class``)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class _Process:
    """One of Spark's daemons, its log lines kept in a file and handed to a waiter."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict) -> None:
        self.name = name
        self.log = log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._file = open(log, "w", encoding="utf-8")
        # its own process group: the worker's executors go with it on stop
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, text=True,
                                     errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._file.write(line)
            self._file.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern, deadline: float) -> re.Match:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"the Spark {self.name} did not get ready in time "
                                   f"(waited for {pattern.pattern!r}):\n{self.tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise ClusterError(f"the Spark {self.name} exited (status "
                                   f"{self.proc.wait()}):\n{self.tail()}")
            if m := pattern.search(line):
                return m

    def tail(self, n: int = 20) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # whatever it started (executors) that outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reader.join(5)
        self._file.close()


class StandaloneCluster:
    """A master and one worker on 127.0.0.1 (a context manager); ``url`` is the master's
    ``spark://`` URL once started."""

    def __init__(self, cores: int = 2, memory: str = "2g", workdir: str | None = None) -> None:
        self.cores = cores
        self.memory = memory
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="rqp-spark-standalone-"))
        self.url: str | None = None
        self._procs: list[_Process] = []

    def start(self) -> "StandaloneCluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        spark_class = str(spark_home() / "bin" / "spark-class")
        env = dict(os.environ)
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # no REST submission server (a fixed port, 6066) and no shuffle service: not used here
        env["SPARK_MASTER_OPTS"] = (env.get("SPARK_MASTER_OPTS", "")
                                    + " -Dspark.master.rest.enabled=false").strip()
        env["SPARK_WORKER_DIR"] = str(self.workdir / "work")
        env["SPARK_LOG_DIR"] = str(self.workdir)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            master = _Process("master", [
                spark_class, "org.apache.spark.deploy.master.Master",
                "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
            ], self.workdir / "master.log", env)
            self._procs.append(master)
            self.url = master.wait_for(_MASTER_URL, deadline)[1]
            master.wait_for(_ALIVE, deadline)
            worker = _Process("worker", [
                spark_class, "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
                "--cores", str(self.cores), "--memory", self.memory,
                "--work-dir", str(self.workdir / "work"), self.url,
            ], self.workdir / "worker.log", env)
            self._procs.append(worker)
            worker.wait_for(_REGISTERED, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
        if self._own_dir:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "StandaloneCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rqp.tools.spark_standalone",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--memory", default="2g")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signals.handle(lambda *_: stop.set(), (signal.SIGTERM,))
    signals.let_stops_through()
    with StandaloneCluster(args.cores, args.memory) as cluster:
        print(f"Spark standalone master {cluster.url} (one worker, {args.cores} cores, "
              f"{args.memory}); Ctrl-C stops it", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
