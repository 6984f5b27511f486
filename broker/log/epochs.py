"""The leader-epoch cache: at which offset each partition leader's epoch began (Kafka KIP-101, KIP-279).

A follower that comes back asks its leader where the epoch of its own last
batch ended there; whatever the follower holds past that offset was never
replicated by the leaders that came after, and is cut. Offsets alone cannot
tell that: two leaders may each have written different batches at the same
offsets (KIP-101's divergence cases).

The cache is a list of ``(epoch, start_offset)``, epochs and start offsets
both rising. Epoch 0 is implicit: it is the epoch of every batch written
outside a cluster (magic 1), it starts at the log start and it ends where
the first listed epoch starts, so a single-node log has an empty cache and
no file. A log saves its cache as ``leader-epochs.json`` beside its
segments, replaced atomically, and rebuilds it from the batch headers when
that file is missing or disagrees with them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

from conveyor.broker.log.durable import atomic_write

from conveyor.errors import ConveyorError

log = logging.getLogger(__name__)

EPOCHS_FILE = "leader-epochs.json"
FORMAT = 1
NO_EPOCH = 0  # batches written outside a cluster: the implicit first epoch
UNDEFINED_EPOCH = -1  # ``end_offset_for``: this cache knows nothing of the epoch asked
UNDEFINED_OFFSET = -1


class EpochEntry(NamedTuple):
    epoch: int
    start_offset: int


class LeaderEpochCache:
    """``(epoch, start_offset)`` pairs in rising order; saved to ``path`` on every change when a path is given."""

    def __init__(self, entries: Iterable[tuple[int, int]] = (), *, path: Path | None = None) -> None:
        self.path = path
        self._entries: list[EpochEntry] = []
        for epoch, start in entries:
            self._assign(EpochEntry(epoch, start))

    # --- reading --------------------------------------------------------------------------------

    @property
    def entries(self) -> list[EpochEntry]:
        return list(self._entries)

    @property
    def latest_epoch(self) -> int:
        """The newest epoch; 0 (the implicit epoch outside a cluster) when none is listed."""
        return self._entries[-1].epoch if self._entries else NO_EPOCH

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """``(epoch_found, end_offset)``: the largest known epoch <= ``epoch``, and the offset where it ended.

        It ended where the next listed epoch starts; the latest epoch ends at ``log_end``
        (it is still being written). An epoch older than every listed one answers
        ``(epoch, start of the first listed one)`` (retention may have dropped its entry; the
        implicit epoch 0 is such an epoch). ``(UNDEFINED_EPOCH, UNDEFINED_OFFSET)``, i.e.
        ``(-1, -1)``, answers a negative epoch and one newer than every epoch listed here,
        as Kafka's ``endOffsetFor`` does.
        """
        entries = self._entries
        if epoch < 0:
            return UNDEFINED_EPOCH, UNDEFINED_OFFSET
        if epoch == self.latest_epoch:
            return epoch, log_end
        later = next((i for i, entry in enumerate(entries) if entry.epoch > epoch), None)
        if later is None:  # newer than anything known
            return UNDEFINED_EPOCH, UNDEFINED_OFFSET
        end = entries[later].start_offset
        if later == 0:  # older than anything listed
            return epoch, end
        return entries[later - 1].epoch, end

    def epoch_at(self, offset: int) -> int:
        """The epoch the batch at ``offset`` was written in (0 before the first listed epoch)."""
        found = NO_EPOCH
        for entry in self._entries:
            if entry.start_offset > offset:
                break
            found = entry.epoch
        return found

    # --- changing ------------------------------------------------------------------------------

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Record that ``epoch`` starts at ``start_offset``; return whether the cache changed.

        A repeat of the latest epoch (at the same or a later offset) changes nothing. As in Kafka,
        an entry that would break the rising order (an older or equal epoch, an earlier or equal
        start) first removes the entries it conflicts with. Epoch 0 is implicit and never listed.
        """
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"a leader epoch and its start offset are >= 0, not ({epoch}, {start_offset})")
        if epoch == NO_EPOCH:
            return False
        changed = self._assign(EpochEntry(epoch, start_offset))
        if changed:
            self.save()
        return changed

    def _assign(self, entry: EpochEntry) -> bool:
        latest = self._entries[-1] if self._entries else None
        if latest is not None and entry.epoch == latest.epoch and entry.start_offset >= latest.start_offset:
            return False
        removed = self._remove_from_end(lambda e: e.epoch >= entry.epoch or e.start_offset >= entry.start_offset)
        if len(removed) > 1 or (removed and removed[0].start_offset != entry.start_offset):
            log.warning("leader epoch %d at %d replaces the entries %s", entry.epoch, entry.start_offset, removed)
        self._entries.append(entry)
        return True

    def truncate_from_end(self, end_offset: int) -> None:
        """The log was cut at ``end_offset``: forget the epochs that start there or later."""
        if self._remove_from_end(lambda e: e.start_offset >= end_offset):
            self.save()

    def truncate_from_start(self, start_offset: int) -> None:
        """The log now starts at ``start_offset``: the epoch holding it starts there, older ones go."""
        entries = self._entries
        before = [e for e in entries if e.start_offset <= start_offset]
        if not before or (len(before) == 1 and before[0].start_offset == start_offset):
            return
        self._entries = [EpochEntry(before[-1].epoch, start_offset), *entries[len(before) :]]
        self.save()

    def clear(self) -> None:
        if self._entries:
            self._entries = []
            self.save()

    def _remove_from_end(self, matches: Callable[[EpochEntry], bool]) -> list[EpochEntry]:
        removed: list[EpochEntry] = []
        while self._entries and matches(self._entries[-1]):
            removed.insert(0, self._entries.pop())
        return removed

    # --- the file ------------------------------------------------------------------------------

    def save(self) -> None:
        """Replace the file, if any. A failed save is logged, not raised: the headers can rebuild it."""
        if self.path is None:
            return
        data = json.dumps({"format": FORMAT, "epochs": [list(e) for e in self._entries]}).encode()
        try:
            atomic_write(self.path, data)
        except (ConveyorError, OSError) as exc:
            log.warning("%s: could not save the leader epochs (rebuilt from the batches on open): %s", self.path, exc)


