"""The tail cache: recent batches kept in memory, bounded by bytes.

Consumers near the head of a topic (the normal case) are served from here,
so delivering a fresh append never reads the disk.
"""

from __future__ import annotations

from bisect import bisect_right

from conveyor.broker.wire.record import Batch

_EVICTED = Batch(-1, 0, 0, b"", -1, -1)  # stands in for an evicted batch until the list is compacted


class TailCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._batches: list[Batch] = []
        self._bases: list[int] = []
        self._head = 0  # index of the oldest live entry; evicted ones are compacted lazily

    def add(self, batch: Batch) -> None:
        if self.max_bytes <= 0:
            return
        self._batches.append(batch)
        self._bases.append(batch.base_offset)
        self.bytes += len(batch.body)
        while self.bytes > self.max_bytes and self._head < len(self._batches) - 1:
            self.bytes -= len(self._batches[self._head].body)
            self._batches[self._head] = _EVICTED  # free the body now: only the slot waits for compaction
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._batches):
            self._compact()

    def resize(self, max_bytes: int) -> None:
        """A new bound (a topic's ``cache_bytes`` altered): the oldest batches go now if it shrank."""
        self.max_bytes = max_bytes
        if max_bytes <= 0:
            self._batches, self._bases, self._head, self.bytes = [], [], 0, 0
            return
        while self.bytes > self.max_bytes and self._head < len(self._batches) - 1:
            self.bytes -= len(self._batches[self._head].body)
            self._batches[self._head] = _EVICTED
            self._head += 1

    def _compact(self) -> None:
        del self._batches[: self._head]
        del self._bases[: self._head]
        self._head = 0

    @property
    def start_offset(self) -> int | None:
        return self._bases[self._head] if self._head < len(self._bases) else None

    def read(self, offset: int, max_bytes: int, max_messages: int | None = None) -> list[Batch] | None:
        """Batches from the one holding ``offset``, or None if it is not cached.

        Up to ``max_bytes`` (at least one batch), and no further than the batch holding the
        ``max_messages``-th message: a dispatch for a consumer's few credits must not walk a MiB of
        one-message batches on every pass."""
        start = self.start_offset
        if start is None or offset < start:
            return None
        i = bisect_right(self._bases, offset, lo=self._head) - 1
        if self._batches[i].next_offset <= offset:
            i += 1  # offset is past this batch: it starts the next one
        out: list[Batch] = []
        taken = 0
        batches = self._batches
        stop = len(batches)
        if max_messages is not None:  # the batch holding offset + max_messages - 1 is the last one needed
            stop = min(stop, max(i + 1, bisect_right(self._bases, offset + max(1, max_messages) - 1, lo=i)))
        while i < stop:
            size = len(batches[i].body)
            if out and taken + size > max_bytes:
                break
            out.append(batches[i])
            taken += size
            i += 1
        return out

    def truncate(self, offset: int) -> None:
        """Forget batches at or after ``offset``."""
        i = bisect_right(self._bases, offset - 1, lo=self._head)
        for batch in self._batches[i:]:
            self.bytes -= len(batch.body)
        del self._batches[i:]
        del self._bases[i:]
        self._head = min(self._head, len(self._batches))
        if len(self._batches) > self._head and self._batches[-1].next_offset > offset:  # live entries only
            # a batch straddling the cut: drop it too; the log re-reads from disk
            self.bytes -= len(self._batches[-1].body)
            self._batches.pop()
            self._bases.pop()
            self._head = min(self._head, len(self._batches))

    def drop_before(self, offset: int) -> None:
        while self._head < len(self._batches) and self._batches[self._head].next_offset <= offset:
            self.bytes -= len(self._batches[self._head].body)
            self._batches[self._head] = _EVICTED
            self._head += 1

    def __len__(self) -> int:
        return len(self._batches) - self._head
