"""A single-node data directory joins a cluster: its topics are registered with RF 1, then reassigned to three."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata, PartitionInfo
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command

from conveyor.broker_process import BrokerProcess
from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.replica_logs import records
from tests.replication.cluster_helpers import batch, request

TOPIC = "legacy"
RAW = batch(b"raw-1", b"raw-2")


def partition(cluster: ClusterProcess, nodes: list[str]) -> PartitionInfo | None:
    bootstrap = ",".join(cluster.address(node) for node in nodes)
    return Metadata(bootstrap).refresh([TOPIC]).topics.get(TOPIC, {}).get(0)


def segments(data_dir: Path) -> dict[str, str]:
    folder = data_dir / "topics" / TOPIC
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.log"))}


def publish(address: str, values: list[bytes]) -> dict[int, bytes]:
    with Producer(address, delivery_timeout_ms=120_000) as producer:  # idempotent: producer id and sequences
        futures = [(value, producer.send(TOPIC, value)) for value in values]
        producer.flush(120)
        confirmed = {future.result(120): value for value, future in futures}
    assert len(confirmed) == len(values)
    return confirmed


def consume(address: str, *, at_least: int) -> int:
    """Receive and ack at least ``at_least`` messages as group ``billing`` from offset 0; how many were acked."""
    seen: list[int] = []
    with Subscription(TOPIC, "billing", address=address) as subscription:

        def enough() -> bool:
            messages = subscription.receive(timeout=1.0)
            seen.extend(message.offset for message in messages)
            subscription.ack(messages)
            return len(seen) >= at_least

        wait_for(enough, timeout=60, message=f"{at_least} deliveries")
    assert seen == list(range(len(seen)))
    return len(seen)


def test_a_single_node_directory_joins_a_cluster_and_is_reassigned_to_three_nodes(tmp_path: Path) -> None:
    cluster = ClusterProcess(tmp_path / "cluster", nodes=3)
    single = BrokerProcess(cluster.directory / "n1").start()  # no --cluster: today's single node
    try:
        confirmed = publish(single.address, [f"old-{i}".encode() for i in range(700)])
        first = request(single.address, commands.publish(TOPIC, RAW, pid=4242, seq=0, rid=1))
        assert first.command is Command.PUBLISHED and first.get("base_offset") == 700
        confirmed.update({700: b"raw-1", 701: b"raw-2"})
        acked = consume(single.address, at_least=300)  # a group's committed offset, in groups.json
        with Admin(single.address) as admin:
            wait_for(lambda: admin.describe_group(TOPIC, "billing")["committed_offset"] == acked)
    finally:
        single.stop()
    before = segments(single.data_dir)

    try:
        cluster.start(nodes=["n1"])
        joined = wait_for(lambda: partition(cluster, ["n1"]), message="n1 to register its topic")
        assert (joined.leader, joined.replicas, joined.isr, joined.leader_epoch) == ("n1", ("n1",), ("n1",), 1)
        with Admin(cluster.address("n1")) as admin:
            described = admin.describe_topic(TOPIC)
        assert (described["start_offset"], described["end_offset"]) == (0, 702)  # data and offsets kept
        assert segments(cluster.node("n1").data_dir) == before  # the old batches are not rewritten

        cluster.start_node("n2")
        cluster.start_node("n3")
        command = [sys.executable, "-m", "conveyor", "topics", "reassign", TOPIC, "--replicas", "n1,n2,n3"]
        command += ["--min-insync-replicas", "2", "--wait", "120", "--broker", cluster.bootstrap]
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr

        # The followers copied the leader's batches from offset 0: the same bytes, the same offsets.
        wait_for(
            lambda: len({tuple(segments(cluster.node(node).data_dir).items()) for node in cluster.node_ids}) == 1,
            timeout=60,
            message="the three replicas to hold the same segments",
        )
        confirmed.update(publish(cluster.bootstrap, [f"new-{i}".encode() for i in range(300)]))
        moved = wait_for(lambda: partition(cluster, cluster.node_ids), message="metadata")
        assert set(moved.isr) == {"n1", "n2", "n3"} and moved.leader == "n1"

        cluster.node("n1").kill()

        def new_leader() -> PartitionInfo | None:
            found = partition(cluster, ["n2", "n3"])
            return found if found is not None and found.leader in ("n2", "n3") else None

        after = wait_for(new_leader, timeout=60, message="n2 or n3 to lead")
        assert after.leader_epoch > moved.leader_epoch
        leader = after.leader
        assert leader is not None
        # The single node's idempotent producer resends its batch: the new leader knows its id and sequence.
        again = request(cluster.address(leader), commands.publish(TOPIC, RAW, pid=4242, seq=0, rid=2))
        assert again.command is Command.PUBLISHED
        assert (again.get("base_offset"), again.get("duplicate")) == (700, True)
        confirmed.update(publish(cluster.bootstrap, [f"later-{i}".encode() for i in range(100)]))
        # The group goes on from where it was in single-node mode: its state moved with the topic.
        with Subscription(TOPIC, "billing", address=cluster.bootstrap) as subscription:
            first = wait_for(lambda: subscription.receive(timeout=1.0), timeout=60, message="a delivery")
        assert first[0].offset == acked
    finally:
        cluster.kill()
    assert dict(records(cluster.node(leader).data_dir, TOPIC)) == confirmed
