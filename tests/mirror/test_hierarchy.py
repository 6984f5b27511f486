"""Broker hierarchies: root -> L2 -> L3 mirrors with identical offsets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Producer
from conveyor.errors import ConveyorError, ReadOnlyTopic
from conveyor.testing import BrokerProcess
from tests.helpers import publish, wait_for


@pytest.fixture
def chain(tmp_path):
    root = BrokerProcess(tmp_path / "root").start()
    l2 = BrokerProcess(
        tmp_path / "l2",
        extra=["--upstream", root.address, "--mirror", "orders*", "--mirror-unreachable-after-ms", "3000"],
    ).start()
    l3 = BrokerProcess(tmp_path / "l3", extra=["--upstream", l2.address, "--mirror", "*"]).start()
    yield root, l2, l3
    for broker in (l3, l2, root):
        broker.stop()


def read_all(address: str, topic: str, end: int, timeout: float = 20.0) -> list[tuple[int, int, object]]:
    """(offset, timestamp ms, value) of every message below ``end``, waiting for them."""
    out: list[tuple[int, int, object]] = []
    deadline = time.monotonic() + timeout
    with Admin(address) as admin:
        while len(out) < end and time.monotonic() < deadline:
            try:
                batch = admin.fetch(topic, len(out), 5000, wait_ms=200)
            except Exception:
                time.sleep(0.1)
                continue
            out += [(m.offset, int(m.timestamp * 1000), m.value) for m in batch]
    return out


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(broker: BrokerProcess) -> dict:
    url = broker.metrics_url.replace("/metrics", "/healthz")
    try:
        return json.loads(urllib.request.urlopen(url, timeout=5).read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_messages_reach_the_third_level_with_identical_offsets(chain):
    root, _l2, l3 = chain
    publish(root.address, "orders", [f"order-{i}" for i in range(3000)])
    publish(root.address, "unmirrored", ["x"])
    at_root = read_all(root.address, "orders", 3000)
    at_l3 = read_all(l3.address, "orders", 3000)
    assert len(at_root) == 3000
    assert at_l3 == at_root, "same offsets, timestamps and values two hops down"
    with Admin(l3.address) as admin:
        assert [t["name"] for t in admin.list_topics()] == ["orders"]
    with Producer(l3.address) as producer, pytest.raises(ReadOnlyTopic):
        producer.send("orders", "local").result(timeout=10)
    # Consumers on the leaf read as usual
    sub = Subscription("orders", "leaf", address=l3.address)
    got = []
    deadline = time.monotonic() + 15
    while len(got) < 3000 and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.2)
        sub.ack(batch)
        got += batch
    sub.close()
    assert [m.offset for m in got] == list(range(3000))


def test_killing_the_middle_broker_loses_and_duplicates_nothing(chain):
    root, l2, l3 = chain
    stop = threading.Event()
    sent = []

    def produce() -> None:
        with Producer(root.address, linger_ms=2) as producer:
            i = 0
            while not stop.is_set() and i < 20_000:
                sent.append(producer.send("orders", i))
                i += 1
                if i % 500 == 0:
                    time.sleep(0.02)
            producer.flush(timeout=30)

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.8)
    l2.restart(kill=True)
    time.sleep(0.8)
    l2.restart(kill=True)
    time.sleep(0.5)
    stop.set()
    thread.join(60)
    total = len(sent)
    assert [f.result(timeout=30) for f in sent] == list(range(total))
    at_root = read_all(root.address, "orders", total)
    at_l3 = read_all(l3.address, "orders", total, timeout=30)
    assert len(at_root) == total
    assert at_l3 == at_root, "every offset once, in order, after two kill -9 of the middle broker"


def test_a_stopped_parent_turns_the_child_degraded_then_unhealthy_then_healthy(chain):
    root, l2, _l3 = chain
    publish(root.address, "orders", ["a"])
    assert read_all(l2.address, "orders", 1)
    assert health(l2)["status"] == "HEALTHY"
    root.stop()
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "UNHEALTHY" not in seen:
        seen.append(health(l2)["status"])
        time.sleep(0.2)
    assert "DEGRADED" in seen and seen[-1] == "UNHEALTHY"
    assert seen.index("DEGRADED") < seen.index("UNHEALTHY")
    # Waiting for a parent that is gone costs (almost) nothing: nothing polls.
    before = cpu_seconds(l2.pid)
    time.sleep(3)
    assert cpu_seconds(l2.pid) - before < 0.5
    root.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and health(l2)["status"] != "HEALTHY":
        time.sleep(0.2)
    assert health(l2)["status"] == "HEALTHY"
    publish(root.address, "orders", ["b"])
    assert [v for _o, _t, v in read_all(l2.address, "orders", 2)] == ["a", "b"]


def test_refresh_resets_consumers_and_announces_ready(chain):
    root, l2, _l3 = chain
    publish(root.address, "orders", list(range(500)))
    assert len(read_all(l2.address, "orders", 500)) == 500
    events = []
    sub = Subscription("orders", "app", address=l2.address, on_event=lambda e, o: events.append((e, o)))
    first = []
    deadline = time.monotonic() + 15
    while len(first) < 500 and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.2)
        sub.ack(batch)
        first += batch
    assert len(first) == 500
    # When the child is asked to drop and re-mirror the topic
    with Admin(l2.address) as admin:
        result = admin.refresh_topic("orders")
    assert result["from"] == 0 and result["until"] == 500
    # Then the consumer sees RESET, reads everything again, then READY
    again = []
    deadline = time.monotonic() + 20
    while (len(again) < 500 or ("READY", 500) not in events) and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.2)
        sub.ack(batch)
        again += batch
    sub.close()
    assert events[0] == ("RESET", 0)
    assert ("READY", 500) in events
    assert sorted(m.offset for m in again) == list(range(500))
    assert [m.value for m in sorted(again, key=lambda m: m.offset)] == list(range(500))


def test_a_child_never_dead_letters_into_a_mirrored_topic(tmp_path):
    """Dead letters of a group on a child whose dead-letter topic is a mirror are refused, counted and kept.

    The mirror must stay the parent's log, offset for offset: a local append there
    would shift everything the parent adds later.
    """
    root = BrokerProcess(tmp_path / "root").start()
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", root.address, "--mirror", "*"]).start()
    try:
        publish(root.address, "orders", ["bad order"])
        publish(root.address, "orders.dlq", ["dead at the root"])
        assert len(read_all(child.address, "orders.dlq", 1)) == 1, "the parent's dead-letter topic is mirrored"
        sub = Subscription("orders", "billing", address=child.address, credit=10)
        try:
            got: list = []
            assert wait_for(lambda: got.extend(sub.receive(timeout=0.2)) or got, timeout=20)
            sub.term(got, reason="cannot bill")  # dead-letter it now
            failures = 'reason="read_only_topic"'
            assert wait_for(lambda: child.metric("conveyor_dead_letter_failures_total", failures) >= 1, timeout=10)
            with Admin(child.address) as admin:
                assert admin.describe_group("orders", "billing")["committed_offset"] == 0, "kept, not settled"
        finally:
            sub.close()
        publish(root.address, "orders.dlq", ["dead at the root, later"])
        at_root = read_all(root.address, "orders.dlq", 2)
        assert read_all(child.address, "orders.dlq", 2) == at_root, "the mirror still holds the parent's log"
        with Admin(child.address) as admin:
            assert admin.describe_topic("orders.dlq")["end_offset"] == 2
    finally:
        child.stop()
        root.stop()


def test_groups_reset_refresh_on_a_child_without_that_group_succeeds(tmp_path):
    """The refresh is what was asked for; a group that does not exist on the child yet is no failure."""
    root = BrokerProcess(tmp_path / "root").start()
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", root.address, "--mirror", "*"]).start()
    try:
        publish(root.address, "orders", ["a", "b"])
        assert len(read_all(child.address, "orders", 2)) == 2
        cmd = [sys.executable, "-m", "conveyor", "groups", "reset", "orders", "nobody", "--refresh"]
        result = subprocess.run([*cmd, "--broker", child.address], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        assert read_all(child.address, "orders", 2) == read_all(root.address, "orders", 2), "mirrored again"
    finally:
        child.stop()
        root.stop()


def test_a_childs_segments_are_byte_identical_to_its_parents_for_an_idempotent_producer(tmp_path):
    # The producer's id and sequences are kept in the child's headers: a child's files are a copy,
    # and a resend that reaches it (after a failover) is still recognised by its sequence.
    root = BrokerProcess(tmp_path / "root").start()
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", root.address, "--mirror", "orders"]).start()
    try:
        publish(root.address, "orders", [f"order-{i}" for i in range(500)], batch_size=50)
        assert len(read_all(child.address, "orders", 500)) == 500
    finally:
        child.stop()
        root.stop()
    parent_files = sorted((tmp_path / "root" / "topics" / "orders").glob("*.log"))
    child_files = sorted((tmp_path / "child" / "topics" / "orders").glob("*.log"))
    assert [p.name for p in child_files] == [p.name for p in parent_files]
    assert parent_files[0].read_bytes()[32:40] != b"\xff" * 8, "the parent's batches carry a producer id"
    for parent, copy in zip(parent_files, child_files, strict=True):
        assert copy.read_bytes() == parent.read_bytes(), parent.name


def partition_contents(address: str, topic: str, partitions: int) -> list[list[tuple]]:
    """Each partition's (offset, timestamp ms, key, value), as a consumer's FETCH reads it."""
    with Admin(address) as admin:
        try:
            return [
                [(m.offset, int(m.timestamp * 1000), m.key, m.value) for m in admin.fetch(topic, 0, 5000, partition=p)]
                for p in range(partitions)
            ]
        except ConveyorError:  # not mirrored (or not grown) yet
            return []


def receive_acked(sub: Subscription, got: list, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(got) < count and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.1)
        sub.ack(batch)
        got += batch


def test_a_partitioned_topic_is_mirrored_partition_by_partition_with_identical_offsets(tmp_path):
    """Every partition of a topic made after the mirror started, and partitions added upstream later, reach the
    child with the parent's offsets; a group on the child reads them all, the added ones without a restart."""
    root = BrokerProcess(tmp_path / "root").start()
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", root.address, "--mirror", "keyed"]).start()
    sub = None
    try:
        with Admin(root.address) as admin:
            admin.create_topic("keyed", partitions=4)
        with Producer(root.address, linger_ms=2) as producer:
            for future in [producer.send("keyed", f"{k}-{n}", key=f"k{k}") for n in range(5) for k in range(40)]:
                future.result(30)
        at_root = partition_contents(root.address, "keyed", 4)
        assert all(at_root) and sum(map(len, at_root)) == 200
        wait_for(lambda: partition_contents(child.address, "keyed", 4) == at_root, timeout=30, message="4 copied")
        sub = Subscription("keyed", "g", address=child.address)
        got: list = []
        receive_acked(sub, got, 200)
        with Admin(root.address) as admin:
            admin.add_partitions("keyed", 6)
        with Producer(root.address) as producer:
            for p in range(6):
                producer.send("keyed", f"added-{p}", key=f"p{p}", partition=p).result(30)
        at_root = partition_contents(root.address, "keyed", 6)
        wait_for(lambda: partition_contents(child.address, "keyed", 6) == at_root, timeout=30, message="6 copied")
        receive_acked(sub, got, 206)
        assert sorted((m.partition, m.offset) for m in got) == sorted(
            (p, offset) for p, rows in enumerate(at_root) for offset, *_ in rows
        ), "the child's group got every message of every partition once"
        with Admin(child.address) as admin:
            assert [t["name"] for t in admin.list_topics()] == ["keyed"]
            assert len(admin.describe_topic("keyed")["partitions"]) == 6
            assert sorted(admin.mirror_status()["topics"]) == ["keyed", *(f"keyed#{p}" for p in range(1, 6))]
            refreshed = admin.refresh_topic("keyed")
            assert [(r["topic"], r["until"]) for r in refreshed["partitions"]] == [
                ("keyed" if p == 0 else f"keyed#{p}", len(rows)) for p, rows in enumerate(at_root)
            ]
        wait_for(lambda: partition_contents(child.address, "keyed", 6) == at_root, timeout=30, message="refreshed")
    finally:
        if sub is not None:
            sub.close()
        child.stop()
        root.stop()
