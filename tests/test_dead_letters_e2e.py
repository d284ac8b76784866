"""Dead letters end to end: the agents produce them (unknown queue, full queue, oversized
message, no route), rqp-dlq-drain archives both hosts' DEAD.LETTER.Q, rqp-dlq-report counts
them; the counts are compared with what was sent."""

from __future__ import annotations

import json
import sys

from pyspark.sql import Row
from pyspark.testing import assertDataFrameEqual

from rqp import UNSURE_MSG
from rqp.report import job
from tests.agents import make_queue, remove_queue, send, start_receiver, start_sender, write_rqprc
from tests.testbed import wait_for

FULL, GONE, SMALL, NOWHERE = 0x52510011, 0x52510022, 0x52510033, 0x52510044

DEPTH = "import sys, sysv_ipc\ntry:\n    print(sysv_ipc.MessageQueue(0x5251DEAD).current_messages)" \
        "\nexcept sysv_ipc.ExistentialError:\n    print(0)"


def test_dead_letters_from_the_agents_are_drained_and_reported(testbed, spark, tmp_path):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config="host_name: host-b\nmax_message_size: 1000\n"
                             "put_retry_count: 1\nput_retry_interval: 0.05s\n")
    for key in (FULL, GONE, SMALL):
        make_queue(b, key)
    b.python("import sysv_ipc\nq = sysv_ipc.MessageQueue(0x52510011, max_message_size=8192)\n"
             "q.send(bytes(8192)); q.send(bytes(8192))")  # 16 KiB: FULL has no room left
    rqprc = write_rqprc(a, [b], queues={"APP_THE_GONE_COMMON": GONE}, error_limit=10)
    start_sender(a, rqprc)
    send(a, rqprc, GONE, ["first"], UNSURE_MSG)  # delivered: the route to b is known
    wait_for(lambda: int(b.python("import sysv_ipc; print(sysv_ipc.MessageQueue(0x52510022)"
                                  ".current_messages)")) == 1, timeout=20, message="no route")
    remove_queue(b, GONE)
    send(a, rqprc, GONE, ["g1", "g2", "g3"], UNSURE_MSG)          # UNKNOWN_QUEUE on b x3
    send(a, rqprc, FULL, ["f1", "f2"], UNSURE_MSG)                 # QUEUE_FULL on b x2
    send(a, rqprc, SMALL, ["x" * 2000, "y" * 3000], UNSURE_MSG)    # MESSAGE_TOO_BIG on b x2
    send(a, rqprc, NOWHERE, ["n1", "n2", "n3", "n4"], UNSURE_MSG)  # NO_ROUTE on a x4
    wait_for(lambda: (int(a.python(DEPTH)), int(b.python(DEPTH))) == (4, 7), timeout=30,
             message="the dead letters did not all arrive")

    archive = tmp_path / "archive"
    for host in (a, b):
        out = host.run([sys.executable, "-m", "rqp_agents.drain", "--once", "--archive",
                        str(archive)])
        assert "drained" in out.stdout
    assert (int(a.python(DEPTH)), int(b.python(DEPTH))) == (0, 0)

    output = tmp_path / "report"
    summary = job.run_report(spark, [str(archive)], str(output))
    assert summary["totals"]["dead_letters"] == 11 and summary["totals"]["duplicates_dropped"] == 0
    by_reason = spark.read.parquet(str(output / "parquet" / "by_reason"))
    assertDataFrameEqual(by_reason.select("reason", "count"), [
        Row(reason="NO_ROUTE", count=4), Row(reason="UNKNOWN_QUEUE", count=3),
        Row(reason="QUEUE_FULL", count=2), Row(reason="MESSAGE_TOO_BIG", count=2)])
    by_queue = spark.read.parquet(str(output / "parquet" / "by_queue"))
    assertDataFrameEqual(by_queue.select("queue_key_hex", "count"), [
        Row(queue_key_hex="0x52510044", count=4), Row(queue_key_hex="0x52510022", count=3),
        Row(queue_key_hex="0x52510011", count=2), Row(queue_key_hex="0x52510033", count=2)])
    by_source = spark.read.parquet(str(output / "parquet" / "by_source_host"))
    counts = {row["source"]: row["count"] for row in by_source.collect()}
    assert counts[a.address] == 7 and sum(counts.values()) == 11  # b's records name a as source
    by_destination = spark.read.parquet(str(output / "parquet" / "by_destination_host"))
    assert {r["destination"]: r["count"] for r in by_destination.collect()}["host-b"] == 7
    stats = json.loads((output / "summary.json").read_text())
    too_big = [s for s in spark.read.parquet(str(output / "parquet" / "payload_stats")).collect()
               if s["reason"] == "MESSAGE_TOO_BIG"]
    assert [(s["min"], s["max"]) for s in too_big] == [(2000, 3000)]
    assert stats["totals"]["reasons"] == 4
