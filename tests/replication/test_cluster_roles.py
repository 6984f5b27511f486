"""The agent's events drive a real broker's roles (the agent is a stand-in that records ISR proposals)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conveyor.broker.cluster.events import IsrAnswer, NodesChanged, PartitionChanged, TopicChanged
from conveyor.broker.cluster.keys import NodeRecord, PartitionState, TopicConfigRecord, TopicPartition
from conveyor.broker.server.cluster_roles import ClusterRoles
from conveyor.broker.server.partitions import Role

from tests.helpers import wait_for
from tests.replication.cluster_helpers import Node

TP = TopicPartition("orders", 0)


@dataclass
class Agent:
    proposals: list[tuple[TopicPartition, tuple[str, ...], int, int]] = field(default_factory=list)

    def propose_isr(
        self, tp: TopicPartition, isr: tuple[str, ...], leader_epoch: int, expected_mod_revision: int
    ) -> int:
        self.proposals.append((tp, isr, leader_epoch, expected_mod_revision))
        return len(self.proposals)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node("a", tmp_path / "a", lag_max_ms=60_000).start()
    yield made
    made.stop()


def roles_of(node: Node) -> tuple[ClusterRoles, Agent]:
    agent = Agent()
    roles = ClusterRoles(agent, node.partitions)
    node.partitions.propose = roles.propose
    return roles, agent


def nodes_event(**addresses: str) -> NodesChanged:
    return NodesChanged({n: NodeRecord(n, address) for n, address in addresses.items()})


def test_records_and_configs_make_this_node_leader_with_the_topics_min_insync(node: Node) -> None:
    roles, _ = roles_of(node)
    node.on_loop(lambda: roles.handle(TopicChanged("orders", TopicConfigRecord(3, 3))))
    node.on_loop(
        lambda: roles.handle(PartitionChanged(TP, PartitionState(("a", "b", "c"), "a", 1, ("a", "b", "c")), 7))
    )
    leader = node.on_loop(lambda: node.partitions.check_leader("orders"))
    assert (leader.epoch, leader.min_insync, leader.isr) == (1, 3, {"a", "b", "c"})


def test_a_follower_waits_for_its_leaders_address(node: Node) -> None:
    roles, _ = roles_of(node)
    node.on_loop(lambda: roles.handle(PartitionChanged(TP, PartitionState(("b", "a"), "b", 2, ("b", "a")), 3)))
    assert node.on_loop(lambda: node.partitions.role("orders")) is Role.NONE
    node.on_loop(lambda: roles.handle(nodes_event(a=node.address, b="tcp://127.0.0.1:1")))
    assert node.on_loop(lambda: node.partitions.role("orders")) is Role.FOLLOWER
    node.on_loop(lambda: roles.handle(PartitionChanged(TP, None, 4)))  # deleted
    assert node.on_loop(lambda: node.partitions.role("orders")) is Role.NONE


def test_a_gone_follower_is_proposed_out_on_the_records_revision_and_the_answer_is_the_isr(node: Node) -> None:
    roles, agent = roles_of(node)
    node.on_loop(lambda: roles.handle(nodes_event(a=node.address, b="tcp://127.0.0.1:1", c="tcp://127.0.0.1:2")))
    state = PartitionState(("a", "b", "c"), "a", 5, ("a", "b", "c"))
    node.on_loop(lambda: roles.handle(PartitionChanged(TP, state, 11)))
    node.on_loop(lambda: roles.handle(nodes_event(a=node.address, b="tcp://127.0.0.1:1")))
    wait_for(lambda: agent.proposals, message="a proposal")
    assert agent.proposals == [(TP, ("a", "b"), 5, 11)]
    assert node.on_loop(lambda: node.partitions.check_leader("orders").isr) == {"a", "b", "c"}  # not written yet
    written = PartitionState(("a", "b", "c"), "a", 5, ("a", "b"))
    node.on_loop(lambda: roles.handle(IsrAnswer(1, TP, True, written, 12)))
    assert node.on_loop(lambda: node.partitions.check_leader("orders").isr) == {"a", "b"}
    assert roles.revisions[TP] == 12


def test_a_refused_proposal_takes_the_record_etcd_holds(node: Node) -> None:
    roles, _ = roles_of(node)
    node.on_loop(lambda: roles.handle(PartitionChanged(TP, PartitionState(("a", "b"), "a", 5, ("a", "b")), 11)))
    newer = PartitionState(("a", "b"), "b", 6, ("b",))  # meanwhile the controller moved the partition
    node.on_loop(lambda: roles.handle(nodes_event(a=node.address, b="tcp://127.0.0.1:1")))
    node.on_loop(lambda: roles.handle(IsrAnswer(1, TP, False, newer, 13)))
    assert node.on_loop(lambda: node.partitions.role("orders")) is Role.FOLLOWER
