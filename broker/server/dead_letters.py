"""Dead-lettering: messages past ``max_deliveries`` (or terminated) go to the dead-letter topic.

A dead letter is one batch holding the original records, headers naming
why they died. It is settled only once the dead-letter topic holds it
durably (the same group commit as confirms); a write that fails, or a sync
that cuts it back, puts the messages back unsettled to be tried again, so a
dead letter is never lost. This is the exceptional path, so it may decode
records one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.confirms import Send
from conveyor.broker.server.containment import Containment
from conveyor.broker.server.group_table import GroupIndex
from conveyor.broker.server.groups import MAX_ENTRIES, DeadLetter, Group, Pending, entries_for
from conveyor.broker.server.partition_logs import dead_letter_target
from conveyor.broker.wire import commands
from conveyor.broker.wire.ranges import Range
from conveyor.broker.wire.ranges import count as count_offsets
from conveyor.broker.wire.record import Batch, pack_records, unpack_records

from conveyor.errors import ConveyorError
from conveyor.names import dead_letter_log, dead_letter_topic, split_log

if TYPE_CHECKING:
    from conveyor.broker.server.group_log import DeliveryGate

log = logging.getLogger("conveyor.broker")

ORIGIN_TOPIC = "x-origin-topic"
ORIGIN_PARTITION = "x-origin-partition"  # only for partition k > 0: a single-partition dead letter is unchanged
ORIGIN_OFFSET = "x-origin-offset"
ORIGIN_GROUP = "x-origin-group"
ORIGIN_TIMESTAMP = "x-origin-timestamp"
DELIVERY_COUNT = "x-delivery-count"
LAST_ERROR = "x-last-error"

# A dead letter that cannot be stored for a reason time will not fix (a mirrored, read-only dead-letter
# topic, an invalid name, a bug) is kept unsettled and tried again this slowly: never dropped, never
# retried every second.
DEAD_LETTER_RETRY_SECONDS = 30.0
# Cluster mode: how often dead letters waiting for their dead-letter topic to be led here try again.
DEAD_LETTER_WAIT_SECONDS = 1.0

__all__ = ["DEAD_LETTER_RETRY_SECONDS", "DeadLetters", "DeadWrite", "dead_letter_body", "dead_letter_topic"]


def dead_letter_body(
    log: TopicLog, ranges: list[Range], *, group: str, deliveries: int, reason: str
) -> tuple[bytes, int] | None:
    """One batch body holding every message of ``ranges``, headers naming their origin."""
    records: list[Any] = []
    for start, end in ranges:
        for batch in _batches(log, max(start, log.start_offset), end):
            decoded = unpack_records(batch.body)
            for offset in range(max(start, batch.base_offset), min(end, batch.next_offset)):
                key, headers, value = decoded[offset - batch.base_offset]
                records.append([key, _origin(headers, log.name, offset, batch, group, deliveries, reason), value])
    if not records:
        return None
    return pack_records(records), len(records)


def _origin(
    headers: dict[str, Any] | None, log: str, offset: int, batch: Batch, group: str, deliveries: int, reason: str
) -> dict[str, Any]:
    """The origin headers: the topic's name (never the log ``T#k``), and its partition when it is not 0."""
    topic, partition = split_log(log)
    where = {ORIGIN_TOPIC: topic, ORIGIN_PARTITION: str(partition)} if partition else {ORIGIN_TOPIC: topic}
    return {
        **(headers or {}),
        **where,
        ORIGIN_OFFSET: str(offset),
        ORIGIN_GROUP: group,
        ORIGIN_TIMESTAMP: str(batch.timestamp_ms),
        DELIVERY_COUNT: str(deliveries),
        LAST_ERROR: reason[:4096],
    }


def _batches(log: TopicLog, start: int, end: int) -> list[Batch]:
    out: list[Batch] = []
    offset = start
    while offset < min(end, log.end_offset):
        batches = log.read(offset, max_bytes=1 << 20)
        if not batches:
            break
        out.extend(b for b in batches if b.base_offset < end)
        offset = batches[-1].next_offset
    return out


