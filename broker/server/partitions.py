"""This node's role for each replicated partition, and the broker's hooks that depend on it.

Each (topic, partition) is LEADER (it takes publishes, serves subscribers,
and its ``PartitionLeader`` keeps the followers' state and the high
watermark), FOLLOWER (``Replicas`` fetches it from the leader) or NONE. The
cluster agent drives the transitions (``become_leader``, ``become_follower``,
``stop``) from the partition records it watches; tests call them directly.
Everything runs on the broker's loop thread: another thread hands work over
with ``Broker.call_soon``.

A single-node broker has no ``Partitions`` at all: none of this runs, and
every hook the broker calls is behind ``if self.partitions is not None``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
from conveyor.broker.cluster.keys import PartitionState
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.group_log import SETTINGS as GROUP_LOG_SETTINGS
from conveyor.broker.server.group_log import group_log_name, is_group_log
from conveyor.broker.server.replica import Replicas
from conveyor.broker.server.replication import IsrChange, PartitionLeader, check_epoch, diverging
from conveyor.broker.wire.protocol import Frame
from conveyor.broker.wire.protocol import field as hfield

from conveyor.errors import ConveyorError, InvalidName, NotLeader
from conveyor.names import split_log

log = logging.getLogger("conveyor.partitions")

TopicPartition = tuple[str, int]


class Role(enum.Enum):
    LEADER = "leader"
    FOLLOWER = "follower"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Following:
    leader: str
    address: str
    epoch: int


def _shadow_propose(change: IsrChange) -> None:
    """A group log proposes no ISR: its topic's ISR is written to it (``isr_written``)."""


def role_for(state: PartitionState | None, me: str) -> Role:
    """What a partition record makes this node: its leader, one of its followers, or nothing.

    An offline partition (no live in-sync replica) or one this node is not assigned
    gives no role; a follower needs a leader to fetch from.
    """
    if state is None or state.offline or state.leader is None or me not in state.assignment:
        return Role.NONE
    return Role.LEADER if state.leader == me else Role.FOLLOWER


class PartitionsHost(Protocol):
    """What the roles need of their broker (the broker is one)."""

    @property
    def ctx(self) -> zmq.Context[Any]: ...
    @property
    def poller(self) -> zmq.Poller: ...
    @property
    def store(self) -> Store: ...
    @property
    def appended(self) -> set[str]: ...  # topics whose readers the next group commit wakes
    @property
    def max_batch_bytes(self) -> int: ...

    def fail_confirms_of(self, topic: str, exc: ConveyorError) -> None: ...


