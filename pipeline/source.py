"""The ``conveyor`` PySpark data source: batch and streaming reads.

Each partition of a topic is one ordered log, so a read is an offset range
``[start, end)`` per topic partition, each cut into Spark partitions of
``partitionSize`` offsets (8 topic partitions and ranges of 3 pieces make 24
Spark partitions); every piece is read with FETCH by whichever executor runs
it, straight from its partition's leader, and handed to Spark as Arrow
record batches. Only durable offsets are planned (the broker's
``visible_offset``: its durable offset, and on a replicated topic no further
than the high watermark), so what a query reads is what survives a broker
crash.

Streaming keeps ``{"topic": T, "offset": N}`` in the query's checkpoint for a
topic of one partition (as before partitions), and ``{"topic": T,
"partitions": {"0": n, "1": m, ...}}`` for several. Each micro-batch is a
planned set of ranges, replayed identically after a restart, which with an
idempotent sink (the file sink, Delta, ``foreachBatch`` with a batch id)
makes a query exactly-once across restarts of the query and of the broker.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from conveyor.pipeline.broker_client import (
    Connection,
    DataLoss,
    TopicBounds,
    offset_for_timestamp,
    partition_bounds,
)
from conveyor.pipeline.broker_reader import bodies_to_arrow, fetch_range
from conveyor.pipeline.options import ReadOptions, StartPosition
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

__all__ = [
    "SCHEMA",
    "ConveyorDataSource",
    "ConveyorReader",
    "ConveyorStreamReader",
    "OffsetRange",
    "cap_ends",
    "split_partitions",
]

NAME = "conveyor"
SCHEMA = (
    "topic string, offset long, timestamp timestamp, key string, headers map<string,string>, value binary, "
    "partition int"
)

Positions = dict[int, int]  # partition -> offset


@dataclass
class OffsetRange(InputPartition):
    """One Spark partition: offsets ``[start, end)`` of ``partition`` of ``topic``.

    ``earliest``: the range starts wherever that partition's log starts now (a
    stream's checkpoint that does not name the partition), not at ``start``.
    """

    topic: str
    start: int
    end: int
    partition: int = 0
    earliest: bool = False

    def __post_init__(self) -> None:
        self.value = (self.topic, self.partition, self.start, self.end)

    def __len__(self) -> int:
        return self.end - self.start


def split_range(
    topic: str, start: int, end: int, partition_size: int, min_partitions: int = 1, partition: int = 0
) -> list[OffsetRange]:
    """``[start, end)`` of one topic partition in nearly equal pieces of at most ``partition_size`` offsets."""
    total = end - start
    if total <= 0:
        return []
    pieces = min(total, max(min_partitions, math.ceil(total / partition_size)))
    bounds = [start + total * i // pieces for i in range(pieces + 1)]
    return [OffsetRange(topic, lo, hi, partition) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def split_partitions(
    topic: str,
    planned: dict[int, tuple[int, int]],
    partition_size: int,
    min_partitions: int = 1,
    earliest: frozenset[int] = frozenset(),
) -> list[OffsetRange]:
    """Every topic partition's planned range, each cut by ``split_range``.

    ``min_partitions`` is shared over the topic partitions in proportion to
    their ranges (one partition: all of it, as before partitions).
    """
    total = sum(max(0, end - start) for start, end in planned.values())
    pieces: list[OffsetRange] = []
    for partition, (start, end) in sorted(planned.items()):
        least = math.ceil(min_partitions * (end - start) / total) if total else 1
        for piece in split_range(topic, start, end, partition_size, max(1, least), partition):
            piece.earliest = partition in earliest  # skip to the log start, where it is then
            pieces.append(piece)
    return pieces


def cap_ends(starts: Positions, ends: Positions, max_rows: int) -> Positions:
    """``ends`` moved back so that at most ``max_rows`` offsets lie past ``starts`` in all.

    The rows are shared in proportion to what each partition has to read
    (largest remainders get the rows left over, lowest partition first on a
    tie), so a partition far behind is not starved by the others; the same
    inputs give the same ends, which a replayed micro-batch relies on.
    """
    lags = {k: max(0, end - starts.get(k, 0)) for k, end in ends.items()}
    total = sum(lags.values())
    if total <= max_rows:
        return dict(ends)
    shares = {k: lag * max_rows // total for k, lag in lags.items()}
    left = max_rows - sum(shares.values())
    for k in sorted(lags, key=lambda k: (-(lags[k] * max_rows % total), k)):
        if left <= 0:
            break
        if lags[k] > shares[k]:
            shares[k] += 1
            left -= 1
    return {k: starts.get(k, 0) + shares[k] if lags[k] else end for k, end in ends.items()}


def read_partition(opts: ReadOptions, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """Arrow record batches for one planned range, as the executor reads it."""
    if not isinstance(partition, OffsetRange) or partition.end <= partition.start:
        return
    with _connect(opts, partition.partition) as conn:
        chunks = fetch_range(
            conn,
            partition.topic,
            partition.start,
            partition.end,
            max_bytes=opts.fetch_max_bytes,
            max_messages=opts.fetch_max_messages,
            fail_on_data_loss=opts.fail_on_data_loss and not partition.earliest,
            partition=partition.partition,
        )
        for entries, bodies, first, stop in chunks:
            yield bodies_to_arrow(partition.topic, entries, bodies, first, stop, partition.partition)


def resolve(
    conn: Connection, opts: ReadOptions, position: StartPosition, bounds: TopicBounds, partition: int = 0
) -> int:
    """A position as an offset of ``partition`` (inside ``[bounds.start, bounds.end]``, but for an offset)."""
    position = position.for_partition(partition)
    if position.kind == "earliest":
        return bounds.start
    if position.kind == "latest":
        return bounds.end
    if position.kind == "timestamp":
        return offset_for_timestamp(conn, opts.topic, position.value, bounds, partition)
    return position.value


def _connect(opts: ReadOptions, partition: int = 0) -> Connection:
    """A connection to ``partition``'s leader with the reader's options (its CURVE keys travel with it)."""
    return Connection(
        opts.broker,
        topic=opts.topic,
        partition=partition,
        request_timeout=opts.request_timeout,
        retry_for=opts.broker_timeout,
        keys=opts.client_keys(),
    )


# --- batch ---------------------------------------------------------------------------------------


class ConveyorReader(DataSourceReader):
    """A batch read of ``[startingOffsets, endingOffsets)`` of every partition of the topic."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self.offset_min: int | None = None  # from pushed offset filters, inclusive
        self.offset_max: int | None = None  # exclusive
        self.time_min_ms: int | None = None  # from pushed timestamp filters: first batch time kept
        self.time_max_ms: int | None = None  # first batch time no longer kept
        self.only_partitions: set[int] | None = None  # from pushed partition filters

    def plan(self) -> dict[int, tuple[int, int]]:
        """The offsets this read covers in each partition, after options and pushed filters."""
        with _connect(self.opts) as conn:
            return {
                partition: self._plan_partition(conn, partition, bounds)
                for partition, bounds in enumerate(partition_bounds(conn, self.opts.topic))
                if self.only_partitions is None or partition in self.only_partitions
            }

    def _plan_partition(self, conn: Connection, partition: int, bounds: TopicBounds) -> tuple[int, int]:
        opts = self.opts
        start = resolve(conn, opts, opts.starting, bounds, partition)
        end = resolve(conn, opts, opts.ending, bounds, partition)
        if start < bounds.start:
            if opts.fail_on_data_loss:
                where = f"{opts.topic} partition {partition}" if partition else opts.topic
                raise DataLoss(
                    f"startingOffsets {start} of {where} is below the log start {bounds.start} "
                    "(retention); set failOnDataLoss=false to start there instead",
                    topic=opts.topic,
                    partition=partition,
                    offset=start,
                )
            start = bounds.start
        if end > bounds.end:
            end = bounds.end  # not durable (or not written) yet: a batch read stops at what exists
        if self.offset_min is not None:
            start = max(start, self.offset_min)
        if self.offset_max is not None:
            end = min(end, self.offset_max)
        if start < end and self.time_min_ms is not None:
            found = offset_for_timestamp(conn, opts.topic, self.time_min_ms, TopicBounds(start, end), partition)
            start = max(start, found)
        if start < end and self.time_max_ms is not None:
            found = offset_for_timestamp(conn, opts.topic, self.time_max_ms, TopicBounds(start, end), partition)
            end = min(end, found)
        return start, max(start, end)

    def partitions(self) -> Sequence[InputPartition]:
        return split_partitions(self.opts.topic, self.plan(), self.opts.partition_size, self.opts.min_partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.opts, partition)


