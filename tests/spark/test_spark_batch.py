"""Batch reads and writes through a real broker and a real local Spark."""

from __future__ import annotations

import json
import math
import time
import zlib
from datetime import UTC, datetime

import pytest
from conveyor.pipeline import columns
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from conveyor import Admin, Producer
from tests.helpers import free_address
from tests.spark.spark_helpers import publish_numbered, publish_to_partitions, read, value_of

pytestmark = pytest.mark.spark


def test_batch_read_of_100k_messages_equals_what_was_published(spark, conveyor_broker):
    n = 100_000
    offsets = publish_numbered(conveyor_broker.address, "orders", n)
    assert offsets == list(range(n))

    df = read(spark, conveyor_broker.address, "orders", partitionSize=30_000)
    assert df.columns == ["topic", "offset", "timestamp", "key", "headers", "value", "partition"]
    assert df.rdd.getNumPartitions() == 4  # offset ranges of at most 30,000
    table = df.toArrow()

    assert table.num_rows == n
    assert table.column("offset").to_pylist() == list(range(n))
    assert table.column("value").to_pylist() == [value_of(i) for i in range(n)]
    assert table.column("key").to_pylist() == [f"k{i % 10}" if i % 10 == 0 else None for i in range(n)]
    headers = table.column("headers").to_pylist()
    assert headers[100] == [("n", "100")] and headers[101] is None
    assert set(table.column("topic").to_pylist()) == {"orders"}
    assert set(table.column("partition").to_pylist()) == {0}
    stamps = table.column("timestamp").to_pylist()
    assert all(abs((datetime.now(UTC) - ts).total_seconds()) < 600 for ts in (stamps[0], stamps[-1]))


def test_read_of_an_offset_range_and_pushed_down_filters(spark, conveyor_broker):
    address = conveyor_broker.address
    publish_numbered(address, "ranges", 5000, batch_size=1000)  # several broker batches; ranges start mid-batch
    time.sleep(0.05)
    cut = datetime.now(UTC)
    time.sleep(0.05)
    publish_numbered(address, "ranges", 1000, start=5000, batch_size=1000)

    ranged = read(spark, address, "ranges", startingOffsets=1234, endingOffsets=3456, partitionSize=500)
    rows = ranged.select("offset", "value").collect()
    assert [r.offset for r in rows] == list(range(1234, 3456))
    assert [bytes(r.value) for r in rows] == [value_of(i) for i in range(1234, 3456)]
    assert ranged.rdd.getNumPartitions() == 5

    # The same range as a filter: pushed down, the planned partitions shrink too.
    full = read(spark, address, "ranges", partitionSize=500)
    assert full.rdd.getNumPartitions() == 12
    filtered = full.where((F.col("offset") >= 1234) & (F.col("offset") < 3456))
    assert filtered.rdd.getNumPartitions() == 5
    assert filtered.count() == 3456 - 1234
    assert full.where("offset = 77").select("value").first().value == value_of(77)

    # Timestamps: a filter keeps exactly the later batch; pushdown prunes to it.
    later = full.where(F.col("timestamp") >= F.lit(cut))
    assert later.rdd.getNumPartitions() == 2
    assert sorted(r.offset for r in later.select("offset").collect()) == list(range(5000, 6000))
    since = read(spark, address, "ranges", startingTimestamp=int(cut.timestamp() * 1000))
    assert since.count() == 1000


def test_batch_write_then_read_back(spark, conveyor_broker):
    address = conveyor_broker.address
    rows = [
        (f"payload-{i}", f"key-{i % 3}" if i % 2 else None, {"i": str(i)} if i % 5 == 0 else None) for i in range(2000)
    ]
    df = spark.createDataFrame(rows, "value string, key string, headers map<string,string>").repartition(3)
    df.write.format("conveyor").option("broker", address).option("topic", "written").mode("append").save()

    back = read(spark, address, "written").collect()
    assert len(back) == 2000
    assert [r.offset for r in back] == list(range(2000))
    got = {bytes(r.value).decode(): (r.key, dict(r.headers or {})) for r in back}
    for value, key, headers in rows:
        got_key, got_headers = got[value]
        assert got_key == key
        assert got_headers == {**(headers or {}), "content-type": "text/plain; charset=utf-8"}

    # Binary values go as they are; other columns (here those of a read) are ignored.
    copy = read(spark, address, "written").where("offset < 10")
    copy.write.format("conveyor").option("broker", address).option("topic", "copied").mode("append").save()
    copied = sorted(bytes(r.value) for r in read(spark, address, "copied").collect())
    assert copied == sorted(bytes(r.value) for r in copy.collect())


