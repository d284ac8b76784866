"""The report driver's file operations, on a local path or any Hadoop file system URI alike
(``hdfs://``, ``s3a://``, ``file://``): small text files written whole, listed, read and
deleted. The Spark half writes its tables through Spark; everything else it writes (the
summary, the page, the columnar store's commit records) goes through here, so that the report
runs the same against a shared file system or HDFS as on one machine.

A local path is handled with plain ``os`` calls (a ``rename`` over the old file is atomic
there); another URI through the JVM's ``org.apache.hadoop.fs.FileSystem`` of the running
session (as atomic as that store's rename).
"""

from __future__ import annotations

import os
import shutil
import uuid

from rqp.report.common import ReportError, local_path
from rqp.system.files import write_file_atomically

__all__ = ["join", "write_text", "read_text", "list_names", "delete"]


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a path or a URI."""
    return "/".join([base.rstrip("/"), *parts])


def _hadoop(spark, path: str):
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return hadoop_path, hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())


def write_text(spark, path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old
    file or the new one, never half of one."""
    data = text.encode("utf-8")
    local = local_path(path)
    if local is not None:
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        write_file_atomically(local, data)
        return
    final, fs = _hadoop(spark, path)
    tmp = type(final)(final.getParent(), f".{final.getName()}.{uuid.uuid4().hex}.tmp")
    out = fs.create(tmp, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()
    if fs.exists(final):
        fs.delete(final, False)
    if not fs.rename(tmp, final):
        fs.delete(tmp, False)
        raise ReportError(f"could not rename {tmp} to {path}")


def read_text(spark, path: str) -> str:
    local = local_path(path)
    if local is not None:
        with open(local, encoding="utf-8") as f:
            return f.read()
    hadoop_path, fs = _hadoop(spark, path)
    stream = fs.open(hadoop_path)
    try:
        jvm = spark.sparkContext._jvm
        return jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
    finally:
        stream.close()


def list_names(spark, directory: str) -> list[str]:
    """The names in ``directory`` (sorted; none when it does not exist)."""
    local = local_path(directory)
    if local is not None:
        try:
            return sorted(os.listdir(local))
        except FileNotFoundError:
            return []
    hadoop_path, fs = _hadoop(spark, directory)
    if not fs.exists(hadoop_path):
        return []
    return sorted(status.getPath().getName() for status in fs.listStatus(hadoop_path))


def delete(spark, path: str) -> None:
    """Delete a file or a directory tree (nothing when it is not there)."""
    local = local_path(path)
    if local is not None:
        if os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local)
        elif os.path.lexists(local):
            os.unlink(local)
        return
    hadoop_path, fs = _hadoop(spark, path)
    fs.delete(hadoop_path, True)
