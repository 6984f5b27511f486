"""The ``conveyor`` sink: ``df.write`` and ``df.writeStream`` to a topic.

Columns: ``value`` (binary or string, required, not null), ``key`` (string
or binary) and ``headers`` (map<string,string>) are optional; anything else
(``topic``, ``offset``, ``timestamp`` of a DataFrame read from a topic) is
ignored, so a read can be written elsewhere unchanged.

Every task publishes its rows as batches under one idempotent producer id
with publisher confirms (``pipeline.broker_publisher.BatchPublisher``), to
the partitions of the topic as a producer routes them (a key to
``crc32(key) % partitions``; ``PartitionedPublisher``). Retries and
duplicates:

* ``idempotent=true`` (default): the producer id is derived from the write
  (a random ``writeId`` per ``save()``, or the one you pass) and the
  partition id; for a stream, from the query id, the micro-batch id and the
  partition id. Batches are cut by count and size only, so a retried task
  (or a replayed micro-batch) sends the same batches under the same
  sequence numbers and the broker stores each once: the retry skips what
  the failed attempt stored and counts it as ``duplicates``. This holds
  when a partition's rows are the same, in the same order, on every
  attempt: true for data read from files, tables and Conveyor topics and
  for narrow transformations of them, not guaranteed after a shuffle
  (``sortWithinPartitions`` restores it). A retry that finds the broker
  holding *different* records under its sequence numbers fails with
  ``NON_DETERMINISTIC_RETRY`` rather than skip rows it never stored.
* ``idempotent=false``: a random producer id per task attempt; a retry
  publishes everything again (at-least-once), and the counts in the commit
  line say how many messages each attempt wrote.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from conveyor.broker.wire.values import CONTENT_TYPE, TEXT
from conveyor.pipeline.broker_client import Connection, partition_count
from conveyor.pipeline.broker_publisher import PartitionedPublisher, PublishStats, producer_id_for
from conveyor.pipeline.options import OptionError, WriteOptions
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

__all__ = ["ConveyorCommitMessage", "ConveyorStreamWriter", "ConveyorWriter", "WriteOptions", "check_write_schema"]

log = logging.getLogger("conveyor.pipeline.sink")

QUERY_ID_KEY = "sql.streaming.queryId"  # Spark's StreamExecution.QUERY_ID_KEY
BATCH_ID_KEY = "streaming.sql.batchId"  # Spark's MicroBatchExecution.BATCH_ID_KEY


@dataclass
class ConveyorCommitMessage(WriterCommitMessage):
    """What one task did, for the driver's commit line."""

    partition: int
    attempt: int
    producer_id: int
    written: int
    duplicates: int
    batches: int
    first_offset: int | None
    last_offset: int | None


def check_write_schema(schema: StructType) -> None:
    """Refuse a DataFrame the sink cannot write, naming the column."""
    fields = {f.name.lower(): f for f in schema.fields}
    value = fields.get("value")
    if value is None:
        raise OptionError(
            "the conveyor sink needs a 'value' column (binary or string); "
            "e.g. select(to_json(struct('*')).alias('value')) with option contentType=application/json"
        )
    if not isinstance(value.dataType, BinaryType | StringType):
        raise OptionError(f"column 'value' must be binary or string, not {value.dataType.simpleString()}")
    key = fields.get("key")
    if key is not None and not isinstance(key.dataType, BinaryType | StringType):
        raise OptionError(f"column 'key' must be string or binary, not {key.dataType.simpleString()}")
    headers = fields.get("headers")
    if headers is not None and not (
        isinstance(headers.dataType, MapType)
        and isinstance(headers.dataType.keyType, StringType)
        and isinstance(headers.dataType.valueType, StringType)
    ):
        raise OptionError(f"column 'headers' must be map<string,string>, not {headers.dataType.simpleString()}")


def _column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    for i, field_name in enumerate(batch.schema.names):
        if field_name.lower() == name:
            return batch.column(i)
    return None


def records_from_arrow(batch: pa.RecordBatch, content_type: str | None) -> tuple[list[Any], list[Any], list[bytes]]:
    """Keys, headers and values of one Arrow batch, as msgpack will pack them."""
    n = batch.num_rows
    value = _column(batch, "value")
    assert value is not None
    if value.null_count:
        raise ValueError("column 'value' has nulls; every message needs a value")
    text = pa.types.is_string(value.type) or pa.types.is_large_string(value.type)
    values: list[bytes] = value.cast(pa.binary()).to_pylist() if text else value.to_pylist()
    key = _column(batch, "key")
    keys: list[Any] = [None] * n if key is None or key.null_count == n else key.to_pylist()
    default_type = content_type or (TEXT if text else None)
    column = _column(batch, "headers")
    if column is None or column.null_count == n:
        headers: list[Any] = [{CONTENT_TYPE: default_type}] * n if default_type else [None] * n
    else:
        # A null in a map<string,string> is no header at all: the broker takes str -> str only.
        headers = [{k: v for k, v in h if v is not None} or None if h else None for h in column.to_pylist()]
        if default_type:
            headers = [h if h and CONTENT_TYPE in h else {**(h or {}), CONTENT_TYPE: default_type} for h in headers]
    return keys, headers, values


