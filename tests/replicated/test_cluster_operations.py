"""Operating a cluster: ``conveyor cluster status``, the cluster metrics, and the health probes.

Three real brokers on a real etcd: a follower is killed, and the leader's
metrics, ``/healthz`` and ``/readyz`` say what it lost, while ``/livez``
stays 200 everywhere (another node's death is never a reason to restart).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer

from conveyor.cluster_process import ClusterProcess
from conveyor.testing import BrokerProcess
from tests.helpers import free_port, http_get, sample_value, scrape, wait_for


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=120, check=False
    )


def status_json(bootstrap: str) -> dict[str, Any]:
    done = cli("cluster", "status", "--broker", bootstrap, "--format", "json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def probe(broker: BrokerProcess, path: str) -> tuple[int, dict[str, Any]]:
    status, body = http_get(broker.metrics_url.rsplit("/", 1)[0] + path)
    return status, json.loads(body)


def metric(broker: BrokerProcess, name: str, **labels: str) -> float | None:
    return sample_value(scrape(broker.metrics_url), name, **labels)


def leader_of(cluster: ClusterProcess, topic: str) -> str:
    def known() -> str | None:
        partition = Metadata(cluster.bootstrap).refresh([topic]).topics.get(topic, {}).get(0)
        return partition.leader if partition is not None and len(partition.isr) == 3 else None

    return str(wait_for(known, message=f"{topic} to have a leader and three in-sync replicas"))


def publish(cluster: ClusterProcess, topic: str, count: int) -> None:
    with Producer(cluster.bootstrap) as producer:
        futures = [producer.send(topic, i) for i in range(count)]
        producer.flush(60)
        for future in futures:
            future.result(60)


def test_cluster_status_shows_nodes_leaders_isr_hw_and_follower_lag(cluster: ClusterProcess) -> None:
    # Given a replicated topic with 100 confirmed messages
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
    leader = leader_of(cluster, "orders")
    publish(cluster, "orders", 100)

    # When `conveyor cluster status --format json` asks the cluster
    def settled() -> dict[str, Any] | None:
        status = status_json(cluster.bootstrap)
        partition = status["partitions"][0]
        caught_up = all(f["lag_messages"] == 0 for f in partition["followers"])
        return status if partition["high_watermark"] == 100 and caught_up else None

    status = wait_for(settled, message="HW 100 and both followers caught up")
    # Then it lists the three nodes, alive, and the controller
    assert status["mode"] == "cluster"
    assert [(n["id"], n["alive"]) for n in status["nodes"]] == [("n1", True), ("n2", True), ("n3", True)]
    assert status["controller"] in cluster.node_ids
    assert [n["id"] for n in status["nodes"] if n["controller"]] == [status["controller"]]
    # And the partition: leader, epoch, replicas, in-sync set, HW and each follower's lag
    (partition,) = status["partitions"]
    assert partition["topic"] == "orders" and partition["partition"] == 0
    assert partition["leader"] == leader and partition["epoch"] >= 1
    assert sorted(partition["replicas"]) == sorted(partition["isr"]) == ["n1", "n2", "n3"]
    assert partition["min_insync_replicas"] == 2 and partition["end_offset"] == 100
    assert partition["under_replicated"] is False and partition["below_min_insync"] is False
    followers = {f["node"]: f for f in partition["followers"]}
    assert sorted(followers) == sorted(set(cluster.node_ids) - {leader})
    assert all(f["in_isr"] and f["lag_seconds"] == 0 and f["fetch_offset"] == 100 for f in followers.values())

    # And the table says the same, one row per partition
    table = cli("cluster", "status", "--broker", cluster.bootstrap)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("cluster: 3 of 3 nodes alive, controller ")
    row = next(line for line in lines if line.startswith("orders "))
    epoch = str(partition["epoch"])
    assert row.split()[:10] == ["orders", "0", leader, epoch, "n1,n2,n3", "n1,n2,n3", "2", "100", "100", "ok"]


def test_a_dead_follower_shows_in_metrics_health_and_status_and_livez_stays_up(cluster: ClusterProcess) -> None:
    # Given two topics on three nodes: "orders" needs 2 in-sync replicas, "strict" all 3
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
        admin.create_topic("strict", replication_factor=3, min_insync_replicas=3)
    leaders = {topic: leader_of(cluster, topic) for topic in ("orders", "strict")}
    publish(cluster, "orders", 50)
    victim = next(node for node in cluster.node_ids if node not in leaders.values())  # a follower of both
    orders, strict = cluster.node(leaders["orders"]), cluster.node(leaders["strict"])
    labels = {"topic": "orders", "partition": "0"}
    assert metric(orders, "conveyor_partition_isr_size", **labels) == 3
    assert metric(orders, "conveyor_partition_under_replicated", **labels) == 0
    assert metric(orders, "conveyor_partition_leader", **labels) == 1
    assert metric(orders, "conveyor_cluster_node_registered") == 1
    assert sum(metric(cluster.node(n), "conveyor_cluster_controller") or 0 for n in cluster.node_ids) == 1
    assert probe(orders, "/readyz")[0] == 200

    # When the follower of both is killed
    cluster.node(victim).kill()

    # Then the leader of "orders" counts it under-replicated, with two in-sync replicas
    wait_for(
        lambda: metric(orders, "conveyor_partition_under_replicated", **labels) == 1,
        message="orders under-replicated on its leader",
    )
    assert metric(orders, "conveyor_partition_isr_size", **labels) == 2
    assert metric(orders, "conveyor_partition_below_min_insync", **labels) == 0
    follower = {**labels, "follower": victim}
    publish(cluster, "orders", 10)  # the dead follower falls behind in messages
    wait_for(lambda: (metric(orders, "conveyor_replica_lag_messages", **follower) or 0) >= 10, message="lag")
    wait_for(lambda: (metric(orders, "conveyor_replica_lag_seconds", **follower) or 0) > 0, message="lag seconds")
    # And its /healthz and /readyz say DEGRADED (still 200: it takes publishes)
    if leaders["orders"] != leaders["strict"]:
        code, body = wait_for(lambda: _with_status(orders, "/healthz", "DEGRADED"), message="orders leader DEGRADED")
        assert code == 200 and body["checks"]["replication"]["under_replicated"]["orders/0"]["isr"] == sorted(
            set(cluster.node_ids) - {victim}
        )
        code, body = probe(orders, "/readyz")
        assert code == 200 and body == {"ready": True, "status": "DEGRADED"}
    else:  # one node leads both: the worse, UNHEALTHY, wins; both are listed (the rule: test_cluster_health_rules)
        code, body = wait_for(lambda: _with_status(orders, "/healthz", "UNHEALTHY"), message="leader UNHEALTHY")
        assert sorted(body["checks"]["replication"]["under_replicated"]) == ["orders/0", "strict/0"]
    # And the leader of "strict" (below its min_insync 3) is UNHEALTHY: 503 on /healthz and /readyz
    strict_labels = {"topic": "strict", "partition": "0"}
    wait_for(
        lambda: metric(strict, "conveyor_partition_below_min_insync", **strict_labels) == 1,
        message="strict below min_insync on its leader",
    )
    code, body = wait_for(lambda: _with_status(strict, "/healthz", "UNHEALTHY"), message="strict leader UNHEALTHY")
    assert code == 503 and body["checks"]["replication"]["below_min_insync"] == ["strict/0"]
    code, body = probe(strict, "/readyz")
    assert code == 503 and body["ready"] is False and "replication" in body["reason"]
    # And /livez stays 200 on every node still running: a dead peer is no reason to restart
    for node in set(cluster.node_ids) - {victim}:
        code, body = probe(cluster.node(node), "/livez")
        assert code == 200 and body["live"] is True, (node, body)
    # And `cluster status` shows the node dead and the partitions under-replicated
    status = wait_for(
        lambda: (s := status_json(cluster.bootstrap)) and not _alive(s, victim) and s, message="status: node dead"
    )
    by_topic = {p["topic"]: p for p in status["partitions"]}
    assert by_topic["orders"]["under_replicated"] and victim not in by_topic["orders"]["isr"]
    assert by_topic["strict"]["below_min_insync"] is True
    lag = {f["node"]: f for f in by_topic["orders"]["followers"]}[victim]
    assert lag["in_isr"] is False and lag["lag_messages"] >= 10


def test_a_new_leader_is_counted_on_every_node_and_shown_by_status(cluster: ClusterProcess) -> None:
    # Given a replicated topic, its leader and epoch, and no leader change counted yet
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
    old = leader_of(cluster, "orders")
    labels = {"topic": "orders", "partition": "0"}
    survivors = [node for node in cluster.node_ids if node != old]
    for node in survivors:
        changes = wait_for(
            lambda node=node: _sample(cluster.node(node), "conveyor_partition_leader_changes_total", **labels),
            message=f"the leader-change counter on {node}",
        )
        assert changes == (0.0,)
    epoch = status_json(cluster.bootstrap)["partitions"][0]["epoch"]

    # When the leader is killed
    cluster.node(old).kill()

    # Then each survivor counts the leader change, and one of them leads
    for node in survivors:
        wait_for(
            lambda node=node: (
                (metric(cluster.node(node), "conveyor_partition_leader_changes_total", **labels) or 0) >= 1
            ),
            message=f"{node} to count the new leader",
        )
    wait_for(
        lambda: sum(metric(cluster.node(node), "conveyor_partition_leader", **labels) or 0 for node in survivors) == 1,
        message="one survivor leading orders",
    )
    # And `cluster status` names the new leader at a higher epoch, the old one dead
    status = wait_for(
        lambda: (s := status_json(cluster.bootstrap))["partitions"][0]["leader"] in survivors and s,
        message="status naming a new leader",
    )
    (partition,) = status["partitions"]
    assert partition["epoch"] > epoch and partition["high_watermark"] is not None
    assert {n["id"]: n["alive"] for n in status["nodes"]}[old] is False


def _sample(broker: BrokerProcess, name: str, **labels: str) -> tuple[float] | None:
    value = metric(broker, name, **labels)
    return None if value is None else (value,)


def _with_status(broker: BrokerProcess, path: str, wanted: str) -> tuple[int, dict[str, Any]] | None:
    code, body = probe(broker, path)
    return (code, body) if body.get("status") == wanted else None


def _alive(status: dict[str, Any], node: str) -> bool:
    return any(n["id"] == node and n["alive"] for n in status["nodes"])


def test_cluster_status_on_a_single_node_says_so(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "single") as broker:
        publish_single(broker.address)
        table = cli("cluster", "status", "--broker", broker.address)
        assert table.returncode == 0, table.stderr
        assert table.stdout.startswith("single node (no cluster): local at " + broker.address)
        status = status_json(broker.address)
    assert status["mode"] == "single"
    assert status["nodes"] == [{"id": "local", "address": broker.address, "alive": True, "controller": True}]
    (partition,) = status["partitions"]
    assert partition["leader"] == "local" and partition["replicas"] == partition["isr"] == ["local"]
    assert partition["high_watermark"] == partition["end_offset"] == 3 and partition["followers"] == []


def test_a_single_broker_exports_no_cluster_series(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "single") as broker:
        publish_single(broker.address)
        text = scrape(broker.metrics_url)
        code, body = probe(broker, "/healthz")
    assert "conveyor_partition_" not in text and "conveyor_cluster_" not in text and "conveyor_replica_" not in text
    assert code == 200 and "replication" not in body["checks"] and "cluster" not in body["checks"]


def publish_single(address: str) -> None:
    with Producer(address) as producer:
        for i in range(3):
            producer.send("orders", i)
        producer.flush(30)


def test_a_node_is_not_ready_until_registered_in_etcd_and_stays_live(tmp_path: Path) -> None:
    # Given a cluster node whose etcd is not there (a port where nothing listens)
    etcd, address = f"etcd://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    node = BrokerProcess(tmp_path / "n1", extra=["--cluster", etcd, "--node-id", "n1", "--advertise", address])
    node._bind = address  # as ClusterProcess does: the address it advertises
    with node as broker:
        # Then it serves its probes, but is not ready: it is not registered
        code, body = probe(broker, "/readyz")
        assert code == 503 and body["ready"] is False and body["reason"] == "not registered in etcd"
        code, body = probe(broker, "/healthz")
        assert body["checks"]["cluster"] == {"status": "DEGRADED", "node": "n1", "error": "not registered in etcd"}
        assert metric(broker, "conveyor_cluster_node_registered") == 0
        # And /livez is 200: waiting for etcd is no reason to restart
        code, body = probe(broker, "/livez")
        assert code == 200 and body["live"] is True


def test_a_registered_node_is_ready(cluster: ClusterProcess) -> None:
    for node in cluster.node_ids:
        _code, body = wait_for(lambda node=node: _ready(cluster.node(node)), message=f"{node} ready")
        assert body["ready"] is True and body["status"] == "HEALTHY"
        assert probe(cluster.node(node), "/healthz")[1]["checks"]["cluster"]["status"] == "HEALTHY"


def _ready(broker: BrokerProcess) -> tuple[int, dict[str, Any]] | None:
    code, body = probe(broker, "/readyz")
    return (code, body) if code == 200 else None
