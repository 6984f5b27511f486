"""Partitioned topics on one broker process: routing, per-key order, groups over every partition.

Partition 0 of a topic is the log it always was; partition k > 0 is a log of its
own (docs/partitions.md). These run a real broker and real clients.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.client.futures import Offset
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.wire.partitioning import partition_for_key

from conveyor.errors import TopicExists, UnknownPartition
from conveyor.names import dead_letter_log, partition_log, split_log
from tests.helpers import wait_for

# Known vectors: CRC-32 (IEEE) of the key's UTF-8 bytes, modulo the partition count. A client in
# another language must give the same partitions (docs/partitions.md has the same table).
KEY_VECTORS = [
    ("", 8, 0),  # crc32 0x00000000
    ("123456789", 8, 0xCBF43926 % 8),  # the CRC-32 check value
    ("123456789", 1000, 0xCBF43926 % 1000),
    ("order-1", 8, zlib.crc32(b"order-1") % 8),
    ("héllo", 7, zlib.crc32("héllo".encode()) % 7),
]


@pytest.mark.parametrize(("key", "partitions", "expected"), KEY_VECTORS)
def test_a_key_maps_to_crc32_of_its_utf8_bytes_modulo_the_partitions(key, partitions, expected):
    assert partition_for_key(key, partitions) == expected
    assert partition_for_key(key.encode(), partitions) == expected


def test_the_known_vectors_are_fixed_numbers():
    assert partition_for_key("123456789", 8) == 6  # 0xCBF43926 = 3421780262
    assert partition_for_key("order-1", 8) == zlib.crc32(b"order-1") % 8
    assert partition_for_key("anything", 1) == 0


def test_log_names_of_partitions():
    assert partition_log("orders", 0) == "orders"
    assert partition_log("orders", 3) == "orders#3"
    assert split_log("orders#3") == ("orders", 3)
    assert split_log("orders") == ("orders", 0)
    assert dead_letter_log("orders#3") == "orders.dlq#3"
    assert dead_letter_log("orders") == "orders.dlq"
    assert dead_letter_log("orders#2", "bad") == "bad#2"


def test_an_offset_is_an_int_that_carries_its_partition():
    assert Offset(3) == 3 and Offset(3).partition == 0 and repr(Offset(3)) == "3"
    five = Offset(5, 2)
    assert five == 5 and five + 1 == 6 and five.partition == 2
    assert json.dumps([five]) == "[5]"


def receive_all(subs, count, timeout=30.0, ack=True):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        for sub in subs:
            batch = sub.receive(timeout=0.05)
            if batch and ack:
                sub.ack(batch)
            got += [(sub, m) for m in batch]
    return got


def test_keys_route_to_their_partition_and_keep_their_order_under_concurrency(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        described = admin.create_topic("orders", partitions=8)
        assert [p["partition"] for p in described["partitions"]] == list(range(8))
        with pytest.raises(TopicExists):
            admin.create_topic("orders", partitions=8)
    keys = [f"key-{i}" for i in range(1000)]
    per_key = 5
    futures: list = []
    lock = threading.Lock()

    def publish(part: list[str]) -> None:
        with Producer(address, linger_ms=2) as producer:
            mine = [(k, n, producer.send("orders", {"k": k, "n": n}, key=k)) for n in range(per_key) for k in part]
            producer.flush(30)
        with lock:
            futures.extend(mine)

    threads = [threading.Thread(target=publish, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(futures) == len(keys) * per_key
    for key, _n, future in futures:
        offset = future.result(30)
        assert isinstance(offset, int) and offset.partition == partition_for_key(key, 8)
    with Admin(address) as admin:
        info = admin.describe_topic("orders")
        assert info["end_offset"] == len(keys) * per_key == sum(p["end_offset"] for p in info["partitions"])
        assert all(p["end_offset"] > 0 for p in info["partitions"])
    sub = Subscription("orders", "ordered", address=address, credit=2000)
    try:
        got = receive_all([sub], len(keys) * per_key)
    finally:
        sub.close()
    seen: dict[str, list[int]] = {}
    for _sub, message in got:
        assert message.partition == partition_for_key(message.key, 8)
        seen.setdefault(message.value["k"], []).append(message.value["n"])
    assert len(got) == len(keys) * per_key
    assert all(ns == list(range(per_key)) for ns in seen.values()), "per-key order at the consumer"


def test_a_group_of_four_receives_every_message_of_every_partition_once(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("work", partitions=8)
    with Producer(address, linger_ms=2, batch_size=50) as producer:
        sent = [producer.send("work", i) for i in range(2000)]  # keyless: sticky batches over the partitions
        producer.flush(30)
    partitions = {f.result(30).partition for f in sent}
    assert len(partitions) == 8, "keyless batches rotate over every partition"
    members = [Subscription("work", "g4", address=address, credit=100) for _ in range(4)]
    try:
        got = receive_all(members, 2000)
        time.sleep(0)  # nothing more may come: checked below against the group's own lag
        with Admin(address) as admin:
            wait_for(lambda: admin.describe_group("work", "g4")["lag"] == 0, timeout=30)
            group = admin.describe_group("work", "g4")
    finally:
        for sub in members:
            sub.close()
    values = sorted(m.value for _sub, m in got)
    assert values == list(range(2000)), "every message exactly once"
    assert len({sub for sub, _m in got}) > 1, "the members share the work"
    assert [row["partition"] for row in group["partitions"]] == list(range(8))
    assert all(row["lag"] == 0 for row in group["partitions"])


def test_admin_fetch_and_tail_read_each_partition(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("t3", partitions=3)
        with Producer(address) as producer:
            for p in range(3):
                for i in range(2):
                    assert producer.send("t3", f"p{p}-{i}", partition=p).result(30) == Offset(i, p)
            with pytest.raises(UnknownPartition):
                producer.send("t3", "x", partition=3)
        for p in range(3):
            fetched = admin.fetch("t3", 0, 10, partition=p)
            assert [(m.partition, m.offset, m.value) for m in fetched] == [
                (p, 0, f"p{p}-0".encode()),
                (p, 1, f"p{p}-1".encode()),
            ] or [(m.partition, m.offset, m.value) for m in fetched] == [(p, 0, f"p{p}-0"), (p, 1, f"p{p}-1")]
        with pytest.raises(UnknownPartition):
            admin.fetch("t3", 0, 10, partition=3)
        assert [t["name"] for t in admin.list_topics()] == ["t3"]
    base = [sys.executable, "-m", "conveyor", "tail", "t3", "--broker", address, "--from", "earliest"]
    out = subprocess.run([*base, "--count", "6", "--format", "json"], capture_output=True, text=True, timeout=60)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted((r["partition"], r["offset"]) for r in rows) == [(p, i) for p in range(3) for i in range(2)]
    out = subprocess.run([*base, "--partition", "2", "--count", "2"], capture_output=True, text=True, timeout=60)
    assert [line.split("\t")[0] for line in out.stdout.splitlines()] == ["2:0", "2:1"]


def test_an_async_producer_routes_by_key_and_resolves_offsets_with_partitions(conveyor_broker):
    import asyncio

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("a4", partitions=4)

    async def main() -> list:
        producer = AsyncProducer(address)
        try:
            futures = [await producer.send("a4", i, key=f"k{i}") for i in range(20)]
            routed = [(i, await f) for i, f in enumerate(futures)]
            admin.add_partitions("a4", 6)
            await (await producer.send("a4", "told", partition=0))  # its confirm says 6
            key = next(k for k in (f"key-{i}" for i in range(1000)) if partition_for_key(k, 6) == 5)
            assert (await (await producer.send("a4", "added", key=key))).partition == 5
            return routed
        finally:
            await producer.close()

    with Admin(address) as admin:
        for i, offset in asyncio.run(main()):
            assert offset.partition == partition_for_key(f"k{i}", 4)


def test_an_existing_single_partition_data_directory_opens_unchanged(conveyor_broker):
    address = conveyor_broker.address
    with Producer(address) as producer:
        assert producer.send("plain", b"x").result(30) == 0
    topic_json = Path(conveyor_broker.data_dir) / "topics" / "plain" / "topic.json"
    before = topic_json.read_bytes()
    assert b"partitions" not in before
    conveyor_broker.restart()
    with Admin(address) as admin:
        info = admin.describe_topic("plain")
        assert info["end_offset"] == 1 and info["partitions"] == [{"partition": 0, "start_offset": 0, "end_offset": 1}]
        assert [m.partition for m in admin.fetch("plain", 0, 10)] == [0]
    assert topic_json.read_bytes() == before
    assert sorted(p.name for p in (Path(conveyor_broker.data_dir) / "topics").iterdir()) == ["plain"]


def test_a_partitioned_topic_made_on_the_command_line_survives_a_restart_resets_and_deletes_whole(conveyor_broker):
    address = conveyor_broker.address
    create = [sys.executable, "-m", "conveyor", "topics", "create", "kept", "--partitions", "3", "--broker", address]
    made = subprocess.run([*create, "--format", "json"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    with Producer(address) as producer:
        for p in range(3):
            producer.send("kept", f"v{p}", partition=p).result(30)
    sub = Subscription("kept", "g", address=address)
    try:
        assert len(receive_all([sub], 3)) == 3
        with Admin(address) as admin:  # the acks arrived (an ack still in flight at a stop is redelivered later)
            wait_for(lambda: admin.describe_group("kept", "g")["lag"] == 0, timeout=30)
    finally:
        sub.close()
    conveyor_broker.restart()
    with Admin(address) as admin:
        info = admin.describe_topic("kept")
        assert [(p["partition"], p["end_offset"]) for p in info["partitions"]] == [(0, 1), (1, 1), (2, 1)]
        assert [row["committed_offset"] for row in admin.describe_group("kept", "g")["partitions"]] == [1, 1, 1]
        reset = admin.reset_offsets("kept", "g", "earliest")
        assert [row["lag"] for row in reset["partitions"]] == [1, 1, 1] and reset["lag"] == 3
        admin.delete_topic("kept")
        assert admin.list_topics() == []
        topics_dir = Path(conveyor_broker.data_dir) / "topics"
        assert not [p.name for p in topics_dir.iterdir() if p.name.startswith("kept")]
        again = admin.create_topic("kept", partitions=2)
        assert [p["end_offset"] for p in again["partitions"]] == [0, 0]


# --- a topic name with "#" is refused everywhere, never an alias of a partition's log ----------


def test_a_topic_name_with_a_hash_is_an_invalid_name_in_every_client(conveyor_broker):
    import asyncio

    from conveyor.errors import InvalidName

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("hx", partitions=2)
        with Producer(address) as producer:
            with pytest.raises(InvalidName):
                producer.send("hx#1", b"v").result(30)
            with pytest.raises(InvalidName):
                producer.send_many("hx#1", [b"v"])
        for call in (
            lambda: admin.describe_topic("hx#1"),
            lambda: admin.fetch("hx#1", 0, 10),
            lambda: admin.create_topic("hy#1"),
            lambda: admin.alter_topic("hx#1", retention_ms=1000),
            lambda: admin.describe_group("hx#1", "g"),
            lambda: admin.reset_offsets("hx#1", "g", "earliest"),
            lambda: admin.delete_group("hx#1", "g"),
            lambda: admin.delete_topic("hx#1"),
        ):
            with pytest.raises(InvalidName):
                call()

        async def send_async() -> None:
            producer = AsyncProducer(address)
            try:
                await (await producer.send("hx#1", b"v"))
            finally:
                await producer.close()

        with pytest.raises(InvalidName):
            asyncio.run(send_async())
        with pytest.raises(InvalidName):
            sub = Subscription("hx#1", "g", address=address)
            try:
                sub.receive(timeout=5)
            finally:
                sub.close()
        tail = [sys.executable, "-m", "conveyor", "tail", "hx#1", "--broker", address, "--count", "1"]
        out = subprocess.run(tail, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "name must match" in out.stderr, out.stderr
        info = admin.describe_topic("hx")
        assert [p["end_offset"] for p in info["partitions"]] == [0, 0], "nothing reached partition 1"
        assert "hx#1" not in {t["name"] for t in admin.list_topics()}


def test_a_raw_frame_naming_a_partition_log_as_its_topic_is_an_invalid_name(conveyor_broker):
    import msgpack
    from conveyor.broker.wire.protocol import Command

    from tests.broker.flood_helpers import RawClient

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("rx", partitions=2)
    body = msgpack.packb([[None, None, b"x"]], use_bin_type=True)
    raw = RawClient(address)
    try:
        raw.send(Command.PUBLISH, {"rid": 1, "topic": "rx#1"}, body)
        raw.send(Command.SUBSCRIBE, {"rid": 2, "sub": 1, "topic": "rx#1", "group": "g"})
        raw.send(Command.FETCH, {"rid": 3, "topic": "rx#1", "offset": 0, "max_messages": 10})
        ops = ["describe_topic", "alter_topic", "delete_topic", "describe_group", "reset_offsets", "delete_group"]
        for rid, op in enumerate(ops, start=10):
            args = {"topic": "rx#1", "group": "g", "to": "earliest", "config": {"retention_ms": 1000}}
            raw.send(Command.ADMIN, {"rid": rid, "op": op, **args})
        raw.send(Command.ADMIN, {"rid": 30, "op": "create_topic", "topic": "ry#1"})
        replies = {r.get("rid"): r for r in raw.replies(3 + len(ops) + 1)}
    finally:
        raw.close()
    assert sorted(replies) == [1, 2, 3, *range(10, 10 + len(ops)), 30]
    for rid, reply in replies.items():
        assert (reply.command, reply.get("code")) == (Command.ERROR, 206), (rid, reply.header)
    with Admin(address) as admin:
        assert [p["end_offset"] for p in admin.describe_topic("rx")["partitions"]] == [0, 0]


# --- a producer learns a topic's partitions again when what it knew no longer holds ------------


def key_for(partition: int, partitions: int) -> str:
    return next(k for k in (f"key-{i}" for i in range(1000)) if partition_for_key(k, partitions) == partition)


def routed(producer, topic: str, key: str):
    """Where one message with ``key`` lands (None while it fails with UNKNOWN_PARTITION)."""
    try:
        return producer.send(topic, b"v", key=key).result(30).partition
    except UnknownPartition:
        return None


def test_a_producer_that_found_no_broker_learns_the_partitions_once_one_answers(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("late", partitions=4)
    conveyor_broker.stop()
    key = key_for(3, 4)
    with Producer(address, linger_ms=1) as producer:
        first = producer.send("late", b"first", key=key)  # no answer: partition 0 for now
        conveyor_broker.start()
        assert first.result(30).partition == 0
        wait_for(lambda: routed(producer, "late", key) == 3, timeout=30, message="routing by the real count")


def test_a_producer_asks_again_after_unknown_partition(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("shrunk", partitions=4)
        key = key_for(3, 4)
        with Producer(address, linger_ms=1) as producer:
            assert routed(producer, "shrunk", key) == 3
            admin.delete_topic("shrunk")
            admin.create_topic("shrunk", partitions=2)
            with pytest.raises(UnknownPartition):
                producer.send("shrunk", b"v", key=key).result(30)
            wanted = partition_for_key(key, 2)
            wait_for(lambda: routed(producer, "shrunk", key) == wanted, timeout=30, message="the new count")


def test_a_partition_shows_in_metrics_as_its_log_name_and_partition_0_as_the_topic(conveyor_broker):
    """docs/partitions.md, "Metrics": no ``partition`` label on per-topic series; single-partition series unchanged."""
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("m3", partitions=3)
    with Producer(address) as producer:
        producer.send("m3", b"a", partition=0).result(30)
        for future in producer.send_many("m3", [b"b", b"c"], partition=2):
            future.result(30)

    def published() -> tuple[float, float, float]:
        name = "conveyor_published_messages_total"
        return tuple(conveyor_broker.metric(name, f'topic="{log}"') for log in ("m3", "m3#1", "m3#2"))

    wait_for(lambda: published() == (1, 0, 2), timeout=30, message="published per partition log")


def test_the_partitioner_asks_a_count_again_after_its_back_off_its_age_or_unknown_partition():
    """Unit test of broker/client/partitioner.py with a stand-in broker: when it asks, once per batch at most."""
    from conveyor.broker.client.partitioner import FIRST_RETRY, MAX_AGE, Partitioner

    from conveyor.errors import BrokerUnavailable
    from tests.helpers import FakeClock

    clock, answers, asked = FakeClock(), [BrokerUnavailable("down"), BrokerUnavailable("down"), 4], []

    def count_of(topic: str) -> int:
        asked.append(topic)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def batch_left_and_asked(count: int) -> None:
        partitioner.batch_left(partitioner.route("t", key, None))
        wait_for(lambda: len(asked) == count and not partitioner._asking, timeout=30, message=f"ask {count}")

    partitioner = Partitioner(count_of, clock=clock)
    key = key_for(3, 4)
    assert partitioner.route("t", key, None) == "t" and partitioner.guessed("t")
    assert partitioner.route("t", None, 2) == "t#2", "a guessed count lets an explicit partition through"
    partitioner.batch_left("t")
    assert len(asked) == 1, "not asked again before the back-off"
    clock.advance(FIRST_RETRY)
    batch_left_and_asked(2)
    assert partitioner.route("t", key, None) == "t", "still no answer: partition 0"
    clock.advance(FIRST_RETRY)
    partitioner.batch_left("t")
    assert len(asked) == 2, "the back-off doubled"
    clock.advance(FIRST_RETRY)
    batch_left_and_asked(3)
    assert partitioner.route("t", key, None) == "t#3" and not partitioner.guessed("t")
    for _ in range(100):
        partitioner.batch_left(partitioner.route("t", key, None))
    assert len(asked) == 3, "a known count is not asked per batch"
    partitioner.stale("t")
    answers.append(2)
    batch_left_and_asked(4)
    assert partitioner.counts["t"] == 2, "asked again after UNKNOWN_PARTITION"
    with pytest.raises(UnknownPartition):
        partitioner.route("t", None, 3)
    answers.append(8)
    clock.advance(MAX_AGE)
    batch_left_and_asked(5)
    assert partitioner.counts["t"] == 8, "asked again when the answer is MAX_AGE old"


# --- adding partitions to a topic (docs/partitions.md, "How to add partitions") ----------------


def test_added_partitions_reach_a_running_group_from_their_start_and_survive_a_restart(conveyor_broker):
    """A member subscribes to the new partitions without restarting (EVENT PARTITIONS); an existing group
    reads them from offset 0 even if it asked to start at ``latest``; only increases are accepted."""
    from conveyor.errors import InvalidRequest

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("grow", partitions=2)
        sub = Subscription("grow", "g", address=address, credit=10)
        try:
            with Producer(address) as producer:
                for p in range(2):
                    producer.send("grow", f"old-{p}", partition=p).result(30)
                assert sorted(m.partition for _s, m in receive_all([sub], 2)) == [0, 1]
                admin.reset_offsets("grow", "late", "latest")  # a group with no member now, past "old-*"
                grown = admin.add_partitions("grow", 4)
                assert [p["partition"] for p in grown["partitions"]] == [0, 1, 2, 3]
            with Producer(address) as producer:  # a new producer asks the count: 4
                for p in range(4):
                    producer.send("grow", f"new-{p}", partition=p).result(30)
            got = receive_all([sub], 4)
            assert sorted((m.partition, m.value) for _s, m in got) == [(p, f"new-{p}") for p in range(4)]
            assert sub.partitions == 4 and ("PARTITIONS", 0) in sub.events
            wait_for(lambda: admin.describe_group("grow", "g")["lag"] == 0, timeout=30)
        finally:
            sub.close()
        for wanted in (4, 3, 1025):
            with pytest.raises(InvalidRequest) as refused:
                admin.add_partitions("grow", wanted)
            assert refused.value.code == 207
        assert len(admin.describe_topic("grow")["partitions"]) == 4
    conveyor_broker.restart()
    with Admin(address) as admin:
        assert [p["end_offset"] for p in admin.describe_topic("grow")["partitions"]] == [2, 2, 1, 1]
        late = admin.describe_group("grow", "late")["partitions"]
        assert [(row["committed_offset"], row["lag"]) for row in late[2:]] == [(0, 1), (0, 1)], late
    late_sub = Subscription("grow", "late", address=address, start="latest")
    try:
        got = receive_all([late_sub], 4)
        assert sorted((m.partition, m.value) for _s, m in got) == [(p, f"new-{p}") for p in range(4)]
    finally:
        late_sub.close()


def test_topics_alter_partitions_on_the_command_line_adds_and_refuses_a_decrease(conveyor_broker):
    address = conveyor_broker.address
    alter = [sys.executable, "-m", "conveyor", "topics", "alter", "cli-grow", "--broker", address, "--format", "json"]
    with Admin(address) as admin:
        admin.create_topic("cli-grow", partitions=2, retention_ms=3_600_000)
        done = subprocess.run([*alter, "--partitions", "3"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["partitions"]) == 3
        refused = subprocess.run([*alter, "--partitions", "2"], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "INVALID_REQUEST" in refused.stderr, refused.stderr
        topic_json = Path(conveyor_broker.data_dir) / "topics" / "cli-grow#2" / "topic.json"
        stored = json.loads(topic_json.read_text())
        assert stored["retention_ms"] == 3_600_000 and stored["extra"] == {"partition_of": "cli-grow"}


def test_a_running_producer_routes_by_the_added_partitions_from_its_next_confirm(conveyor_broker):
    """The confirm of a partitioned topic's batch carries its count: no waiting for the 5-minute refresh."""
    address = conveyor_broker.address
    with Admin(address) as admin, Producer(address, linger_ms=1) as producer:
        admin.create_topic("widen")
        assert producer.send("widen", b"before").result(30) == Offset(0, 0)
        admin.add_partitions("widen", 4)
        assert producer.send("widen", b"told", partition=0).result(30) == Offset(1, 0)  # its confirm says 4
        assert routed(producer, "widen", key_for(3, 4)) == 3


