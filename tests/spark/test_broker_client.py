"""The Spark connector's broker client, without Spark: publishing, fetching, Arrow conversion.

No JVM here (no ``spark`` fixture), so these run fast; they are marked
``spark`` with the rest of the directory because they need the ``spark``
extra (pyarrow).
"""

from __future__ import annotations

import threading
import zlib

import pytest
from conveyor.pipeline.broker_client import Connection, offset_for_timestamp, partition_bounds, topic_bounds
from conveyor.pipeline.broker_publisher import (
    Batcher,
    BatchPublisher,
    NonDeterministicRetry,
    producer_id_for,
    route_records,
)
from conveyor.pipeline.broker_reader import ARROW_SCHEMA, bodies_to_arrow, fetch_range
from conveyor.pipeline.options import OptionError, ReadOptions, WriteOptions, parse_position
from conveyor.pipeline.source import ConveyorStreamReader, cap_ends, split_partitions, split_range
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from conveyor import Admin, Producer
from tests.helpers import free_address

pytestmark = pytest.mark.spark


def read_values(address: str, topic: str) -> list[bytes]:
    with Connection(address) as conn:
        bounds = topic_bounds(conn, topic)
        return [
            v
            for chunk in fetch_range(conn, topic, bounds.start, bounds.end)
            for v in bodies_to_arrow(topic, *chunk).column("value").to_pylist()
        ]


def batches(n_batches: int, per_batch: int = 100) -> list[tuple[bytes, int]]:
    batcher = Batcher(max_records=per_batch)
    values = [b"v%06d" % i for i in range(n_batches * per_batch)]
    out = list(batcher.add([None] * len(values), [None] * len(values), values))
    return out + list(batcher.finish())


def test_publisher_survives_a_broker_kill_without_loss_or_duplicates(conveyor_broker):
    planned = batches(300)
    restarted = threading.Event()

    def crash() -> None:
        conveyor_broker.restart(kill=True)
        restarted.set()

    with BatchPublisher(conveyor_broker.address, "kill9", producer_id_for("t", 1), request_timeout=1.0) as pub:
        for i, (body, count) in enumerate(planned):
            if i == 100:
                threading.Thread(target=crash, daemon=True).start()
            pub.publish(body, count)
        stats = pub.flush()
    assert restarted.wait(30)
    assert stats.written + stats.duplicates == 30_000
    values = read_values(conveyor_broker.address, "kill9")
    assert values == [b"v%06d" % i for i in range(30_000)]

    # The same producer id again (a task retry): nothing is stored twice.
    with BatchPublisher(conveyor_broker.address, "kill9", producer_id_for("t", 1), request_timeout=1.0) as pub:
        for body, count in planned:
            pub.publish(body, count)
        again = pub.flush()
    assert (again.written, again.duplicates) == (0, 30_000)
    assert len(read_values(conveyor_broker.address, "kill9")) == 30_000


def test_batches_are_cut_the_same_however_the_input_is_sliced():
    values = [b"x" * (i % 50) for i in range(10_000)]
    keys, headers = [None] * len(values), [None] * len(values)

    def cut(step: int) -> list[tuple[bytes, int]]:
        batcher = Batcher(max_records=700, max_bytes=16_000)
        out = []
        for lo in range(0, len(values), step):
            out += batcher.add(keys[lo : lo + step], headers[lo : lo + step], values[lo : lo + step])
        return out + list(batcher.finish())

    assert cut(1) == cut(333) == cut(10_000)
    assert sum(count for _, count in cut(333)) == 10_000


