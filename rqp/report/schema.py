"""The dead-letter archive format the report reads, declared once as a Spark schema.

The drain tool (``rqp-dlq-drain``) archives dead letters as JSON Lines, one object per line,
in files named ``*.jsonl.gz`` or ``*.jsonl``. This module is the report's copy of that format,
version :data:`ARCHIVE_SCHEMA_VERSION`: the report never infers a schema (inference reads the
whole archive once more, and would silently follow whatever the files happen to contain).
A file with a line whose ``schema`` field is none of :data:`READABLE_SCHEMAS` is rejected with
:class:`ArchiveSchemaError`, which names the file. Schema 1 lines lack the keys schema 2 added
(the message's ``mtype``, priority, expiry): they read as null there.

``timestamp`` and ``archived_at`` are read as the strings they are in the file (ISO-8601 UTC,
``Z``) and turned into timestamps by :func:`rqp.report.analysis.normalize`; ``timestamp_ns``
is the exact instant when it is there.
"""

from __future__ import annotations

import re

from rqp.protocol import reasons as _reasons
from rqp.protocol.constants import INT64_MAX, UINT64_MAX
from rqp.protocol.errors import RQPError

__all__ = [
    "ARCHIVE_FIELDS",
    "ARCHIVE_FILE_GLOB",
    "ARCHIVE_SCHEMA",
    "ARCHIVE_SCHEMA_VERSION",
    "READABLE_SCHEMAS",
    "CORRUPT_RECORD_COLUMN",
    "READ_SCHEMA",
    "ArchiveSchemaError",
    "REASONS",
    "TRANSIENT_REASONS",
    "MESSAGE_INTRINSIC_REASONS",
]

#: The archive format version this report understands (the ``schema`` key of every line).
ARCHIVE_SCHEMA_VERSION = 2
#: Every archive schema this report reads (a later one only adds keys).
READABLE_SCHEMAS = (1, 2)

#: Which files of a directory (or a glob) are archives: Hadoop glob syntax, file names only.
ARCHIVE_FILE_GLOB = "*.{jsonl,jsonl.gz}"

#: Spark puts a line that is not a JSON object here (and nulls in every other column).
CORRUPT_RECORD_COLUMN = "_corrupt_record"

#: Every field of a version-2 line, with its Spark type: declared once, as plain names, so that
#: this module imports without PySpark (``rqp-dlq-report --help`` and its checks need none).
_FIELDS: tuple[tuple[str, str], ...] = (
    ("schema", "integer"),
    ("id", "string"),
    ("archived_by", "string"),
    ("archived_at", "string"),
    ("host", "string"),
    ("agent", "string"),
    ("reason", "string"),
    ("reason_code", "integer"),
    ("queue_key", "long"),
    ("queue_key_hex", "string"),
    ("queue_name", "string"),
    ("message_key", "string"),
    ("message_type", "string"),
    ("timestamp", "string"),
    ("timestamp_ns", "long"),
    ("attempts", "integer"),
    ("original_length", "long"),
    ("payload_length", "long"),
    ("truncated", "boolean"),
    ("header_only", "boolean"),
    ("source_host", "string"),
    ("destination_host", "string"),
    ("detail", "string"),
    ("spill_path", "string"),
    ("payload_b64", "string"),
    ("payload_preview", "string"),
    ("record_version", "integer"),
    ("mtype", "long"),
    ("priority", "integer"),
    ("expires_at_ms", "long"),
)

ARCHIVE_FIELDS: tuple[str, ...] = tuple(name for name, _ in _FIELDS)

#: What every archive line has, whatever its schema: what a tool that acts on one reads.
REQUIRED_FIELDS = ("schema", "id", "reason", "queue_key", "message_key", "message_type",
                   "payload_b64")
#: What schema 2 added, which every line of it has.
REQUIRED_SINCE_2 = ("record_version", "mtype", "priority", "expires_at_ms")

_JSON_TYPES = {"integer": (int,), "long": (int,), "string": (str,), "boolean": (bool,)}
#: A message key as the drain writes it: a uint64 in hex.
_MESSAGE_KEY = re.compile(r"0[xX][0-9a-fA-F]{1,16}")