def test_rewriting_with_the_same_write_id_stores_nothing_twice(spark, conveyor_broker):
    address = conveyor_broker.address
    df = spark.range(30_000, numPartitions=2).select(F.col("id").cast("string").alias("value"))

    def save() -> None:
        (
            df.write.format("conveyor")
            .option("broker", address)
            .option("topic", "once")
            .option("writeId", "nightly-2024-01-01")
            .option("batchSize", 1000)  # 15 batches per task: more than the broker's window of 8
            .mode("append")
            .save()
        )

    save()
    save()
    with Admin(address) as admin:
        assert admin.describe_topic("once")["end_offset"] == 30_000


def test_a_retried_write_task_does_not_duplicate(spark, conveyor_broker):
    """A task that fails after publishing part of its rows is retried; the retry skips what is stored."""
    address = conveyor_broker.address

    def fail_first_attempt(i: int) -> str:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and i == 15_000:
            time.sleep(1.0)  # let the writer publish (and the broker confirm) the rows before this one
            raise RuntimeError("injected failure of the first attempt")
        return f"row-{i}"

    udf = F.udf(fail_first_attempt, StringType(), useArrow=False)
    df = spark.range(40_000, numPartitions=2).select(udf(F.col("id")).alias("value"))
    (
        df.write.format("conveyor")
        .option("broker", address)
        .option("topic", "retried")
        .option("batchSize", 1000)
        .mode("append")
        .save()
    )
    values = [bytes(r.value).decode() for r in read(spark, address, "retried").collect()]
    assert len(values) == 40_000
    assert sorted(values) == sorted(f"row-{i}" for i in range(40_000))
    # The retry really did resend stored batches, and the broker recognised them.
    resent = conveyor_broker.metric("conveyor_duplicate_batches_total", 'topic="retried"')
    refused = conveyor_broker.metric("conveyor_protocol_errors_total", "DUPLICATE_SEQUENCE")
    assert resent + refused > 0


def test_decoded_value_reads_json_and_msgpack(spark, conveyor_broker):
    address = conveyor_broker.address
    with Producer(address) as producer:
        producer.send("mixed", {"id": 1, "name": "msgpack"})  # application/msgpack
        producer.send(
            "mixed", json.dumps({"id": 2, "name": "json"}).encode(), headers={"content-type": "application/json"}
        )
        producer.send("mixed", b'{"id": 3, "name": "bare"}')  # no content type: read as JSON
        producer.flush(timeout=10)
    schema = StructType([StructField("id", LongType()), StructField("name", StringType())])
    df = read(spark, address, "mixed").select("offset", columns.decoded_value(schema).alias("v"))
    got = [(r.offset, r.v.id, r.v.name) for r in df.orderBy("offset").collect()]
    assert got == [(0, 1, "msgpack"), (1, 2, "json"), (2, 3, "bare")]
    assert read(spark, address, "mixed").where("offset = 0").select(columns.msgpack_to_json().alias("j")).first().j == (
        '{"id":1,"name":"msgpack"}'
    )