def topic_partitions(opts: WriteOptions) -> int:
    """How many partitions the sink's topic has (1 when it does not exist yet), asked once per write.

    Asked where the write is planned, so every task of a write, and every
    retry of one, routes rows by the same count (and so cuts the same
    batches in each partition): partitions added while the write runs get
    rows from the next write on.
    """
    with Connection(
        opts.broker,
        topic=opts.topic,
        request_timeout=opts.request_timeout,
        retry_for=opts.delivery_timeout,
        keys=opts.client_keys(),
    ) as conn:
        return partition_count(conn, opts.topic)


def publish_partition(
    opts: WriteOptions,
    batches: Iterator[pa.RecordBatch],
    producer_id: int,
    *,
    partition: int,
    attempt: int,
    partitions: int = 1,
) -> ConveyorCommitMessage:
    """Publish every row of one task to the topic's ``partitions``; returns once all are confirmed.

    Rows go where a producer would send them: a key to ``crc32(key) %
    partitions``, keyless rows a batch at a time to one partition and then
    the next, starting at the task's own (``PartitionedPublisher``).
    """
    with PartitionedPublisher(
        opts.broker,
        opts.topic,
        producer_id,
        partitions=partitions,
        keyless_from=partition,
        batch_size=opts.batch_size,
        batch_bytes=opts.batch_bytes,
        max_in_flight=opts.max_in_flight,
        request_timeout=opts.request_timeout,
        delivery_timeout=opts.delivery_timeout,
        verify_duplicates=opts.verify_duplicates and opts.idempotent,
        keys=opts.client_keys(),
    ) as publisher:
        for batch in batches:
            if batch.num_rows:
                publisher.add(*records_from_arrow(batch, opts.content_type))
        stats = publisher.flush()
    return ConveyorCommitMessage(
        partition,
        attempt,
        producer_id,
        stats.written,
        stats.duplicates,
        stats.batches,
        stats.first_offset,
        stats.last_offset,
    )


def _task() -> tuple[int, int, TaskContext | None]:
    ctx = TaskContext.get()
    if ctx is None:
        return 0, 0, None
    return ctx.partitionId(), ctx.attemptNumber(), ctx


def summarize(topic: str, messages: list[Any], what: str) -> PublishStats:
    total = PublishStats()
    tasks = [m for m in messages if isinstance(m, ConveyorCommitMessage)]
    for m in tasks:
        total.merge(PublishStats(m.written, m.duplicates, m.batches, m.first_offset, m.last_offset))
    retried = sum(1 for m in tasks if m.attempt > 0)
    line = (
        f"conveyor: {what}: {total.written} messages written to {topic!r} by {len(tasks)} tasks"
        f" ({retried} retried), {total.duplicates} found already stored and skipped"
    )
    if total.first_offset is not None:
        line += f", offsets {total.first_offset}..{total.last_offset}"
    print(line, file=sys.stderr, flush=True)
    return total


class ConveyorWriter(DataSourceArrowWriter):
    """``df.write.format("conveyor")``: one idempotent publisher per task."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        check_write_schema(schema)
        self.opts = opts
        self.partitions = topic_partitions(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ConveyorCommitMessage:
        partition, attempt, _ = _task()
        if self.opts.idempotent:
            pid = producer_id_for("write", self.opts.write_id, partition)
        else:
            pid = random.getrandbits(62) or 1
        return publish_partition(
            self.opts, iterator, pid, partition=partition, attempt=attempt, partitions=self.partitions
        )

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        summarize(self.opts.topic, list(messages), f"write {self.opts.write_id}")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        summarize(self.opts.topic, list(messages), f"write {self.opts.write_id} ABORTED (stored messages stay)")


class ConveyorStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("conveyor")``: a micro-batch replayed after a restart dedups."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        check_write_schema(schema)
        self.opts = opts
        self.partitions = topic_partitions(opts)  # once per run of the query

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ConveyorCommitMessage:
        partition, attempt, ctx = _task()
        query = ctx.getLocalProperty(QUERY_ID_KEY) if ctx is not None else None
        batch_id = ctx.getLocalProperty(BATCH_ID_KEY) if ctx is not None else None
        if self.opts.idempotent and query and batch_id is not None:
            pid = producer_id_for("stream", query, batch_id, partition)
        else:
            pid = random.getrandbits(62) or 1
        return publish_partition(
            self.opts, iterator, pid, partition=partition, attempt=attempt, partitions=self.partitions
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        total = PublishStats()
        for m in messages:
            if isinstance(m, ConveyorCommitMessage):
                total.merge(PublishStats(m.written, m.duplicates, m.batches, m.first_offset, m.last_offset))
        log.info(
            "batch %d: %d written to %s, %d already stored", batchId, total.written, self.opts.topic, total.duplicates
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        summarize(self.opts.topic, list(messages), f"micro-batch {batchId} ABORTED (stored messages stay)")
