"""The Spark sink's writes to the broker, with no Spark in it.

* ``Batcher``: cuts records into batch bodies by count and size, deterministically.
* ``BatchPublisher``: publishes pre-packed batches to one partition under one
  idempotent producer id with explicit sequences and publisher confirms; what
  the broker already stored (a task retry) is skipped and counted.
* ``PartitionedPublisher``: routes records to a topic's partitions as every
  producer does (``crc32(key) % partitions``, keyless records a batch at a
  time) and publishes each partition's with a ``Batcher`` and a
  ``BatchPublisher`` of its own.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgpack
import zmq
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.wire import commands
from conveyor.broker.wire.partitioning import partition_for_key
from conveyor.broker.wire.protocol import Command, Frame, error_from_header
from conveyor.pipeline.broker_client import Connection
from conveyor.pipeline.broker_reader import fetch_range

from conveyor.errors import (
    BrokerUnavailable,
    ConveyorError,
    DuplicateSequence,
)
from conveyor.names import partition_log

__all__ = [
    "BatchPublisher",
    "Batcher",
    "NonDeterministicRetry",
    "PartitionedPublisher",
    "PublishStats",
    "producer_id_for",
    "route_records",
]


class NonDeterministicRetry(ConveyorError):
    """A retried write task produced different batches than the attempt it replaces."""

    code = 601
    name = "NON_DETERMINISTIC_RETRY"


def producer_id_for(*parts: object) -> int:
    """A stable 62-bit idempotent producer id for, e.g., ``(write id, partition)``.

    The same parts always give the same id, so a retried task publishes under
    the id of the attempt it replaces and the broker drops what was stored.
    """
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") & ((1 << 62) - 1)) or 1


@dataclass
class PublishStats:
    """What one publisher did: messages stored now and messages found already stored."""

    written: int = 0
    duplicates: int = 0
    batches: int = 0
    first_offset: int | None = None
    last_offset: int | None = None

    def merge(self, other: PublishStats) -> None:
        self.written += other.written
        self.duplicates += other.duplicates
        self.batches += other.batches
        firsts = [o for o in (self.first_offset, other.first_offset) if o is not None]
        lasts = [o for o in (self.last_offset, other.last_offset) if o is not None]
        self.first_offset = min(firsts) if firsts else None
        self.last_offset = max(lasts) if lasts else None


@dataclass
class _Flight:
    seq: int
    body: bytes
    count: int
    rid: int = 0
    sent_at: float = 0.0


@dataclass
class BatchPublisher:
    """Publishes whole batch bodies with one producer id, in sequence, with confirms.

    Ordering is what makes resends safe. The broker remembers the last 8
    sequences it stored per producer and calls anything older a duplicate,
    so a lost batch must never be overtaken by more than a few later ones:

    * at most ``max_in_flight`` (≤ 4) batches are unconfirmed, and they are
      always the oldest unconfirmed ones, so at most 3 later batches can be
      stored ahead of a lost one;
    * sequence 0 is confirmed before sequence 1 is sent, so a lost batch
      always has a stored one below it in the broker's window;
    * the socket is one TCP connection (no silent ZeroMQ reconnect): when
      the broker dies, what was sent after the loss is lost with it. On no
      answer in ``request_timeout``, or a retriable error, the publisher
      opens a fresh connection and resends every unconfirmed batch, oldest
      first.

    A batch the broker already has under this id and sequence (the attempt
    before a task retry stored it) is skipped and counted in
    ``stats.duplicates``. With ``verify_duplicates`` such a batch is read
    back and compared byte for byte, so a retried task whose input changed
    (rows in another order after a shuffle) fails loudly instead of
    skipping rows it never stored.
    """

    address: str
    topic: str
    producer_id: int
    max_in_flight: int = 4
    request_timeout: float = 10.0
    delivery_timeout: float = 120.0
    verify_duplicates: bool = True
    keys: ClientKeys | None = None  # CURVE keys from the writer's options; None: the process's
    partition: int = 0  # the broker numbers a producer's sequences per partition log
    stats: PublishStats = field(default_factory=PublishStats)

    def __post_init__(self) -> None:
        if not 1 <= self.max_in_flight <= 4:
            raise ValueError("max_in_flight must be 1..4 (half the broker's window of 8 sequences)")
        self.log_name = partition_log(self.topic, self.partition)
        self.conn = Connection(
            self.address,
            topic=self.topic,
            partition=self.partition,
            request_timeout=self.request_timeout,
            retry_for=self.delivery_timeout,
            auto_reconnect=False,
            keys=self.keys,
        )
        self._seq = 0
        self._flights: dict[int, _Flight] = {}  # by the rid of their latest transmission
        self._last_progress = time.monotonic()
        self._resend_at: float | None = None  # a fresh connection is due (after a backoff)
        self._failures = 0

    def publish(self, body: bytes, count: int) -> None:
        """Send one batch body of ``count`` records; blocks while the window is full."""
        limit = 1 if self._seq <= 1 else self.max_in_flight  # sequence 0 alone, until confirmed
        while len(self._flights) >= limit:
            self._pump()
        flight = _Flight(self._seq, body, count)
        self._seq += 1
        if self._resend_at is None:
            self._transmit(flight)
        else:
            flight.rid = -flight.seq - 1  # goes with the others on the next connection
            self._flights[flight.rid] = flight

    def flush(self) -> PublishStats:
        """Wait until every batch is confirmed (or found stored); raises on failure."""
        while self._flights:
            self._pump()
        return self.stats

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> BatchPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _transmit(self, flight: _Flight) -> None:
        request = partial(commands.publish, self.log_name, flight.body, pid=self.producer_id, seq=flight.seq)
        self._flights.pop(flight.rid, None)
        try:
            flight.rid = self.conn.send_built(request, block=False)
        except zmq.Again:  # the connection is gone: everything goes again on a new one
            self._connection_lost()
            flight.rid = -flight.seq - 1
        flight.sent_at = time.monotonic()
        self._flights[flight.rid] = flight

    def _connection_lost(self) -> None:
        """Drop the connection; everything unconfirmed goes again, in order, on a fresh one."""
        if self._resend_at is None:
            self._failures += 1
            self._resend_at = time.monotonic() + min(0.05 * 2**self._failures, 1.0)

    def _resend_all(self) -> None:
        self._resend_at = None
        self.conn.reconnect()
        for flight in sorted(self._flights.values(), key=lambda f: f.seq):
            if self._resend_at is not None:
                break  # lost again at once: the rest waits for the next connection
            self._transmit(flight)

    def _pump(self) -> None:
        now = time.monotonic()
        if now - self._last_progress > self.delivery_timeout:
            raise BrokerUnavailable(
                f"no confirm from {self.address} for {self.delivery_timeout:.0f}s", topic=self.topic
            )
        if self._resend_at is not None:
            if now < self._resend_at:
                time.sleep(self._resend_at - now)
            self._resend_all()
            return
        oldest = min(f.sent_at for f in self._flights.values())
        reply = self.conn.receive(max(0.001, oldest + self.request_timeout - now))
        if reply is None:
            self.conn.note(None)
            self._connection_lost()  # no answer in time: the broker may be gone
            return
        flight = self._flights.get(reply.get("rid"))
        if flight is not None:
            self._settle(flight, reply)

    def _settle(self, flight: _Flight, reply: Frame) -> None:
        if reply.command is Command.PUBLISHED:
            base = int(reply.get("base_offset"))
            if reply.get("duplicate"):
                if self.verify_duplicates:
                    self._verify(flight, base)
                self.stats.duplicates += flight.count
            else:
                self.stats.written += flight.count
            self._done(flight, base)
            return
        if reply.command is not Command.ERROR:
            return
        exc = error_from_header(reply.header)
        if isinstance(exc, DuplicateSequence) and "older than" in exc.message:
            # Stored before, by the attempt this one replaces (which kept the same order rules):
            # a later sequence of this producer is already in the broker's window.
            self.stats.duplicates += flight.count
            self._done(flight, None)
            return
        if isinstance(exc, DuplicateSequence):
            raise NonDeterministicRetry(
                f"batch {flight.seq} of producer {self.producer_id} differs from the one stored by an earlier "
                f"attempt: {exc.message}. Make the written partitions deterministic (e.g. sortWithinPartitions) "
                "or set idempotent=false for at-least-once",
                topic=self.topic,
            )
        if exc.retriable:
            self.conn.note(exc)  # NOT_LEADER and the like: the fresh connection goes to the leader of the moment
            self._connection_lost()  # later batches may be refused too: resend them all, in order
            return
        raise exc

    def _done(self, flight: _Flight, base: int | None) -> None:
        del self._flights[flight.rid]
        self._last_progress = time.monotonic()
        self._failures = 0
        self.stats.batches += 1
        if base is not None:
            last = base + flight.count - 1
            self.stats.first_offset = base if self.stats.first_offset is None else min(self.stats.first_offset, base)
            self.stats.last_offset = last if self.stats.last_offset is None else max(self.stats.last_offset, last)

    def _verify(self, flight: _Flight, base: int) -> None:
        with Connection(
            self.address,
            topic=self.topic,
            partition=self.partition,
            request_timeout=self.request_timeout,
            retry_for=self.delivery_timeout,
            keys=self.keys,
        ) as conn:
            chunks = fetch_range(conn, self.topic, base, base + flight.count, partition=self.partition)
            entries, bodies, _, _ = next(iter(chunks))
        stored = [bytes(body) for entry, body in zip(entries, bodies, strict=False) if entry.base_offset == base]
        if stored != [flight.body]:
            raise NonDeterministicRetry(
                f"batch {flight.seq} of producer {self.producer_id} was stored with other records at offset {base} "
                "by an earlier attempt; the retried task's input changed. Make the written partitions "
                "deterministic (e.g. sortWithinPartitions) or set idempotent=false for at-least-once",
                topic=self.topic,
                offset=base,
            )


class Batcher:
    """Cuts records into batch bodies by count and size, deterministically.

    The boundaries depend only on the records, in order, never on timing or
    on how Spark sliced its Arrow batches: a retried task cuts the same
    batches, so its sequence numbers name the same data.
    """

    def __init__(self, *, max_records: int = 5000, max_bytes: int = 1 << 20) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._keys: list[Any] = []
        self._headers: list[Any] = []
        self._values: list[bytes] = []
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)

    def add(self, keys: list[Any], headers: list[Any], values: list[bytes]) -> Iterator[tuple[bytes, int]]:
        """Take more records; yield every batch that is full."""
        self._keys.extend(keys)
        self._headers.extend(headers)
        self._values.extend(values)
        taken = 0
        while len(self._values) - taken >= self.max_records:
            yield from self._cut(taken, taken + self.max_records)
            taken += self.max_records
        if taken:
            del self._keys[:taken], self._headers[:taken], self._values[:taken]

    def finish(self) -> Iterator[tuple[bytes, int]]:
        """Yield what is left as the last batch(es)."""
        if self._values:
            yield from self._cut(0, len(self._values))
        self._keys, self._headers, self._values = [], [], []

    def _cut(self, lo: int, hi: int) -> Iterator[tuple[bytes, int]]:
        values = self._values[lo:hi]
        if sum(map(len, values)) + 16 * len(values) <= self.max_bytes:
            yield self._pack(lo, hi), hi - lo
            return
        start, size = lo, 0  # too many bytes for one batch: split greedily, row by row
        for i in range(lo, hi):
            length = len(self._values[i]) + 16
            if i > start and size + length > self.max_bytes:
                yield self._pack(start, i), i - start
                start, size = i, 0
            size += length
        yield self._pack(start, hi), hi - start

    def _pack(self, lo: int, hi: int) -> bytes:
        return self._packer.pack(list(zip(self._keys[lo:hi], self._headers[lo:hi], self._values[lo:hi], strict=True)))


def route_records(
    keys: list[Any], partitions: int, *, batch_size: int, keyless_from: int = 0, keyless_seen: int = 0
) -> list[int]:
    """The partition of each record, as a producer picks it (docs/partitions.md).

    A key goes to ``crc32(key) % partitions`` (``partition_for_key``, the
    producers' own function). Keyless records go a batch at a time to one
    partition, then the next: the i-th keyless record of a task (counting
    ``keyless_seen`` before these) goes to ``(keyless_from + i // batch_size)
    % partitions``. That depends only on the records, in order, so a retried
    task routes every record as the attempt it replaces did, and its
    sequences name the same batches.
    """
    out: list[int] = []
    keyless = keyless_seen
    for key in keys:
        if key is None:
            out.append((keyless_from + keyless // batch_size) % partitions)
            keyless += 1
        else:
            out.append(partition_for_key(key, partitions))
    return out


class PartitionedPublisher:
    """Publishes records to the partitions of a topic: one ``Batcher`` and ``BatchPublisher`` per partition.

    Every partition's publisher has the same producer id: the broker keeps
    an idempotent producer's sequences per partition log, so each numbers
    its batches from 0, and a retried task dedups in every partition. With
    one partition it is exactly the single publisher of before.
    """

    def __init__(
        self,
        address: str,
        topic: str,
        producer_id: int,
        *,
        partitions: int,
        keyless_from: int = 0,
        batch_size: int = 5000,
        batch_bytes: int = 1 << 20,
        **publisher: Any,
    ) -> None:
        self.address, self.topic, self.producer_id = address, topic, producer_id
        self.partitions = max(1, partitions)
        self.keyless_from = keyless_from % self.partitions
        self.batch_size, self.batch_bytes = batch_size, batch_bytes
        self._publisher_options = publisher
        self._keyless = 0  # keyless records routed so far: where the next one goes
        self.batchers: dict[int, Batcher] = {}
        self.publishers: dict[int, BatchPublisher] = {}

    def add(self, keys: list[Any], headers: list[Any], values: list[bytes]) -> None:
        """Take more records (in order); publishes every batch that is full."""
        if self.partitions == 1:
            self._add(0, keys, headers, values)
            return
        routes = route_records(
            keys,
            self.partitions,
            batch_size=self.batch_size,
            keyless_from=self.keyless_from,
            keyless_seen=self._keyless,
        )
        self._keyless += keys.count(None)
        split: dict[int, tuple[list[Any], list[Any], list[bytes]]] = {}
        for partition, key, header, value in zip(routes, keys, headers, values, strict=True):
            bucket = split.get(partition)
            if bucket is None:
                bucket = split[partition] = ([], [], [])
            bucket[0].append(key)
            bucket[1].append(header)
            bucket[2].append(value)
        for partition in sorted(split):
            self._add(partition, *split[partition])

    def _add(self, partition: int, keys: list[Any], headers: list[Any], values: list[bytes]) -> None:
        batcher = self.batchers.get(partition)
        if batcher is None:
            batcher = self.batchers[partition] = Batcher(max_records=self.batch_size, max_bytes=self.batch_bytes)
        for body, count in batcher.add(keys, headers, values):
            self._publisher(partition).publish(body, count)

    def _publisher(self, partition: int) -> BatchPublisher:
        publisher = self.publishers.get(partition)
        if publisher is None:
            publisher = self.publishers[partition] = BatchPublisher(
                self.address, self.topic, self.producer_id, partition=partition, **self._publisher_options
            )
        return publisher

    def flush(self) -> PublishStats:
        """Publish what is left and wait for every confirm; the stats of all partitions."""
        for partition, batcher in sorted(self.batchers.items()):
            for body, count in batcher.finish():
                self._publisher(partition).publish(body, count)
        total = PublishStats()
        for _partition, publisher in sorted(self.publishers.items()):
            total.merge(publisher.flush())
        if len(self.publishers) > 1:
            total.first_offset = total.last_offset = None  # offsets of different partitions do not compare
        return total

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()

    def __enter__(self) -> PartitionedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