def test_adding_partitions_grows_the_dead_letter_topic_first(conveyor_broker):
    """Partition k's dead letters go to partition k of the dead-letter topic, so it grows with its origin."""
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("dl", partitions=2)
        with Producer(address) as producer:
            producer.send("dl", b"poison", partition=1).result(30)
        sub = Subscription("dl", "g", address=address)
        try:
            (_sub, message), *_ = receive_all([sub], 1, ack=False)
            sub.term([message], reason="cannot")
            wait_for(lambda: "dl.dlq" in {t["name"] for t in admin.list_topics()}, timeout=30, message="a DLQ")
        finally:
            sub.close()
        assert len(admin.describe_topic("dl.dlq")["partitions"]) == 2
        admin.add_partitions("dl", 4)
        assert [p["end_offset"] for p in admin.describe_topic("dl.dlq")["partitions"]] == [0, 1, 0, 0]


def test_altering_a_partitioned_topic_changes_every_partition(conveyor_broker):
    """A setting is the topic's: `topics alter` applied it to partition 0 alone; partitions added later copy it."""
    with Admin(conveyor_broker.address) as admin:
        admin.create_topic("al", partitions=3)
        assert admin.alter_topic("al", retention_ms=60_000)["config"]["retention_ms"] == 60_000
    for log in ("al", "al#1", "al#2"):
        stored = json.loads((Path(conveyor_broker.data_dir) / "topics" / log / "topic.json").read_text())
        assert stored["retention_ms"] == 60_000, log