def test_fetch_to_arrow_slices_batches_and_keeps_keys_and_headers(conveyor_broker):
    address = conveyor_broker.address
    with Producer(address, batch_size=7, linger_ms=50) as producer:
        for i in range(50):
            producer.send("arrow", b"%d" % i, key=b"\xff\xfe" if i == 3 else f"k{i}", headers={"h": str(i)})
        producer.flush(timeout=10)
    with Connection(address) as conn:
        chunks = list(fetch_range(conn, "arrow", 5, 23, max_messages=4))
        assert chunks[0][2] == 5 and chunks[-1][3] == 23
        table = [bodies_to_arrow("arrow", *c) for c in chunks]
    assert all(t.schema == ARROW_SCHEMA for t in table)
    offsets = [o for t in table for o in t.column("offset").to_pylist()]
    assert offsets == list(range(5, 23))
    values = [v for t in table for v in t.column("value").to_pylist()]
    assert values == [b"%d" % i for i in range(5, 23)]
    first = table[0].to_pylist()[0]
    assert first["key"] == "k5" and first["headers"] == [("h", "5")] and first["topic"] == "arrow"
    with Connection(address) as conn:
        raw_key = bodies_to_arrow("arrow", *next(iter(fetch_range(conn, "arrow", 3, 4)))).column("key")[0].as_py()
        assert raw_key == "\ufffd\ufffd"  # a binary key that is not UTF-8 still reads, replaced
        assert offset_for_timestamp(conn, "arrow", 0) == 0
        assert offset_for_timestamp(conn, "arrow", 2**50) == 50


def test_options_and_planning():
    opts = ReadOptions.parse({"topic": "t", "startingOffsets": "12", "endingOffsets": "latest", "partitionSize": "10"})
    assert (opts.starting.kind, opts.starting.value, opts.ending.kind) == ("offset", 12, "latest")
    assert parse_position("x", '{"timestamp": 5}', "earliest").kind == "timestamp"
    assert ReadOptions.parse({"topic": "t"}, streaming=True).starting.kind == "latest"
    with pytest.raises(OptionError):
        ReadOptions.parse({})
    with pytest.raises(OptionError):
        ReadOptions.parse({"topic": "t", "partitionSize": "zero"})
    with pytest.raises(OptionError):
        WriteOptions.parse({"topic": "t", "maxInFlight": "8"})
    assert [(p.start, p.end) for p in split_range("t", 0, 25, 10)] == [(0, 8), (8, 16), (16, 25)]
    assert [(p.start, p.end) for p in split_range("t", 0, 4, 10, min_partitions=2)] == [(0, 2), (2, 4)]
    assert split_range("t", 5, 5, 10) == []
    assert producer_id_for("w", 1) == producer_id_for("w", 1) != producer_id_for("w", 2)
    assert 0 < producer_id_for("w", 1) < 2**62


def test_a_retry_that_brings_other_records_fails_loudly(conveyor_broker):
    pid = producer_id_for("t", 2)
    with BatchPublisher(conveyor_broker.address, "changed", pid) as pub:
        for body, count in batches(3):
            pub.publish(body, count)
        pub.flush()
    batcher = Batcher(max_records=100)
    values = [b"w%06d" % i for i in range(300)]  # as many records per batch, other contents
    with BatchPublisher(conveyor_broker.address, "changed", pid) as pub, pytest.raises(NonDeterministicRetry):
        for body, count in batcher.add([None] * 300, [None] * 300, values):
            pub.publish(body, count)
        pub.flush()
    assert len(read_values(conveyor_broker.address, "changed")) == 300


def test_the_publisher_and_reader_given_a_dead_broker_first_use_the_live_one(conveyor_broker):
    # Given a bootstrap list whose first address nobody listens on
    bootstrap = f"{free_address()},{conveyor_broker.address}"
    # When a publisher writes and a connection reads through it
    with BatchPublisher(bootstrap, "listed", producer_id_for("listed", 1)) as pub:
        for body, count in batches(3):
            pub.publish(body, count)
        stats = pub.flush()
    # Then everything went to the live broker, and reads back through the list
    assert stats.written == 300
    assert read_values(bootstrap, "listed") == [b"v%06d" % i for i in range(300)]


