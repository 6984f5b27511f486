"""Consumer groups across failover: each replicated topic's group log, and the delivery gate.

In a cluster, a topic's consumer groups live on its leader, so their state
must reach the followers before a failover needs it. Each replicated topic
``T`` has a second local log, ``__groups.T`` (``group_log_name``), led and
followed with ``T`` (same epoch, replicas and in-sync set: ``Partitions``
shadows every role change of ``T`` on it) and replicated by the same
follower FETCH. Its records are group states: one batch per dispatch pass,
holding, for each group the pass changed, what ``groups.json`` keeps of it
(settings, next offset, the unsettled ranges with their delivery counts,
due times and dead letters being written). A group's latest record is its
state, so replaying is idempotent and order is the log's. A new leadership
writes a snapshot (every group) first.

The delivery gate: a DELIVER planned in a pass is held until the record of
that pass (which counts the delivery) is below the group log's high
watermark, so a failover can never forget a delivery a consumer saw, and no
message goes past ``max_deliveries`` because a count was lost. It is the
mechanism that gates confirms. Deliveries are planned over what the leader
holds durably (``Ahead``), not only below the topic's high watermark, and a
DELIVER also waits until its messages are below that HW: the record and
the messages it delivers are replicated in the same round trip, instead of
the record's round starting only once the messages' round ended. A record
that counts a delivery whose messages a new leader lacks is harmless: a
group resumes at most at its log's end (``GroupTable.make``), and those
offsets come as new.

A single node has none of this: no group log, no gate, the same files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgpack
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.groups import DeadLetter, Delivery, Group
from conveyor.broker.wire.record import pack_records, unpack_records

from conveyor.names import fit_name

log = logging.getLogger("conveyor.group_log")

PREFIX = "__groups."
REPLAY_BYTES = 1 << 20
# A group log keeps its newest records (whole segments past ``retention_bytes`` go) and a snapshot is
# written after every ``SNAPSHOT_BYTES`` of records, so the latest snapshot is always kept and a new
# leader replays at most about that much.
SETTINGS = {"segment_bytes": 4 << 20, "retention_bytes": 64 << 20}
SNAPSHOT_BYTES = 1 << 20

GroupStates = dict[str, dict[str, Any]]


def group_log_name(topic: str) -> str:
    """The name of ``topic``'s group log (a valid topic name, however long ``topic`` is)."""
    return fit_name(PREFIX + topic)


def is_group_log(name: str) -> bool:
    return name.startswith(PREFIX)


def group_state(group: Group, now: float, now_ms: int, dying: Any = ()) -> dict[str, Any]:
    """What a record keeps of a group: what ``groups.json`` keeps (settings and ``saved_state``)."""
    return {**group.settings.to_dict(), **group.saved_state(now, now_ms, dying)}


def encode_record(states: dict[str, dict[str, Any] | None], *, snapshot: bool, since: int) -> bytes:
    """One batch body: one record whose value maps group name -> state (None: the group is gone).

    ``since`` is the offset of the latest snapshot (this one's own for a snapshot): replay starts there.
    """
    value = msgpack.packb({"snapshot": snapshot, "since": since, "groups": states}, use_bin_type=True)
    return pack_records([(None, None, value)])


def _decode(body: bytes) -> list[dict[str, Any]]:
    return [msgpack.unpackb(value, raw=False, strict_map_key=False) for _k, _h, value in unpack_records(body)]


def apply_record(states: GroupStates, body: bytes) -> None:
    """Apply one stored batch of a group log to ``states`` (a snapshot replaces them all)."""
    for record in _decode(body):
        if record.get("snapshot"):
            states.clear()
        for name, state in record.get("groups", {}).items():
            if state is None:
                states.pop(name, None)
            else:
                states[name] = state


def replay(log_: TopicLog) -> GroupStates | None:
    """The group states a group log holds (every batch this node has); None when it holds none."""
    if log_.end_offset <= log_.start_offset:
        return None
    states: GroupStates = {}
    apply_from(log_, states, max(log_.start_offset, latest_snapshot(log_)))
    return states