def test_a_long_poll_fetch_of_a_partition_that_times_out_answers_from_that_partition(conveyor_broker):
    """A parked FETCH of partition k is answered at its deadline from partition k, never from partition 0
    (and with another FETCH parked on partition 0, the expiry still finds its own)."""
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("polled", partitions=2)
        with Producer(address) as producer:
            producer.send("polled", "in-zero", partition=0).result(10)
        waiter = threading.Thread(target=lambda: Admin(address).fetch("polled", 1, 10, wait_ms=400))
        waiter.start()  # parked on partition 0, past its end
        assert admin.fetch("polled", 0, 10, wait_ms=200, partition=1) == []
        waiter.join(10)
        assert conveyor_broker.metric("conveyor_internal_errors_total") == 0
        assert [m.value for m in admin.fetch("polled", 0, 10)] == ["in-zero"]


# --- what a user sees of a partitioned topic: names, sums, the command line -------------------------


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=timeout)


def test_dead_letters_of_a_partition_name_its_topic_and_partition_never_its_log(conveyor_broker):
    """x-origin-topic was the log's name ('dl1#1'); DEAD_LETTERED named 'dl1.dlq#1' and said partition 0."""
    address = conveyor_broker.address
    told: list = []
    with Admin(address) as admin:
        admin.create_topic("dl1", partitions=2)
        with Producer(address) as producer:
            producer.send("dl1", b"poison", partition=1, headers={"origin": "test"}).result(30)
        sub = Subscription(
            "dl1", "g", address=address, max_deliveries=1, on_dead_letter=lambda m, e: told.append((m, e))
        )
        try:
            (_sub, message), *_ = receive_all([sub], 1, ack=False)
            assert message.partition == 1 and "partition=1" in repr(message)
            sub.nack(message, error="bad")  # one Message, not a list: the broker dead-letters it (max_deliveries 1)
            wait_for(lambda: sub.receive(timeout=0.05) == [] and told, timeout=30, message="DEAD_LETTERED")
        finally:
            sub.close()
        ((dead_messages, exc),) = told
        assert [m.partition for m in dead_messages] == [1] and exc.dead_letter_topic == "dl1.dlq"
        (dead,) = admin.fetch("dl1.dlq", 0, 10, partition=1)
        assert dead.headers["x-origin-topic"] == "dl1" and dead.headers["x-origin-partition"] == "1"
        assert dead.headers["x-origin-offset"] == "0" and dead.headers["origin"] == "test"
    out = cli("tail", "dl1.dlq", "--broker", address, "--from", "earliest", "--count", "1", "--format", "json")
    assert json.loads(out.stdout)["headers"]["x-origin-topic"] == "dl1", out.stderr


