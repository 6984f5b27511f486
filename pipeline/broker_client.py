"""The Spark connector's broker client: its connection, and the topic metadata it asks for.

* ``Connection``: request/reply by ``rid`` over one DEALER (``conveyor.broker.net.requester``),
  with the reader's or writer's own CURVE keys, reconnecting and resending
  while the broker is away (restarts, kill -9) up to a deadline.
* ``topic_bounds``: what a reader may read (log start, durable end).
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
    UnknownLeaderEpoch,
    UnknownTopic,
)

__all__ = [
    "CURVE_OPTIONS",
    "Connection",
    "DataLoss",
    "TopicBounds",
    "batch_timestamp_at",
    "fetch_request",
    "offset_for_timestamp",
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
    connection then goes to ``topic``'s leader, and each reconnect goes to
    the leader of the moment (``conveyor.broker.client.metadata``).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        topic: str | None = None,
        request_timeout: float = 10.0,
        retry_for: float = 120.0,
        auto_reconnect: bool = True,
        keys: ClientKeys | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.topic = topic
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

    def _leader(self) -> str:
        """The topic's leader (any broker without a topic); with one address, that address."""
        try:
            return self.metadata.leader_for(self.topic) if self.topic else self.metadata.any_address()
        except ConveyorError as exc:
            if not exc.retriable:
                raise
            return self.metadata.any_address()  # no broker can say now: the retry asks again

    def note(self, error: ConveyorError | None) -> None:
        """What the last failure says about the leader (None: no answer in time); the next reconnect follows it."""
        if error is None or isinstance(error, BrokerUnavailable):
            self.metadata.lost(self.address)
        elif isinstance(error, NotLeader) and self.topic:
            self.metadata.not_leader(self.topic, 0, error)
        elif isinstance(error, _LEADERSHIP) or (isinstance(error, UnknownTopic) and self.metadata.following):
            self.metadata.stale(self.topic)

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


def topic_bounds(conn: Connection, topic: str) -> TopicBounds:
    """Log start and durable end of ``topic`` (an unknown topic reads as empty)."""

    def describe() -> TopicBounds:
        try:
            described = conn.wait_for(conn.send_built(partial(commands.admin, "describe_topic", {"topic": topic})))
            info = described.get("result")
        except ConveyorError as exc:
            if exc.name == "UNKNOWN_TOPIC":
                return TopicBounds(0, 0)
            raise
        end = int(info.get("visible_offset", info.get("durable_offset", info["end_offset"])))
        return TopicBounds(int(info.get("start_offset", 0)), end)

    return conn.retrying(describe)


def fetch_request(topic: str, offset: int, max_messages: int, max_bytes: int, wait_ms: int = 0) -> FramesFor:
    """A FETCH for ``Connection.send_built`` (which adds the rid)."""
    return partial(commands.fetch, topic, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms)


def batch_timestamp_at(conn: Connection, topic: str, offset: int) -> int:
    """The append time (ms) of the batch holding ``offset``."""

    def one() -> int:
        reply = conn.wait_for(conn.send_built(fetch_request(topic, offset, 1, 1)))
        entries = entries_from_wire(reply.get("entries"))
        if not entries:
            raise DataLoss(f"offset {offset} of {topic} is not readable", topic=topic, offset=offset)
        return entries[0].timestamp_ms

    return conn.retrying(one)


def offset_for_timestamp(conn: Connection, topic: str, timestamp_ms: int, bounds: TopicBounds | None = None) -> int:
    """The first offset whose batch was appended at or after ``timestamp_ms``.

    Bisects over FETCH of one record (about log2(n) requests), relying
    on broker append times being non-decreasing along the log, as the broker's
    own ``reset_offsets`` to a time does. Returns the end when nothing is that new.
    """
    bounds = bounds or topic_bounds(conn, topic)
    lo, hi = bounds.start, bounds.end
    while lo < hi:
        mid = (lo + hi) // 2
        if batch_timestamp_at(conn, topic, mid) >= timestamp_ms:
            hi = mid
        else:
            lo = mid + 1
    return lo