@dataclass(slots=True)
class DeadWrite:
    """Dead letters appended to a dead-letter topic: settled once that append is durable."""

    group: Group
    letter: DeadLetter
    log: TopicLog
    end: int


class DeadLetters:
    """The dead letters being written, and what to do when they are stored, cut back or fail.

    ``to_dispatch``, ``appended`` and ``moved`` are the loop's sets (groups to dispatch, topics appended
    to, groups whose committed offset may move); ``on_cut`` answers confirms a failed sync cut back.
    """

    def __init__(
        self,
        store: Store,
        groups: GroupIndex,
        *,
        to_dispatch: set[Group],
        appended: set[str],
        moved: set[Group],
        send: Send,
        on_cut: Callable[[ConveyorError, TopicLog], None],
        metrics: Any,
        containment: Containment,
        clock: Callable[[], float],
    ) -> None:
        self.writes: list[DeadWrite] = []
        self.store = store
        self.groups = groups
        self.to_dispatch = to_dispatch
        self.appended = appended
        self.moved = moved
        self._send = send
        self._on_cut = on_cut
        self._metrics = metrics
        self._containment = containment
        self._clock = clock
        self.gate: DeliveryGate | None = None  # cluster mode: settled letters are recorded in the group log

    def _live(self, group: Group) -> bool:
        return self.groups.get((group.topic, group.name)) is group

    def handle(self) -> None:
        """Write the dead letters of the groups to dispatch this pass.

        Every path that makes dead letters (nack, term, leave, lease expiry) also queues the group for dispatch.
        """
        for group in [g for g in self.to_dispatch if g.dead]:
            if not self._live(group):
                continue
            source = self.store.logs.get(group.topic)
            for dead in group.take_dead(source.start_offset if source is not None else 0):
                if source is None:
                    continue
                try:
                    self._write(group, source, dead)
                except Exception as exc:  # never lost: kept unsettled and tried again, slowly
                    context = {"topic": group.topic, "group": group.name, "ranges": dead.ranges[:4]}
                    self._containment.record("dead_letter", exc, context)
                    failures = self._metrics.dead_letter_failures.labels(group.topic, group.name, "internal")
                    failures.inc(count_offsets(dead.ranges))
                    self.undead(group, dead, delay=DEAD_LETTER_RETRY_SECONDS)
            self.to_dispatch.add(group)

    def _write(self, group: Group, source: TopicLog, dead: DeadLetter) -> None:
        built = dead_letter_body(source, dead.ranges, group=group.name, deliveries=dead.deliveries, reason=dead.reason)
        if built is None:
            return
        name = dead_letter_log(group.topic, group.settings.dead_letter_topic)  # partition k: the DLQ's k
        failures = self._metrics.dead_letter_failures
        if self.gate is not None and not self.gate.leads(name):
            # In a cluster the dead-letter topic is a replicated topic: written where it is led. Not
            # here (yet): ask for it and keep the letters dead, never redelivered past max_deliveries.
            self.gate.want_topic(name)
            self.undead(group, dead, delay=DEAD_LETTER_WAIT_SECONDS, dead_only=True)
            return
        if name in self.store.logs and self.store.logs[name].config.read_only:
            # A mirror holds the parent's offsets: a local append would make it a different log.
            log.error(
                "dead-lettering %s/%s: %s is mirrored from the parent and read-only here; give the group a "
                "local dead-letter topic (dead_letter_topic, @retry_policy(dead_letter=...)). Redelivering "
                "in %.0f s instead",
                group.topic,
                group.name,
                name,
                DEAD_LETTER_RETRY_SECONDS,
            )
            failures.labels(group.topic, group.name, "read_only_topic").inc(built[1])
            self.undead(group, dead, delay=DEAD_LETTER_RETRY_SECONDS)
            return
        try:
            target = dead_letter_target(self.store, group.topic, name)
            result = target.append(built[0], built[1])
        except ConveyorError as exc:
            retriable = exc.retriable
            delay = 1.0 if retriable else DEAD_LETTER_RETRY_SECONDS
            log.error(
                "dead-lettering %s/%s into %s failed, redelivering in %.0f s instead: %s",
                group.topic,
                group.name,
                name,
                delay,
                exc,
            )
            if name in self.store.logs:  # a sync inside the append may have cut it back
                self._on_cut(exc, self.store.logs[name])
            failures.labels(group.topic, group.name, "storage" if retriable else exc.name.lower()).inc(built[1])
            self.undead(group, dead, delay=delay)
            return
        self.writes.append(DeadWrite(group, dead, target, result.base_offset + result.count))
        self.appended.add(target.name)
        self._metrics.dead_lettered_messages.labels(group.topic, group.name).inc(built[1])
        if dead.expired:
            self._metrics.expired_messages.labels(group.topic, group.name).inc(built[1])

    def settle_durable(self) -> None:
        """Settle the dead letters now durable (their groups' offsets may commit) and tell their members."""
        if not self.writes:
            return
        stored = [w for w in self.writes if w.end <= w.log.visible_offset]
        self.moved.update(w.group for w in stored)
        if self.gate is not None:
            for write in stored:
                self.gate.touch(write.group)
        self.writes = [w for w in self.writes if w.end > w.log.visible_offset]
        for write in stored:
            if write.letter.by_broker:
                with self._containment.guard("dead_letter", topic=write.group.topic, group=write.group.name):
                    self._tell(write)

    def cut(self) -> None:
        """After a failed sync: dead letters their topic no longer holds are not dead-lettered after all."""
        for write in [w for w in self.writes if w.end > w.log.end_offset]:
            self.writes.remove(write)
            self.undead(write.group, write.letter)

    def topic_deleted(self) -> None:
        """Dead letters whose dead-letter topic was deleted are not settled: redelivered."""
        for write in [w for w in self.writes if self.store.logs.get(w.log.name) is not w.log]:
            self.writes.remove(write)
            self.undead(write.group, write.letter)

    def dying(self) -> dict[Group, list[DeadLetter]]:
        """The letters being written, by group: saved as unsettled until their topic holds them durably."""
        dying: dict[Group, list[DeadLetter]] = {}
        for write in self.writes:
            dying.setdefault(write.group, []).append(write.letter)
        return dying

    def _tell(self, write: DeadWrite) -> None:
        """Tell a member of the group (the one that had them last, if still there) the broker dead-lettered
        these messages past ``max_deliveries``, so the runner can call ``@error_handler`` for them.

        An EVENT ``DEAD_LETTERED`` carrying the messages as DELIVER entries do; best effort: with no
        member left, or a member not reading, nobody is told (the dead-letter topic holds them anyway).
        """
        group, letter = write.group, write.letter
        members = group.members + group.joining
        member = next((m for m in members if m.key == letter.member), members[0] if members else None)
        source = self.store.logs.get(group.topic)
        if member is None or source is None:
            return
        entries = [e for a, b in letter.ranges for e in entries_for(source, a, b, letter.deliveries)]
        for start in range(0, len(entries), MAX_ENTRIES):
            part = entries[start : start + MAX_ENTRIES]
            for entry in part:
                entry.first_ms = letter.first_ms
            frames = commands.dead_lettered(
                member.sub_id,
                group.topic,
                offset=part[0].first,
                reason=letter.reason,
                deliveries=letter.deliveries,
                dead_letter_topic=split_log(write.log.name)[0],  # the topic's name; the frame's ``p`` says which
                entries=[e.to_wire() for e in part],
                bodies=[e.batch.body for e in part],
            )
            self._send(member.peer, frames)

    def undead(self, group: Group, letter: DeadLetter, *, delay: float = 1.0, dead_only: bool = False) -> None:
        """Dead letters that could not be stored are not settled: redeliver them (and dead-letter them again).

        ``dead_only``: try storing them again after ``delay``, without a redelivery in between.
        """
        if self._live(group):
            ranges = list(letter.ranges)
            group.pending.append(
                Pending(
                    ranges,
                    letter.deliveries,
                    self._clock() + delay,
                    letter.reason,
                    first_ms=letter.first_ms,
                    dead=dead_only,
                )
            )
            self.to_dispatch.add(group)
