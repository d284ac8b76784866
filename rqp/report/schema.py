"""The dead-letter archive format the report reads, declared once as a Spark schema.

The drain tool (``rqp-dlq-drain``) archives dead letters as JSON Lines, one object per line,
in files named ``*.jsonl.gz`` or ``*.jsonl``. This module is the report's copy of that format,
version :data:`ARCHIVE_SCHEMA_VERSION`: the report never infers a schema (inference reads the
whole archive once more, and would silently follow whatever the files happen to contain).
A file whose ``schema`` field is not :data:`ARCHIVE_SCHEMA_VERSION` is rejected with
:class:`ArchiveSchemaError`, which names the file.

``timestamp`` and ``archived_at`` are read as the strings they are in the file (ISO-8601 UTC,
``Z``) and turned into timestamps by :func:`rqp.report.analysis.normalize`; ``timestamp_ns``
is the exact instant when it is there.
"""

from __future__ import annotations

from pyspark.sql.types import (
    BooleanType, IntegerType, LongType, StringType, StructField, StructType,
)

__all__ = [
    "ARCHIVE_FIELDS",
    "ARCHIVE_FILE_GLOB",
    "ARCHIVE_SCHEMA",
    "ARCHIVE_SCHEMA_VERSION",
    "CORRUPT_RECORD_COLUMN",
    "READ_SCHEMA",
    "ArchiveSchemaError",
    "REASONS",
    "TRANSIENT_REASONS",
    "MESSAGE_INTRINSIC_REASONS",
]

#: The archive format version this report understands (the ``schema`` key of every line).
ARCHIVE_SCHEMA_VERSION = 1

#: Which files of a directory (or a glob) are archives: Hadoop glob syntax, file names only.
ARCHIVE_FILE_GLOB = "*.{jsonl,jsonl.gz}"

#: Spark puts a line that is not a JSON object here (and nulls in every other column).
CORRUPT_RECORD_COLUMN = "_corrupt_record"

ARCHIVE_SCHEMA = StructType(
    [
        StructField("schema", IntegerType()),
        StructField("id", StringType()),
        StructField("archived_by", StringType()),
        StructField("archived_at", StringType()),
        StructField("host", StringType()),
        StructField("agent", StringType()),
        StructField("reason", StringType()),
        StructField("reason_code", IntegerType()),
        StructField("queue_key", LongType()),
        StructField("queue_key_hex", StringType()),
        StructField("queue_name", StringType()),
        StructField("message_key", StringType()),
        StructField("message_type", StringType()),
        StructField("timestamp", StringType()),
        StructField("timestamp_ns", LongType()),
        StructField("attempts", IntegerType()),
        StructField("original_length", LongType()),
        StructField("payload_length", LongType()),
        StructField("truncated", BooleanType()),
        StructField("header_only", BooleanType()),
        StructField("source_host", StringType()),
        StructField("destination_host", StringType()),
        StructField("detail", StringType()),
        StructField("spill_path", StringType()),
        StructField("payload_b64", StringType()),
        StructField("payload_preview", StringType()),
    ]
)

ARCHIVE_FIELDS: tuple[str, ...] = tuple(ARCHIVE_SCHEMA.fieldNames())

#: What the reader is given: the archive schema plus the column for unreadable lines.
READ_SCHEMA = StructType(
    [*ARCHIVE_SCHEMA.fields, StructField(CORRUPT_RECORD_COLUMN, StringType())]
)

#: The reasons the agents and the drain write (readers must accept others too).
REASONS: tuple[str, ...] = (
    "NO_QUEUE_KEY", "BAD_MESSAGE_TYPE", "MALFORMED_RECORD", "NO_ROUTE",
    "RETRY_BUDGET_EXHAUSTED", "NOT_CONFIRMED", "UNKNOWN_QUEUE", "NOT_AUTHORIZED", "QUEUE_FULL",
    "MESSAGE_TOO_BIG", "INVALID_QUEUE_KEY", "QUEUE_NOT_OFFERED", "PUT_FAILED", "MALFORMED",
)

#: Reasons that describe the state of the destination at the time, not the message: sent again
#: once the cause is fixed (a queue created or offered, a full queue drained, a route added),
#: the same message would be delivered.
TRANSIENT_REASONS: tuple[str, ...] = ("QUEUE_FULL", "UNKNOWN_QUEUE", "NO_ROUTE", "QUEUE_NOT_OFFERED")

#: Reasons that are properties of the message itself: sending it again fails again, however
#: much traffic its queue receives later.
MESSAGE_INTRINSIC_REASONS: tuple[str, ...] = (
    "NO_QUEUE_KEY", "BAD_MESSAGE_TYPE", "MALFORMED_RECORD", "MESSAGE_TOO_BIG",
    "INVALID_QUEUE_KEY", "MALFORMED",
)


class ArchiveSchemaError(ValueError):
    """An input file is not a version-1 dead-letter archive (the message names the file)."""
