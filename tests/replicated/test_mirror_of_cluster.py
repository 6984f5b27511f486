"""A single broker mirrors a replicated topic of a three-node cluster, and follows its leader through a kill -9."""

from __future__ import annotations

from pathlib import Path

from conveyor.broker.client.admin import Admin

from conveyor.cluster_process import ClusterProcess
from conveyor.testing import BrokerProcess
from tests.helpers import publish, wait_for
from tests.mirror.test_hierarchy import health
from tests.replicated.test_failover import leader_of

FIRST = 300
MORE = 200


def records(address: str, topic: str, count: int) -> list[tuple[int, object]]:
    """(offset, value) of the first ``count`` messages of ``topic`` at ``address`` (fewer if it has fewer)."""
    out: list[tuple[int, object]] = []
    with Admin(address) as admin:
        while len(out) < count:
            batch = admin.fetch("orders", len(out), count - len(out), wait_ms=0)
            if not batch:
                break
            out += [(m.offset, m.value) for m in batch]
    return out


def copied(child: BrokerProcess, expected: list[tuple[int, object]]) -> bool:
    try:
        return records(child.address, "orders", len(expected) + 1) == expected
    except Exception:  # the child has not adopted the topic yet
        return False


def fetching_from(child: BrokerProcess) -> str | None:
    return health(child)["checks"]["upstream"].get("fetching_from")


def test_a_mirror_of_a_cluster_follows_the_leader_through_a_kill_9(cluster: ClusterProcess, tmp_path: Path) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
    leader, _epoch = leader_of(cluster, "orders")
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", cluster.bootstrap, "--mirror", "orders*"]).start()
    try:
        offsets = publish(cluster.bootstrap, "orders", [f"order-{i}" for i in range(FIRST)], timeout=60)
        assert offsets == list(range(FIRST))
        expected = [(i, f"order-{i}") for i in range(FIRST)]
        wait_for(lambda: copied(child, expected), timeout=60, message="the child to copy the first records")
        wait_for(lambda: fetching_from(child) == cluster.address(leader), timeout=60, message="the link on the leader")

        cluster.node(leader).kill()
        more = publish(cluster.bootstrap, "orders", [f"order-{i}" for i in range(FIRST, FIRST + MORE)], timeout=120)
        assert more == list(range(FIRST, FIRST + MORE))
        new_leader, _ = leader_of(cluster, "orders", other_than=leader)
        expected = [(i, f"order-{i}") for i in range(FIRST + MORE)]
        assert records(cluster.address(new_leader), "orders", FIRST + MORE + 1) == expected
        wait_for(lambda: copied(child, expected), timeout=90, message="the child to copy every record after the kill")
        wait_for(lambda: fetching_from(child) == cluster.address(new_leader), timeout=60, message="the new leader")
        wait_for(lambda: health(child)["checks"]["upstream"]["status"] == "HEALTHY", timeout=60, message="HEALTHY")
    finally:
        child.stop()


def test_a_mirror_of_a_cluster_copies_every_partition(cluster: ClusterProcess, tmp_path: Path) -> None:
    """The link node describes only the partitions it leads: the count comes from ``partition_count``, and
    every partition is copied (each node holds a replica of each: replication factor 3 on three nodes)."""
    from conveyor.broker.client.producer import Producer

    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", partitions=4, replication_factor=3)
    with Producer(cluster.bootstrap) as producer:
        futures = [producer.send("orders", f"v{i}", key=f"k{i}") for i in range(400)]
        producer.flush(60)
        assert {future.result(60).partition for future in futures} == {0, 1, 2, 3}

    def content(address: str) -> list[list[object]]:
        with Admin(address) as admin:
            return [[m.value for m in admin.fetch("orders", 0, 1000, partition=k)] for k in range(4)]

    source = content(cluster.bootstrap)
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", cluster.bootstrap, "--mirror", "orders*"]).start()
    try:

        def same() -> bool:
            try:
                return content(child.address) == source
            except Exception:  # not adopted yet
                return False

        wait_for(same, timeout=60, message="the child to copy every partition")
    finally:
        child.stop()
