"""An in-memory backend: ephemeral topics and fast unit tests.

Everything the broker relies on behaves as in ``FileLog`` (offsets,
retention, idempotence, truncation); only durability is absent.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.wire.record import Batch, decode_header


class MemoryLog(TopicLog):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches: list[Batch] = []
        self._bases: list[int] = []

    def _write(self, header: bytes, body: bytes, base_offset: int, count: int, timestamp_ms: int) -> None:
        head = decode_header(header)  # keep the producer id, sequence and epoch, as FileLog's reads return them
        batch = Batch(base_offset, count, timestamp_ms, body, head.producer_id, head.sequence, head.leader_epoch)
        self._batches.append(batch)
        self._bases.append(base_offset)

    def _read_stored(self, offset: int, max_bytes: int, until: int | None = None) -> list[Batch]:
        batches = self._batches
        i = max(0, bisect_right(self._bases, offset) - 1)
        out: list[Batch] = []
        taken = 0
        while i < len(batches):
            if batches[i].next_offset > offset:
                if out and taken + len(batches[i].body) > max_bytes:
                    break
                out.append(batches[i])
                taken += len(batches[i].body)
                if until is not None and batches[i].next_offset >= until:
                    break
            i += 1
        return out

    def _sync(self) -> None:
        return None

    def _reset(self, offset: int) -> None:
        self._batches.clear()
        self._bases.clear()

    def _truncate(self, offset: int) -> int:
        i = bisect_right(self._bases, offset - 1)
        if i and self._batches[i - 1].next_offset > offset:
            i -= 1  # the batch straddling the cut goes too
        del self._batches[i:]
        del self._bases[i:]
        return self._batches[-1].next_offset if self._batches else self.start_offset

    def _drop_segments_before(self, now_ms: int) -> int:
        batches = self._batches
        total = self.size_bytes()
        drop = 0
        while drop < len(batches) - 1:
            batch = batches[drop]
            too_big = self.config.retention_bytes >= 0 and total - len(batch.body) >= self.config.retention_bytes
            too_old = self.config.retention_ms >= 0 and now_ms - batch.timestamp_ms > self.config.retention_ms
            if not (too_big or too_old):
                break
            total -= len(batch.body)
            drop += 1
        del batches[:drop]
        del self._bases[:drop]
        return batches[0].base_offset if batches else self.end_offset

    def size_bytes(self) -> int:
        return sum(len(b.body) for b in self._batches)

    def segment_count(self) -> int:
        return 1

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        for batch in self._batches:
            if batch.timestamp_ms >= timestamp_ms:
                return max(batch.base_offset, self.start_offset)
        return self.end_offset