def test_describe_sums_every_partition_and_resets_one_partition_or_all(conveyor_broker):
    """durable/visible/segments/size and the group's committed/next/end were partition 0's, next to summed
    lags; a negative --to reset every partition to earliest; one partition could not be reset alone."""
    from conveyor.errors import InvalidRequest

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("sums", partitions=3)
        with Producer(address) as producer:
            for p, n in enumerate((2, 3, 4)):
                for i in range(n):
                    producer.send("sums", f"{p}-{i}", partition=p).result(30)
        info = admin.describe_topic("sums")
        rows = info["partitions"]
        assert [(r["end_offset"], r["durable_offset"], r["visible_offset"]) for r in rows] == [
            (2, 2, 2),
            (3, 3, 3),
            (4, 4, 4),
        ]
        assert (info["end_offset"], info["durable_offset"], info["visible_offset"]) == (9, 9, 9)
        assert info["segments"] == sum(r["segments"] for r in rows) == 3
        assert info["size_bytes"] == sum(r["size_bytes"] for r in rows) > rows[0]["size_bytes"]
        admin.reset_offsets("sums", "g", "earliest")
        group = admin.reset_offsets("sums", "g", 2, partition=1)  # that partition alone
        assert [r["committed_offset"] for r in group["partitions"]] == [0, 2, 0]
        assert (group["committed_offset"], group["next_offset"], group["end_offset"], group["lag"]) == (2, 2, 9, 7)
        assert {"in_flight", "pending_redelivery", "next_offset", "skipped_by_retention"} <= set(group["partitions"][1])
        made = admin.reset_offsets("sums", "new", "latest", partition=1)  # a new group: the others at their start
        assert [r["committed_offset"] for r in made["partitions"]] == [0, 3, 0]
        with pytest.raises(InvalidRequest):
            admin.reset_offsets("sums", "g", -5)
        with pytest.raises(UnknownPartition):
            admin.reset_offsets("sums", "g", 0, partition=3)
        assert [r["committed_offset"] for r in admin.describe_group("sums", "g")["partitions"]] == [0, 2, 0]
    base = ["--broker", address]
    refused = cli("groups", "reset", "sums", "g", "--to", "-5", *base)
    assert refused.returncode == 2 and "[CONFIG_ERROR]" in refused.stderr and "-5" in refused.stderr, refused.stderr
    one = cli("groups", "reset", "sums", "g", "--to", "latest", "--partition", "2", "--format", "json", *base)
    assert [r["committed_offset"] for r in json.loads(one.stdout)["partitions"]] == [0, 2, 4], one.stderr
    listed = cli("groups", "list", *base).stdout.splitlines()
    assert listed[0].split() == ["TOPIC", "GROUP", "COMMITTED_OFFSET", "END_OFFSET", "LAG", "IN_FLIGHT"]
    assert listed[1].split() == ["sums", "g", "6", "9", "3", "0"]
    topics = cli("topics", "list", *base).stdout.splitlines()
    assert topics[0].split()[:2] == ["NAME", "PARTITIONS"] and topics[1].split()[:4] == ["sums", "3", "0", "9"]
    described = cli("topics", "describe", "sums", *base).stdout
    assert not described.lstrip().startswith("{") and "PARTITIONS" in described, described
    table = described.split("\n\n", 1)[1].splitlines()
    assert table[0].split()[:3] == ["PARTITION", "START_OFFSET", "END_OFFSET"] and len(table) == 4
    assert json.loads(cli("topics", "describe", "sums", "--format", "json", *base).stdout)["end_offset"] == 9
    group_table = cli("groups", "describe", "sums", "g", *base).stdout
    assert "LAG" in group_table and not group_table.lstrip().startswith("{"), group_table
    assert [line.split()[0] for line in group_table.split("\n\n", 1)[1].splitlines()[1:]] == ["0", "1", "2"]


