"""The broker's consumer groups: the index, and how a group is made, loaded, changed and committed.

A pass that appended to a topic wakes that topic's groups: looking them up
must cost what the topic has, not what the broker has (a broker may hold
100,000 groups, nearly all idle). The index keeps the by-topic view in step
with every insertion and removal of the plain mapping. ``GroupTable`` adds
the rules: stored settings are checked, a new group starts where it asks
(``earliest``, ``latest``, an offset, a timestamp), the newest
subscription's settings win, and offsets are committed by the store's writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from conveyor.broker.config.options import INT32_MAX, INT64_MAX
from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.groups import DeadLetter, Group, GroupSettings

from conveyor.errors import ConveyorError, GroupLimit, InvalidName, InvalidRequest
from conveyor.names import log_fields, log_label

log = logging.getLogger("conveyor.broker")

Key = tuple[str, str]


class GroupIndex(dict[Key, Group]):
    """``{(topic, group): Group}`` that also answers ``of_topic(topic)`` in O(groups of that topic)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_topic: dict[str, dict[str, Group]] = {}

    def __setitem__(self, key: Key, group: Group) -> None:
        super().__setitem__(key, group)
        self._by_topic.setdefault(key[0], {})[key[1]] = group

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        self._unindex(key)

    def pop(self, key: Key, *default: Any) -> Any:
        if key in self:
            self._unindex(key)
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self._by_topic.clear()

    def _unindex(self, key: Key) -> None:
        topic = self._by_topic.get(key[0])
        if topic is not None:
            topic.pop(key[1], None)
            if not topic:
                del self._by_topic[key[0]]

    def of_topic(self, topic: str) -> list[Group]:
        """The groups of ``topic`` (a copy: safe to change the index while walking it)."""
        return list(self._by_topic.get(topic, {}).values())

    def names_of_topic(self, topic: str) -> list[str]:
        return sorted(self._by_topic.get(topic, {}))

    def live(self, group: Group) -> bool:
        """Still the table's group for its name (not deleted, nor replaced by a new one)."""
        return self.get((group.topic, group.name)) is group


def resolve_position(log: TopicLog, position: Any) -> int:
    """``earliest``, ``latest``, an offset, or ``{"timestamp": ms}`` to an offset."""
    if position in (None, "earliest"):
        return log.start_offset
    if position == "latest":
        return log.end_offset
    if isinstance(position, int) and not isinstance(position, bool):
        return min(max(position, log.start_offset), log.end_offset)
    if isinstance(position, dict):
        if "offset" in position:
            return resolve_position(log, int(position["offset"]))
        if "timestamp" in position:
            return log.offset_for_timestamp(int(position["timestamp"]))
    if isinstance(position, str) and position.lstrip("-").isdigit():
        return resolve_position(log, int(position))
    raise InvalidRequest(f"position must be earliest, latest, an offset or {{'timestamp': ms}}, not {position!r}")


