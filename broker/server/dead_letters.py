"""Building dead-letter batches: the original records plus why they died.

This is the exceptional path, so it may decode records one by one.
"""

from __future__ import annotations

from typing import Any

from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.wire.ranges import Range
from conveyor.broker.wire.record import Batch, pack_records, unpack_records

from conveyor.names import dead_letter_topic

ORIGIN_TOPIC = "x-origin-topic"
ORIGIN_OFFSET = "x-origin-offset"
ORIGIN_GROUP = "x-origin-group"
ORIGIN_TIMESTAMP = "x-origin-timestamp"
DELIVERY_COUNT = "x-delivery-count"
LAST_ERROR = "x-last-error"

__all__ = ["dead_letter_body", "dead_letter_topic"]


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
    headers: dict[str, Any] | None, topic: str, offset: int, batch: Batch, group: str, deliveries: int, reason: str
) -> dict[str, Any]:
    return {
        **(headers or {}),
        ORIGIN_TOPIC: topic,
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
