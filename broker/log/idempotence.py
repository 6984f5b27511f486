"""Idempotent-producer state: which batches each producer id already stored.

Rebuilt from batch headers when a log opens, so a batch resent after a
broker crash is still recognised and answered with its original offsets.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.errors import DuplicateSequence

WINDOW = 8  # recent batches remembered per producer, as Kafka keeps 5
MAX_PRODUCERS = 100_000  # least recently seen ids are forgotten past this


class ProducerState:
    def __init__(self, *, window: int = WINDOW, max_producers: int = MAX_PRODUCERS) -> None:
        self.window = window
        self.max_producers = max_producers
        # producer id -> {sequence: base_offset}, oldest sequence first
        self._seen: OrderedDict[int, OrderedDict[int, tuple[int, int]]] = OrderedDict()

    def check(self, producer_id: int, sequence: int, count: int) -> int | None:
        """The base offset if this batch was stored already, else None.

        Raises ``DuplicateSequence`` when the sequence is older than the window,
        where the broker can no longer tell whether it was stored.
        """
        recent = self._seen.get(producer_id)
        if recent is None:
            return None
        if sequence in recent:
            base, stored_count = recent[sequence]
            if stored_count != count:
                raise DuplicateSequence(
                    f"producer {producer_id} reused sequence {sequence} for a different batch",
                    producer_id=producer_id,
                    sequence=sequence,
                )
            return base
        if sequence < min(recent):
            raise DuplicateSequence(
                f"producer {producer_id} resent sequence {sequence}, older than the remembered window",
                producer_id=producer_id,
                sequence=sequence,
            )
        # Newer than anything stored, or inside the window but never stored (a batch
        # that failed and is retried): store it. Gaps are allowed: a batch the broker
        # rejected for good never consumes a place.
        return None

    def record(self, producer_id: int, sequence: int, base_offset: int, count: int) -> None:
        recent = self._seen.get(producer_id)
        if recent is None:
            recent = self._seen[producer_id] = OrderedDict()
            if len(self._seen) > self.max_producers:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(producer_id)
        recent[sequence] = (base_offset, count)
        if len(recent) > self.window:
            del recent[min(recent)]

    def truncate(self, offset: int) -> None:
        """Forget batches at or after ``offset`` (they were cut from the log)."""
        for pid in list(self._seen):
            recent = self._seen[pid]
            for seq in [s for s, (base, _c) in recent.items() if base >= offset]:
                del recent[seq]
            if not recent:
                del self._seen[pid]

    def __len__(self) -> int:
        return len(self._seen)
