"""What the ``rqp-dlq-report`` command (:mod:`rqp.report.job`) and its Spark half
(:mod:`rqp.report.compute`) share: the program's name, the error a user can fix, what to
install, and how a local path is told from another file system's URI."""

from __future__ import annotations

from urllib.parse import urlparse

from rqp.protocol.errors import RQPError

__all__ = ["JAVA", "PROG", "SPARK_EXTRA", "ReportError", "local_path"]

PROG = "rqp-dlq-report"

#: What to install, said wherever PySpark or Java is missing.
SPARK_EXTRA = "pip install 'rqp[spark]'"
JAVA = "a Java 17 runtime (Debian: apt-get install openjdk-17-jre-headless)"


class ReportError(RQPError):
    """A problem the user can fix (bad input, missing tool): printed without a traceback."""


def local_path(path: str) -> str | None:
    """The local file system path of ``path``, or None for another file system's URI
    (``hdfs://``, ``s3a://``, ...)."""
    parsed = urlparse(path)
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or C:\...)
        return path
    if parsed.scheme == "file":
        return parsed.path
    return None