def test_tail_from_an_offset_applies_to_each_partition_and_publish_prints_partition_and_offset(conveyor_broker):
    """--from 1 failed when any partition was shorter; publish printed Offset(0, partition=2) or 0."""
    address = conveyor_broker.address
    base = ["--broker", address]
    with Admin(address) as admin:
        admin.create_topic("tf", partitions=3)
    sent = cli("publish", "tf", "a", "b", "c", "--partition", "1", *base)
    assert sent.stdout.split() == ["1:0", "1:1", "1:2"], sent.stderr
    keyed = cli("publish", "tf", "k", "--key", key_for(2, 3), *base)
    assert keyed.stdout.split() == ["2:0"], keyed.stderr
    assert cli("publish", "plain-tf", "x", *base).stdout.split() == ["0"]
    assert cli("publish", "plain-tf", "y", "--partition", "0", *base).stdout.split() == ["1"]
    refused = cli("publish", "tf", "x", "--partition", "-1", *base)
    assert refused.returncode == 2 and "--partition" in refused.stderr, refused.stderr
    tail = ["tail", "tf", *base, "--from", "1", "--format", "json", "--idle-timeout", "3"]
    out = cli(*tail, "--count", "2")
    assert sorted((r["partition"], r["offset"]) for r in map(json.loads, out.stdout.splitlines())) == [(1, 1), (1, 2)]
    past = cli("tail", "tf", *base, "--from", "5", "--partition", "2", "--count", "1")
    assert past.returncode != 0 and "tf partition 2" in past.stderr and "#" not in past.stderr, past.stderr


