"""Consumer groups follow a topic's leadership (cluster mode).

When this node starts leading a topic, its groups are rebuilt from the
topic's group log (``group_log``): committed offsets, what was in flight
(redelivered now, its delivery counted), delayed redeliveries with their due
times, dead letters not yet stored. When it stops leading, the groups and
their subscriptions here end: each member is told BYE and subscribes again
where the topic is led now. The broker's parts the gate needs
(``GateHost``) are reached through here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from conveyor.broker.server.group_log import (
    DeliveryGate,
    GroupStates,
    apply_from,
    group_log_name,
    is_group_log,
    replay,
)
from conveyor.broker.server.groups import DeadLetter, Delivery, Group
from conveyor.broker.server.partitions import Partitions
from conveyor.broker.wire import commands

if TYPE_CHECKING:
    from conveyor.broker.server.broker import Broker

log = logging.getLogger("conveyor.group_roles")


class GroupRoles:
    """The broker side of group replication: ``Partitions``' ``on_lead``/``on_step_down``, the gate's host."""

    def __init__(self, broker: Broker, partitions: Partitions) -> None:
        self.broker = broker
        self.partitions = partitions
        self.gate: DeliveryGate | None = None
        self.applied: dict[str, int] = {}  # followed group log -> the offset its records are applied up to

    # --- GateHost -------------------------------------------------------------------------------

    def leader_epoch(self, topic: str) -> int | None:
        leader = self.partitions.leader_of(topic)
        return leader.epoch if leader is not None else None

    def send_plan(self, group: Group, plan: Delivery, frames: list[Any]) -> None:
        self.broker.dispatcher.send_plan(group, plan, frames)

    def dying(self) -> dict[Group, list[DeadLetter]]:
        return self.broker.dead_letters.dying()

    def wake(self, topic: str) -> None:
        """A group log grew: the followers' parked FETCH is answered now, and the next pass syncs it."""
        self.broker.appended.add(topic)
        self.broker.fetches.wake(topic)
        self.broker.stop_wake()

    def want_topic(self, topic: str) -> None:
        """A dead-letter topic the cluster may not have: the controller is asked for it (once at a time)."""
        if self.broker.cluster is not None:
            self.broker.cluster.want_topic(topic)

    # --- following ---------------------------------------------------------------------------------

    def apply_followed(self) -> None:
        """Apply what the followed group logs received since the last call to ``groups.json``.

        A new leadership replays its group log anyway; this keeps a follower's offsets file
        (what an operator or a tool reads) in step. A log cut back or restarted since (a
        truncation, retention) is replayed from its latest snapshot.
        """
        store = self.broker.store
        followed = [topic for topic, _partition in self.partitions.following]
        topics = {group_log_name(topic): topic for topic in followed if not is_group_log(topic)}
        for name in followed:
            log_ = store.logs.get(name)
            topic = topics.get(name)
            if log_ is None or topic is None:
                continue
            applied = self.applied.get(name)
            if topic is None or applied == log_.end_offset:
                continue
            if applied is None or not log_.start_offset <= applied <= log_.end_offset:
                states = replay(log_) or {}
            else:
                states = dict(store.groups.get(topic, {}))
                apply_from(log_, states, applied)
            self._store(topic, states)
            self.applied[name] = log_.end_offset

    def _store(self, topic: str, states: GroupStates) -> None:
        store = self.broker.store
        for name in [n for n in store.groups.get(topic, {}) if n not in states]:
            store.delete_group(topic, name)
        for name, state in states.items():
            if store.group(topic, name) != state:
                store.save_group(topic, name, state)

    # --- leadership -------------------------------------------------------------------------------

    def lead(self, topic: str) -> None:
        """This node leads ``topic`` now: its groups start from the group log."""
        assert self.gate is not None
        broker = self.broker
        self._drop(topic, "leadership changed")
        states = self.gate.lead(topic, dict(broker.store.groups.get(topic, {})))
        self._store(topic, states)  # this node's groups.json holds what it leads from
        self.applied.pop(group_log_name(topic), None)
        for name, state in states.items():
            try:
                group = broker.groups.make(topic, name, state)
            except Exception as exc:  # one bad state never keeps the others from leading
                broker.containment.record("group_log", exc, {"topic": topic, "group": name})
                continue
            broker.to_dispatch.add(group)
        if states:
            log.info("%s: %d group(s) resumed from %s", topic, len(states), group_log_name(topic))

    def step_down(self, topic: str) -> None:
        """This node no longer leads ``topic``: its groups and subscriptions here end."""
        self._drop(topic, f"{topic} is led by another node now")

    def _drop(self, topic: str, reason: str) -> None:
        broker = self.broker
        if self.gate is not None:
            self.gate.drop(topic)
        told: set[bytes] = set()
        for group in broker.groups.of_topic(topic):
            for member in group.members + group.joining:
                broker.peers.forget_subscription(member.peer, member.sub_id)
                if member.peer not in told:
                    told.add(member.peer)
                    broker._send(member.peer, commands.bye(reason))
            del broker.groups[(topic, group.name)]
