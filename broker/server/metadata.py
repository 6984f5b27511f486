"""METADATA answers: who leads each (topic, partition), and where every node listens.

The handler asks a ``MetadataProvider`` and encodes what it gets, so the
answer's source can change without touching the handler: a single-node
broker answers "me" (``SingleNodeMetadata``); a cluster node will answer from
its etcd view by providing the same ``metadata(topics)`` method.

The reply is keyed by topic and partition from the start (partition keys
are decimal strings, as msgpack maps need string keys); see
docs/protocol.md, "METADATA", and ``schema.check_metadata_result``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from conveyor.broker.wire import commands

SINGLE_NODE_ID = "local"  # a single-node broker started without --node


@dataclass(frozen=True, slots=True)
class PartitionMetadata:
    """One partition as a client routes by it. ``leader`` is None while the partition is offline."""

    leader: str | None
    leader_addr: str | None
    leader_epoch: int
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    offline: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "leader_addr": self.leader_addr,
            "leader_epoch": self.leader_epoch,
            "replicas": list(self.replicas),
            "isr": list(self.isr),
            "offline": self.offline,
        }


@dataclass(frozen=True, slots=True)
class ClusterMetadata:
    """What one node knows: itself, the controller, the nodes, and the partitions of the topics asked for."""

    node: str
    controller: str | None
    nodes: Mapping[str, str]
    topics: Mapping[str, Mapping[int, PartitionMetadata]] = field(default_factory=dict)

    def topics_to_wire(self) -> dict[str, Any]:
        return {
            name: {"partitions": {str(number): p.to_wire() for number, p in sorted(partitions.items())}}
            for name, partitions in self.topics.items()
        }


class MetadataProvider(Protocol):
    """What the METADATA handler asks. ``topics`` None: every topic; a topic the node does not know is left out."""

    def metadata(self, topics: Sequence[str] | None) -> ClusterMetadata: ...


class SingleNodeMetadata:
    """A broker without a cluster: it is the only node, the controller, and the leader of every topic, epoch 0.

    ``address`` is called per answer (the endpoint is known only once bound);
    ``topic_names`` lists the topics that exist now.
    """

    def __init__(
        self,
        node_id: str,
        address: Callable[[], str],
        topic_names: Callable[[], Iterable[str]],
        partition_count: Callable[[str], int] = lambda topic: 1,
    ) -> None:
        self.node_id = node_id or SINGLE_NODE_ID
        self._address = address
        self._topic_names = topic_names
        self._partition_count = partition_count

    def metadata(self, topics: Sequence[str] | None) -> ClusterMetadata:
        me, address = self.node_id, self._address()
        known = {name for name in self._topic_names() if "#" not in name}  # a partition's log is not a topic
        wanted = sorted(known) if topics is None else [t for t in dict.fromkeys(topics) if t in known]
        partition = PartitionMetadata(me, address, 0, (me,), (me,))
        every = {name: dict.fromkeys(range(self._partition_count(name)), partition) for name in wanted}
        return ClusterMetadata(me, me, {me: address}, every)


def metadata_reply(rid: Any, view: ClusterMetadata) -> list[Any]:
    """The METADATA_RESULT frames for ``view``."""
    return commands.metadata_result(
        rid, node=view.node, controller=view.controller, nodes=view.nodes, topics=view.topics_to_wire()
    )
