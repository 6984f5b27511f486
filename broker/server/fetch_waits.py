"""Long-poll FETCH: read a topic's durable batches, or park until there are some (or the wait ends).

A mirror keeps one FETCH in flight per topic with ``wait_ms``; it is parked
here and answered when a group commit makes its offset durable, when the
topic moves past it (retention, a resync) or is deleted, or at its
deadline. Deadlines are a heap the loop's poll timeout follows: nothing
polls. A FETCH is answered with visible data only: durable, and in a
cluster below the partition's high watermark too (``TopicLog.visible_offset``).

A follower's FETCH (it names a ``replica``) is the exception: it is checked
and recorded by the partition's leader side (``ReplicaFetches``), served up
to the log's end offset, and woken by an append rather than a sync, so the
leader's fsync and the follower's overlap. Its answer carries the high
watermark, and ``diverging`` when the follower's log left this one. One
with ``report`` is only recorded: its sender's real FETCH is parked here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.confirms import ReplyError, Send
from conveyor.broker.server.groups import MAX_ENTRIES
from conveyor.broker.server.partition_logs import log_for
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import wire_entry
from conveyor.broker.wire.protocol import Frame
from conveyor.broker.wire.protocol import field as hfield
from conveyor.broker.wire.record import Batch

from conveyor.errors import ConveyorError, NotLeader, OffsetOutOfRange, ShuttingDown, UnknownTopic


class ReplicaFetches(Protocol):
    """The leader side of replication, as a FETCH from a follower needs it (``partitions.Partitions``)."""

    def on_replica_fetch(self, frame: Frame, log_: TopicLog) -> dict[str, int] | None: ...
    def hw(self, topic: str, partition: int = 0) -> int: ...


@dataclass(slots=True)
class FetchWait:
    peer: bytes
    frame: Frame
    deadline: float
    offset: int  # answered once this offset is durable (or at the deadline)
    done: bool = False  # answered before its deadline (its heap entry is skipped)
    replica: bool = False  # a follower's: answered once this offset is appended
    log: str = ""  # the log it waits on (partition k of T is the log T#k; the frame names T and p)


class FetchWaits:
    """FETCH answers and the parked FETCHes, by topic and by deadline."""

    def __init__(
        self,
        store: Store,
        send: Send,
        reply_error: ReplyError,
        clock: Callable[[], float],
        *,
        max_wait_ms: int,
        max_batch_bytes: int,
    ) -> None:
        self.store = store
        self.by_topic: dict[str, list[FetchWait]] = defaultdict(list)
        self._deadlines: list[tuple[float, int, FetchWait]] = []
        self._seq = itertools.count()
        self._send = send
        self._reply_error = reply_error
        self._clock = clock
        self._max_wait_ms = max_wait_ms
        self._max_batch_bytes = max_batch_bytes
        self.replicas: ReplicaFetches | None = None  # set when this node replicates partitions
        self.partition_count: Callable[[str], int] = store.partition_count  # a cluster node counts by its records
        self.missing: Callable[[str], None] = lambda log_name: None

    def fetch(self, peer: bytes, frame: Frame) -> None:
        """Answer a FETCH now, or park it while it asks to wait for offsets not yet durable."""
        topic = log_for(self.store, frame, self.partition_count)
        if topic not in self.store.logs:
            self.missing(topic)  # a cluster node that does not hold it: NOT_LEADER, naming the leader
        log_ = self.store.topic(topic)
        replica = frame.get("replica") is not None
        if replica:
            if self.replicas is None:
                raise NotLeader(f"this broker replicates nothing: {topic} has no leader here", topic=topic)
            diverging = self.replicas.on_replica_fetch(frame, log_)
            if frame.get("report"):
                return  # a durable end reported while its FETCH is parked here: nothing to answer
            if diverging is not None:
                self._send(peer, self._fetched(frame, log_, [], offset=0, replica=True, diverging=diverging))
                return
        offset = hfield(frame, "offset", int, log_.start_offset)
        wait_ms = max(0, min(hfield(frame, "wait_ms", int, 0), self._max_wait_ms))
        if offset >= _limit(log_, replica) and wait_ms > 0:
            wait = FetchWait(peer, frame, self._clock() + wait_ms / 1000, offset, replica=replica, log=topic)
            self.by_topic[topic].append(wait)
            heapq.heappush(self._deadlines, (wait.deadline, next(self._seq), wait))
            return
        self._answer(peer, frame, log_)

    def next_deadline(self) -> float | None:
        """When the earliest parked FETCH must be answered (answered ones are dropped from the heap here)."""
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def wake(self, topic: str) -> None:
        """Answer the FETCHes parked on ``topic`` whose offset became durable; the others wait on.

        Under ``interval:MS`` an append is not a reason to answer, the sync that follows it
        (perhaps in a later pass) is. A deleted topic answers them all.
        """
        log_ = self.store.logs.get(topic)
        ready: list[FetchWait] = []
        still: list[FetchWait] = []
        for wait in self.by_topic.pop(topic, []):
            # Answered: durable data to read, or nothing any more (retention, a resync, a deletion).
            answer = log_ is None or wait.offset < _limit(log_, wait.replica) or wait.offset < log_.start_offset
            (ready if answer else still).append(wait)
        if still:
            self.by_topic[topic] = still
        for wait in ready:
            self._finish(topic, wait)

    def expire(self, now: float) -> None:
        """Answer the parked FETCHes whose wait is over with what their topic holds."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _when, _seq, wait = heapq.heappop(self._deadlines)
            if wait.done:
                continue
            topic = wait.log  # not the frame's topic: for partition k > 0 that names partition 0's log
            waits = self.by_topic.get(topic)
            if waits is not None:
                waits.remove(wait)
                if not waits:
                    del self.by_topic[topic]
            self._finish(topic, wait)

    def shutdown(self) -> None:
        for waits in self.by_topic.values():
            for wait in waits:
                self._reply_error(wait.peer, ShuttingDown("broker shutting down"), wait.frame.get("rid"))

    def _finish(self, topic: str, wait: FetchWait) -> None:
        """Answer a parked fetch: what its topic holds now, or UNKNOWN_TOPIC if the topic was deleted."""
        wait.done = True
        log_ = self.store.logs.get(topic)
        if log_ is None:
            gone = UnknownTopic(f"no topic {topic} (deleted)", topic=topic)
            self._reply_error(wait.peer, gone, wait.frame.get("rid"))
        else:
            try:
                self._answer(wait.peer, wait.frame, log_)
            except ConveyorError as exc:  # an unreadable batch is this fetch's answer, not the group commit's end
                self._reply_error(wait.peer, exc, wait.frame.get("rid"))

    def _answer(self, peer: bytes, frame: Frame, log_: TopicLog) -> None:
        """Answer a FETCH; a parked one too, which may find retention (or a resync) moved the start past it."""
        replica = frame.get("replica") is not None
        offset = hfield(frame, "offset", int, log_.start_offset)
        max_messages = max(1, hfield(frame, "max_messages", int, 10_000))
        max_bytes = max(1, min(hfield(frame, "max_bytes", int, 1 << 20), self._max_batch_bytes))
        limit = _limit(log_, replica)
        batches = []
        if offset < limit:
            try:
                batches = log_.read(offset, max_bytes=max_bytes, max_messages=max_messages)
            except OffsetOutOfRange as exc:
                self._reply_error(peer, exc, frame.get("rid"))
                return
            batches = [b for b in batches if b.base_offset < limit][:MAX_ENTRIES]  # fits a header
        self._send(peer, self._fetched(frame, log_, batches, offset=offset, replica=replica))

    def _fetched(
        self,
        frame: Frame,
        log_: TopicLog,
        batches: list[Batch],
        *,
        offset: int,
        replica: bool,
        diverging: dict[str, int] | None = None,
    ) -> list[Any]:
        """The FETCHED frames; a follower's also carry the high watermark and ``diverging``."""
        entries = [
            wire_entry(
                b.base_offset,
                b.count,
                b.timestamp_ms,
                max(offset, b.base_offset),
                b.next_offset,
                producer_id=b.producer_id,
                sequence=b.sequence,
                leader_epoch=b.leader_epoch,
            )
            for b in batches
        ]
        hw = self.replicas.hw(log_.name) if replica and self.replicas is not None else None
        return commands.fetched(
            frame.get("rid"),
            log_.name,
            start_offset=log_.start_offset,
            end_offset=_limit(log_, replica),
            entries=entries,
            bodies=[b.body for b in batches],
            hw=hw,
            diverging=diverging,
        )


def _limit(log_: TopicLog, replica: bool) -> int:
    """How far a FETCH may read: a follower's to the end, anyone else's to the visible offset."""
    return log_.end_offset if replica else log_.visible_offset
