"""The ``conveyor`` PySpark data source: batch and streaming reads.

A topic is one ordered log, so a read is an offset range ``[start, end)``
cut into Spark partitions of ``partitionSize`` offsets; every partition is
read with FETCH by whichever executor runs it, straight from the broker,
and handed to Spark as Arrow record batches. Only durable offsets are
planned (the broker's ``visible_offset``: its durable offset, and on a
replicated topic no further than the high watermark), so what a query
reads is what survives a broker crash.

Streaming keeps ``{"topic": T, "offset": N}`` in the query's checkpoint.
Each micro-batch is a planned range, replayed identically after a restart,
which with an idempotent sink (the file sink, Delta, ``foreachBatch`` with
a batch id) makes a query exactly-once across restarts of the query and of
the broker.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from conveyor.pipeline.broker_client import Connection, DataLoss, TopicBounds, offset_for_timestamp, topic_bounds
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
]

NAME = "conveyor"
SCHEMA = "topic string, offset long, timestamp timestamp, key string, headers map<string,string>, value binary"


@dataclass
class OffsetRange(InputPartition):
    """One Spark partition: offsets ``[start, end)`` of ``topic``."""

    topic: str
    start: int
    end: int

    def __post_init__(self) -> None:
        self.value = (self.topic, self.start, self.end)

    def __len__(self) -> int:
        return self.end - self.start


def split_range(topic: str, start: int, end: int, partition_size: int, min_partitions: int = 1) -> list[OffsetRange]:
    """``[start, end)`` in nearly equal pieces of at most ``partition_size`` offsets."""
    total = end - start
    if total <= 0:
        return []
    pieces = min(total, max(min_partitions, math.ceil(total / partition_size)))
    bounds = [start + total * i // pieces for i in range(pieces + 1)]
    return [OffsetRange(topic, lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def read_partition(opts: ReadOptions, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """Arrow record batches for one planned range, as the executor reads it."""
    if not isinstance(partition, OffsetRange) or partition.end <= partition.start:
        return
    with _connect(opts) as conn:
        chunks = fetch_range(
            conn,
            partition.topic,
            partition.start,
            partition.end,
            max_bytes=opts.fetch_max_bytes,
            max_messages=opts.fetch_max_messages,
            fail_on_data_loss=opts.fail_on_data_loss,
        )
        for entries, bodies, first, stop in chunks:
            yield bodies_to_arrow(partition.topic, entries, bodies, first, stop)


def resolve(conn: Connection, opts: ReadOptions, position: StartPosition, bounds: TopicBounds) -> int:
    """A position as an offset inside ``[bounds.start, bounds.end]``."""
    if position.kind == "earliest":
        return bounds.start
    if position.kind == "latest":
        return bounds.end
    if position.kind == "timestamp":
        return offset_for_timestamp(conn, opts.topic, position.value, bounds)
    return position.value


def _connect(opts: ReadOptions) -> Connection:
    """A connection with the reader's options (its CURVE keys travel with it to the executors)."""
    return Connection(
        opts.broker,
        topic=opts.topic,
        request_timeout=opts.request_timeout,
        retry_for=opts.broker_timeout,
        keys=opts.client_keys(),
    )


# --- batch ---------------------------------------------------------------------------------------


class ConveyorReader(DataSourceReader):
    """A batch read of ``[startingOffsets, endingOffsets)``."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self.offset_min: int | None = None  # from pushed offset filters, inclusive
        self.offset_max: int | None = None  # exclusive
        self.time_min_ms: int | None = None  # from pushed timestamp filters: first batch time kept
        self.time_max_ms: int | None = None  # first batch time no longer kept

    def plan(self) -> tuple[int, int]:
        """The offsets this read covers, after options and pushed filters."""
        opts = self.opts
        with _connect(opts) as conn:
            bounds = topic_bounds(conn, opts.topic)
            start = resolve(conn, opts, opts.starting, bounds)
            end = resolve(conn, opts, opts.ending, bounds)
            if start < bounds.start:
                if opts.fail_on_data_loss:
                    raise DataLoss(
                        f"startingOffsets {start} of {opts.topic} is below the log start {bounds.start} "
                        "(retention); set failOnDataLoss=false to start there instead",
                        topic=opts.topic,
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
                start = max(start, offset_for_timestamp(conn, opts.topic, self.time_min_ms, TopicBounds(start, end)))
            if start < end and self.time_max_ms is not None:
                end = min(end, offset_for_timestamp(conn, opts.topic, self.time_max_ms, TopicBounds(start, end)))
        return start, max(start, end)

    def partitions(self) -> Sequence[InputPartition]:
        start, end = self.plan()
        return split_range(self.opts.topic, start, end, self.opts.partition_size, self.opts.min_partitions)

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

    ``offset`` comparisons narrow the planned range exactly and are not
    evaluated again. ``timestamp`` comparisons narrow it to whole broker
    batches (append times have millisecond precision and are per batch), and
    Spark still evaluates them on what is read.
    """

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for f in filters:
            column = getattr(f, "attribute", ())
            value = getattr(f, "value", None)
            if column == ("offset",) and type(value) is int and self._push_offset(f, value):
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
    """Micro-batches of offset ranges; the offset lives in the query's checkpoint.

    ``commit`` is not where progress is kept: Spark calls it a batch late,
    and the checkpoint's offset log is what a restarted query resumes from.
    """

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._target: int | None = None  # Trigger.AvailableNow: the end fixed at query start
        self._conn: Connection | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts, "_target": self._target, "_conn": None}

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = _connect(self.opts)
        return self._conn

    def _offset(self, offset: int) -> dict[str, Any]:
        return {"topic": self.opts.topic, "offset": int(offset)}

    def _position(self, offset: dict[str, Any]) -> int:
        topic = offset.get("topic", self.opts.topic)
        if topic != self.opts.topic:
            raise ValueError(
                f"this checkpoint reads topic {topic!r}, not {self.opts.topic!r}: use a new checkpoint location"
            )
        return int(offset["offset"])

    def _bounds(self) -> TopicBounds:
        return topic_bounds(self._connection(), self.opts.topic)

    def initialOffset(self) -> dict[str, Any]:
        conn = self._connection()
        bounds = self._bounds()
        start = resolve(conn, self.opts, self.opts.starting, bounds)
        return self._offset(min(max(start, bounds.start), bounds.end))

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        position = self._position(start)
        bounds = self._bounds()
        end = bounds.end
        if end < position:
            if self.opts.fail_on_data_loss:
                raise DataLoss(
                    f"{self.opts.topic} ends at {end}, before offset {position} this query already read: "
                    "the topic was deleted or lost data. Set failOnDataLoss=false to carry on from its end",
                    topic=self.opts.topic,
                    offset=position,
                )
            return self._offset(position)  # nothing new until the log grows past what was read
        if self._target is not None:
            end = min(end, self._target)
        if isinstance(limit, ReadMaxRows):
            end = min(end, position + limit.max_rows)
        return self._offset(max(end, position))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return self._offset(self._bounds().end)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._bounds().end

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        lo, hi = self._position(start), self._position(end)
        return split_range(self.opts.topic, lo, hi, self.opts.partition_size, self.opts.min_partitions)

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
