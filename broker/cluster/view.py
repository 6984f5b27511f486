"""A node's picture of the cluster, built from one range read and kept by the watch (pure).

``ClusterView.load`` takes the key-values of the range, ``apply`` one watch
change at a time; both return the ``Change``s the agent turns into events
for the broker's loop. A damaged key or value is counted in ``damaged`` and
skipped: the view keeps what it had for that key.

Only the agent thread touches a ``ClusterView``; the loop gets frozen
``ClusterSnapshot``s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.keys import (
    CreateRequest,
    DeleteRequest,
    Keys,
    NodeRecord,
    PartitionState,
    ReassignRequest,
    RecordError,
    ShutdownRequest,
    TopicConfigRecord,
    TopicPartition,
)

T = TypeVar("T")


class KeyValueLike(Protocol):
    """What the view reads of etcd's ``KeyValue`` (so this module needs no etcd client)."""

    @property
    def key(self) -> str: ...
    @property
    def value(self) -> bytes: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def create_revision(self) -> int: ...
    @property
    def lease(self) -> int: ...


@dataclass(frozen=True)
class Versioned(Generic[T]):
    """A decoded record with the revisions a CAS needs."""

    value: T
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Change:
    """What one key-value did to the view: ``kind`` as in ``keys.ParsedKey``, ``deleted`` for a DELETE."""

    kind: str
    key: str
    deleted: bool = False
    node_id: str = ""
    topic: str = ""
    tp: TopicPartition | None = None


@dataclass(frozen=True)
class ClusterSnapshot:
    """The view at one revision, safe to hand to another thread."""

    revision: int
    nodes: Mapping[str, NodeRecord]
    controller: str | None
    topics: Mapping[str, TopicConfigRecord]
    partitions: Mapping[TopicPartition, PartitionState]
    partition_revisions: Mapping[TopicPartition, int]
    shutting_down: frozenset[str]


