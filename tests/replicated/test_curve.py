"""Three CURVE brokers: followers fetch from their leader over CURVE, and clients still need an authorized key."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.net import security

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import AuthFailed
from tests.helpers import curve_keys, wait_for


def segments(cluster: ClusterProcess, node: str, topic: str) -> dict[str, str]:
    folder = cluster.node(node).data_dir / "topics" / topic
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.log"))}


def test_replication_between_curve_brokers_uses_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = curve_keys(tmp_path / "keys")
    # The brokers share one server certificate (clients know one server key); only alice is an authorized client.
    # They start without any client keys in their environment: replication must use the broker's own certificate.
    for name in ("CONVEYOR_CURVE_SERVER_KEY", "CONVEYOR_CURVE_KEY"):
        monkeypatch.delenv(name, raising=False)
    curve = ["--curve-secret-key", str(keys / "server" / "broker.key_secret")]
    curve += ["--curve-authorized-keys", str(keys / "authorized")]
    cluster = ClusterProcess(tmp_path / "cluster", nodes=3, extra=curve)
    try:
        cluster.start()
        monkeypatch.setenv("CONVEYOR_CURVE_SERVER_KEY", str(keys / "server" / "broker.key"))
        monkeypatch.setenv("CONVEYOR_CURVE_KEY", str(keys / "clients" / "alice.key_secret"))
        with Admin(cluster.bootstrap) as admin:
            admin.create_topic("secret", replication_factor=3, min_insync_replicas=3)
        wait_for(lambda: Metadata(cluster.bootstrap).refresh(["secret"]).topics.get("secret"), timeout=60)
        # min_insync 3: a confirm needs both followers to have fetched the batch from the leader.
        with Producer(cluster.bootstrap, delivery_timeout_ms=60_000) as producer:
            futures = [producer.send("secret", f"s-{i}".encode()) for i in range(500)]
            producer.flush(60)
            assert sorted(future.result(60) for future in futures) == list(range(500))
        wait_for(
            lambda: len({tuple(segments(cluster, node, "secret").items()) for node in cluster.node_ids}) == 1,
            timeout=60,
            message="the three replicas to hold the same segments",
        )

        # A client whose key is not authorized is still refused by every node.
        monkeypatch.setenv("CONVEYOR_CURVE_KEY", str(keys / "strangers" / "mallory.key_secret"))
        for node in cluster.node_ids:
            with Admin(cluster.address(node), timeout_ms=10_000) as stranger, pytest.raises(AuthFailed):
                stranger.list_topics()
    finally:
        cluster.kill()


def test_brokers_with_certificates_of_their_own_fetch_with_the_key_each_leader_advertises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = curve_keys(tmp_path / "keys")
    for name in ("CONVEYOR_CURVE_SERVER_KEY", "CONVEYOR_CURVE_KEY"):
        monkeypatch.delenv(name, raising=False)
    node_extra: dict[str, list[str]] = {}
    for node in ("n1", "n2", "n3"):
        security.generate(keys / "brokers", node)
        shutil.copy(keys / "brokers" / f"{node}.key", keys / "authorized" / f"{node}.key")  # the operator's step
        node_extra[node] = ["--curve-secret-key", str(keys / "brokers" / f"{node}.key_secret")]
    authorized = ["--curve-authorized-keys", str(keys / "authorized")]
    cluster = ClusterProcess(tmp_path / "cluster", nodes=3, extra=authorized, node_extra=node_extra)
    try:
        cluster.start()
        # A client knows one broker's key here: it talks to n1, which leads the first topic (the least loaded).
        monkeypatch.setenv("CONVEYOR_CURVE_SERVER_KEY", str(keys / "brokers" / "n1.key"))
        monkeypatch.setenv("CONVEYOR_CURVE_KEY", str(keys / "clients" / "alice.key_secret"))
        with Admin(cluster.address("n1")) as admin:
            created = admin.create_topic("own", replication_factor=3, min_insync_replicas=3)
        assert created["replication_factor"] == 3
        with Producer(cluster.address("n1"), delivery_timeout_ms=60_000) as producer:
            futures = [producer.send("own", f"o-{i}".encode()) for i in range(300)]
            producer.flush(60)
            assert sorted(future.result(60) for future in futures) == list(range(300))
        wait_for(
            lambda: len({tuple(segments(cluster, node, "own").items()) for node in cluster.node_ids}) == 1,
            timeout=60,
            message="the three replicas to hold the same segments",
        )
    finally:
        cluster.kill()