def test_per_partition_positions_and_planning():
    # An offset applies to every partition; a JSON object names partitions, the others take the default.
    named = parse_position("startingOffsets", '{"0": 12, "3": -1}', "earliest")
    assert [named.for_partition(k) for k in (0, 3, 5)] == [
        parse_position("x", "12", "earliest"),
        parse_position("x", "latest", "earliest"),
        parse_position("x", "earliest", "earliest"),
    ]
    assert parse_position("x", "7", "earliest").for_partition(4).value == 7
    # Each topic partition is cut alone; minPartitions is shared in proportion to the ranges.
    pieces = split_partitions("t", {0: (0, 25), 1: (5, 5), 2: (10, 14)}, 10)
    assert [(p.partition, p.start, p.end) for p in pieces] == [(0, 0, 8), (0, 8, 16), (0, 16, 25), (2, 10, 14)]
    assert len(split_partitions("t", {0: (0, 10), 1: (0, 10)}, 100, min_partitions=4)) == 4
    # maxOffsetsPerTrigger over partitions: shared by what each has to read, exact in total, never past an end.
    assert cap_ends({0: 0, 1: 0, 2: 50}, {0: 100, 1: 10, 2: 50}, 1000) == {0: 100, 1: 10, 2: 50}
    capped = cap_ends({0: 0, 1: 0, 2: 5}, {0: 300, 1: 100, 2: 6}, 41)
    assert sum(capped[k] - s for k, s in {0: 0, 1: 0, 2: 5}.items()) == 41
    assert capped[0] > capped[1] > 0 and capped[2] <= 6
    # Keys route as every producer does (docs/partitions.md vectors); keyless rows a batch at a time.
    assert route_records(["123456789", "", b"123456789"], 8, batch_size=10) == [6, 0, 6]
    assert route_records([None] * 5, 4, batch_size=2, keyless_from=3) == [3, 3, 0, 0, 1]
    assert route_records([None, "k", None], 4, batch_size=2, keyless_seen=1) == [0, zlib.crc32(b"k") % 4, 1]


def test_a_stream_checkpoint_from_before_partitions_resumes_as_partition_0(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("eight", partitions=8)
    with Producer(address) as producer:
        for i in range(80):
            producer.send("eight", b"%d" % i, partition=i % 8)
            producer.send("one", b"%d" % i)
        producer.flush(timeout=10)
    with Connection(address, topic="eight") as conn:
        assert partition_bounds(conn, "eight") == [type(topic_bounds(conn, "one"))(0, 10)] * 8

    # A topic of one partition keeps the offset it always had in a checkpoint.
    one = ConveyorStreamReader(ReadOptions.parse({"broker": address, "topic": "one"}, streaming=True))
    assert one.latestOffset({"topic": "one", "offset": 30}, ReadAllAvailable()) == {"topic": "one", "offset": 80}
    assert [
        (p.partition, p.start, p.end)
        for p in one.partitions({"topic": "one", "offset": 30}, {"topic": "one", "offset": 80})
    ] == [(0, 30, 80)]
    # {"offset": N} is partition 0's; the others, not named, start at their log start.
    eight = ConveyorStreamReader(ReadOptions.parse({"broker": address, "topic": "eight"}, streaming=True))
    old = {"topic": "eight", "offset": 4}
    end = eight.latestOffset(old, ReadMaxRows(1000))
    assert end == {"topic": "eight", "partitions": {str(k): 10 for k in range(8)}}
    planned = eight.partitions(old, end)
    assert [(p.partition, p.start, p.end, p.earliest) for p in planned] == [(0, 4, 10, False)] + [
        (k, 0, 10, True) for k in range(1, 8)
    ]
    # Partitions added to a topic a stream reads are read from their start.
    with Admin(address) as admin:
        admin.add_partitions("one", 3)
    with Producer(address) as producer:
        for i in range(5):
            producer.send("one", b"%d" % i, partition=2)
        producer.flush(timeout=10)
    grown = one.latestOffset({"topic": "one", "offset": 80}, ReadAllAvailable())
    assert grown == {"topic": "one", "partitions": {"0": 80, "1": 0, "2": 5}}
    assert [(p.partition, p.start, p.end) for p in one.partitions({"topic": "one", "offset": 80}, grown)] == [(2, 0, 5)]
    capped = eight.latestOffset(end | {"partitions": {"0": 10, "1": 2}}, ReadMaxRows(8))
    assert capped["partitions"]["1"] == 3  # the lagging partitions share the cap
    assert sum(capped["partitions"].values()) - 10 - 2 == 8
    one.stop()
    eight.stop()