@dataclass
class ClusterView:
    """Everything under ``/conveyor/<cluster>/`` that a node or controller acts on, keyed by TopicPartition."""

    keys: Keys
    revision: int = 0
    loaded_revision: int = 0  # the last range read's: watch events at or below it are already in
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    controller: str | None = None
    controller_revision: int = 0  # create_revision of the controller key: the controller epoch
    topics: dict[str, TopicConfigRecord] = field(default_factory=dict)
    topic_revisions: dict[str, int] = field(default_factory=dict)  # config mod_revision: what an alter compares
    partitions: dict[TopicPartition, PartitionState] = field(default_factory=dict)
    partition_revisions: dict[TopicPartition, int] = field(default_factory=dict)
    creates: dict[str, Versioned[CreateRequest]] = field(default_factory=dict)
    shutdowns: dict[str, Versioned[ShutdownRequest]] = field(default_factory=dict)
    reassigns: dict[TopicPartition, Versioned[ReassignRequest]] = field(default_factory=dict)
    deletes: dict[str, Versioned[DeleteRequest]] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)  # key -> why, for logs and tests

    def load(self, kvs: Iterable[KeyValueLike], revision: int) -> list[Change]:
        """Replace the whole view by a range read at ``revision``; the changes cover every key that differs."""
        before = self.snapshot()
        self.nodes, self.topics, self.partitions, self.partition_revisions = {}, {}, {}, {}
        self.topic_revisions = {}
        self.controller, self.controller_revision = None, 0
        self.creates, self.shutdowns, self.reassigns, self.deletes, self.damaged = {}, {}, {}, {}, {}
        for kv in kvs:
            self._put(kv)
        self.revision = self.loaded_revision = revision
        return self._diff(before)

    def apply(self, kind: str, kv: KeyValueLike) -> Change | None:
        """One watch event (``kind`` "PUT" or "DELETE", ``kv`` a ``KeyValue``); ``None`` if it changed nothing.

        An event the last range read already holds (a watch resumed from before a
        reload delivers some again) is ignored, so a reload never goes back in time.
        """
        if kv.mod_revision <= self.loaded_revision:
            return None
        self.revision = max(self.revision, kv.mod_revision)
        if kind == "DELETE":
            return self._delete(kv.key)
        return self._put(kv)

    def live(self) -> frozenset[str]:
        """Registered nodes that have not asked to shut down: the ones that may lead."""
        return frozenset(self.nodes) - frozenset(self.shutdowns)

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            self.revision,
            MappingProxyType(dict(self.nodes)),
            self.controller,
            MappingProxyType(dict(self.topics)),
            MappingProxyType(dict(self.partitions)),
            MappingProxyType(dict(self.partition_revisions)),
            frozenset(self.shutdowns),
        )

    # --- one key ----------------------------------------------------------

    def _put(self, kv: KeyValueLike) -> Change | None:
        key, value, mod, created, lease = kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease
        try:
            parsed = self.keys.parse(key)
            change = Change(parsed.kind, key, node_id=parsed.node_id, topic=parsed.topic, tp=parsed.tp)
            match parsed.kind:
                case "meta":
                    return None
                case "node":
                    self.nodes[parsed.node_id] = k.decode_node(key, parsed.node_id, value)
                case "controller":
                    self.controller = k.decode_controller(key, value)
                    self.controller_revision = created
                case "config":
                    self.topics[parsed.topic] = k.decode_topic_config(key, value)
                    self.topic_revisions[parsed.topic] = mod
                case "partition":
                    assert parsed.tp is not None
                    self.partitions[parsed.tp] = k.decode_partition(key, value)
                    self.partition_revisions[parsed.tp] = mod
                case "create":
                    self.creates[parsed.topic] = Versioned(k.decode_create(key, value), mod, created, lease)
                case "shutdown":
                    self.shutdowns[parsed.node_id] = Versioned(k.decode_shutdown(key, value), mod, created, lease)
                case "reassign":
                    assert parsed.tp is not None
                    self.reassigns[parsed.tp] = Versioned(k.decode_reassign(key, value), mod, created, lease)
                case "delete":
                    self.deletes[parsed.topic] = Versioned(k.decode_delete(key, value), mod, created, lease)
        except RecordError as exc:
            self.damaged[key] = str(exc)
            return None
        self.damaged.pop(key, None)
        return change

    def _delete(self, key: str) -> Change | None:
        self.damaged.pop(key, None)
        try:
            parsed = self.keys.parse(key)
        except RecordError:
            return None
        found: object = None
        match parsed.kind:
            case "node":
                found = self.nodes.pop(parsed.node_id, None)
            case "controller":
                found, self.controller, self.controller_revision = self.controller, None, 0
            case "config":
                found = self.topics.pop(parsed.topic, None)
                self.topic_revisions.pop(parsed.topic, None)
            case "partition":
                assert parsed.tp is not None
                found = self.partitions.pop(parsed.tp, None)
                self.partition_revisions.pop(parsed.tp, None)
            case "create":
                found = self.creates.pop(parsed.topic, None)
            case "shutdown":
                found = self.shutdowns.pop(parsed.node_id, None)
            case "reassign":
                assert parsed.tp is not None
                found = self.reassigns.pop(parsed.tp, None)
            case "delete":
                found = self.deletes.pop(parsed.topic, None)
        if found is None:
            return None
        return Change(parsed.kind, key, True, parsed.node_id, parsed.topic, parsed.tp)

    def _diff(self, before: ClusterSnapshot) -> list[Change]:
        """The changes from ``before`` to now, for a reload (a start or a resync after compaction)."""
        changes: list[Change] = []
        for node in sorted(set(before.nodes) | set(self.nodes)):
            if before.nodes.get(node) != self.nodes.get(node):
                changes.append(Change("node", self.keys.node(node), node not in self.nodes, node_id=node))
        if before.controller != self.controller:
            changes.append(Change("controller", self.keys.controller, self.controller is None))
        for topic in sorted(set(before.topics) | set(self.topics)):
            if before.topics.get(topic) != self.topics.get(topic):
                changes.append(Change("config", self.keys.topic_config(topic), topic not in self.topics, topic=topic))
        for tp in sorted(set(before.partitions) | set(self.partitions)):
            if before.partition_revisions.get(tp) != self.partition_revisions.get(tp):
                gone = tp not in self.partitions
                changes.append(Change("partition", self.keys.partition(tp), gone, topic=tp.topic, tp=tp))
        changes.extend(Change("create", self.keys.create_request(t), topic=t) for t in sorted(self.creates))
        changes.extend(Change("delete", self.keys.delete_request(t), topic=t) for t in sorted(self.deletes))
        changes.extend(Change("shutdown", self.keys.shutdown_request(n), node_id=n) for n in sorted(self.shutdowns))
        changes.extend(
            Change("reassign", self.keys.reassign_request(tp), topic=tp.topic, tp=tp) for tp in sorted(self.reassigns)
        )
        return changes
