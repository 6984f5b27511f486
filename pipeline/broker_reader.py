"""The Spark source's reads from the broker, with no Spark in it.

* ``fetch_range``: FETCH ``[start, end)`` of a topic's partition as raw batch bodies,
  one request always in flight ahead of the caller (pipelined).
* ``bodies_to_arrow``: FETCHED entries and bodies to one Arrow record batch
  with the source's columns, decoded in C (msgpack, pyarrow), no Python per row.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import msgpack
import pyarrow as pa
from conveyor.broker.wire.entry import DeliveryEntry, entries_from_wire
from conveyor.pipeline.broker_client import Connection, DataLoss, fetch_request

from conveyor.errors import (
    ConveyorError,
    OffsetOutOfRange,
)
from conveyor.names import partition_log

__all__ = ["ARROW_SCHEMA", "Chunk", "bodies_to_arrow", "fetch_range"]

TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
HEADERS_TYPE = pa.map_(pa.string(), pa.string())
# Exactly what Spark expects for the source's schema (``to_arrow_schema(..., timezone="UTC")``).
ARROW_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", TIMESTAMP_TYPE),
        pa.field("key", pa.string()),
        pa.field("headers", HEADERS_TYPE),
        pa.field("value", pa.binary()),
        pa.field("partition", pa.int32()),
    ]
)

_KEY, _HEADERS, _VALUE = itemgetter(0), itemgetter(1), itemgetter(2)


Chunk = tuple[list[DeliveryEntry], list[Any], int, int]  # entries, bodies, from, to


def fetch_range(
    conn: Connection,
    topic: str,
    start: int,
    end: int,
    *,
    max_bytes: int = 8 << 20,
    max_messages: int = 200_000,
    fail_on_data_loss: bool = True,
    partition: int = 0,
) -> Iterator[Chunk]:
    """FETCH ``[start, end)`` of ``partition`` as ``(entries, bodies, first, stop)`` chunks, in order.

    The request for the next chunk is sent before the current one is handed
    out, so the broker reads while the caller decodes. Offsets below the log
    start (retention) raise ``DataLoss``, or are skipped when
    ``fail_on_data_loss`` is false. A broker that goes away is waited for.
    """
    pos = start
    if pos >= end:
        return
    log_name = partition_log(topic, partition)
    where = f"{topic} partition {partition}" if partition else topic  # for the messages below
    conn.use_partition(partition)

    def ask(offset: int) -> int:
        return conn.send_built(fetch_request(log_name, offset, min(max_messages, end - offset), max_bytes))

    deadline = time.monotonic() + conn.retry_for
    pending = ask(pos)
    empty_since: float | None = None
    while pos < end:
        try:
            reply = conn.wait_for(pending)
        except OffsetOutOfRange as exc:
            log_start = int(exc.fields.get("start_offset", pos))
            log_end = exc.fields.get("end_offset")
            if log_end is not None and pos > int(log_end):
                if not fail_on_data_loss:
                    return
                raise DataLoss(
                    f"offsets [{pos}, {end}) of {where} are past its end {log_end}: the broker lost data or the "
                    "topic was recreated; set failOnDataLoss=false to skip them",
                    topic=topic,
                    partition=partition,
                    offset=pos,
                ) from exc
            if fail_on_data_loss or log_start <= pos:
                raise DataLoss(
                    f"offsets [{pos}, {min(log_start, end)}) of {where} are gone (log starts at {log_start}); "
                    "set failOnDataLoss=false to skip them",
                    topic=topic,
                    partition=partition,
                    offset=pos,
                ) from exc
            pos = min(log_start, end)
            if pos < end:
                pending = ask(pos)
            continue
        except ConveyorError as exc:
            if not exc.retriable or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
            conn.reconnect()
            pending = ask(pos)
            continue
        deadline = time.monotonic() + conn.retry_for
        entries = entries_from_wire(reply.get("entries"))
        if not entries:
            # Planned offsets are durable, so they must come; wait a little (a broker
            # still recovering its log), then call it data loss.
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > conn.retry_for:
                raise DataLoss(
                    f"offsets [{pos}, {end}) of {where} never became readable",
                    topic=topic,
                    partition=partition,
                    offset=pos,
                )
            time.sleep(0.1)
            pending = ask(pos)
            continue
        empty_since = None
        stop = min(entries[-1].end, end)
        if stop < end:
            pending = ask(stop)  # pipelined: the broker works on it while we decode
        yield entries, list(reply.payload), pos, stop
        pos = stop


def bodies_to_arrow(
    topic: str, entries: list[DeliveryEntry], bodies: list[Any], first: int, stop: int, partition: int = 0
) -> pa.RecordBatch:
    """One record batch for offsets ``[first, stop)`` of the given FETCHED chunk of ``partition``."""
    keys: list[Any] = []
    headers: list[Any] = []
    values: list[Any] = []
    stamps: list[int] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of fresh tuples would trigger the cyclic collector for nothing
    try:
        for entry, body in zip(entries, bodies, strict=False):
            base = entry.base_offset
            lo = max(first, entry.first, base)
            hi = min(stop, entry.end)
            if hi <= lo:
                continue
            records = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=False, unicode_errors="replace")
            if lo > base or hi < base + len(records):
                records = records[lo - base : hi - base]
            keys.extend(map(_KEY, records))
            headers.extend(map(_HEADERS, records))
            values.extend(map(_VALUE, records))
            stamps.extend(itertools.repeat(entry.timestamp_ms * 1000, len(records)))
    finally:
        if gc_was_enabled:
            gc.enable()
    n = len(values)
    columns = [
        pa.repeat(pa.scalar(topic, pa.string()), n),
        pa.array(range(first, first + n), pa.int64()),
        pa.array(stamps, TIMESTAMP_TYPE),
        _key_array(keys, n),
        pa.nulls(n, HEADERS_TYPE) if headers.count(None) == n else pa.array(headers, HEADERS_TYPE),
        pa.array(values, pa.binary()),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
    ]
    if n != stop - first:
        raise DataLoss(f"expected offsets [{first}, {stop}) of {topic}, got {n} records", topic=topic, offset=first)
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def _key_array(keys: list[Any], n: int) -> pa.Array:
    if keys.count(None) == n:
        return pa.nulls(n, pa.string())
    try:
        return pa.array(keys, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a binary key that is not UTF-8
        return pa.array(
            [k.decode("utf-8", "replace") if isinstance(k, bytes | bytearray) else k for k in keys], pa.string()
        )
