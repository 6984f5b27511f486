"""The Spark connector's broker client: its connection, and the topic metadata it asks for.

* ``Connection``: request/reply by ``rid`` over one DEALER (``conveyor.broker.net.requester``),
  with the reader's or writer's own CURVE keys, reconnecting and resending
  while the broker is away (restarts, kill -9) up to a deadline.
* ``topic_bounds``: what a reader may read (log start, durable end);
  ``partition_bounds`` the same for each partition of a topic.
* ``offset_for_timestamp``: the first offset appended at or after a time,
  by bisecting FETCH (the broker has no such lookup yet).

Reading is in ``broker_reader``, writing in ``broker_publisher``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.net.connection import DEFAULT_HWM
from conveyor.broker.net.requester import FramesFor, Requester
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import entries_from_wire
from conveyor.broker.wire.protocol import Frame

from conveyor.errors import (
    AuthFailed,
    BrokerUnavailable,
    ConveyorError,
    FencedLeaderEpoch,
    NotEnoughReplicas,
    NotLeader,
    OffsetOutOfRange,
    UnknownLeaderEpoch,
    UnknownTopic,
)
from conveyor.names import partition_log

__all__ = [
    "CURVE_OPTIONS",
    "Connection",
    "DataLoss",
    "TopicBounds",
    "batch_timestamp_at",
    "describe_topic",
    "fetch_request",
    "offset_for_timestamp",
    "partition_bounds",
    "partition_count",
    "topic_bounds",
]

CURVE_OPTIONS = "curveServerKey (the broker's public key) and curveKey (this client's .key_secret file)"


class DataLoss(ConveyorError):
    """Offsets the query needs are gone (retention) or never became readable."""

    code = 600
    name = "DATA_LOSS"


_LEADERSHIP = (NotEnoughReplicas, FencedLeaderEpoch, UnknownLeaderEpoch)  # ask who leads before the next try


# --- the connection ------------------------------------------------------------------------------


class Connection(Requester):
    """The Spark connector's connection to the broker: a ``Requester`` that keeps trying for ``retry_for``.

    ``request`` retries what can be retried (no answer in time, a broker
    shutting down or restarting, retriable storage errors) on a fresh socket
    until ``retry_for`` seconds have passed since the first attempt.

    ``keys`` are the CURVE keys from the reader's or writer's options (they
    travel to the executors with it); without them, the process's.

    With ``auto_reconnect=False`` the socket is one TCP connection and no
    more: ZeroMQ does not quietly re-establish it, so when the broker dies,
    everything sent after the loss fails too, instead of reaching the
    restarted broker ahead of the lost messages. The publisher needs that.

    ``address`` may be a bootstrap list (``tcp://a:5555,tcp://b:5555``): the
    connection then goes to the leader of ``partition`` of ``topic``, and each
    reconnect goes to the leader of the moment (``conveyor.broker.client.metadata``,
    which every client routes by). ``use_partition`` moves it to another partition's.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        topic: str | None = None,
        partition: int = 0,
        request_timeout: float = 10.0,
        retry_for: float = 120.0,
        auto_reconnect: bool = True,
        keys: ClientKeys | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.metadata = Metadata(address, context=context, keys=keys, timeout=request_timeout)
        super().__init__(
            self._leader(),
            context=context,
            keys=keys,
            timeout=request_timeout,
            retry_for=retry_for,
            auto_reconnect=auto_reconnect,
            hwm=DEFAULT_HWM,
        )

    @property
    def request_timeout(self) -> float:
        return self.timeout

    def use_partition(self, partition: int) -> None:
        """Send what follows to ``partition``'s leader (the same socket when that is where it goes already)."""
        if partition == self.partition:
            return
        self.partition = partition
        if self._leader() != self.address:
            self.reconnect()

    def _leader(self) -> str:
        """The partition's leader (any broker without a topic); with one address, that address."""
        try:
            if self.topic:
                return self.metadata.leader_for(self.topic, self.partition)
            return self.metadata.any_address()
        except ConveyorError as exc:
            if not exc.retriable:
                raise
            return self.metadata.any_address()  # no broker can say now: the retry asks again

    def note(self, error: ConveyorError | None) -> None:
        """What the last failure says about the leader (None: no answer in time); the next reconnect follows it."""
        if error is None or isinstance(error, BrokerUnavailable):
            self.metadata.lost(self.address)
        elif isinstance(error, NotLeader) and self.topic:
            self.metadata.not_leader(self.topic, self.partition, error)
        elif isinstance(error, _LEADERSHIP) or (isinstance(error, UnknownTopic) and self.metadata.following):
            self.metadata.stale(self.topic, self.partition)

    def wait_for(self, rid: int, timeout: float | None = None) -> Frame:
        try:
            return super().wait_for(rid, timeout)
        except ConveyorError as exc:
            self.note(exc)
            raise

    def reconnect(self) -> None:
        """A fresh socket to the topic's leader of the moment."""
        self.address = self._leader()
        super().reconnect()

    def refusal(self, refused: AuthFailed) -> AuthFailed:
        return AuthFailed(
            f"{refused.message}; the Spark connector takes its keys as the options {CURVE_OPTIONS}", **refused.fields
        )

    def admin(self, op: str, **args: Any) -> Any:
        return self.call(partial(commands.admin, op, args)).get("result")

    def __enter__(self) -> Connection:
        return self


# --- topic metadata -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicBounds:
    """What a reader may read: ``[start, end)``, where end is the durable offset."""

    start: int
    end: int


def describe_topic(conn: Connection, topic: str) -> dict[str, Any] | None:
    """``describe_topic`` of ``topic`` (None: no such topic), asked of its partition 0's leader."""

    def describe() -> dict[str, Any] | None:
        conn.use_partition(0)
        try:
            described = conn.wait_for(conn.send_built(partial(commands.admin, "describe_topic", {"topic": topic})))
        except ConveyorError as exc:
            if exc.name == "UNKNOWN_TOPIC":
                return None
            raise
        result: dict[str, Any] = described.get("result")
        return result

    return conn.retrying(describe)


def topic_bounds(conn: Connection, topic: str) -> TopicBounds:
    """Log start and durable end of ``topic``'s partition 0 (an unknown topic reads as empty)."""
    info = describe_topic(conn, topic)
    if info is None:
        return TopicBounds(0, 0)
    end = int(info.get("visible_offset", info.get("durable_offset", info["end_offset"])))
    return TopicBounds(int(info.get("start_offset", 0)), end)


PAST_ANY_END = 1 << 62  # a FETCH at or past a log's durable end reads nothing; its header says where the log is


def partition_count(conn: Connection, topic: str) -> int:
    """How many partitions ``topic`` has (1 for a topic that does not exist yet: its first PUBLISH makes one)."""
    info = describe_topic(conn, topic)
    return 1 if info is None else _count(info)


def _count(info: dict[str, Any]) -> int:
    """The topic's partition count: in a cluster the answering node lists only the partitions it leads."""
    return int(info.get("partition_count") or len(info.get("partitions") or [0]))


def partition_bounds(conn: Connection, topic: str) -> list[TopicBounds]:
    """What a reader may read of each partition of ``topic``, by partition number (an unknown topic: one, empty).

    A topic of one partition is described as before. For several, the count
    is ``describe_topic``'s ``partition_count`` (in a cluster the node
    answering lists only the partitions it leads), and each durable end
    comes from a FETCH at that end, sent to the partition's own leader: its
    answer says how far that partition may be read (the broker's
    ``visible_offset``) wherever the partition lives.
    """
    info = describe_topic(conn, topic)
    if info is None:
        return [TopicBounds(0, 0)]
    count = _count(info)
    if count <= 1:
        end = int(info.get("visible_offset", info.get("durable_offset", info["end_offset"])))
        return [TopicBounds(int(info.get("start_offset", 0)), end)]
    ends = {int(row["partition"]): int(row["end_offset"]) for row in info.get("partitions") or []}
    try:  # a partition led elsewhere is not described here: asked past any end, its answer says where it is
        return [_partition_end(conn, topic, k, ends.get(k, PAST_ANY_END)) for k in range(count)]
    finally:
        conn.use_partition(0)


def _partition_end(conn: Connection, topic: str, partition: int, end: int) -> TopicBounds:
    """``[start, durable end)`` of one partition, from the header of a FETCH at ``end`` (which reads nothing)."""

    def ask() -> TopicBounds:
        conn.use_partition(partition)
        try:
            reply = conn.wait_for(conn.send_built(fetch_request(partition_log(topic, partition), end, 1, 1)))
        except OffsetOutOfRange as exc:  # the log was cut below what describe_topic said: ask where it is now
            reply_fields = exc.fields
            return TopicBounds(int(reply_fields["start_offset"]), int(reply_fields["end_offset"]))
        return TopicBounds(int(reply.get("start_offset", 0)), int(reply.get("end_offset", 0)))

    return conn.retrying(ask)


def fetch_request(topic: str, offset: int, max_messages: int, max_bytes: int, wait_ms: int = 0) -> FramesFor:
    """A FETCH for ``Connection.send_built`` (which adds the rid)."""
    return partial(commands.fetch, topic, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms)


def batch_timestamp_at(conn: Connection, topic: str, offset: int, partition: int = 0) -> int:
    """The append time (ms) of the batch holding ``offset`` of ``partition``."""

    def one() -> int:
        conn.use_partition(partition)
        reply = conn.wait_for(conn.send_built(fetch_request(partition_log(topic, partition), offset, 1, 1)))
        entries = entries_from_wire(reply.get("entries"))
        if not entries:
            raise DataLoss(f"offset {offset} of {topic} is not readable", topic=topic, offset=offset)
        return entries[0].timestamp_ms

    return conn.retrying(one)


def offset_for_timestamp(
    conn: Connection, topic: str, timestamp_ms: int, bounds: TopicBounds | None = None, partition: int = 0
) -> int:
    """The first offset of ``partition`` whose batch was appended at or after ``timestamp_ms``.

    Bisects over FETCH of one record (about log2(n) requests), relying
    on broker append times being non-decreasing along the log, as the broker's
    own ``reset_offsets`` to a time does. Returns the end when nothing is that new.
    """
    bounds = bounds or partition_bounds(conn, topic)[partition]
    lo, hi = bounds.start, bounds.end
    while lo < hi:
        mid = (lo + hi) // 2
        if batch_timestamp_at(conn, topic, mid, partition) >= timestamp_ms:
            hi = mid
        else:
            lo = mid + 1
    return lo
