"""Unit: how a mirror's one link treats a cluster upstream's answers (no sockets are connected here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import zmq
from conveyor.broker.net.metadata import ClusterView
from conveyor.broker.server.mirror import Mirror, MirrorSettings, TopicMirror

from conveyor.errors import NotLeader, UnknownTopic

BOOTSTRAP = "tcp://127.0.0.1:7001,tcp://127.0.0.1:7002,tcp://127.0.0.1:7003"


def mirror_of(upstream: str, *topics: str) -> Mirror:
    host: Any = SimpleNamespace(
        ctx=zmq.Context.instance(), poller=zmq.Poller(), metrics=MagicMock(), max_batch_bytes=1 << 20
    )
    mirror = Mirror(host, MirrorSettings(upstream, ("orders*",)), clock=lambda: 100.0)
    mirror.topics = {t: TopicMirror(t) for t in topics}
    return mirror


def test_a_cluster_upstream_keeps_a_topic_its_node_does_not_hold() -> None:
    mirror = mirror_of(BOOTSTRAP, "orders", "orders.eu")
    mirror._on_error(mirror.topics["orders.eu"], UnknownTopic("no such topic", topic="orders.eu"))
    assert set(mirror.topics) == {"orders", "orders.eu"}
    assert mirror.topics["orders.eu"].retry_at > 100.0  # asked again later, not in a loop


def test_one_parent_still_drops_a_topic_deleted_upstream() -> None:
    mirror = mirror_of("tcp://127.0.0.1:7001", "orders")
    mirror._on_error(mirror.topics["orders"], UnknownTopic("no such topic", topic="orders"))
    assert mirror.topics == {}


def test_the_link_follows_a_not_leader_hint_only_for_its_first_topic() -> None:
    mirror = mirror_of(BOOTSTRAP, "orders", "orders.eu")
    mirror._on_error(mirror.topics["orders.eu"], NotLeader("led elsewhere", leader_addr="tcp://127.0.0.1:7002"))
    assert mirror.link.address == "tcp://127.0.0.1:7001"
    mirror._on_error(mirror.topics["orders"], NotLeader("led elsewhere", leader_addr="tcp://127.0.0.1:7003"))
    assert mirror.link.address == "tcp://127.0.0.1:7003"


def test_a_silent_link_moves_to_the_next_bootstrap_address() -> None:
    mirror = mirror_of(BOOTSTRAP, "orders")
    mirror.link.reconnect("silent")
    mirror.tick(100.0)
    assert mirror.link.address == "tcp://127.0.0.1:7002"
    mirror.close()


def test_a_topic_the_cluster_deleted_is_dropped_once_metadata_asked_since_does_not_name_it() -> None:
    mirror = mirror_of(BOOTSTRAP, "orders", "orders.eu")
    mirror._on_error(mirror.topics["orders.eu"], UnknownTopic("no such topic", topic="orders.eu"))
    assert mirror._next_discovery == 100.0  # METADATA is asked at the next tick

    view = ClusterView("tcp://127.0.0.1:7001", "n1", "n1", {"n1": "tcp://127.0.0.1:7001"}, {"orders": {}})
    mirror._metadata_asked = 99.0  # a METADATA asked before the answer: it cannot tell
    mirror._gone_upstream(view)
    assert set(mirror.topics) == {"orders", "orders.eu"}

    mirror._metadata_asked = 100.0  # asked since: the cluster has "orders" only
    mirror._gone_upstream(view)
    assert set(mirror.topics) == {"orders"}  # as one parent's UNKNOWN_TOPIC does


def test_a_topic_the_cluster_still_has_is_kept_after_a_node_without_it_answered() -> None:
    mirror = mirror_of(BOOTSTRAP, "orders.eu")
    mirror._on_error(mirror.topics["orders.eu"], UnknownTopic("no such topic", topic="orders.eu"))
    mirror._metadata_asked = 100.0
    mirror._gone_upstream(ClusterView("tcp://127.0.0.1:7001", "n1", "n1", {}, {"orders.eu": {}}))
    assert set(mirror.topics) == {"orders.eu"}