def apply_from(log_: TopicLog, states: GroupStates, offset: int) -> None:
    """Apply to ``states`` every record of ``log_`` from ``offset`` to its end (what this node holds)."""
    while offset < log_.end_offset:
        batches = log_.read(offset, max_bytes=REPLAY_BYTES)
        if not batches:
            break
        for batch in batches:
            if batch.next_offset > offset:
                apply_record(states, batch.body)
                offset = batch.next_offset


def latest_snapshot(log_: TopicLog) -> int:
    """Where the latest snapshot is, as the log's last record says (0 when it does not say)."""
    last = log_.read(log_.end_offset - 1, max_bytes=1)
    records = _decode(last[-1].body) if last else []
    return int(records[-1].get("since", 0)) if records else 0


class GateHost(Protocol):
    """What the gate needs of the broker's parts."""

    def leader_epoch(self, topic: str) -> int | None: ...  # this node's epoch if it leads ``topic``
    def send_plan(self, group: Group, plan: Delivery, frames: list[Any]) -> None: ...
    def dying(self) -> dict[Group, list[DeadLetter]]: ...
    def wake(self, topic: str) -> None: ...  # a group log was appended to: followers fetch, the loop syncs
    def want_topic(self, topic: str) -> None: ...  # ask the cluster for a topic (a dead-letter topic)


@dataclass(slots=True)
class Held:
    """A planned DELIVER waiting for its pass's record, and its messages, to be replicated."""

    group: Group
    plan: Delivery
    frames: list[Any]
    data_end: int = 0  # the topic's HW must reach this: the end of the messages it delivers
    after: int = -1  # the group log's end once that record is written; -1: not yet written


class Ahead:
    """A led topic's log as the gated dispatch reads it: up to what this leader holds durably.

    Readers elsewhere see a replicated log only below its high watermark
    (``TopicLog.visible_offset``); deliveries planned here leave only once their
    messages are below it too (``DeliveryGate.release``).
    """

    def __init__(self, log_: TopicLog) -> None:
        self._log = log_
        self.visible_offset = log_.durable_offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


