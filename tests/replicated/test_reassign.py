"""``conveyor topics reassign``: a topic's replicas move to other nodes, which then hold every confirmed record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata, PartitionInfo
from conveyor.broker.client.producer import Producer

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import InvalidRequest
from tests.helpers import wait_for
from tests.replicated.replica_logs import records


def partition(cluster: ClusterProcess, topic: str) -> PartitionInfo | None:
    return Metadata(cluster.bootstrap).refresh([topic]).topics.get(topic, {}).get(0)


def publish(cluster: ClusterProcess, topic: str, values: list[bytes]) -> dict[int, bytes]:
    """Send ``values``; offset -> value of each confirmed one (all must be)."""
    with Producer(cluster.bootstrap, delivery_timeout_ms=120_000) as producer:
        futures = [(value, producer.send(topic, value)) for value in values]
        producer.flush(120)
        confirmed = {future.result(120): value for value, future in futures}
    assert len(confirmed) == len(values)
    return confirmed


def reassign_cli(cluster: ClusterProcess, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "conveyor", "topics", "reassign", *args, "--broker", cluster.bootstrap]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_reassign_moves_a_topic_off_its_leader_and_the_new_replica_takes_over_on_failure(
    cluster: ClusterProcess,
) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("moves", replication_factor=2, min_insync_replicas=2)
        wait_for(lambda: partition(cluster, "moves"), message="moves to have a leader")
        admin.create_topic("moves.dlq", replication_factor=2, min_insync_replicas=2)  # placed with its source
    before = wait_for(lambda: partition(cluster, "moves"), message="moves to have a leader")
    assert before.replicas == ("n1", "n2") and before.leader == "n1"
    dead = wait_for(lambda: partition(cluster, "moves.dlq"), message="moves.dlq to have a leader")
    assert dead.replicas == ("n1", "n2")
    confirmed = publish(cluster, "moves", [f"m-{i}".encode() for i in range(1500)])

    done = reassign_cli(cluster, "moves", "--replicas", "n2,n3", "--wait", "120", "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    assert answer["state"] == "done" and answer["dead_letter_topic"] == "moves.dlq"

    after = wait_for(lambda: partition(cluster, "moves"), message="moves' metadata")
    assert after.replicas == ("n2", "n3")
    assert set(after.isr) == {"n2", "n3"}
    assert after.leader == "n2" and after.leader_epoch > before.leader_epoch  # the leader was removed: it moved
    dead = wait_for(lambda: partition(cluster, "moves.dlq"), message="moves.dlq's metadata")
    assert (dead.replicas, dead.leader) == (("n2", "n3"), "n2")  # the dead letters moved with their topic
    confirmed.update(publish(cluster, "moves", [f"after-{i}".encode() for i in range(300)]))

    cluster.node("n2").kill()

    def n3_leads() -> PartitionInfo | None:
        found = partition(cluster, "moves")
        return found if found is not None and found.leader == "n3" else None

    last = wait_for(n3_leads, timeout=60, message="n3 to lead moves")
    assert last.leader_epoch > after.leader_epoch
    with Admin(cluster.bootstrap) as admin:
        wait_for(lambda: admin.describe_topic("moves")["end_offset"] == len(confirmed), timeout=60)

    cluster.kill()
    held = dict(records(cluster.node("n3").data_dir, "moves"))
    assert held == confirmed  # every confirmed record, at the offset it was confirmed at


def test_reassign_is_refused_for_unknown_nodes_and_topics(cluster: ClusterProcess) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("stays", replication_factor=1)
        with pytest.raises(InvalidRequest, match="not registered"):
            admin.reassign_topic("stays", ["n1", "n9"])
        with pytest.raises(InvalidRequest, match="distinct"):
            admin.reassign_topic("stays", ["n1", "n1"])
        with pytest.raises(InvalidRequest, match="min_insync_replicas"):
            admin.reassign_topic("stays", ["n1", "n2"], min_insync_replicas=3)
    missing = reassign_cli(cluster, "nowhere", "--replicas", "n1")
    assert missing.returncode != 0 and "UNKNOWN_TOPIC" in missing.stderr + missing.stdout


def test_a_failed_node_is_replaced_by_reassigning_its_partitions_to_a_new_node(tmp_path: Path) -> None:
    cluster = ClusterProcess(tmp_path / "cluster", nodes=4)
    try:
        cluster.start(nodes=["n1", "n2", "n3"])
        with Admin(cluster.bootstrap) as admin:
            admin.create_topic("kept", replication_factor=3, min_insync_replicas=2)
        first = wait_for(lambda: partition(cluster, "kept"), message="kept to have a leader")
        assert set(first.replicas) == {"n1", "n2", "n3"}
        confirmed = publish(cluster, "kept", [f"k-{i}".encode() for i in range(1000)])

        cluster.node("n3").kill()  # its disk is gone for good
        wait_for(lambda: (p := partition(cluster, "kept")) is not None and "n3" not in p.isr, timeout=60)
        confirmed.update(publish(cluster, "kept", [f"while-down-{i}".encode() for i in range(300)]))

        cluster.start_node("n4")
        done = reassign_cli(cluster, "kept", "--replicas", "n1,n2,n4", "--wait", "120")
        assert done.returncode == 0, done.stdout + done.stderr
        replaced = wait_for(lambda: partition(cluster, "kept"), message="kept's metadata")
        assert replaced.replicas == ("n1", "n2", "n4") and set(replaced.isr) == {"n1", "n2", "n4"}
        confirmed.update(publish(cluster, "kept", [f"after-{i}".encode() for i in range(300)]))
        with Admin(cluster.bootstrap) as admin:
            wait_for(lambda: admin.describe_topic("kept")["end_offset"] == len(confirmed), timeout=60)
    finally:
        cluster.kill()
    assert dict(records(cluster.node("n4").data_dir, "kept")) == confirmed  # the new node holds it all
