"""Streaming reads to Parquet: exactly once across query restarts and a broker crash."""

from __future__ import annotations

import json

import pytest

from conveyor import Admin
from tests.helpers import wait_for
from tests.spark.spark_helpers import BackgroundProducer, publish_to_partitions, read

pytestmark = pytest.mark.spark

STREAM_OPTIONS = {
    "startingOffsets": "earliest",
    "maxOffsetsPerTrigger": "20000",
    "partitionSize": "10000",
    "requestTimeoutMs": "2000",  # notice a dead broker quickly
}


def start_archive(
    spark, address: str, topic: str, out: str, checkpoint: str, *, available_now: bool = False, **options: str
):
    reader = spark.readStream.format("conveyor").option("broker", address).option("topic", topic)
    for key, value in {**STREAM_OPTIONS, **options}.items():
        reader = reader.option(key, value)
    writer = reader.load().writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="200 milliseconds").start()


def processed(query) -> int:
    """Rows the query has read in batches that completed."""
    return sum(p["numInputRows"] for p in query.recentProgress)


def end_offset(address: str, topic: str) -> int:
    with Admin(address) as admin:
        return admin.describe_topic(topic)["durable_offset"]


def caught_up(query, address: str, topic: str) -> bool:
    progress = query.lastProgress
    if not progress or query.exception() is not None:
        return False
    end = progress["sources"][0]["endOffset"]
    return end is not None and json.loads(end)["offset"] == end_offset(address, topic)


def assert_exactly_once(
    spark, address: str, topic: str, out: str, published: list[bytes], uncertain: list[bytes] = ()
) -> None:
    """The Parquet output holds every offset of the topic once, with the topic's values."""
    archived = spark.read.parquet(out).select("offset", "value").toArrow().sort_by("offset")
    topic_rows = read(spark, address, topic).select("offset", "value").toArrow().sort_by("offset")
    offsets = archived.column("offset").to_pylist()
    assert len(offsets) == len(set(offsets)), "an offset was archived twice"
    assert offsets == topic_rows.column("offset").to_pylist() == list(range(end_offset(address, topic)))
    assert archived.column("value").to_pylist() == topic_rows.column("value").to_pylist()
    # Every message the producer had confirmed is there, once (the topic holds no duplicates either).
    values = archived.column("value").to_pylist()
    assert len(values) == len(set(values))
    assert set(published) <= set(values) <= set(published) | set(uncertain)


def test_stream_to_parquet_stopped_and_restarted_twice_while_publishing(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    producer = BackgroundProducer(address, "events", rate=2000).start()
    try:
        for run in range(3):
            query = start_archive(spark, address, "events", out, checkpoint)
            before = producer.sent
            # Each run makes progress on data published during it, then is stopped mid-stream.
            wait_for(lambda q=query: processed(q) >= 2000, timeout=90, message=f"run {run} to archive rows")
            wait_for(lambda b=before: producer.sent > b + 3000, timeout=30, message="more publishing")
            assert query.exception() is None
            if run < 2:
                query.stop()
        published = producer.stop()
        wait_for(lambda: caught_up(query, address, "events"), timeout=90, message="the last run to catch up")
        query.stop()
    finally:
        producer.stop() if producer._thread.is_alive() else None
    assert len(published) > 9000
    assert_exactly_once(spark, address, "events", out, published)


def test_broker_killed_and_restarted_under_a_running_stream(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    producer = BackgroundProducer(address, "crashy", rate=2000).start()
    query = start_archive(spark, address, "crashy", out, checkpoint)
    try:
        wait_for(lambda: processed(query) >= 2000, timeout=90, message="rows archived before the crash")
        conveyor_broker.restart(kill=True)  # kill -9, then the same port and data
        after_restart = processed(query)
        wait_for(lambda: processed(query) >= after_restart + 3000, timeout=120, message="rows archived after the crash")
        assert query.isActive and query.exception() is None
        published = producer.stop()  # every unconfirmed batch was resent and confirmed
        wait_for(lambda: caught_up(query, address, "crashy"), timeout=90, message="the stream to catch up")
    finally:
        query.stop()
        producer.stop() if producer._thread.is_alive() else None
    # the Producer may give up on a batch it resent after the crash (DUPLICATE_SEQUENCE: the
    # broker no longer remembers that sequence); whether those were stored is unknown to it, not to us.
    assert_exactly_once(spark, address, "crashy", out, published, producer.uncertain)


def test_stream_of_an_8_partition_topic_stopped_and_restarted_resumes_each_partition(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    with Admin(address) as admin:
        admin.create_topic("events8", partitions=8)
    published = publish_to_partitions(address, "events8", 3000)

    # Stopped after its first micro-batch: maxOffsetsPerTrigger shares the batch over the
    # partitions, so every partition is left part-read, its own offset in the checkpoint.
    query = start_archive(spark, address, "events8", out, checkpoint, maxOffsetsPerTrigger="2000")
    try:
        wait_for(lambda: processed(query) >= 2000, timeout=90, message="a first micro-batch")
    finally:
        query.stop()
    first = json.loads(query.recentProgress[0]["sources"][0]["endOffset"])
    assert sorted(first["partitions"]) == [str(k) for k in range(8)]
    assert sum(first["partitions"].values()) == 2000
    assert all(0 < first["partitions"][str(k)] < sum(1 for p, _ in published if p == k) for k in range(8))

    published |= publish_to_partitions(address, "events8", 500, start=3000)
    query = start_archive(spark, address, "events8", out, checkpoint, available_now=True, maxOffsetsPerTrigger="2000")
    assert query.awaitTermination(120)
    assert query.exception() is None

    archived = spark.read.parquet(out).select("partition", "offset", "value").toArrow()
    rows = list(zip(*(archived.column(c).to_pylist() for c in ("partition", "offset", "value")), strict=True))
    assert len(rows) == len(published) == 3500  # nothing lost, nothing twice
    assert {(p, o): v for p, o, v in rows} == published
