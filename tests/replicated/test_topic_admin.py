"""Deleting and altering a topic in a cluster: three real brokers on a real etcd, one cluster for the module.

``topics delete`` goes to the controller, which removes the topic's records;
each replica then drops its partition, its group log and its files, so a topic
made again under the same name starts at offset 0 everywhere with none of the
old data. ``topics alter`` writes the topic's config record; every replica
applies it, and a node that was down when it changed applies it when it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import ConfigError, InvalidName, UnknownGroup, UnknownTopic
from conveyor.etcd_process import free_port
from conveyor.testing import BrokerProcess
from tests.helpers import stays_false, wait_for
from tests.mirror.test_hierarchy import health


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    nodes = ClusterProcess(tmp_path_factory.mktemp("topic-admin") / "cluster", nodes=3).start()
    try:
        yield nodes
    finally:
        nodes.kill()


def in_sync(cluster: ClusterProcess, topic: str) -> str:
    """Until ``topic`` has a leader and three in-sync replicas; its leader."""

    def known() -> str | None:
        partition = Metadata(cluster.bootstrap).refresh([topic]).topics.get(topic, {}).get(0)
        return partition.leader if partition is not None and len(partition.isr) == 3 else None

    return str(wait_for(known, message=f"{topic} to have a leader and three in-sync replicas"))


def publish(cluster: ClusterProcess, topic: str, values: list[bytes]) -> list[int]:
    with Producer(cluster.bootstrap) as producer:
        futures = [producer.send(topic, value) for value in values]
        producer.flush(60)
        return [future.result(60) for future in futures]


def topic_dir(cluster: ClusterProcess, node: str, topic: str) -> Path:
    return cluster.node(node).data_dir / "topics" / topic


def segments(cluster: ClusterProcess, node: str, topic: str) -> bytes:
    """Every byte of the replica's segment files (read while it runs: a payload is there once written)."""
    directory = topic_dir(cluster, node, topic)
    try:
        return b"".join(path.read_bytes() for path in sorted(directory.glob("*.log")))
    except FileNotFoundError:  # the directory is being replaced
        return b""


def end_offsets(cluster: ClusterProcess, topic: str) -> dict[str, int]:
    """Each node's end offset of ``topic``, as it describes its own partitions."""
    ends: dict[str, int] = {}
    for node in cluster.node_ids:
        with Admin(cluster.address(node)) as admin:
            for row in admin.describe_partitions(topic)["partitions"]:
                ends[node] = row["end_offset"]
    return ends