class GroupTable(GroupIndex):
    """The groups, over ``store``; ``to_dispatch`` is the loop's set of groups to dispatch this pass."""

    def __init__(
        self,
        store: Store,
        *,
        defaults: Callable[[], GroupSettings],
        max_groups: int,
        metrics: Any,
        to_dispatch: set[Group],
        clock: Callable[[], float],
    ) -> None:
        super().__init__()
        self.store = store
        self.defaults = defaults
        self.max_groups = max_groups
        self.metrics = metrics
        self.to_dispatch = to_dispatch
        self.clock = clock

    def load(self) -> None:
        for topic, groups in self.store.groups.items():
            for name, state in groups.items():
                self.make(topic, name, state)

    def make(self, topic: str, name: str, state: dict[str, Any]) -> Group:
        """A group from its saved ``state`` (its offsets, settings and unsettled messages), now in the table."""
        log_ = self.store.topic(topic)
        settings = self.stored_settings(topic, name, state)
        offset = int(state.get("next_offset", state.get("committed_offset", log_.start_offset)))
        if offset > log_.end_offset:  # the log lost a tail the offsets file had seen (power cut, fsync=none)
            log.warning("group %s/%s: committed offset %d is past the log end %d", topic, name, offset, log_.end_offset)
            offset = log_.end_offset  # new messages will take those offsets again: deliver them
        group = Group(topic, name, settings, next_offset=offset, clock=self.clock)
        group.skipped_by_retention = int(state.get("skipped_by_retention", 0))
        group.on_skip = self._skipped_by_retention
        # What was unsettled when the broker stopped comes again with its delivery counts.
        group.restore(state.get("unsettled", []), self.clock(), int(time.time() * 1000))
        if group.dead:
            self.to_dispatch.add(group)  # dead letters are stored without waiting for a member
        group.skip_retained(log_.start_offset)  # retention ran past it while the broker was down
        self[(topic, name)] = group
        return group

    def create(self, topic: str, name: str, start: Any, settings: GroupSettings) -> Group:
        """A new group for a SUBSCRIBE, starting at ``start``; saved at once."""
        log_ = self.store.topic(topic)
        if topic in self.store.groups_quarantined and start != "earliest":
            # Its offsets were in the quarantined file: starting later could skip what it never acked.
            log.warning(
                "group %s/%s asks to start at %r, but %s's offsets file was quarantined and this may be an old "
                "group: starting at the log start instead (its messages are delivered again)",
                topic,
                name,
                start,
                topic,
            )
            start = "earliest"
        group = self.make(topic, name, {"committed_offset": resolve_position(log_, start), **settings.to_dict()})
        self.store.save_group(topic, name, {**group.settings.to_dict(), "committed_offset": group.next_offset})
        return group

    def stored_settings(self, topic: str, name: str, state: dict[str, Any]) -> GroupSettings:
        """A group's stored settings; one out of range (a hand-edited groups.json) is logged and the default used.

        The same bounds as a SUBSCRIBE's: a stored setting must never make a group
        dead-letter everything, expire every lease at once, or retry an impossible dead letter.
        """
        defaults = self.defaults()
        values = {**defaults.to_dict(), **{k: state[k] for k in defaults.to_dict() if k in state}}
        bounds = {"max_deliveries": (1, INT64_MAX), "ack_timeout_ms": (1, INT32_MAX)}
        for key, (low, high) in bounds.items():
            if not low <= values[key] <= high:
                log.error(
                    "group %s/%s: stored %s %r is out of range [%d, %d]; using %r",
                    topic,
                    name,
                    key,
                    values[key],
                    low,
                    high,
                    getattr(defaults, key),
                )
                values[key] = getattr(defaults, key)
        if values["dead_letter_topic"]:
            try:
                check_name(values["dead_letter_topic"])
                if values["dead_letter_topic"] == topic:
                    raise InvalidName("it is the group's own topic: dead letters would loop back to the group")
            except InvalidName as exc:
                log.error("group %s/%s: stored dead_letter_topic refused (%s); using %s.dlq", topic, name, exc, topic)
                values["dead_letter_topic"] = ""
        return GroupSettings(**values)

    def _skipped_by_retention(self, group: Group, count: int) -> None:
        """A group moved past messages retention deleted before it got to them: say so, and count them."""
        log.warning(
            "group %s/%s: %d message(s) skipped: retention deleted them before the group got to them; "
            "it goes on from offset %d",
            group.topic,
            group.name,
            count,
            group.next_offset,
        )
        self.metrics.skipped_messages.labels(group.topic, group.name, "retention").inc(count)

    def check_room(self, topic: str, name: str) -> None:
        """GROUP_LIMIT when the broker already holds ``--max-groups`` groups."""
        if len(self) >= self.max_groups:
            raise GroupLimit(
                f"cannot create group {name} on {log_label(topic)}: the broker holds {len(self)} groups "
                f"(--max-groups {self.max_groups})",
                **log_fields(topic),
                group=name,
                limit=self.max_groups,
            )

    def apply_settings(self, group: Group, settings: GroupSettings, by: bytes) -> None:
        """The newest subscription's settings are the group's (what a redeploy expects): apply, log, store."""
        changes = group.settings.changes(settings)
        if not changes:
            return
        log.warning(
            "group %s/%s: settings changed by a new subscription from %s: %s",
            group.topic,
            group.name,
            by.hex(),
            ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()),
        )
        group.apply_settings(settings)
        group.settings_changed = {
            "at_ms": int(time.time() * 1000),
            "by": by.hex(),
            "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()},
        }
        state = self.store.group(group.topic, group.name) or {}
        committed = state.get("committed_offset", group.committed_offset)
        self.store.save_group(group.topic, group.name, {**state, **settings.to_dict(), "committed_offset": committed})
        self.metrics.group_settings_changes.labels(group.topic, group.name).inc()
        self.to_dispatch.add(group)

    def skip_retained(self, moved: list[TopicLog]) -> None:
        """After retention: a group below its log's new start goes on from there, members or not."""
        for log_ in moved:
            for group in self.of_topic(log_.name):
                if group.skip_retained(log_.start_offset):
                    self.to_dispatch.add(group)

    def reset_topic(self, topic: str, offset: int) -> None:
        """The topic's log starts again at ``offset`` (a mirror's resync): so do its groups, saved at once."""
        for group in self.of_topic(topic):
            group.skip_retained(offset)  # the parent's retention deleted what came before
            group.reset(offset)
            self.store.save_group(topic, group.name, {**group.settings.to_dict(), "committed_offset": offset})
            self.to_dispatch.add(group)
        self.store.write_groups()

    def commit(self, moved: Iterable[Group], dying: dict[Group, list[DeadLetter]]) -> None:
        """Stage the offsets of ``moved`` (``dying``: letters not yet settled) and hand them to the writer."""
        now, now_ms = self.clock(), int(time.time() * 1000)  # due times are saved on the wall clock
        states = {(g.topic, g.name): g.saved_state(now, now_ms, dying.get(g, ())) for g in moved if self.live(g)}
        self.store.commit_groups(states)
        try:
            self.store.write_groups(wait=False)  # two fsyncs and a rename: not on the event loop
        except ConveyorError as exc:
            log.error("committing group offsets failed: %s", exc)
