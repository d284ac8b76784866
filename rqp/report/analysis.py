"""The dead-letter analysis: pure DataFrame -> DataFrame functions.

Nothing here reads or writes files or brings dead letters to the driver; :mod:`rqp.report.job`
does the I/O. The functions take the archive's columns (:mod:`rqp.report.schema`) and are
meant to be chained::

    dead = normalize(raw)                      # derived columns, one row per dead-letter id
    counts_by(dead, "reason")                  # count, first_seen, last_seen per reason
    counts_by(dead, "queue_key", labels=("queue_key_hex", "queue_name"))
    payload_stats(dead, by="reason")           # original_length: min, max, avg, p50, p95
    samples(dead, "reason")                    # the earliest dead letter of each reason
    likely_recoverable(dead, traffic=None)     # see its docstring for the evidence used

Times are Spark timestamps (instants); ``hour`` is truncated to the hour in UTC whatever the
session time zone is. The job sets ``spark.sql.session.timeZone`` to UTC so that files and
pages show UTC too.

One host, one name
------------------

A machine appears in the archive under several spellings: its host name in ``host`` (where a
record was dead-lettered, e.g. ``vm``), the peer's address in a receiving MCA's
``source_host`` (``127.0.0.1`` when the sender ran on the same machine, ``::ffff:10.0.0.5`` on
a dual-stack socket, or its TLS identity), ``host:port`` or ``[v6]:port`` in a sending MCA's
``destination_host``. :func:`host_identity` gives every one of them the one name the facts
allow, and ``host``, ``source`` and ``destination`` all use it:

* case and a trailing dot do not matter in DNS: ``VM.example.`` is ``vm.example``;
* a port says which socket, not which machine: ``vm:7460`` and ``[::1]:7460`` lose it;
* an IPv4-mapped IPv6 address is the IPv4 address: ``::ffff:10.0.0.5`` is ``10.0.0.5``;
* a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``) seen by a host IS that host:
  it is replaced by the record's ``host``.

What the records cannot tell is left apart, not guessed: another address of the same machine
(``10.0.0.5`` for ``vm``), a short name beside a full one (``vm`` and ``vm.prod.example``, e.g.
a TLS identity), names that only DNS or an inventory could join. Resolving them at report time
(reverse DNS) would make a report depend on the network of the day it ran.

Likely recoverable dead letters
-------------------------------

"Would this message be delivered if it were sent again?" needs evidence. Two kinds are used,
and the ``evidence`` column says which one a row rests on:

``traffic``
    A list of deliveries (``queue_key``, ``timestamp``; ``--traffic PATH``) is given. A dead
    letter is likely recoverable when its queue received a delivery LATER than the dead letter
    was made (``evidence_at`` is the latest such delivery), unless its reason is a property of
    the message itself (:data:`~rqp.report.schema.MESSAGE_INTRINSIC_REASONS`, e.g.
    ``MESSAGE_TOO_BIG``): that message fails again however well its queue works.

``transient_reason``
    No traffic data. The dead letters themselves cannot show that a queue later worked: a
    later dead letter for the same queue (for another reason or not) is evidence of a failure,
    not of a delivery. So without traffic data the report does not pretend to know; it lists
    the dead letters whose reason is transient (:data:`~rqp.report.schema.TRANSIENT_REASONS`:
    ``QUEUE_FULL``, ``UNKNOWN_QUEUE``, ``NO_ROUTE``, ``QUEUE_NOT_OFFERED``) as "likely
    recoverable once the cause is fixed", with ``evidence_at`` empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from rqp.report.schema import MESSAGE_INTRINSIC_REASONS, TRANSIENT_REASONS

__all__ = [
    "UNKNOWN_HOST",
    "host_identity",
    "PERCENTILE_ACCURACY",
    "dead_lettered_at",
    "normalize",
    "normalize_traffic",
    "counts_by",
    "payload_stats",
    "samples",
    "likely_recoverable",
    "SAMPLE_COLUMNS",
    "RECOVERABLE_COLUMNS",
]

#: The destination host of a dead letter when the record does not say.
UNKNOWN_HOST = "(unknown)"

#: ``percentile_approx`` accuracy: the rank error is at most 1/PERCENTILE_ACCURACY of the rows.
#: Below that many rows per group the percentiles are exact: the smallest value v such that at
#: least p of the values are <= v.
PERCENTILE_ACCURACY = 10_000

#: What :func:`samples` shows of a dead letter (after the group columns).
SAMPLE_COLUMNS: tuple[str, ...] = (
    "id", "timestamp", "host", "agent", "reason", "queue_key", "queue_key_hex", "queue_name",
    "source", "destination", "message_type", "attempts", "original_length", "detail",
    "payload_preview",
)

#: The columns of :func:`likely_recoverable`.
RECOVERABLE_COLUMNS: tuple[str, ...] = (
    "id", "timestamp", "reason", "queue_key", "queue_key_hex", "queue_name", "source",
    "destination", "message_type", "original_length", "evidence", "evidence_at",
)


def _names(cols: str | Iterable[str] | None) -> list[str]:
    if cols is None:
        return []
    if isinstance(cols, str):
        return [cols]
    return list(cols)


def _nonempty(name: str) -> Column:
    c = F.col(name)
    return c.isNotNull() & (c != "")


def _to_timestamp(c: Column) -> Column:
    """An ISO-8601 string (``...Z``, any fraction of a second) or a timestamp, as a timestamp;
    null when unreadable (never an error)."""
    return F.try_to_timestamp(c.cast("string"))


def dead_lettered_at() -> Column:
    """When an archive row was dead-lettered, as a timestamp: ``timestamp_ns`` when it is there
    (> 0), else the ISO string ``timestamp``."""
    ns = F.col("timestamp_ns")
    # Integer division: a double cannot hold nanoseconds since 1970 exactly.
    return F.when(ns > 0, F.timestamp_micros(F.expr("timestamp_ns div 1000"))).otherwise(
        _to_timestamp(F.col("timestamp")))


def _hour_utc(ts: Column) -> Column:
    # Truncation through epoch seconds: UTC hours whatever spark.sql.session.timeZone says.
    seconds = F.unix_seconds(ts)
    return F.timestamp_seconds(seconds - F.pmod(seconds, F.lit(3600)))


#: Loopback spellings, after :func:`_canonical_host` (RFC 6761: any name under ``localhost``).
_LOOPBACK = (r"^(127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|::1|0:0:0:0:0:0:0:1|localhost"
             r"|localhost\.localdomain|localhost6|ip6-localhost|ip6-loopback|.+\.localhost)$")


def _canonical_host(c: Column) -> Column:
    """The spelling-free form of a host name or address (see the module docstring): trimmed,
    lower case, without a trailing dot, a port, IPv6 brackets or an IPv4-mapped prefix."""
    c = F.lower(F.trim(c))
    c = (F.when(c.rlike(r"^\[[^\]]*\](:[0-9]+)?$"), F.regexp_extract(c, r"^\[([^\]]*)\]", 1))
         .when(c.rlike(r"^[^:]+:[0-9]+$"), F.regexp_extract(c, r"^([^:]+):", 1))
         .otherwise(c))
    c = F.regexp_replace(c, r"^(::|0:0:0:0:0:)ffff:([0-9]+\.[0-9]+\.[0-9]+\.[0-9]+)$", "$2")
    return F.regexp_replace(c, r"(.)\.$", "$1")


def host_identity(address: Column | str, host: Column | str = "host") -> Column:
    """The one name of the machine ``address`` names, as seen from the record's ``host`` (where
    it was dead-lettered): canonical (no case, port, brackets, trailing dot), and a loopback
    address replaced by that ``host``. Empty stays empty, null stays null."""
    address = F.col(address) if isinstance(address, str) else address
    host = F.col(host) if isinstance(host, str) else host
    name = _canonical_host(address)
    own = _canonical_host(host)
    return F.when(name.rlike(_LOOPBACK) & (own != ""), own).otherwise(name)


def normalize(df: DataFrame) -> DataFrame:
    """The archive rows with derived columns, one row per dead-letter ``id``.

    * ``timestamp``: when it was dead-lettered, as a timestamp: ``timestamp_ns`` when it is
      there (> 0), else the ISO string ``timestamp``; ``archived_at`` as a timestamp too;
    * ``host``, ``source``, ``destination``: one name per machine (:func:`host_identity`, see
      "One host, one name" above);
    * ``source``: ``source_host`` unless empty, else ``host`` (it was dead-lettered where it
      was sent from);
    * ``destination``: ``destination_host`` unless empty, else ``host`` when the receiving agent
      dead-lettered it, else ``"(unknown)"``;
    * ``hour``: ``timestamp`` truncated to the hour (UTC);
    * ``copies``: how many input rows had this id (1 unless the drain archived it again).

    Duplicate ids are dropped: of the copies, the one archived first is kept (then the smallest
    ``archived_by``, then the smallest row), so the result does not depend on file order. Rows
    without an id cannot be told apart: each is kept, with ``copies`` 1.
    """
    out = (
        df.withColumn("timestamp", dead_lettered_at())
        .withColumn("archived_at", _to_timestamp(F.col("archived_at")))
        # rows without an id each get a key of their own ("\0" cannot start a hex id)
        .withColumn("_key", F.coalesce(F.col("id"), F.concat(
            F.lit("\u0000"), F.monotonically_increasing_id().cast("string"))))
    )
    rest = sorted(c for c in df.columns if c not in ("archived_at", "archived_by"))
    first = Window.partitionBy("_key").orderBy(
        F.col("archived_at").asc_nulls_last(), F.col("archived_by").asc_nulls_last(),
        *[F.col(c).asc_nulls_last() for c in rest])
    # One shuffle and one sort by id, both windows share them.
    out = (
        out.withColumn("copies", F.count(F.lit(1)).over(Window.partitionBy("_key")))
        .withColumn("_n", F.row_number().over(first))
        .where(F.col("_n") == 1)
        .drop("_n", "_key")
    )
    host = _canonical_host(F.col("host"))
    return (
        out.withColumn("source", F.when(_nonempty("source_host"),
                                        host_identity("source_host", "host"))
                       .otherwise(host))
        .withColumn("destination",
                    F.when(_nonempty("destination_host"),
                           host_identity("destination_host", "host"))
                    .when(F.col("agent") == "receiver", host)
                    .otherwise(F.lit(UNKNOWN_HOST)))
        .withColumn("host", host)
        .withColumn("hour", _hour_utc(F.col("timestamp")))
    )


def normalize_traffic(traffic: DataFrame) -> DataFrame:
    """Deliveries as (``queue_key`` long, ``timestamp`` timestamp), rows without either dropped.

    ``queue_key`` may be a number or a string (decimal, or hexadecimal with ``0x``);
    ``timestamp`` a timestamp or an ISO-8601 string.
    """
    key = F.trim(F.col("queue_key").cast("string"))
    is_hex = F.lower(key).startswith("0x")
    hex_digits = F.substring(key, 3, 64)
    queue_key = F.when(is_hex & hex_digits.rlike("^[0-9a-fA-F]{1,16}$"),
                       F.conv(hex_digits, 16, 10).try_cast("long")).otherwise(
        key.try_cast("long"))
    return (
        traffic.select(queue_key.alias("queue_key"),
                       _to_timestamp(F.col("timestamp")).alias("timestamp"))
        .where(F.col("queue_key").isNotNull() & F.col("timestamp").isNotNull())
    )


def counts_by(df: DataFrame, *cols: str, labels: Sequence[str] = ()) -> DataFrame:
    """``count``, ``first_seen`` and ``last_seen`` (of ``timestamp``) per group of ``cols``.

    ``labels`` are columns that describe a group rather than define it (e.g. the name of a queue
    key): each is the largest non-null value in the group, so a key whose name is missing in
    some records still makes one row.
    """
    if not cols:
        raise ValueError("counts_by needs at least one column to group by")
    return df.groupBy(*cols).agg(
        *[F.max(c).alias(c) for c in labels],
        F.count(F.lit(1)).alias("count"),
        F.min("timestamp").alias("first_seen"),
        F.max("timestamp").alias("last_seen"),
    )


def payload_stats(df: DataFrame, by: str | Sequence[str] | None = None) -> DataFrame:
    """Statistics of ``original_length`` (the payload size in bytes before any truncation):
    ``count``, ``min``, ``max``, ``avg``, ``p50``, ``p95``; one row overall when ``by`` is
    None, else one row per group. The percentiles are ``percentile_approx`` with
    :data:`PERCENTILE_ACCURACY` (exact for small groups: the smallest value v with at least p of
    the values <= v)."""
    length = F.col("original_length")
    aggs = [
        F.count(F.lit(1)).alias("count"),
        F.min(length).alias("min"),
        F.max(length).alias("max"),
        F.avg(length).alias("avg"),
        F.percentile_approx(length, 0.5, PERCENTILE_ACCURACY).alias("p50"),
        F.percentile_approx(length, 0.95, PERCENTILE_ACCURACY).alias("p95"),
    ]
    keys = _names(by)
    if not keys:
        return df.agg(*aggs)
    return df.groupBy(*keys).agg(*aggs)


def samples(df: DataFrame, by: str | Sequence[str] = "reason") -> DataFrame:
    """One dead letter per group of ``by``: the earliest (by ``timestamp``, then ``id``), with
    the :data:`SAMPLE_COLUMNS` (``payload_preview`` among them)."""
    keys = _names(by)
    if not keys:
        raise ValueError("samples needs at least one column to group by")
    shown = [c for c in SAMPLE_COLUMNS if c not in keys]
    # First the earliest time per group (a hash aggregate), then only the rows at that time
    # (a broadcast join: there is one row per group) are compared in full.
    first = df.groupBy(*keys).agg(F.min("timestamp").alias("_first"))
    first = first.select(*[F.col(k).alias(f"_k{i}") for i, k in enumerate(keys)], "_first")
    cond = [df[k].eqNullSafe(first[f"_k{i}"]) for i, k in enumerate(keys)]
    cond.append(df["timestamp"].eqNullSafe(first["_first"]))
    earliest = df.join(F.broadcast(first), on=cond, how="inner").select(*df.columns)
    # min of a struct compares field by field: timestamp first, then id, then the rest.
    fields = ["timestamp", "id"] + [c for c in shown if c not in ("timestamp", "id")]
    return (
        earliest.groupBy(*keys)
        .agg(F.min(F.struct(*[F.col(c).alias(c) for c in fields])).alias("_s"))
        .select(*keys, *[F.col("_s")[c].alias(c) for c in shown])
    )


def likely_recoverable(dead: DataFrame, traffic: DataFrame | None = None) -> DataFrame:
    """The normalized dead letters that would probably be delivered if sent again, with the
    :data:`RECOVERABLE_COLUMNS`; ``evidence`` says why (see the module docstring):

    * with ``traffic`` (deliveries: ``queue_key``, ``timestamp``): dead letters whose queue
      received a delivery after the dead letter's time, reasons intrinsic to the message left
      out; ``evidence`` = ``"traffic"``, ``evidence_at`` = the latest such delivery;
    * without: dead letters with a transient reason; ``evidence`` = ``"transient_reason"``,
      ``evidence_at`` null.

    Never a notice (:func:`rqp.storage.archive.is_notice`): its sender keeps the message.
    """
    from rqp.storage.archive import NOTICE_AGENT, NOTICE_MESSAGE_TYPE
    # A notice's message is its sender's, which sends it again itself: a replay keeps it (a
    # trial's report counted 49 of them of 164 as likely recoverable).
    dead = dead.where(~F.coalesce((F.col("agent") == NOTICE_AGENT)
                                  & (F.col("message_type") == NOTICE_MESSAGE_TYPE), F.lit(False)))
    if traffic is None:
        rows = (
            dead.where(F.col("reason").isin(*TRANSIENT_REASONS))
            .withColumn("evidence", F.lit("transient_reason"))
            .withColumn("evidence_at", F.lit(None).cast("timestamp"))
        )
        return rows.select(*RECOVERABLE_COLUMNS)
    last = (
        normalize_traffic(traffic)
        .groupBy("queue_key")
        .agg(F.max("timestamp").alias("evidence_at"))
    )
    candidates = dead.where(
        F.col("reason").isNull() | ~F.col("reason").isin(*MESSAGE_INTRINSIC_REASONS))
    rows = (
        candidates.join(last, on="queue_key", how="inner")
        .where(F.col("evidence_at") > F.col("timestamp"))
        .withColumn("evidence", F.lit("traffic"))
    )
    return rows.select(*RECOVERABLE_COLUMNS)