def settings_on_disk(cluster: ClusterProcess, node: str, topic: str) -> dict[str, Any]:
    try:
        return dict(json.loads((topic_dir(cluster, node, topic) / "topic.json").read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def test_a_deleted_topic_made_again_starts_at_offset_0_on_every_replica(cluster: ClusterProcess) -> None:
    # Given a topic with three replicas, 30 confirmed messages on each, and its group log
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("reborn", replication_factor=3)
    in_sync(cluster, "reborn")
    publish(cluster, "reborn", [b"old-%03d" % i for i in range(30)])
    with Admin(cluster.bootstrap) as admin:
        assert admin.reset_offsets("reborn", "readers", 10)["committed_offset"] == 10
    wait_for(lambda: end_offsets(cluster, "reborn") == dict.fromkeys(cluster.node_ids, 30), message="30 on each")
    assert all(topic_dir(cluster, node, "__groups.reborn").is_dir() for node in cluster.node_ids)

    # When it is deleted
    with Admin(cluster.bootstrap) as admin:
        assert admin.delete_topic("reborn") == {"deleted": "reborn"}

    # Then no node holds it, its group log or its partition any more, and METADATA does not name it
    def gone() -> bool:
        dirs = [topic_dir(cluster, n, t) for n in cluster.node_ids for t in ("reborn", "__groups.reborn")]
        return not any(path.exists() for path in dirs) and "reborn" not in Metadata(cluster.bootstrap).refresh().topics

    wait_for(gone, message="the topic gone from every node and from METADATA")
    with Admin(cluster.bootstrap) as admin, pytest.raises(UnknownTopic):
        admin.delete_topic("reborn")

    # When a producer publishes to the name again (auto-create is on, as on a single node)
    offsets = publish(cluster, "reborn", [b"new-%03d" % i for i in range(5)])

    # Then the topic is made again from offset 0, and every replica holds the new records only
    assert offsets == [0, 1, 2, 3, 4]
    in_sync(cluster, "reborn")
    wait_for(lambda: end_offsets(cluster, "reborn") == dict.fromkeys(cluster.node_ids, 5), message="5 on each")
    for node in cluster.node_ids:
        data = wait_for(lambda n=node: (found := segments(cluster, n, "reborn")).count(b"new-") == 5 and found)
        assert b"old-" not in data, f"{node} kept records of the deleted topic"
    with Admin(cluster.bootstrap) as admin, pytest.raises(UnknownGroup):  # its groups went with it
        admin.describe_group("reborn", "readers")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_an_alter_reaches_every_replica_and_a_node_that_was_down(cluster: ClusterProcess) -> None:
    # Given a topic with three replicas
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("tuned", replication_factor=3, retention_ms="7d")
    leader = in_sync(cluster, "tuned")

    # When its retention is altered with the command line (sent to its leader)
    done = cli(
        "topics", "alter", "tuned", "--set", "retention_ms=1h", "--broker", cluster.bootstrap, "--format", "json"
    )

    # Then the answer shows it, and every replica's topic.json holds it
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["config"]["retention_ms"] == 3_600_000
    for node in cluster.node_ids:
        wait_for(lambda n=node: settings_on_disk(cluster, n, "tuned").get("retention_ms") == 3_600_000)

    # And a bad value, a setting fixed at creation, and an unknown topic get a single node's errors
    with Admin(cluster.bootstrap) as admin:
        with pytest.raises(ConfigError):
            admin.alter_topic("tuned", retention_ms="soon")
        with pytest.raises(ConfigError, match="cannot be changed after creation"):
            admin.alter_topic("tuned", storage="memory")
        with pytest.raises(UnknownTopic):
            admin.alter_topic("no-such-topic", retention_ms="1h")

    # When a follower is down while a limit is altered, then starts again
    follower = next(node for node in cluster.node_ids if node != leader)
    cluster.node(follower).stop()
    with Admin(cluster.bootstrap) as admin:
        assert admin.alter_topic("tuned", retention_bytes="1MiB")["config"]["retention_bytes"] == 1 << 20
    cluster.start_node(follower)

    # Then it applies what changed while it was down, and keeps what changed before
    wanted = {"retention_ms": 3_600_000, "retention_bytes": 1 << 20}

    def applied(node: str) -> bool:
        on_disk = settings_on_disk(cluster, node, "tuned")
        return all(on_disk.get(name) == value for name, value in wanted.items())

    for node in cluster.node_ids:
        wait_for(lambda n=node: applied(n), message=f"{node}'s topic.json to hold {wanted}")


def test_a_node_away_while_a_topic_is_deleted_and_made_again_drops_its_old_copy(cluster: ClusterProcess) -> None:
    # Given two topics with three replicas and data on each
    with Admin(cluster.bootstrap) as admin:
        for topic in ("gone", "again"):
            admin.create_topic(topic, replication_factor=3)
    for topic in ("gone", "again"):
        in_sync(cluster, topic)
        publish(cluster, topic, [b"old-%03d" % i for i in range(20)])
    wait_for(lambda: end_offsets(cluster, "again") == dict.fromkeys(cluster.node_ids, 20), message="20 on each")
    away = cluster.node_ids[-1]

    # When a node is down while both are deleted and one is made again on the other two with new data
    cluster.node(away).stop()
    with Admin(cluster.bootstrap) as admin:
        admin.delete_topic("gone")
        admin.delete_topic("again")
        admin.create_topic("again", replication_factor=2)
    publish(cluster, "again", [b"new-%03d" % i for i in range(3)])
    cluster.start_node(away)

    # Then it drops its copy of the old "again", which etcd holds under another topic id
    wait_for(lambda: not segments(cluster, away, "again"), message=f"{away} to drop the earlier topic's records")

    # And it does not register its copy of the deleted topic (nor delete data because a record is missing),
    # until `topics delete` sent to it removes the files
    stays_false(lambda: "gone" in Metadata(cluster.bootstrap).refresh().topics, 1.0, message="gone registered")
    assert topic_dir(cluster, away, "gone").is_dir()
    with Admin(cluster.address(away)) as admin:
        assert admin.fetch("gone", 0, 10) == []  # not served
        assert admin.delete_topic("gone") == {"deleted": "gone"}
    assert not topic_dir(cluster, away, "gone").exists()
    assert "gone" not in Metadata(cluster.bootstrap).refresh().topics

    # And once it is a replica of the new one again, it holds the new records only, at offsets 0-2
    with Admin(cluster.bootstrap) as admin:
        admin.reassign_topic("again", cluster.node_ids)
    in_sync(cluster, "again")
    wait_for(lambda: end_offsets(cluster, "again").get(away) == 3, message=f"{away} at offset 3")
    data = wait_for(lambda: (found := segments(cluster, away, "again")).count(b"new-") == 3 and found)
    assert b"old-" not in data


def test_a_mirror_of_the_cluster_stops_mirroring_a_topic_deleted_upstream(
    cluster: ClusterProcess, tmp_path: Path
) -> None:
    # Given a child broker mirroring two of the cluster's topics
    with Admin(cluster.bootstrap) as admin:
        for topic in ("mirrored.kept", "mirrored.gone"):
            admin.create_topic(topic, replication_factor=3)
    for topic in ("mirrored.kept", "mirrored.gone"):
        in_sync(cluster, topic)
        publish(cluster, topic, [b"m-%d" % i for i in range(5)])
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", cluster.bootstrap, "--mirror", "mirrored.*"]).start()
    try:
        mirrored = lambda: set(health(child)["checks"]["upstream"]["topics"])  # noqa: E731
        wait_for(lambda: mirrored() == {"mirrored.kept", "mirrored.gone"}, message="both topics mirrored")

        # When one is deleted from the cluster
        with Admin(cluster.bootstrap) as admin:
            admin.delete_topic("mirrored.gone")

        # Then the child stops mirroring it, as it does when its one parent deletes a topic, and keeps the other
        wait_for(lambda: mirrored() == {"mirrored.kept"}, message="the deleted topic no longer mirrored")
    finally:
        child.stop()


def test_groups_list_with_the_bootstrap_list_shows_the_groups_of_topics_every_node_leads(
    cluster: ClusterProcess,
) -> None:
    """A topic's groups live on its leader: a list asked of one node showed only what that node led."""
    topics = [f"glist-{n}" for n in range(3)]
    with Admin(cluster.bootstrap) as admin:
        for topic in topics:
            admin.create_topic(topic, replication_factor=3)
        leaders = {topic: in_sync(cluster, topic) for topic in topics}
        assert len(set(leaders.values())) > 1, leaders  # placement spreads leaders over the nodes
        for topic in topics:
            admin.reset_offsets(topic, "billing", "earliest")
        listed = {(row["topic"], row["group"]) for row in admin.list_groups()}
    assert {(topic, "billing") for topic in topics} <= listed


def test_a_group_log_name_is_refused_to_clients_and_the_group_log_stays_intact(cluster: ClusterProcess) -> None:
    """``__groups.<topic>`` holds the topic's group records: a client's create or publish there is INVALID_NAME."""
    publish(cluster, "glog", [b"one"])
    with Admin(cluster.bootstrap) as admin:
        admin.reset_offsets("glog", "g", "earliest")
        with pytest.raises(InvalidName):
            admin.create_topic("__groups.other", replication_factor=3)
    with Producer(cluster.bootstrap) as producer, pytest.raises(InvalidName):
        producer.send("__groups.glog", b"not a group record").result(60)
    for node in cluster.node_ids:  # internal, as Kafka's __consumer_offsets: not in a user's topic list
        with Admin(cluster.address(node)) as admin:
            names = {topic["name"] for topic in admin.list_topics()}
        assert "glog" in names and not any(name.startswith("__groups.") for name in names), (node, names)


def test_a_group_reset_sent_to_a_follower_reaches_the_leader(cluster: ClusterProcess) -> None:
    """A follower answered ``groups reset`` with a group of its own, which the leader never saw."""
    publish(cluster, "greset", [b"a", b"b"])
    leader = in_sync(cluster, "greset")
    follower = next(node for node in ("n1", "n2", "n3") if node != leader)
    with Admin(cluster.address(follower)) as admin:
        admin.reset_offsets("greset", "ops", 1)
    with Admin(cluster.address(leader)) as admin:
        assert admin.describe_group("greset", "ops")["committed_offset"] == 1


def test_a_second_node_with_an_id_in_use_is_refused_and_the_first_keeps_its_key(
    cluster: ClusterProcess, tmp_path: Path
) -> None:
    """A node started under a live node's ``--node-id`` took its key: clients were sent to it, and its
    exit deleted the key, so the real node's partitions lost it from their in-sync sets."""
    address = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "conveyor", "--cluster", cluster.etcd_url, "--node-id", "n1"]
    command += ["--bind", address, "--data-dir", str(tmp_path / "impostor"), "--metrics-port", "0"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "[CLUSTER_ERROR]" in refused.stderr and "in use" in refused.stderr
    assert Metadata(cluster.bootstrap).refresh().nodes["n1"] == cluster.address("n1")