class Partitions:
    """The roles of this node (``node_id``); ISR changes go to ``propose`` (the cluster agent)."""

    def __init__(
        self,
        host: PartitionsHost,
        node_id: str,
        *,
        propose: Callable[[IsrChange], None] = lambda change: None,
        lag_max_ms: int = 10_000,
        fetch_wait_ms: int = 500,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.node_id = node_id
        self.propose = propose
        self.lag_max = lag_max_ms / 1000
        self.clock = clock
        self.leading: dict[TopicPartition, PartitionLeader] = {}
        self.following: dict[TopicPartition, Following] = {}
        self.on_unknown: Callable[[str], None] = lambda topic: None
        self.draining = False  # a controlled shutdown is under way: no more appends to led partitions
        # A topic's consumer groups live where it is led: the broker rebuilds them from the topic's
        # group log when this node starts leading it (``on_lead``) and drops them when it stops.
        self.on_lead: Callable[[str], None] = lambda topic: None
        self.on_step_down: Callable[[str], None] = lambda topic: None
        self.replicas = Replicas(host, node_id, wait_ms=fetch_wait_ms, clock=clock)

    # --- transitions ------------------------------------------------------------------------

    def apply_state(
        self,
        topic: str,
        partition: int,
        state: PartitionState | None,
        *,
        min_insync: int,
        addresses: Mapping[str, str],
    ) -> Role:
        """Take the role a partition record (a ``PartitionChanged``) gives this node; the role taken.

        ``addresses``: each live node's advertised endpoint. The same record twice changes
        nothing; a record of this node's own epoch with another ISR is the ISR written.
        A follower whose leader has no known address yet stays as it is.
        """
        role = role_for(state, self.node_id)
        if role is Role.LEADER and state is not None:
            self.become_leader(
                topic,
                partition,
                epoch=state.leader_epoch,
                replicas=state.assignment,
                isr=state.isr,
                min_insync=min_insync,
            )
        elif role is Role.FOLLOWER and state is not None and state.leader is not None:
            address = addresses.get(state.leader)
            if address is None:
                return self.role(topic, partition)
            self.become_follower(topic, partition, leader=state.leader, address=address, epoch=state.leader_epoch)
        else:
            self.stop(topic, partition)
        return role

    def become_leader(
        self,
        topic: str,
        partition: int = 0,
        *,
        epoch: int,
        replicas: Iterable[str],
        isr: Iterable[str],
        min_insync: int,
    ) -> PartitionLeader:
        """Lead this partition from ``epoch`` on; HW starts at the last one heard as a follower.

        The topic's group log is led with it (same epoch, replicas and ISR), then ``on_lead``.
        """
        tp = (topic, partition)
        current = self.leading.get(tp)
        if current is not None and current.epoch == epoch:
            current.isr_written(isr)
            current.replicas = tuple(replicas)
            current.min_insync = min_insync
            if not is_group_log(topic):
                self.become_leader(
                    group_log_name(topic), partition, epoch=epoch, replicas=replicas, isr=isr, min_insync=min_insync
                )
            return current
        leader = self._lead(topic, partition, epoch, tuple(replicas), set(isr), min_insync)
        if not is_group_log(topic):
            name = group_log_name(topic)
            if self.leading.get((name, partition)) is not None:
                self.leading.pop((name, partition))  # an older epoch's: led again at this one
            self.become_leader(name, partition, epoch=epoch, replicas=replicas, isr=isr, min_insync=min_insync)
            self.on_lead(topic)
        return leader

    def _lead(
        self, topic: str, partition: int, epoch: int, replicas: tuple[str, ...], isr: set[str], min_insync: int
    ) -> PartitionLeader:
        tp = (topic, partition)
        followed = self.replicas.unfollow(topic, partition)
        self.following.pop(tp, None)
        log_ = self._log(topic)
        hw = min(log_.durable_offset, followed.hw if followed is not None else log_.durable_offset)
        if epoch > log_.last_epoch:
            log_.assign_epoch(epoch)  # this epoch starts at the log end, before any publish of it
        leader = PartitionLeader(
            topic,
            partition,
            self.node_id,
            epoch,
            replicas,
            isr,
            min_insync,
            self.lag_max,
            _shadow_propose if is_group_log(topic) else self.propose,  # a group log's ISR is its topic's
            epoch_start=log_.end_offset,
            hw=hw,
        )
        leader.now_caught_up(self.clock())
        self.leading[tp] = leader
        log.info("%s/%d: leader, epoch %d, isr %s, hw %d", topic, partition, epoch, sorted(leader.isr), hw)
        self._hw_moved(topic, leader, log_)
        return leader

    def become_follower(self, topic: str, partition: int = 0, *, leader: str, address: str, epoch: int) -> None:
        """Follow ``leader`` (at ``address``) from ``epoch`` on; a leader stepping down fails its waiting confirms."""
        tp = (topic, partition)
        if self.following.get(tp) == Following(leader, address, epoch):
            return  # already so
        was = self.leading.pop(tp, None)
        self._log(topic)
        if was is not None:
            self.host.fail_confirms_of(topic, self.not_leader(topic, partition))
        if not is_group_log(topic):
            if was is not None:
                self.on_step_down(topic)
            self.become_follower(group_log_name(topic), partition, leader=leader, address=address, epoch=epoch)
        self.following[tp] = Following(leader, address, epoch)
        self.host.store.topic(topic).set_high_watermark(was.hw if was is not None else 0)
        hw = was.hw if was is not None else 0
        self.replicas.follow(topic, partition, leader=leader, address=address, epoch=epoch, hw=hw)
        log.info("%s/%d: follower of %s (%s), epoch %d", topic, partition, leader, address, epoch)

    def stop(self, topic: str, partition: int = 0) -> None:
        """Neither lead nor follow this partition any more (it moved away, or the node stops)."""
        tp = (topic, partition)
        if self.leading.pop(tp, None) is not None:
            self.host.fail_confirms_of(topic, self.not_leader(topic, partition))
            if not is_group_log(topic):
                self.on_step_down(topic)
        self.following.pop(tp, None)
        self.replicas.unfollow(topic, partition)
        if not is_group_log(topic):
            self.stop(group_log_name(topic), partition)

    def role(self, topic: str, partition: int = 0) -> Role:
        if (topic, partition) in self.leading:
            return Role.LEADER
        if (topic, partition) in self.following:
            return Role.FOLLOWER
        return Role.NONE

    def leader_of(self, topic: str, partition: int = 0) -> PartitionLeader | None:
        return self.leading.get((topic, partition))

    # --- ISR answers from the agent ------------------------------------------------------------

    def isr_written(self, topic: str, partition: int, isr: Iterable[str]) -> None:
        """The agent wrote (or etcd holds) this ISR for a partition this node leads."""
        leader = self.leading.get((topic, partition))
        if leader is not None:
            leader.isr_written(isr)
            self._hw_moved(topic, leader, self.host.store.topic(topic))
        if not is_group_log(topic):
            self.isr_written(group_log_name(topic), partition, isr)

    def isr_refused(self, topic: str, partition: int) -> None:
        leader = self.leading.get((topic, partition))
        if leader is not None:
            leader.isr_refused()

    def follower_gone(self, node: str) -> None:
        """A node's key left etcd: propose dropping it from every ISR this node leads."""
        for leader in self.leading.values():
            leader.follower_gone(node)

    # --- what the broker asks --------------------------------------------------------------------

    def not_leader(self, topic: str, partition: int = 0) -> NotLeader:
        following = self.following.get((topic, partition))
        name, number = split_log(topic)  # the log T#k is partition k of T: clients know it by those
        if following is None:
            return NotLeader(f"{name}/{number} is not led by this node", topic=name, partition=number)
        return NotLeader(
            f"{name}/{number} is led by {following.leader}",
            topic=name,
            partition=number,
            leader=following.leader,
            leader_addr=following.address,
            leader_epoch=following.epoch,
        )

    def check_leader(self, topic: str, partition: int = 0) -> PartitionLeader:
        """This node's leadership of the partition, or ``NOT_LEADER`` naming the leader it knows."""
        leader = self.leading.get((topic, partition))
        if leader is None:
            if (topic, partition) not in self.following:
                self.on_unknown(topic)  # a topic the cluster may not know yet: cluster mode asks for it
            raise self.not_leader(topic, partition)
        return leader

    def check_group_admin(self, topic: str, partition: int = 0) -> None:
        """A group ADMIN op (describe, reset, delete) on a followed topic: ``NOT_LEADER``.

        A topic's groups live on its leader; a follower that made or changed one
        of its own would be changing a copy nobody dispatches from, silently.
        """
        if (topic, partition) in self.following:
            raise self.not_leader(topic, partition)

    def check_publish(self, topic: str, partition: int = 0) -> int:
        """A PUBLISH goes only to the leader, and only while enough replicas are in sync; the epoch to write."""
        check_client_topic(topic)
        leader = self.check_leader(topic, partition)
        if self.draining:  # a controlled shutdown: appends stop so a follower can catch up to the end
            name, number = split_log(topic)
            raise NotLeader(
                f"{name}/{number}: its leader {self.node_id} is shutting down", topic=name, partition=number
            )
        leader.check_publish()
        return leader.epoch

    def on_replica_fetch(self, frame: Frame, log_: TopicLog) -> dict[str, int] | None:
        """A follower's FETCH: check it, record it; the ``diverging`` answer when its log left this one."""
        topic = log_.name
        leader = self.check_leader(topic)
        check_epoch(hfield(frame, "leader_epoch", int, None), leader.epoch)
        offset = hfield(frame, "offset", int, 0)
        last_epoch = hfield(frame, "last_epoch", int, None)
        found = diverging(log_.epoch_end_offset(last_epoch) if last_epoch else (-1, -1), last_epoch, offset)
        if found is not None:
            return found
        durable = hfield(frame, "durable", int, 0)
        if frame.get("report"):
            leader.on_report(hfield(frame, "replica", str), offset, durable)
        else:
            leader.on_fetch(hfield(frame, "replica", str), offset, durable, log_.end_offset, self.clock())
        self._hw_moved(topic, leader, log_)
        return None

    def hw(self, topic: str, partition: int = 0) -> int:
        leader = self.leading.get((topic, partition))
        if leader is not None:
            return leader.hw
        followed = self.replicas.followed(topic, partition)
        return followed.hw if followed is not None else 0

    def successors(self) -> dict[TopicPartition, str]:
        """For each led partition, a follower that holds its whole log durably (controlled shutdown)."""
        found: dict[TopicPartition, str] = {}
        for tp, leader in self.leading.items():
            if is_group_log(tp[0]):
                continue  # moves with its topic: every delivery it counted is on each ISR member already
            node = leader.successor(self.host.store.topic(tp[0]).end_offset)
            if node is not None:
                found[tp] = node
        return found

    # --- the loop's hooks -------------------------------------------------------------------------

    def after_sync(self, topics: set[str]) -> None:
        """After the group commit: a led partition's own durable end moved (HW may follow); followers fetch."""
        for topic in list(topics):
            leader = self.leading.get((topic, 0))
            if leader is not None:
                self._hw_moved(topic, leader, self.host.store.topic(topic))
        self.replicas.after_sync(topics)

    def on_events(self, events: dict[Any, int]) -> float | None:
        """The leaders' answers to this node's replica FETCHes; when a retry they asked for is due."""
        return self.replicas.on_events(events)

    def tick(self, now: float) -> float | None:
        """Links to leaders (connects, silence, retries) and ISR lag checks; when to come back."""
        for leader in self.leading.values():
            leader.check_lag(now)
        wanted = self.replicas.tick(now)
        if self.leading:
            wanted = min(wanted, now + 1.0) if wanted is not None else now + 1.0
        return wanted

    def close(self) -> None:
        self.replicas.close()

    def _hw_moved(self, topic: str, leader: PartitionLeader, log_: TopicLog) -> None:
        moved = leader.update_hw(log_.durable_offset)
        if moved or log_.high_watermark != leader.hw:
            log_.set_high_watermark(leader.hw)  # readers and confirms see up to it (``visible_offset``)
            self.host.appended.add(topic)  # the group commit wakes confirms, deliveries and FETCHes

    def _log(self, topic: str) -> TopicLog:
        store = self.host.store
        if topic not in store.logs:
            store.create_topic(topic, GROUP_LOG_SETTINGS if is_group_log(topic) else None)
        return store.topic(topic)


def check_client_topic(topic: str) -> None:
    """``__groups.<topic>`` is a topic's group log, written by its leader only: ``INVALID_NAME`` to a client."""
    if is_group_log(topic):
        raise InvalidName(f"{topic!r}: names starting with '__groups.' are the cluster's group logs", topic=topic)