def test_the_command_line_checks_a_partition_count_itself(conveyor_broker):
    base = ["--broker", conveyor_broker.address]
    for count in ("0", "2000"):
        for action in ("create", "alter"):
            result = cli("topics", action, "pc", "--partitions", count, *base)
            assert result.returncode == 2 and "[CONFIG_ERROR]" in result.stderr, result.stderr
            assert f"--partitions takes 1 to 1024 (partitions in all), not {count}" in result.stderr


def test_a_partition_that_is_no_partition_number_is_a_config_error_in_every_producer(conveyor_broker):
    """partition="2" was a TypeError from a comparison; -1 went to the broker."""
    import asyncio

    from conveyor.errors import ConfigError

    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("pn", partitions=3)
        with pytest.raises(ConfigError):
            admin.fetch("pn", 0, 1, partition=-1)
    with Producer(address) as producer:
        for bad in ("2", -1, True, 1.0):
            with pytest.raises(ConfigError, match="partition must be an int of 0 or more"):
                producer.send("pn", b"x", partition=bad)
        assert producer.send("pn", b"x", partition=2).result(30) == Offset(0, 2)

    async def main() -> None:
        producer = AsyncProducer(address)
        try:
            for bad in ("2", -1, False):
                with pytest.raises(ConfigError):
                    await producer.send("pn", b"x", partition=bad)
        finally:
            await producer.close()

    asyncio.run(main())


