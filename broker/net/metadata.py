"""A METADATA answer read: who leads each (topic, partition) and where every node listens.

Both sides of the layer rule need it: clients route through it
(``broker/client/metadata.py``), and a mirror whose upstream is a cluster
follows its topics' leaders with it (``broker/server/mirror.py``). Pure:
no socket is made here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.broker.config.addresses import check_address
from conveyor.broker.wire.schema import check_metadata_result

from conveyor.errors import MalformedFrame

__all__ = ["ClusterView", "PartitionInfo"]


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition of a METADATA answer."""

    leader: str | None
    leader_addr: str | None
    leader_epoch: int
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    offline: bool


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A METADATA answer, and the address it came from (``source``)."""

    source: str
    node: str
    controller: str | None
    nodes: Mapping[str, str]
    topics: Mapping[str, Mapping[int, PartitionInfo]]

    @classmethod
    def from_header(cls, source: str, header: Mapping[str, Any]) -> ClusterView:
        problem = check_metadata_result(header)
        if problem is not None:
            raise MalformedFrame(f"METADATA_RESULT from {source}: {problem}")
        topics = {
            name: {int(number): _partition(p) for number, p in topic["partitions"].items()}
            for name, topic in header["topics"].items()
        }
        return cls(source, header["node"], header["controller"], dict(header["nodes"]), topics)

    def address_of(self, node: str | None) -> str | None:
        """Where ``node`` listens. The node that answered is reached where it was asked (it may bind 0.0.0.0)."""
        if node is None:
            return None
        return self.source if node == self.node else self.nodes.get(node)

    def leader_address(self, topic: str, partition: int = 0) -> str | None:
        """The leader's address; the answering node's for a topic it does not know; None while offline."""
        known = self.topics.get(topic)
        if known is None:
            return self.source
        info = known.get(partition)
        if info is None or info.offline or info.leader is None:
            return None
        return self.address_of(info.leader) or (check_address(info.leader_addr) if info.leader_addr else None)


def _partition(p: Mapping[str, Any]) -> PartitionInfo:
    return PartitionInfo(
        p["leader"], p["leader_addr"], p["leader_epoch"], tuple(p["replicas"]), tuple(p["isr"]), p["offline"]
    )
