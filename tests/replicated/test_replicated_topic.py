"""A replicated topic end to end: three broker processes, one etcd, the public clients."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import TopicExists
from tests.helpers import wait_for


def segment_digests(cluster: ClusterProcess, node: str, topic: str) -> dict[str, str]:
    folder = cluster.node(node).data_dir / "topics" / topic
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.log"))}


def test_a_topic_is_replicated_byte_for_byte_and_consumed_through_the_bootstrap_list(cluster: ClusterProcess) -> None:
    with Producer(cluster.bootstrap) as producer:
        futures = [producer.send("orders", f"order-{i}".encode(), key=str(i % 7)) for i in range(5000)]
        producer.flush(60)
        offsets = [future.result(60) for future in futures]
    assert sorted(offsets) == list(range(5000))  # every one confirmed, no offset twice

    with Admin(cluster.bootstrap) as admin:
        described = admin.describe_topic("orders")
    assert described["end_offset"] == 5000

    view = Metadata(cluster.bootstrap).refresh(["orders"])
    partition = view.topics["orders"][0]
    assert sorted(partition.replicas) == ["n1", "n2", "n3"]
    assert partition.leader_epoch >= 1

    # Followers hold the same batches at the same offsets: the segments are the same bytes.
    wait_for(
        lambda: len({tuple(segment_digests(cluster, node, "orders").items()) for node in cluster.node_ids}) == 1,
        message="the three replicas to hold the same segments",
    )

    seen: set[int] = set()
    with Subscription("orders", "billing", address=cluster.bootstrap) as subscription:

        def drained() -> bool:
            messages = subscription.receive(timeout=1.0)
            seen.update(message.offset for message in messages)
            subscription.ack(messages)
            return len(seen) == 5000

        wait_for(drained, message="the group to receive every message")


def test_topics_create_goes_through_the_controller(cluster: ClusterProcess) -> None:
    with Admin(cluster.bootstrap) as admin:
        created = admin.create_topic("payments", replication_factor=2, min_insync_replicas=2, retention_ms=86_400_000)
        assert created["replication_factor"] == 2 and created["min_insync_replicas"] == 2
        try:
            admin.create_topic("payments")
        except TopicExists:
            pass
        else:
            raise AssertionError("a second create of the same topic must say TOPIC_EXISTS")
    view = wait_for(lambda: Metadata(cluster.bootstrap).refresh(["payments"]).topics.get("payments"))
    assert len(view[0].replicas) == 2 and view[0].leader in view[0].replicas
    with Producer(cluster.bootstrap) as producer:
        assert producer.send("payments", b"first").result(60) == 0


def test_the_async_producer_follows_the_leader_through_a_kill(cluster: ClusterProcess) -> None:
    """Auto-created topic (its first batches refused until it has a leader), then kill -9 of that leader.

    The killed leader is suspect: the batches wait for METADATA to name the next one instead of going
    back to the dead one and waiting out ``request_timeout_ms`` (30 s here) first.
    """
    failover: list[float] = []

    async def run() -> list[int]:
        offsets: list[int] = []
        killed = 0.0
        async with AsyncProducer(cluster.bootstrap, linger_ms=2, request_timeout_ms=30_000) as producer:
            for i in range(3000):
                offsets.append(await (await producer.send("async-orders", f"a{i}".encode())) if i % 500 == 0 else -1)
                if i == 2000:
                    failover.append(time.monotonic() - killed)  # the first confirm awaited after the kill
                if i == 1500:
                    leader = Metadata(cluster.bootstrap).refresh(["async-orders"]).topics["async-orders"][0].leader
                    cluster.node(str(leader)).kill()
                    killed = time.monotonic()
            futures = [await producer.send("async-orders", f"b{i}".encode()) for i in range(3000)]
            offsets.extend([await future for future in futures])
        return [offset for offset in offsets if offset >= 0]

    offsets = asyncio.run(asyncio.wait_for(run(), 180))
    assert len(offsets) == len(set(offsets)) == 3006  # six awaited one by one, 3,000 in a burst: each at its own offset
    assert failover[0] < 15, f"{failover[0]:.1f} s from the kill to a confirm: the dead leader's request timeout"


def test_a_nodes_replication_defaults_apply_to_the_topics_it_creates(tmp_path: Path) -> None:
    extra = ["--default-replication-factor", "2", "--min-insync-replicas", "1"]
    with ClusterProcess(tmp_path / "cluster", nodes=3, extra=extra) as cluster:
        with Producer(cluster.bootstrap) as producer:
            producer.send("defaults", b"auto-created").result(60)
        with Admin(cluster.bootstrap) as admin:
            created = admin.create_topic("explicit", replication_factor=3)
        assert (created["replication_factor"], created["min_insync_replicas"]) == (3, 1)
        view = Metadata(cluster.bootstrap).refresh(["defaults"])
        assert len(view.topics["defaults"][0].replicas) == 2
