"""PUBLISH confirms: a batch is confirmed once it is durable under the fsync policy, never before.

Appends of a pass are made durable by one group commit, then every confirm
whose batch the sync covered is sent; under ``interval:MS`` a confirm may
wait for a later pass's sync. A failed sync (or a sync inside an append that
cut the log back) answers the confirms it lost with the error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.wire import commands

from conveyor.errors import ConveyorError, UnknownTopic

Send = Callable[[bytes, list[Any]], bool]
ReplyError = Callable[[bytes, ConveyorError, Any], None]


@dataclass(slots=True)
class Confirm:
    peer: bytes
    rid: Any
    log: TopicLog
    base_offset: int
    count: int
    duplicate: bool
    received: float
    partitions: int = 1  # the topic's count when the batch came: a confirm says it when more than one


class Confirms:
    """The confirms owed; ``send`` and ``reply_error`` answer a peer, ``latency`` observes publish seconds."""

    def __init__(self, send: Send, reply_error: ReplyError, latency: Any, clock: Callable[[], float]) -> None:
        self.waiting: list[Confirm] = []
        self._send = send
        self._reply_error = reply_error
        self._latency = latency
        self._clock = clock

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, confirm: Confirm) -> None:
        self.waiting.append(confirm)

    def send_durable(self) -> None:
        """Confirm every batch its log now holds durably; the others wait for a later sync."""
        now = self._clock()
        waiting: list[Confirm] = []
        for confirm in self.waiting:
            if confirm.base_offset + confirm.count > confirm.log.visible_offset:
                waiting.append(confirm)  # interval policy: not synced yet
                continue
            self._latency.observe(now - confirm.received)
            self._send(
                confirm.peer,
                commands.published(
                    confirm.rid,
                    confirm.log.name,
                    base_offset=confirm.base_offset,
                    count=confirm.count,
                    duplicate=confirm.duplicate,
                    partitions=confirm.partitions if confirm.partitions > 1 else None,
                ),
            )
        self.waiting = waiting

    def fail(self, exc: ConveyorError, cut_from: TopicLog | None = None) -> None:
        """Answer waiting confirms with ``exc``: all, or those of offsets ``cut_from`` no longer holds."""
        waiting: list[Confirm] = []
        for confirm in self.waiting:
            cut = confirm.log is cut_from and confirm.base_offset + confirm.count > confirm.log.end_offset
            if cut_from is None or cut:
                self._reply_error(confirm.peer, exc, confirm.rid)
            else:
                waiting.append(confirm)
        self.waiting = waiting

    def fail_topic(self, exc: ConveyorError, topic: str) -> None:
        """Answer every confirm waiting on ``topic`` with ``exc`` (this node stopped leading it)."""
        waiting: list[Confirm] = []
        for confirm in self.waiting:
            if confirm.log.name == topic:
                self._reply_error(confirm.peer, exc, confirm.rid)
            else:
                waiting.append(confirm)
        self.waiting = waiting

    def topic_deleted(self, topic: str, logs: Mapping[str, TopicLog]) -> None:
        """Confirms of a log no longer in ``logs`` (deleted) are answered UNKNOWN_TOPIC."""
        gone = UnknownTopic(f"no topic {topic} (deleted)", topic=topic)
        waiting: list[Confirm] = []
        for confirm in self.waiting:
            if logs.get(confirm.log.name) is confirm.log:
                waiting.append(confirm)
            else:
                self._reply_error(confirm.peer, gone, confirm.rid)
        self.waiting = waiting