def _micros(value: Any) -> int | None:
    """A pushed timestamp literal as microseconds since the epoch (UTC)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return None


class ConveyorPushdownReader(ConveyorReader):
    """The batch reader with filter pushdown (``spark.sql.python.filterPushdown.enabled``).

    ``offset`` comparisons narrow every partition's planned range exactly
    (offsets are per partition) and are not evaluated again; so do
    ``partition = k`` and ``partition IN (...)``, which plan those partitions
    only. ``timestamp`` comparisons narrow it to whole broker batches (append
    times have millisecond precision and are per batch), and Spark still
    evaluates them on what is read.
    """

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for f in filters:
            column = getattr(f, "attribute", ())
            value = getattr(f, "value", None)
            if column == ("offset",) and type(value) is int and self._push_offset(f, value):
                continue
            if column == ("partition",) and self._push_partition(f):
                continue
            if column == ("timestamp",):
                self._push_time(f, _micros(value))
            yield f

    def _push_offset(self, f: Filter, value: int) -> bool:
        lo, hi = {
            EqualTo: (value, value + 1),
            GreaterThan: (value + 1, None),
            GreaterThanOrEqual: (value, None),
            LessThan: (None, value),
            LessThanOrEqual: (None, value + 1),
        }.get(type(f), (None, None))
        if lo is None and hi is None:
            return False
        if lo is not None:
            self.offset_min = max(lo, self.offset_min or 0)
        if hi is not None:
            self.offset_max = hi if self.offset_max is None else min(self.offset_max, hi)
        return True

    def _push_partition(self, f: Filter) -> bool:
        if isinstance(f, EqualTo) and type(f.value) is int:
            wanted = {f.value}
        elif isinstance(f, In) and all(type(v) is int for v in f.value):
            wanted = set(f.value)
        else:
            return False
        self.only_partitions = wanted if self.only_partitions is None else self.only_partitions & wanted
        return True

    def _push_time(self, f: Filter, micros: int | None) -> None:
        if micros is None:
            return
        # Batch times are whole milliseconds: keep every batch that may hold a matching row.
        ceil_ms, next_ms = -(-micros // 1000), micros // 1000 + 1
        lo, hi = {
            EqualTo: (ceil_ms, next_ms),
            GreaterThan: (next_ms, None),
            GreaterThanOrEqual: (ceil_ms, None),
            LessThan: (None, ceil_ms),
            LessThanOrEqual: (None, next_ms),
        }.get(type(f), (None, None))
        if lo is not None:
            self.time_min_ms = max(lo, self.time_min_ms or 0)
        if hi is not None:
            self.time_max_ms = hi if self.time_max_ms is None else min(self.time_max_ms, hi)


# --- streaming ----------------------------------------------------------------------------------


class ConveyorStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of offset ranges, one per partition; the offsets live in the query's checkpoint.

    ``commit`` is not where progress is kept: Spark calls it a batch late,
    and the checkpoint's offset log is what a restarted query resumes from.
    A checkpoint's offset is ``{"topic": T, "offset": N}`` for a topic of one
    partition (as written before partitions, so old checkpoints resume as
    they are) and ``{"topic": T, "partitions": {"0": n, ...}}`` for several;
    ``{"offset": N}`` is read as partition 0. A partition the checkpoint does
    not name is read from its log start.
    """

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._target: Positions | None = None  # Trigger.AvailableNow: the ends fixed at query start
        self._conn: Connection | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts, "_target": self._target, "_conn": None}

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = _connect(self.opts)
        return self._conn

    def _offset(self, positions: Positions) -> dict[str, Any]:
        if list(positions) == [0]:
            return {"topic": self.opts.topic, "offset": int(positions[0])}
        return {"topic": self.opts.topic, "partitions": {str(k): int(v) for k, v in sorted(positions.items())}}

    def _positions(self, offset: dict[str, Any]) -> Positions:
        topic = offset.get("topic", self.opts.topic)
        if topic != self.opts.topic:
            raise ValueError(
                f"this checkpoint reads topic {topic!r}, not {self.opts.topic!r}: use a new checkpoint location"
            )
        if "partitions" in offset:
            return {int(k): int(v) for k, v in offset["partitions"].items()}
        return {0: int(offset["offset"])}

    def _bounds(self) -> list[TopicBounds]:
        return partition_bounds(self._connection(), self.opts.topic)

    def initialOffset(self) -> dict[str, Any]:
        conn = self._connection()
        return self._offset(
            {
                k: min(max(resolve(conn, self.opts, self.opts.starting, bounds, k), bounds.start), bounds.end)
                for k, bounds in enumerate(self._bounds())
            }
        )

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        positions = self._positions(start)
        bounds = self._bounds()
        self._check_gone(positions, len(bounds))
        # A partition the checkpoint does not name starts at its log start.
        froms = {k: positions.get(k, b.start) for k, b in enumerate(bounds)}
        ends = {k: self._end(k, froms[k], b.end) for k, b in enumerate(bounds)}
        if isinstance(limit, ReadMaxRows):
            ends = cap_ends(froms, ends, limit.max_rows)
        return self._offset(ends)

    def _end(self, partition: int, position: int, end: int) -> int:
        """How far a micro-batch may read ``partition`` from ``position``, its durable end being ``end``."""
        if end < position:
            if self.opts.fail_on_data_loss:
                where = f"{self.opts.topic} partition {partition}" if partition else self.opts.topic
                raise DataLoss(
                    f"{where} ends at {end}, before offset {position} this query already read: "
                    "the topic was deleted or lost data. Set failOnDataLoss=false to carry on from its end",
                    topic=self.opts.topic,
                    partition=partition,
                    offset=position,
                )
            return position  # nothing new until the log grows past what was read
        if self._target is not None:
            end = min(end, self._target.get(partition, end))
        return max(end, position)

    def _check_gone(self, positions: Positions, count: int) -> None:
        """Partitions the checkpoint read that the topic no longer has (deleted and made again with fewer)."""
        gone = sorted(k for k, offset in positions.items() if k >= count and offset > 0)
        if gone and self.opts.fail_on_data_loss:
            raise DataLoss(
                f"{self.opts.topic} has {count} partitions, and this query already read partitions {gone}: "
                "the topic was deleted and made again. Set failOnDataLoss=false to carry on without them",
                topic=self.opts.topic,
            )

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return self._offset({k: b.end for k, b in enumerate(self._bounds())})

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {k: b.end for k, b in enumerate(self._bounds())}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        starts, ends = self._positions(start), self._positions(end)
        planned = {k: (starts.get(k, 0), hi) for k, hi in ends.items()}
        missing = frozenset(k for k in ends if k not in starts)
        return split_partitions(
            self.opts.topic, planned, self.opts.partition_size, self.opts.min_partitions, earliest=missing
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# --- the data source ----------------------------------------------------------------------------


class ConveyorDataSource(DataSource):
    """``spark.read.format("conveyor")``, ``readStream``, ``write`` and ``writeStream``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = ReadOptions.parse(self.options)
        return ConveyorPushdownReader(opts) if opts.pushdown else ConveyorReader(opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ConveyorStreamReader(ReadOptions.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from conveyor.pipeline.sink import ConveyorWriter, WriteOptions

        return ConveyorWriter(WriteOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from conveyor.pipeline.sink import ConveyorStreamWriter, WriteOptions

        return ConveyorStreamWriter(WriteOptions.parse(self.options), schema)
