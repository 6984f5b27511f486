"""What the cluster agent tells the broker's loop, and how the loop configures it.

The agent thread puts these on ``ClusterAgent.events`` and calls the loop's
``wake``; the loop drains them with ``ClusterAgent.poll()``. Every event is
frozen and holds no reference into the agent's view, so the loop may keep it.
Answers to the loop's requests carry the ``request_id`` the request returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from conveyor.broker.cluster.keys import NodeRecord, PartitionState, TopicConfigRecord, TopicPartition

from conveyor.errors import ConveyorError


@dataclass(frozen=True)
class ClusterSettings:
    """How a node joins a cluster (the ``--cluster`` flags map onto these)."""

    endpoints: tuple[str, ...]  # "http://127.0.0.1:2379", tried in turn
    node_id: str
    advertise: str  # "tcp://host:port", where clients and followers reach this node
    cluster_name: str = "default"
    metrics: str = ""
    version: str = ""
    curve_public: str = ""  # the broker's CURVE public key (Z85), advertised in its node record
    lease_ms: int = 2000
    etcd_timeout: float = 2.0
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = None

    @property
    def lease_seconds(self) -> int:
        """etcd leases are whole seconds: the nearest one, at least 1."""
        return max(1, round(self.lease_ms / 1000))


class ClusterEvent:
    """Base of everything on the agent's event queue."""


@dataclass(frozen=True)
class Registered(ClusterEvent):
    """The node's key is in etcd under ``lease_id`` and the view is loaded (at start, and again after a lost lease)."""

    node_id: str
    lease_id: int
    revision: int


@dataclass(frozen=True)
class LeaseLost(ClusterEvent):
    """The node's lease ended: the cluster may have moved its partitions; the agent registers again.

    Leadership follows the partition records only: a ``PartitionChanged`` naming
    another leader (or a higher epoch) is what takes a partition away.
    """

    lease_id: int


@dataclass(frozen=True)
class NodesChanged(ClusterEvent):
    """The registered nodes, all of them, after a join or a leave."""

    nodes: Mapping[str, NodeRecord]


@dataclass(frozen=True)
class ControllerChanged(ClusterEvent):
    """Who is controller now (``None`` while nobody is); ``me`` when this node is."""

    controller: str | None
    me: bool


@dataclass(frozen=True)
class TopicChanged(ClusterEvent):
    """A topic's config appeared or changed; ``config`` is ``None`` when it was deleted."""

    topic: str
    config: TopicConfigRecord | None


@dataclass(frozen=True)
class PartitionChanged(ClusterEvent):
    """A partition's record: ``state`` ``None`` when it was deleted; ``mod_revision`` is what an ISR CAS compares."""

    tp: TopicPartition
    state: PartitionState | None
    mod_revision: int


@dataclass(frozen=True)
class TopicCreated(ClusterEvent):
    """The answer to ``create_topic``: the config once the controller wrote it, or the error that refused it."""

    request_id: int
    topic: str
    config: TopicConfigRecord | None = None
    error: ConveyorError | None = None


@dataclass(frozen=True)
class IsrAnswer(ClusterEvent):
    """The answer to ``propose_isr``: ``ok`` when the CAS won; ``state`` and ``mod_revision`` are current either way.

    ``state`` is ``None`` and ``error`` set when the proposal could not be made
    (etcd unreachable, the partition gone, this node not its leader at that epoch).
    """

    request_id: int
    tp: TopicPartition
    ok: bool
    state: PartitionState | None
    mod_revision: int
    error: ConveyorError | None = None


@dataclass(frozen=True)
class ShutdownAnswer(ClusterEvent):
    """The answer to ``request_shutdown``: the controller moved this node's leaderships (or ``error``)."""

    request_id: int
    error: ConveyorError | None = None


@dataclass(frozen=True)
class ReassignAnswer(ClusterEvent):
    """The answer to ``reassign``: the request is stored; the moves show as ``PartitionChanged``."""

    request_id: int
    tp: TopicPartition
    error: ConveyorError | None = None


@dataclass(frozen=True)
class TopicDeleted(ClusterEvent):
    """The answer to ``delete_topic``: the controller removed the topic's records (or ``error``)."""

    request_id: int
    topic: str
    error: ConveyorError | None = None


@dataclass(frozen=True)
class TopicAltered(ClusterEvent):
    """The answer to ``alter_topic``: the config as written (or ``error``); every node applies it from
    its ``TopicChanged``."""

    request_id: int
    topic: str
    config: TopicConfigRecord | None = None
    error: ConveyorError | None = None


@dataclass(frozen=True)
class Request:
    """A loop request as queued to the agent thread (internal)."""

    request_id: int
    kind: str  # create | isr | shutdown | reassign | delete | alter
    topic: str = ""
    tp: TopicPartition | None = None
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    settings: Mapping[str, object] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    leader_epoch: int = 0
    partitions: int = 1
    mod_revision: int | None = None
    successors: Mapping[TopicPartition, str] = field(default_factory=dict)