class DeliveryGate:
    """Group-state records of the led topics, and the DELIVERs that wait for them."""

    def __init__(self, store: Store, host: GateHost, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.host = host
        self.clock = clock
        self.held: dict[str, list[Held]] = {}
        self.touched: set[Group] = set()
        self.written: dict[tuple[str, str], dict[str, Any]] = {}
        self.records = 0  # group-state records written (a metric for tests and status)
        self.snapshots: dict[str, tuple[int, int]] = {}  # topic -> (latest snapshot's offset, bytes since)

    def gates(self, topic: str) -> bool:
        """Whether deliveries of ``topic`` wait for the group log (this node leads it)."""
        return self.host.leader_epoch(group_log_name(topic)) is not None

    def leads(self, topic: str) -> bool:
        """Whether this node leads ``topic`` (a dead-letter topic is written only where it is led)."""
        return self.host.leader_epoch(topic) is not None

    def want_topic(self, topic: str) -> None:
        self.host.want_topic(topic)

    def planning_view(self, log_: TopicLog) -> TopicLog:
        """The log a gated dispatch plans over: past HW, up to this leader's durable end."""
        return cast(TopicLog, Ahead(log_))

    def hold(self, group: Group, plan: Delivery, frames: list[Any]) -> None:
        data_end = max((entry.end for entry in plan.entries), default=0)
        self.held.setdefault(group.topic, []).append(Held(group, plan, frames, data_end))

    def touch(self, group: Group) -> None:
        self.touched.add(group)

    # --- the records ----------------------------------------------------------------------------

    def write(self) -> None:
        """One record per topic whose groups changed this pass; the DELIVERs held till now wait for it."""
        if not self.touched and not self.held:
            return
        by_topic: dict[str, list[Group]] = {}
        for group in self.touched:
            by_topic.setdefault(group.topic, []).append(group)
        self.touched.clear()
        for topic in set(by_topic) | set(self.held):
            self._write_topic(topic, by_topic.get(topic, []))

    def _write_topic(self, topic: str, groups: list[Group]) -> None:
        name = group_log_name(topic)
        epoch = self.host.leader_epoch(name)
        target = self.store.logs.get(name)
        if epoch is None or target is None:
            return
        now, now_ms = self.clock(), int(time.time() * 1000)
        dying = self.host.dying() if groups else {}
        changed: dict[str, dict[str, Any] | None] = {}
        live = self.store.groups.get(topic, {})
        for group in groups:
            if group.name not in live:
                continue  # deleted since (its tombstone is written)
            state = group_state(group, now, now_ms, dying.get(group, ()))
            if self.written.get((topic, group.name)) != state:
                changed[group.name] = state
        since, size = self.snapshots.get(topic, (0, 0))
        for group_name, written in changed.items():
            if written is not None:
                self.written[(topic, group_name)] = written
        if changed and size >= SNAPSHOT_BYTES:
            self._snapshot(topic, target, epoch)
        elif changed:
            body = encode_record(changed, snapshot=False, since=since)
            target.append(body, 1, leader_epoch=epoch)
            self.snapshots[topic] = (since, size + len(body))
            self.records += 1
            self.host.wake(name)
        for held in self.held.get(topic, []):
            if held.after < 0:
                held.after = target.end_offset

    def forget(self, topic: str, group: str) -> None:
        """A group was deleted: its tombstone goes into the group log (this node leads the topic)."""
        name = group_log_name(topic)
        epoch = self.host.leader_epoch(name)
        target = self.store.logs.get(name)
        self.written.pop((topic, group), None)
        if epoch is None or target is None:
            return
        since, size = self.snapshots.get(topic, (0, 0))
        body = encode_record({group: None}, snapshot=False, since=since)
        target.append(body, 1, leader_epoch=epoch)
        self.snapshots[topic] = (since, size + len(body))
        self.records += 1
        self.host.wake(name)

    def release(self) -> None:
        """Send the held DELIVERs whose record and messages are below their logs' high watermarks, in order."""
        for topic in list(self.held):
            items = self.held[topic]
            target = self.store.logs.get(group_log_name(topic))
            data = self.store.logs.get(topic)
            if target is None or data is None:
                continue
            visible, data_visible = target.visible_offset, data.visible_offset
            ready = 0
            while ready < len(items) and 0 <= items[ready].after <= visible and items[ready].data_end <= data_visible:
                ready += 1
            if not ready:
                continue
            out, self.held[topic] = items[:ready], items[ready:]
            if not self.held[topic]:
                del self.held[topic]
            for held in out:
                if any(chunk.id in held.group.chunks for chunk in held.plan.chunks):
                    self.host.send_plan(held.group, held.plan, held.frames)

    # --- leadership -------------------------------------------------------------------------------

    def lead(self, topic: str, local: GroupStates) -> GroupStates:
        """This node now leads ``topic``: the group states to start from, written as a snapshot.

        They are what its group log holds; a log with no record yet (a topic made before the
        group log, or a node that held it alone) starts from ``local`` (its ``groups.json``).
        """
        name = group_log_name(topic)
        target = self.store.logs.get(name)
        states = replay(target) if target is not None else None
        if states is None:
            states = dict(local)
        self.drop(topic)
        epoch = self.host.leader_epoch(name)
        for group_name, state in states.items():
            self.written[(topic, group_name)] = state
        if target is not None and epoch is not None:
            self._snapshot(topic, target, epoch, states)
        return states

    def _snapshot(self, topic: str, target: TopicLog, epoch: int, states: GroupStates | None = None) -> None:
        """Every group of ``topic`` in one record: replay starts here from now on."""
        if states is None:
            states = {name: state for (of, name), state in self.written.items() if of == topic}
        since = target.end_offset
        body = encode_record(dict(states), snapshot=True, since=since)
        target.append(body, 1, leader_epoch=epoch)
        self.snapshots[topic] = (since, 0)
        self.records += 1
        self.host.wake(target.name)

    def drop(self, topic: str) -> None:
        """This node no longer leads ``topic``: its held DELIVERs never leave, its records are forgotten."""
        self.held.pop(topic, None)
        self.snapshots.pop(topic, None)
        for key in [k for k in self.written if k[0] == topic]:
            del self.written[key]
        self.touched = {g for g in self.touched if g.topic != topic}
