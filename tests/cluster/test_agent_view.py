"""The agent's view of the cluster: a range read then watch events; a damaged value is skipped, never fatal."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.keys import Keys, NodeRecord, PartitionState, TopicConfigRecord, TopicPartition
from conveyor.broker.cluster.view import ClusterView

KEYS = Keys("c1")
TP = TopicPartition("orders", 0)


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 1
    lease: int = 0


def test_load_then_watch_events_keep_the_view() -> None:
    view = ClusterView(KEYS)
    state = PartitionState(("a", "b"), "a", 1, ("a", "b"))
    changes = view.load(
        [
            KV(KEYS.meta, k.encode_meta(), 1),
            KV(KEYS.node("a"), k.encode_node(NodeRecord("a", "tcp://a:1")), 2),
            KV(KEYS.controller, k.encode_controller("a"), 3, 3),
            KV(KEYS.topic_config("orders"), k.encode_topic_config(TopicConfigRecord(2, 2)), 4),
            KV(KEYS.partition(TP), k.encode_partition(state), 5),
        ],
        revision=9,
    )
    assert [c.kind for c in changes] == ["node", "controller", "config", "partition"]
    assert view.revision == 9 and view.controller == "a" and view.controller_revision == 3
    assert view.partitions[TP] == state and view.partition_revisions[TP] == 5
    moved = PartitionState(("a", "b"), "b", 2, ("b",))
    change = view.apply("PUT", KV(KEYS.partition(TP), k.encode_partition(moved), 10))
    assert change is not None and change.tp == TP and not change.deleted
    assert view.snapshot().partitions[TP] == moved and view.revision == 10
    gone = view.apply("DELETE", KV(KEYS.node("a"), b"", 11))
    assert gone is not None and gone.deleted and gone.node_id == "a" and view.nodes == {}
    assert view.apply("DELETE", KV(KEYS.node("a"), b"", 12)) is None  # already gone


def test_events_a_reload_already_holds_are_ignored() -> None:
    view = ClusterView(KEYS)
    new = PartitionState(("a", "b"), "b", 2, ("b",))
    view.load([KV(KEYS.partition(TP), k.encode_partition(new), 8)], revision=9)
    old = PartitionState(("a", "b"), "a", 1, ("a", "b"))
    assert view.apply("PUT", KV(KEYS.partition(TP), k.encode_partition(old), 7)) is None
    assert view.apply("DELETE", KV(KEYS.partition(TP), b"", 9)) is None
    assert view.partitions[TP] == new


def test_a_damaged_value_is_skipped_and_the_old_record_kept() -> None:
    view = ClusterView(KEYS)
    state = PartitionState(("a",), "a", 1, ("a",))
    view.apply("PUT", KV(KEYS.partition(TP), k.encode_partition(state), 2))
    assert view.apply("PUT", KV(KEYS.partition(TP), b'{"assignment": 1}', 3)) is None
    assert view.partitions[TP] == state and KEYS.partition(TP) in view.damaged
    assert view.apply("PUT", KV(KEYS.prefix + "junk/x", b"{}", 4)) is None
    assert view.apply("PUT", KV(KEYS.partition(TP), k.encode_partition(state), 5)) is not None
    assert KEYS.partition(TP) not in view.damaged


def test_a_reload_reports_only_what_differs() -> None:
    view = ClusterView(KEYS)
    node = KV(KEYS.node("a"), k.encode_node(NodeRecord("a", "tcp://a:1")), 2)
    view.load([node], 2)
    assert view.load([node], 5) == []
    changes = view.load([], 6)
    assert [(c.kind, c.deleted) for c in changes] == [("node", True)]


def test_shutting_down_nodes_are_not_live() -> None:
    view = ClusterView(KEYS)
    for n in "ab":
        view.apply("PUT", KV(KEYS.node(n), k.encode_node(NodeRecord(n, "tcp://x:1")), 2))
    view.apply("PUT", KV(KEYS.shutdown_request("a"), b"{}", 3))
    assert view.live() == {"b"} and view.snapshot().shutting_down == {"a"}