def test_batch_read_of_an_8_partition_topic_reads_every_message_once(spark, conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("parts8", partitions=8)
    published = publish_to_partitions(address, "parts8", 4000)
    counts = [sum(1 for p, _ in published if p == k) for k in range(8)]
    assert all(counts)  # keys and sticky batches reach every partition

    # A bootstrap list (its second broker is down): each partition is read from its leader.
    df = read(spark, f"{address},{free_address()}", "parts8", partitionSize=300)
    assert df.columns == ["topic", "offset", "timestamp", "key", "headers", "value", "partition"]
    assert df.rdd.getNumPartitions() == sum(math.ceil(c / 300) for c in counts)  # partitions x ranges
    table = df.select("partition", "offset", "value").toArrow()
    rows = list(zip(*(table.column(c).to_pylist() for c in ("partition", "offset", "value")), strict=True))
    assert len(rows) == 4000
    assert {(p, o): v for p, o, v in rows} == published  # every message once, at its partition and offset
    for k in range(8):
        assert sorted(o for p, o, _ in rows if p == k) == list(range(counts[k]))

    # Offsets are per partition: an offset option and an offset filter apply to each partition.
    assert read(spark, address, "parts8", startingOffsets=100).count() == sum(c - 100 for c in counts)
    per_partition = read(spark, address, "parts8", startingOffsets='{"2": 5}', endingOffsets='{"2": 9, "3": 0}')
    # Partition 2 from 5 to 9, partition 3 nothing, the others as the defaults say (earliest to latest).
    expected = [(2, o) for o in range(5, 9)] + [(k, o) for k in (0, 1, 4, 5, 6, 7) for o in range(counts[k])]
    assert sorted((r.partition, r.offset) for r in per_partition.collect()) == sorted(expected)
    # A pushed-down partition filter plans that partition only.
    only = read(spark, address, "parts8", partitionSize=300).where("partition = 3 AND offset >= 10")
    assert only.rdd.getNumPartitions() == math.ceil((counts[3] - 10) / 300)
    assert sorted(r.offset for r in only.select("offset").collect()) == list(range(10, counts[3]))


def test_sink_routes_keys_to_the_partitions_of_the_topic(spark, conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("routed", partitions=8)
    rows = [(f"v{i}", None if i % 4 == 0 else f"key-{i % 50}") for i in range(4000)]
    df = spark.createDataFrame(rows, "value string, key string").repartition(2)

    def save() -> None:
        (
            df.write.format("conveyor")
            .option("broker", address)
            .option("topic", "routed")
            .option("writeId", "routed-1")
            .option("batchSize", 200)
            .mode("append")
            .save()
        )

    save()
    save()  # the same writeId again: every partition recognises its batches, nothing is stored twice
    back = read(spark, address, "routed").select("partition", "key", "value").collect()
    assert sorted(r.value.decode() for r in back) == sorted(v for v, _ in rows)
    for r in back:
        if r.key is not None:  # a key lands in crc32(key) % partitions, as every producer sends it
            assert r.partition == zlib.crc32(r.key.encode()) % 8
    keyless = {r.partition for r in back if r.key is None}
    assert len(keyless) > 1  # keyless rows spread a batch at a time


def test_batch_read_of_an_8_partition_topic_over_a_3_node_cluster(spark, tmp_path):
    """Each partition is read from, and written to, its own leader: the leaders are spread over three brokers."""
    from conveyor.broker.client.metadata import Metadata

    from conveyor.cluster_process import ClusterProcess

    with ClusterProcess(tmp_path / "cluster", nodes=3) as cluster:
        with Admin(cluster.bootstrap) as admin:
            admin.create_topic("spread8", partitions=8, replication_factor=2)
            admin.create_topic("spread8-copy", partitions=8, replication_factor=2)
        published = publish_to_partitions(cluster.bootstrap, "spread8", 4000)
        leaders = {p.leader for p in Metadata(cluster.bootstrap).refresh(["spread8"]).topics["spread8"].values()}
        assert leaders == set(cluster.node_ids)
        table = read(spark, cluster.bootstrap, "spread8", partitionSize=500).select("partition", "offset", "value")
        rows = table.toArrow()
        got = list(zip(*(rows.column(c).to_pylist() for c in ("partition", "offset", "value")), strict=True))
        assert len(got) == 4000 and {(p, o): v for p, o, v in got} == published

        # The sink publishes each partition's rows to its leader, keys where every producer sends them.
        copy = read(spark, cluster.bootstrap, "spread8").select("key", "value")
        copy.write.format("conveyor").option("broker", cluster.bootstrap).option("topic", "spread8-copy").mode(
            "append"
        ).save()
        back = read(spark, cluster.bootstrap, "spread8-copy").select("partition", "key", "value").collect()
        assert sorted(bytes(r.value) for r in back) == sorted(published.values())
        assert all(r.partition == zlib.crc32(r.key.encode()) % 8 for r in back if r.key is not None)