def row_problem(row) -> str | None:
    """Why one archive line (a JSON object) does not fit the declared format, in words, or
    None: a required field missing, a field of another JSON type than declared (null is no
    value; true and false are no number), a schema this rqp does not read, or a value no
    record holds. A trial's line with ``"queue_key": "0x52510009"`` stopped ``rqpctl dlq
    replay`` with a traceback, and with it every line after."""
    missing = [name for name in REQUIRED_FIELDS if row.get(name) is None]
    if not missing and row["schema"] not in READABLE_SCHEMAS:  # (what a later one means is
        return (f"schema {row['schema']!r:.20}: this rqp reads archive schemas "  # not known)
                f"{', '.join(map(str, READABLE_SCHEMAS))} (a newer one wrote it?)")
    if row.get("schema") != 1:
        missing += [name for name in REQUIRED_SINCE_2 if row.get(name) is None]
    if missing:
        return f"no {', '.join(missing)}"
    for name, kind in _FIELDS:
        value = row.get(name)
        if value is not None and (not isinstance(value, _JSON_TYPES[kind]) or
                                  kind != "boolean" and isinstance(value, bool)):
            return f"{name} {value!r:.40} is not a " \
                   f"{'number' if kind in ('integer', 'long') else kind}"
    if not _MESSAGE_KEY.fullmatch(row["message_key"]):  # (a trial's 0xZZ, and one > 2^64)
        return f"message_key {row['message_key']!r:.40} is not 0x and 1 to 16 hex digits"
    # the values a record can hold (a trial's mtype 2^64 stopped a replay with a traceback,
    # and 0 was put with type 1): an edited row, which is not put back as something else
    low = 0 if row["reason"] == _reasons.MALFORMED.name else 1  # (never a record: 0)
    for name, least, most in (("mtype", low, INT64_MAX), ("priority", 0, 9),
                              ("expires_at_ms", 0, UINT64_MAX), ("queue_key", 0, UINT64_MAX)):
        value = row.get(name)
        if value is not None and not least <= value <= most:
            return f"{name} {value} is out of range ({least}..{most})"
    return None


def _spark_schemas() -> dict:
    from pyspark.sql.types import (
        BooleanType, IntegerType, LongType, StringType, StructField, StructType,
    )

    types = {"boolean": BooleanType, "integer": IntegerType, "long": LongType,
              "string": StringType}
    archive = StructType([StructField(name, types[kind]()) for name, kind in _FIELDS])
    # What the reader is given: the archive schema plus the column for unreadable lines.
    read = StructType([*archive.fields, StructField(CORRUPT_RECORD_COLUMN, StringType())])
    return {"ARCHIVE_SCHEMA": archive, "READ_SCHEMA": read}


def __getattr__(name: str):
    """``ARCHIVE_SCHEMA`` and ``READ_SCHEMA`` (Spark ``StructType``s), built on first use."""
    if name in ("ARCHIVE_SCHEMA", "READ_SCHEMA"):
        globals().update(_spark_schemas())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The reasons the agents and the drain write (readers must accept others too), and the
#: transient and message-intrinsic ones (see :mod:`rqp.protocol.reasons`, the one table).
REASONS: tuple[str, ...] = tuple(r.name for r in _reasons.REASONS)
TRANSIENT_REASONS: tuple[str, ...] = _reasons.TRANSIENT
MESSAGE_INTRINSIC_REASONS: tuple[str, ...] = _reasons.INTRINSIC


class ArchiveSchemaError(RQPError, ValueError):
    """An input file is not a dead-letter archive this report reads (the message names the
    file)."""

    @classmethod
    def naming(cls, bad) -> "ArchiveSchemaError":
        """The error for ``bad``: (file, lines of another schema, the schemas seen) per file."""
        shown = "\n".join(f"  {file}: {wrong} line(s) with schema {', '.join(versions)}"
                          for file, wrong, versions in list(bad)[:20])
        more = f"\n  ... and {len(bad) - 20} more files" if len(bad) > 20 else ""
        return cls(f"not a dead-letter archive this report reads (archive schemas "
                   f"{', '.join(map(str, READABLE_SCHEMAS))}):\n{shown}{more}")