def load_entries(path: Path) -> list[EpochEntry] | None:
    """The entries saved in ``path``; None if it is missing, damaged or out of order."""
    try:
        data = json.loads(path.read_bytes())
        pairs = data["epochs"]
        if data.get("format") != FORMAT or not isinstance(pairs, list):
            return None
        entries = [EpochEntry(int(epoch), int(start)) for epoch, start in pairs]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: unreadable (%s); rebuilt from the batch headers", path, exc)
        return None
    rising = all(a.epoch < b.epoch and a.start_offset < b.start_offset for a, b in pairwise(entries))
    if not rising or any(e.epoch <= NO_EPOCH or e.start_offset < 0 for e in entries):
        log.warning("%s: entries out of order; rebuilt from the batch headers", path)
        return None
    return entries


def open_cache(
    path: Path, batches: Iterable[tuple[int, int]], *, start_offset: int, end_offset: int
) -> LeaderEpochCache:
    """The cache of a log that opened, checked against its batches ``(epoch, base_offset)`` in offset order.

    The saved file is cut to the log's bounds, as the log itself was on recovery. If it then
    disagrees with what the headers say (or is missing or damaged), the headers win and the
    file is written again; a log that never held a replicated batch writes no file.
    """
    derived = LeaderEpochCache()
    latest = NO_EPOCH
    for epoch, base in batches:
        if epoch != latest and epoch > NO_EPOCH:
            derived._assign(EpochEntry(epoch, base))
            latest = derived.latest_epoch
    saved = load_entries(path)
    if saved is not None:
        stored = LeaderEpochCache(saved)
        stored.truncate_from_end(end_offset)
        stored.truncate_from_start(start_offset)
        if stored.entries == derived.entries:
            stored.path = path
            if stored.entries != saved:
                stored.save()
            return stored
        log.warning("%s: %s disagrees with the batch headers %s; rebuilt", path, stored.entries, derived.entries)
    derived.path = path
    if saved is not None or derived.entries or path.exists():
        derived.save()
    return derived
