"""The default storage backend: a directory of segments per topic."""

from __future__ import annotations

import logging
import os
from bisect import bisect_right
from collections.abc import Callable, Mapping
from pathlib import Path

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log import syscalls
from conveyor.broker.log.durable import atomic_write, free_name, fsync_dir, make_dirs, storage_errors
from conveyor.broker.log.epochs import EPOCHS_FILE, open_cache
from conveyor.broker.log.segment import INDEX_ENTRY, Segment
from conveyor.broker.log.topic_log import TopicConfig, TopicLog
from conveyor.broker.wire.record import Batch, BatchHeader

from conveyor.errors import ConveyorError, SegmentCorrupt, StorageIOError

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"


class FileLog(TopicLog):
    """Segments ``<base offset, 20 digits>.log`` plus sparse ``.index`` files.

    Opening recovers: sealed segments must be whole (``SegmentCorrupt``, or
    moved to ``quarantine/`` when asked), the newest one loses its torn tail.
    """

    def __init__(
        self,
        name: str,
        directory: str | os.PathLike[str],
        config: TopicConfig,
        *,
        fsync: FsyncPolicy,
        quarantine: bool = False,
        clock: Callable[[], float] | None = None,
        monotonic: Callable[[], float] | None = None,
        sync_new_directory: bool = True,
        committed: Mapping[str, int] | None = None,
    ) -> None:
        """``sync_new_directory=False``: the caller makes a new topic's first segment durable (the store's creator).

        ``committed``: each group's committed offset from ``groups.json``, evidence of offsets that existed.
        """
        kwargs = {"clock": clock} if clock is not None else {}
        if monotonic is not None:
            kwargs["monotonic"] = monotonic
        super().__init__(name, config, fsync=fsync, **kwargs)
        self.directory = Path(directory)
        self.quarantine = quarantine
        self.gaps: list[tuple[int, int]] = []  # offset ranges lost to quarantine
        self.segments: list[Segment] = []
        self._bases: list[int] = []
        self._unsynced: list[Segment] = []  # rolled since the last sync
        self._in_doubt = False  # a failed fsync's data is not cut yet: no writes until it is
        self._evidence = self._known_offsets(committed or {})  # read before recovery rewrites the indexes
        with storage_errors(str(self.directory)):
            self.directory.mkdir(parents=True, exist_ok=True)
        self._open(sync_new_directory)

    # --- opening -----------------------------------------------------------

    def _open(self, sync_new_directory: bool = True) -> None:
        bases = sorted(int(p.stem) for p in self.directory.glob("*.log") if p.stem.isdigit())
        if not bases:
            self._new_segment(0, sync_directory=sync_new_directory)
            self.epochs = open_cache(self.directory / EPOCHS_FILE, [], start_offset=0, end_offset=0)
            return
        epoch_starts: list[tuple[int, int]] = []  # (epoch, base offset) where the batches' epoch changes
        lost_from: int | None = None  # base of the oldest segments quarantined before any was kept
        newest_lost_end: int | None = None  # the newest segment was quarantined: offsets it used up to here
        for i, base in enumerate(bases):
            segment = Segment(self.directory, base, index_interval=self.config.index_interval_bytes)
            newest = i == len(bases) - 1
            lost_end = self._recover(segment, sealed=not newest, before_cut=self._keep_confirmed_tail(segment))
            if lost_end is not None:
                if not self.segments and lost_from is None:
                    lost_from = base
                if newest:
                    newest_lost_end = lost_end
                continue
            if not self.segments and lost_from is not None:
                self.gaps.append((lost_from, base))
            self._check_continuity(segment)
            self.segments.append(segment)
            self._bases.append(base)
            self._adopt_producers(segment.recovered_headers)
            _epoch_starts(segment.recovered_headers, epoch_starts)
        if newest_lost_end is not None:
            self._continue_after_quarantine(lost_from, newest_lost_end)
        self._continue_after_loss()
        self.start_offset = self.segments[0].base_offset
        self.end_offset = self.durable_offset = self.segments[-1].next_offset
        self.epochs = open_cache(
            self.directory / EPOCHS_FILE, epoch_starts, start_offset=self.start_offset, end_offset=self.end_offset
        )

    def _known_offsets(self, committed: Mapping[str, int]) -> list[tuple[int, str]]:
        """``(end, why)`` for each sign that offsets below ``end`` once existed, highest first.

        A group commits only what was confirmed (durable), so its committed
        offset is proof. A segment's ``.index`` whose ``.log`` is gone proves
        that segment existed: its base offset, and the entries that are
        plausible (rising, at most one offset per byte). The index of a
        segment that is there stays a hint, rebuilt from the data.
        """
        found = [(int(offset), f"group {group} committed offset {offset}") for group, offset in committed.items()]
        for path in self.directory.glob("*.index"):
            if path.stem.isdigit() and not path.with_suffix(".log").exists():
                highest = int(path.stem) + _plausible_index_end(path.read_bytes())
                found.append((highest, f"{path.name} is left of a segment whose .log is gone (offset {highest - 1})"))
        return sorted(found, reverse=True)

    def _keep_confirmed_tail(self, segment: Segment) -> Callable[[int, int], None]:
        """Before a tail is cut: if evidence says it held confirmed offsets, keep its bytes in ``quarantine/``."""

        def keep(valid_size: int, next_offset: int) -> None:
            if not self._evidence or self._evidence[0][0] <= next_offset:
                return  # a torn write: nothing says it was ever confirmed
            with open(segment.path, "rb") as source:
                source.seek(valid_size)
                self._write_lost_marker(next_offset, source.read())

        return keep

    def _write_lost_marker(self, start: int, data: bytes) -> Path:
        """``quarantine/<start>.log.lost``: the cut bytes (if any), and what tells the next start the gap is known."""
        folder = self.directory / QUARANTINE_DIR
        with storage_errors(str(folder)):
            make_dirs(folder)
            target = free_name(folder, f"{start:020d}.log.lost")
            atomic_write(target, data)
        return target

    def _continue_after_loss(self) -> None:
        """Offsets evidence says existed are missing: loud, recorded, and never given to new messages.

        The log goes on after the highest offset known to have existed (as
        after a quarantined newest segment): a gap is better than two different
        messages at one offset.
        """
        kept_end = self.segments[-1].next_offset
        known = [(end, why) for end, why in self._evidence if end > kept_end]
        self._evidence = []
        if not known:
            return
        lost_end = known[0][0]
        marker = self.directory / QUARANTINE_DIR / f"{kept_end:020d}.log.lost"
        if not marker.exists():
            marker = self._write_lost_marker(kept_end, b"")
        for end, why in known:
            log.error(
                "%s: CONFIRMED DATA LOST: offsets [%d, %d) are missing but %s; they are skipped, never reused "
                "(cut bytes, if any, kept in %s)",
                self.name,
                kept_end,
                end,
                why,
                marker,
            )
        self.lost_ranges.append({"start": kept_end, "end": lost_end, "evidence": [why for _e, why in known]})
        self.gaps.append((kept_end, lost_end))
        if self.segments[-1].size == 0:
            self._delete_newest()  # an empty segment before the gap would only be in the way
        self._new_segment(lost_end)

    def _continue_after_quarantine(self, lost_from: int | None, lost_end: int) -> None:
        """A new newest segment after every offset the quarantined one held: offsets are never given twice."""
        kept_end = self.segments[-1].next_offset if self.segments else lost_from
        if kept_end is not None and kept_end < lost_end:
            self.gaps.append((kept_end, lost_end))
            log.error("%s: offsets [%d, %d) are missing (quarantined)", self.name, kept_end, lost_end)
        self._new_segment(max(lost_end, self.segments[-1].next_offset if self.segments else 0))

    def _recover(
        self, segment: Segment, *, sealed: bool, before_cut: Callable[[int, int], None] | None = None
    ) -> int | None:
        """None if ``segment`` opened; if it was quarantined, the end of the offsets it may have held."""
        try:
            self.truncated_bytes += segment.recover(sealed=sealed, before_cut=before_cut)
            return None
        except SegmentCorrupt as exc:
            if not self.quarantine:
                segment.close()
                raise SegmentCorrupt(
                    f"{exc.message}; start with --quarantine to move the segment to {QUARANTINE_DIR}/ "
                    "(its offsets are then skipped, never reused)",
                    **exc.fields,
                ) from None
            self._quarantine(segment, exc)
            return max(segment.base_offset, int(exc.fields.get("end_offset", segment.base_offset)))

    def _quarantine(self, segment: Segment, reason: SegmentCorrupt) -> None:
        target = self.directory / QUARANTINE_DIR
        make_dirs(target)
        segment.close()
        for path in (segment.path, segment.index_path):
            if path.exists():
                syscalls.rename(path, free_name(target, path.name))
        fsync_dir(target)  # both directory entries: a crash now must not lose the evidence nor bring it back
        fsync_dir(self.directory)
        self.quarantined_segments += 1
        log.error("%s: quarantined corrupt segment %s: %s", self.name, segment.path.name, reason.message)

    def _check_continuity(self, segment: Segment) -> None:
        if not self.segments:
            return
        expected = self.segments[-1].next_offset
        if segment.base_offset == expected:
            return
        if not self.quarantine and not self.gaps and not self._quarantined_within(expected, segment.base_offset):
            segment.close()
            raise SegmentCorrupt(
                f"{segment.path}: starts at offset {segment.base_offset}, previous segment ends at {expected}",
                path=str(segment.path),
                position=0,
            )
        self.gaps.append((expected, segment.base_offset))
        log.error("%s: offsets [%d, %d) are missing (quarantined)", self.name, expected, segment.base_offset)

    def _quarantined_within(self, start: int, end: int) -> bool:
        """Whether ``quarantine/`` holds a segment from ``[start, end)``: a gap an earlier start left on purpose."""
        folder = self.directory / QUARANTINE_DIR
        names = (p.name.split(".")[0] for p in folder.glob("*.log*")) if folder.is_dir() else ()
        return any(name.isdigit() and start <= int(name) < end for name in names)

    def _adopt_producers(self, headers: list[BatchHeader]) -> None:
        for header in headers:
            if header.producer_id >= 0:
                self.producers.record(header.producer_id, header.sequence, header.base_offset, header.count)

    def _new_segment(self, base: int, *, sync_directory: bool = True) -> Segment:
        segment = Segment(self.directory, base, index_interval=self.config.index_interval_bytes)
        self.segments.append(segment)
        self._bases.append(base)
        if sync_directory:
            with storage_errors(str(self.directory)):
                fsync_dir(self.directory)
        return segment

    def reconfigure(self, config: TopicConfig) -> None:
        super().reconfigure(config)
        self.segments[-1].index_interval = config.index_interval_bytes  # older segments are sealed

    # --- primitives ----------------------------------------------------------

    def _write(self, header: bytes, body: bytes, base_offset: int, count: int, timestamp_ms: int) -> None:
        if self._in_doubt:  # a failed fsync left data that could not be cut: cut it, then have this batch resent
            self._discard_unsynced()
            raise StorageIOError(f"{self.name}: the log was cut back after a failed fsync; send again", topic=self.name)
        active = self.segments[-1]
        if active.size and active.size + len(header) + len(body) > self.config.segment_bytes:
            self._roll(base_offset)
            active = self.segments[-1]
        active.append(header, body, base_offset, count, timestamp_ms)

    def _roll(self, base_offset: int) -> None:
        # Under every policy a sealed segment is whole on disk before the next one exists: recovery
        # requires sealed segments to be complete and contiguous, so a power cut between the roll and
        # the next sync must not leave a short segment (a gap) before a newer one.
        sealed = self.segments[-1]
        self._sync_segments([sealed])
        if sealed in self._unsynced:  # it is there if truncate_to made it active again
            self._unsynced.remove(sealed)
        self._new_segment(base_offset)

    def _sync(self) -> None:
        if self._in_doubt:
            self._discard_unsynced()
        self._sync_segments([*self._unsynced, self.segments[-1]])
        self._unsynced.clear()

    def _sync_segments(self, segments: list[Segment]) -> None:
        for segment in segments:  # a failed cut is not a failed fsync: nothing synced is in doubt
            segment.cut_torn_tail()
        try:
            for segment in segments:
                segment.sync()
        except ConveyorError:
            self._discard_unsynced()
            raise

    def _discard_unsynced(self) -> None:
        """After a failed fsync, cut the log back to what the last successful sync made durable.

        Linux may mark the pages of a failed writeback clean without writing them ("fsyncgate"),
        so a later fsync that succeeds proves nothing about them: they must not be confirmed by
        it. Nothing past the durable offset was confirmed, delivered or served; its producers get
        a retriable error and resend. While the cut itself fails, the log takes no writes.
        """
        self._in_doubt = True
        if self.durable_offset < self.end_offset:
            log.error(
                "%s: fsync failed: dropping unsynced offsets [%d, %d)", self.name, self.durable_offset, self.end_offset
            )
            self.truncate_to(self.durable_offset)
        self._in_doubt = False

    def _read_stored(self, offset: int, max_bytes: int, until: int | None = None) -> list[Batch]:
        i = max(0, bisect_right(self._bases, offset) - 1)
        batches = self.segments[i].read(offset, max_bytes=max_bytes, until=until)
        while not batches and i + 1 < len(self.segments):  # offset sits in a gap or at a segment end
            i += 1
            batches = self.segments[i].read(self.segments[i].base_offset, max_bytes=max_bytes, until=until)
        return batches

    def _truncate(self, offset: int) -> int:
        while len(self.segments) > 1 and self.segments[-1].base_offset >= offset:
            self._delete_newest()
        segment = self.segments[-1]
        if segment.base_offset >= offset:
            segment.truncate(0, segment.base_offset)
            segment.last_timestamp_ms = 0
        else:
            position, next_offset, segment.last_timestamp_ms = self._boundary_at(segment, offset)
            segment.truncate(position, next_offset)
        return segment.next_offset

    def _boundary_at(self, segment: Segment, offset: int) -> tuple[int, int, int]:
        """The file position of the first batch ending after ``offset``, its offset, and the time of the one before.

        That time is what age-based retention reads: it must not be the time of a batch cut away.
        """
        position = last_ts = 0
        for header in segment.walk_headers():
            if header.next_offset > offset:
                return position, header.base_offset, last_ts
            position += header.size
            last_ts = header.timestamp_ms
        return position, segment.next_offset, last_ts

    def _reset(self, offset: int) -> None:
        for segment in self.segments:
            segment.delete()
        self.segments.clear()
        self._bases.clear()
        self._unsynced.clear()
        self._new_segment(offset)

    def _delete_newest(self) -> None:
        segment = self.segments.pop()
        self._bases.pop()
        if segment in self._unsynced:
            self._unsynced.remove(segment)
        segment.delete()
        fsync_dir(self.directory)

    def _drop_segments_before(self, now_ms: int) -> int:
        doomed = 0
        total = self.size_bytes()
        for segment in self.segments[:-1]:  # the active segment is never deleted
            too_big = self.config.retention_bytes >= 0 and total - segment.size >= self.config.retention_bytes
            too_old = self.config.retention_ms >= 0 and now_ms - segment.last_timestamp_ms > self.config.retention_ms
            if not (too_big or too_old):
                break
            total -= segment.size
            doomed += 1
        if doomed:
            for segment in self.segments[:doomed]:
                if segment in self._unsynced:
                    segment.sync()
                    self._unsynced.remove(segment)
                segment.delete()
            del self.segments[:doomed]
            del self._bases[:doomed]
            fsync_dir(self.directory)
        return self.segments[0].base_offset

    def size_bytes(self) -> int:
        return sum(segment.size for segment in self.segments)

    def segment_count(self) -> int:
        return len(self.segments)

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        for segment in self.segments:
            if segment.last_timestamp_ms >= timestamp_ms:
                found = segment.timestamp_position(timestamp_ms)
                if found is not None:
                    return max(found, self.start_offset)
        return self.end_offset

    def close(self) -> None:
        for segment in self.segments:
            segment.close()

    def delete_files(self) -> None:
        """Remove the topic's directory entirely (topic deletion)."""
        self.close()
        for path in sorted(self.directory.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        self.directory.rmdir()
        fsync_dir(self.directory.parent)


def _epoch_starts(headers: list[BatchHeader], starts: list[tuple[int, int]]) -> None:
    """Add ``(epoch, base offset)`` to ``starts`` wherever the batches' epoch changes."""
    last = starts[-1][0] if starts else 0
    for header in headers:
        if header.leader_epoch != last:
            last = header.leader_epoch
            starts.append((last, header.base_offset))


MIN_RECORD_BYTES = 4  # a stored record is at least a msgpack [key, headers, value] of nils


def _plausible_index_end(data: bytes) -> int:
    """One past the highest relative offset an index's entries show, trusting them only while they are plausible:
    the first is (0, 0) (a segment's first batch is always indexed), then both rise, and no entry claims more
    records than the bytes before it could hold."""
    end, last_offset, last_position = 1, -1, -1
    for at in range(0, len(data) - len(data) % INDEX_ENTRY.size, INDEX_ENTRY.size):
        relative, position = INDEX_ENTRY.unpack_from(data, at)
        if at == 0 and (relative, position) != (0, 0):
            break
        if relative <= last_offset or position <= last_position or relative * MIN_RECORD_BYTES > position:
            break
        end, last_offset, last_position = relative + 1, relative, position
    return end