def test_a_subscription_says_the_new_partition_count_and_settles_single_messages(conveyor_broker, caplog):
    """It logged 'PARTITIONS at offset 0'; ack(message) raised TypeError from inside by_partition."""
    import logging

    address = conveyor_broker.address
    caplog.set_level(logging.INFO, logger="conveyor.consumer")
    with Admin(address) as admin:
        admin.create_topic("grow2", partitions=2)
        sub = Subscription("grow2", "g", address=address)
        try:
            wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.partitions == 2, timeout=30, message="subscribed")
            admin.add_partitions("grow2", 3)
            wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.partitions == 3, timeout=30, message="grown")
            assert "the topic has 3 partitions now" in caplog.text and "PARTITIONS at offset" not in caplog.text
            with Producer(address) as producer:
                producer.send("grow2", b"a", partition=2).result(30)
                producer.send("grow2", b"b", partition=0).result(30)
            got = [m for _s, m in receive_all([sub], 2, ack=False)]
            for message in got:
                sub.ack(message)
            sub.ack(got[0].ref)  # an int as well (settling twice is ignored)
            wait_for(lambda: admin.describe_group("grow2", "g")["lag"] == 0, timeout=30, message="acked")
        finally:
            sub.close()


def test_a_dead_letter_topic_shared_with_a_smaller_topic_grows_to_take_partition_k(conveyor_broker):
    """Dead letters of partition 3 went to a log 'shared#3' while 'shared' still counted 1 partition: unreadable."""
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("shared")  # made first, with one partition (a single-partition topic's DLQ, say)
        admin.create_topic("four", partitions=4)
        with Producer(address) as producer:
            producer.send("four", b"poison", partition=3).result(30)
        sub = Subscription("four", "g", address=address, dead_letter_topic="shared")
        try:
            (_sub, message), *_ = receive_all([sub], 1, ack=False)
            sub.term([message], reason="cannot")
            wait_for(lambda: admin.describe_topic("shared")["end_offset"] == 1, timeout=30, message="the dead letter")
        finally:
            sub.close()
        assert admin.describe_topic("shared")["partition_count"] == 4
        assert [m.value for m in admin.fetch("shared", 0, 10, partition=3)] == [b"poison"]


def test_the_topic_limit_counts_every_partition_a_create_or_an_add_would_make(conveyor_broker_factory):
    """Each partition is a log (files, descriptors): a create of 8 under --max-topics 5 made all 8."""
    from conveyor.errors import TopicLimit

    broker = conveyor_broker_factory(extra=["--max-topics", "5"])
    with Admin(broker.address) as admin:
        with pytest.raises(TopicLimit):
            admin.create_topic("wide", partitions=8)
        admin.create_topic("narrow", partitions=3)
        with pytest.raises(TopicLimit):
            admin.add_partitions("narrow", 6)
        assert admin.describe_topic("narrow")["partition_count"] == 3
        assert [t["name"] for t in admin.list_topics()] == ["narrow"]
        admin.add_partitions("narrow", 5)  # exactly the limit
