"""The cluster agent's events, turned into this node's replication roles; its ISR proposals, into agent requests.

The agent (``broker/cluster/agent.py``) watches etcd on its own thread and
queues events; the broker's loop drains them and hands each to
``ClusterRoles.handle`` on the loop thread. A partition record
(``PartitionChanged``) gives this node its role through
``Partitions.apply_state``; a topic's config gives its ``min_insync_replicas``;
the registered nodes give the followers their leaders' addresses and tell a
leader which followers left. Going the other way, a leader's ISR change
becomes ``propose_isr``, a CAS on the record's ``mod_revision``, and its
``IsrAnswer`` comes back here: the ISR written, or refused with the record
that etcd holds now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.broker.cluster.events import (
    ClusterEvent,
    IsrAnswer,
    NodesChanged,
    PartitionChanged,
    TopicChanged,
)
from conveyor.broker.cluster.keys import PartitionState, TopicPartition
from conveyor.broker.server.partitions import Partitions, Role, role_for
from conveyor.broker.server.replication import IsrChange

from conveyor.names import partition_log, split_log

log = logging.getLogger("conveyor.cluster_roles")


def default_min_insync(state: PartitionState | None) -> int:
    """Until the topic's config is known: the cluster default, ``min(2, RF)``."""
    return min(2, len(state.assignment)) if state is not None else 1


class IsrProposer(Protocol):
    """The agent, as far as ISR proposals go (``ClusterAgent`` is one)."""

    def propose_isr(
        self, tp: TopicPartition, isr: tuple[str, ...], leader_epoch: int, expected_mod_revision: int
    ) -> int: ...


@dataclass
class ClusterRoles:
    """What the loop knows of the cluster for its roles: the records, their revisions, the nodes."""

    agent: IsrProposer
    partitions: Partitions | None = None  # set once the broker replicates
    states: dict[TopicPartition, PartitionState] = field(default_factory=dict)
    revisions: dict[TopicPartition, int] = field(default_factory=dict)
    min_insync: dict[str, int] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    pending: dict[int, TopicPartition] = field(default_factory=dict)  # proposal request id -> partition
    leader_changes: dict[TopicPartition, int] = field(default_factory=dict)  # new leader epochs seen (a metric)

    def handle(self, event: ClusterEvent) -> None:
        """One agent event, on the loop thread; other kinds are not about roles and are left alone."""
        if isinstance(event, PartitionChanged):
            self._record(event.tp, event.state, event.mod_revision)
        elif isinstance(event, TopicChanged):
            self._topic(event)
        elif isinstance(event, NodesChanged):
            self._nodes({node: record.advertise for node, record in event.nodes.items()})
        elif isinstance(event, IsrAnswer):
            self._isr_answer(event)

    def propose(self, change: IsrChange) -> None:
        """``Partitions``' ISR callback: CAS the ISR on the record this node last saw."""
        tp = cluster_partition(change.topic)
        request_id = self.agent.propose_isr(tp, change.isr, change.leader_epoch, self.revisions.get(tp, 0))
        self.pending[request_id] = tp

    # --- events -------------------------------------------------------------------------------

    def _record(self, tp: TopicPartition, state: PartitionState | None, revision: int) -> None:
        previous = self.states.get(tp)
        if previous is not None and state is not None and state.leader_epoch > previous.leader_epoch:
            self.leader_changes[tp] = self.leader_changes.get(tp, 0) + 1
        if state is None:
            self.states.pop(tp, None)
            self.revisions.pop(tp, None)
        else:
            self.states[tp] = state
            self.revisions[tp] = revision
        self._apply(tp)

    def _topic(self, event: TopicChanged) -> None:
        if event.config is None:
            self.min_insync.pop(event.topic, None)
            return
        self.min_insync[event.topic] = event.config.min_insync_replicas
        for tp in [tp for tp in self.states if tp.topic == event.topic]:
            self._apply(tp)

    def _nodes(self, addresses: dict[str, str]) -> None:
        gone = set(self.addresses) - set(addresses)
        moved = {node for node, address in addresses.items() if self.addresses.get(node) not in (None, address)}
        self.addresses = addresses
        if self.partitions is None:
            return
        for node in gone:
            self.partitions.follower_gone(node)  # a leader proposes dropping it now, not after the lag
        for tp, state in self.states.items():
            # A follower waiting for its leader's address, or whose leader came back elsewhere.
            follower = role_for(state, self.partitions.node_id) is Role.FOLLOWER
            waiting = follower and (local_log(tp), 0) not in self.partitions.following and state.leader in addresses
            if state.leader in moved or waiting:
                self._apply(tp)

    def _isr_answer(self, answer: IsrAnswer) -> None:
        tp = self.pending.pop(answer.request_id, answer.tp)
        if self.partitions is None:
            return
        if answer.ok and answer.state is not None:
            self.states[tp] = answer.state
            self.revisions[tp] = answer.mod_revision
            self.partitions.isr_written(local_log(tp), 0, answer.state.isr)
            return
        if answer.error is not None:
            log.warning("ISR change for %s not written: %s", tp, answer.error)
        self.partitions.isr_refused(local_log(tp), 0)
        if answer.state is not None and answer.mod_revision >= self.revisions.get(tp, 0):
            self._record(tp, answer.state, answer.mod_revision)  # etcd's record, newer than the one proposed on

    def _apply(self, tp: TopicPartition) -> None:
        if self.partitions is None:
            return
        self.partitions.apply_state(
            local_log(tp),
            0,
            self.states.get(tp),
            min_insync=self.min_insync.get(tp.topic, default_min_insync(self.states.get(tp))),
            addresses=self.addresses,
        )


def local_log(tp: TopicPartition) -> str:
    """The log that holds ``tp`` on a node: partition k > 0 of ``T`` is the log ``T#k``.

    Below this module a node knows each partition as a log of its own (its partition 0), as a
    single broker does: leading, following, the high watermark and the group log
    (``__groups.T#k``) all go by log name. Only etcd's records name ``(topic, partition)``.
    """
    return partition_log(tp.topic, tp.partition)


def cluster_partition(log_name: str) -> TopicPartition:
    """The etcd partition of a local log (``local_log``'s inverse)."""
    return TopicPartition(*split_log(log_name))
