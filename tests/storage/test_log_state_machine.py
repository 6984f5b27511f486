"""A model-based test of the topic log: FileLog and MemoryLog against one reference model.

The model keeps every batch, the segments they fall into, the synced watermark and
what the idempotent-producer state should remember. Rules append (plain, idempotent,
resends, bad sequences), read, sync, crash and reopen, apply retention, truncate.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.idempotence import WINDOW
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.wire.record import HEADER_SIZE, NO_PRODUCER, pack_records
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conveyor.errors import DuplicateSequence, OffsetOutOfRange
from tests.helpers import FakeClock
from tests.storage.storage_helpers import crash

SEGMENT_BYTES = 1024
PRODUCERS = [11, 22, 33]


@dataclass(frozen=True)
class MBatch:
    base: int
    count: int
    body: bytes
    ts: int
    pid: int = NO_PRODUCER
    seq: int = -1

    @property
    def next(self) -> int:
        return self.base + self.count


@dataclass
class MSegment:
    base: int
    batches: list[MBatch] = field(default_factory=list)


class Model:
    """The log as a list of segments of batches.

    ``header`` and ``segment_bytes`` describe the backend: FileLog counts the 48-byte
    header and rolls at segment_bytes; MemoryLog behaves as one segment per batch
    counting body bytes only.
    """

    def __init__(self, *, segment_bytes: int, header: int) -> None:
        self.segment_bytes = segment_bytes
        self.header = header
        self.segments = [MSegment(0)]
        self.synced = 0
        self.producers: dict[int, dict[int, MBatch]] = {}  # what ProducerState should remember
        self.next_seq = dict.fromkeys(PRODUCERS, 0)

    # --- shape ----------------------------------------------------------------

    def size(self, batches: list[MBatch]) -> int:
        return sum(self.header + len(b.body) for b in batches)

    @property
    def start(self) -> int:
        return self.segments[0].base

    @property
    def end(self) -> int:
        last = self.segments[-1]
        return last.batches[-1].next if last.batches else last.base

    def batches(self) -> list[MBatch]:
        return [b for s in self.segments for b in s.batches]

    def batch_at(self, offset: int) -> MBatch:
        return next(b for b in self.batches() if b.base <= offset < b.next)

    # --- operations -------------------------------------------------------------

    def append(self, batch: MBatch) -> None:
        active = self.segments[-1]
        used = self.size(active.batches)
        if used and used + self.header + len(batch.body) > self.segment_bytes:
            active = MSegment(batch.base)
            self.segments.append(active)
        active.batches.append(batch)
        if batch.pid != NO_PRODUCER:
            self.remember(batch)

    def remember(self, batch: MBatch) -> None:
        recent = self.producers.setdefault(batch.pid, {})
        recent[batch.seq] = batch
        if len(recent) > WINDOW:
            del recent[min(recent)]

    def truncate(self, offset: int) -> None:
        offset = max(offset, self.start)
        if offset >= self.end:
            return
        while len(self.segments) > 1 and self.segments[-1].base >= offset:
            self.segments.pop()
        last = self.segments[-1]
        last.batches = [b for b in last.batches if b.next <= offset]
        if not last.batches and len(self.segments) > 1 and self.header == 0:
            self.segments.pop()  # MemoryLog: its newest batch, not an empty segment, is what retention keeps
        new_end = self.end
        self.synced = min(self.synced, new_end)
        for pid in list(self.producers):
            recent = self.producers[pid]
            for seq in [s for s, b in recent.items() if b.base >= new_end]:
                del recent[seq]
            if not recent:
                del self.producers[pid]

    def retention(self, now_ms: int, retention_bytes: int, retention_ms: int) -> None:
        total = sum(self.size(s.batches) for s in self.segments)
        while len(self.segments) > 1:
            first = self.segments[0]
            size = self.size(first.batches)
            last_ts = first.batches[-1].ts if first.batches else 0
            too_big = retention_bytes >= 0 and total - size >= retention_bytes
            too_old = retention_ms >= 0 and now_ms - last_ts > retention_ms
            if not (too_big or too_old):
                break
            total -= size
            self.segments.pop(0)

    def reopened(self) -> None:
        """What a reopen rebuilds: producer state from the batches still stored."""
        self.synced = self.end
        self.producers = {}
        for batch in self.batches():
            if batch.pid != NO_PRODUCER:
                self.remember(batch)


values = st.lists(st.binary(max_size=120), min_size=1, max_size=6)
big_values = st.lists(st.binary(min_size=300, max_size=500), min_size=2, max_size=3)


class LogMachine(RuleBasedStateMachine):
    """The rules every backend shares; ``FileLogMachine`` adds crashes and segment files."""

    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.directory: Path | None = None
        self.clock = FakeClock()
        self.log: FileLog | MemoryLog | None = None

    # --- set-up and helpers -------------------------------------------------------

    @initialize(cache_bytes=st.sampled_from([0, 700, 1 << 20]), index_interval=st.sampled_from([64, 300, 4096]))
    def open_log(self, cache_bytes: int, index_interval: int) -> None:
        self.config = TopicConfig(
            segment_bytes=SEGMENT_BYTES, index_interval_bytes=index_interval, cache_bytes=cache_bytes
        )
        if self.backend == "file":
            self.model = Model(segment_bytes=SEGMENT_BYTES, header=HEADER_SIZE)
        else:
            self.model = Model(segment_bytes=0, header=0)
        self.log = self.open()

    def open(self) -> FileLog | MemoryLog:
        if self.backend == "file":
            return FileLog("t", self.directory, self.config, fsync=FsyncPolicy("batch"), clock=self.clock)
        return MemoryLog("t", self.config, fsync=FsyncPolicy("batch"), clock=self.clock)

    def teardown(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.directory is not None:
            shutil.rmtree(self.directory.parent, ignore_errors=True)

    def do_append(self, vals: list[bytes], pid: int = NO_PRODUCER, seq: int = -1) -> None:
        body = pack_records([(None, None, v) for v in vals])
        result = self.log.append(body, len(vals), producer_id=pid, sequence=seq)
        assert not result.duplicate
        assert (result.base_offset, result.count) == (self.model.end, len(vals))
        self.model.append(MBatch(result.base_offset, len(vals), body, int(self.clock() * 1000), pid, seq))

    def assert_batch(self, got, want: MBatch) -> None:
        assert (got.base_offset, got.count, bytes(got.body), got.timestamp_ms) == (
            want.base,
            want.count,
            want.body,
            want.ts,
        )
        assert (got.producer_id, got.sequence) == (want.pid, want.seq)

    # --- appends ------------------------------------------------------------------

    @rule(vals=values)
    def append(self, vals: list[bytes]) -> None:
        self.do_append(vals)

    @rule(vals=big_values)
    def append_big(self, vals: list[bytes]) -> None:
        self.do_append(vals)  # over half a segment: the next append of this size rolls

    @rule(pid=st.sampled_from(PRODUCERS), vals=values, gap=st.sampled_from([0, 0, 0, 1, 3]))
    def append_idempotent(self, pid: int, vals: list[bytes], gap: int) -> None:
        recent = self.model.producers.get(pid)
        seq = max(max(recent) + 1 if recent else 0, self.model.next_seq[pid]) + gap  # gaps are allowed
        self.model.next_seq[pid] = seq + 1
        self.do_append(vals, pid, seq)

    @precondition(lambda self: any(set(range(min(r), max(r))) - set(r) for r in self.model.producers.values()))
    @rule(data=st.data(), vals=values)
    def fill_a_sequence_gap(self, data: st.DataObject, vals: list[bytes]) -> None:
        # A batch that failed earlier is retried after later ones were stored: it is new.
        holes = sorted(
            (pid, seq)
            for pid, recent in self.model.producers.items()
            for seq in set(range(min(recent), max(recent))) - set(recent)
        )
        pid, seq = data.draw(st.sampled_from(holes))
        self.do_append(vals, pid, seq)

    @precondition(lambda self: self.model.producers)
    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.model.producers)))
        recent = self.model.producers[pid]
        seq = data.draw(st.sampled_from([max(recent), *sorted(recent)]))  # the last one, or any remembered
        original = recent[seq]
        end = self.model.end

        result = self.log.append(original.body, original.count, producer_id=pid, sequence=seq)

        assert result.duplicate
        assert (result.base_offset, result.count) == (original.base, original.count)
        assert self.log.end_offset == end

    @precondition(lambda self: any(min(r) > 0 for r in self.model.producers.values()))
    @rule(data=st.data())
    def resend_too_old(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(p for p, r in self.model.producers.items() if min(r) > 0)))
        seq = data.draw(st.integers(0, min(self.model.producers[pid]) - 1))
        end = self.model.end
        with pytest.raises(DuplicateSequence):
            self.log.append(pack_records([(None, None, b"x")]), 1, producer_id=pid, sequence=seq)
        assert self.log.end_offset == end

    # --- reads --------------------------------------------------------------------

    @precondition(lambda self: self.model.end > self.model.start)
    @rule(data=st.data(), max_bytes=st.sampled_from([1, 200, 1500, 1 << 20]))
    def read(self, data: st.DataObject, max_bytes: int) -> None:
        offset = data.draw(st.integers(self.model.start, self.model.end - 1))
        batches = self.log.read(offset, max_bytes=max_bytes)
        assert batches
        assert batches[0].base_offset <= offset < batches[0].next_offset
        for got, following in itertools.pairwise(batches):
            assert got.next_offset == following.base_offset
        for got in batches:
            self.assert_batch(got, self.model.batch_at(got.base_offset))
        assert len(batches) == 1 or sum(len(b.body) for b in batches) <= max_bytes

    @precondition(lambda self: self.model.end > self.model.start)
    @rule(data=st.data(), n=st.integers(1, 10))
    def read_max_messages(self, data: st.DataObject, n: int) -> None:
        offset = data.draw(st.integers(self.model.start, self.model.end - 1))
        full = self.log.read(offset)  # never crosses a segment end, so may hold fewer than n
        limited = self.log.read(offset, max_messages=n)
        assert limited and limited == full[: len(limited)]
        before_last = limited[-1].base_offset - offset
        assert before_last < n  # the last batch was needed to reach n messages
        assert len(limited) == len(full) or limited[-1].next_offset - offset >= n

    @rule(past=st.integers(1, 3))
    def read_out_of_range(self, past: int) -> None:
        assert self.log.read(self.model.end) == []
        with pytest.raises(OffsetOutOfRange):
            self.log.read(self.model.end + past)
        if self.model.start >= past:
            with pytest.raises(OffsetOutOfRange):
                self.log.read(self.model.start - past)

    # --- durability ---------------------------------------------------------------

    @rule()
    def sync(self) -> None:
        self.log.sync()
        self.model.synced = self.model.end

    def crash_and_reopen(self) -> None:
        # Given a log dropped without its final sync (fds closed, pending index entries lost)
        appended = self.model.batches()
        crash(self.log)
        # When it is opened again
        self.log = self.open()
        # Then every synced batch survived and what survived is a prefix of what was appended
        survived = self.read_all()
        assert self.log.end_offset >= self.model.synced
        assert [b.base_offset for b in survived] == [b.base for b in appended[: len(survived)]]
        for got, want in zip(survived, appended, strict=False):
            self.assert_batch(got, want)
        # The process did not die, so the page cache still held everything: nothing was cut
        assert len(survived) == len(appended)
        assert self.log.truncated_bytes == 0
        self.model.reopened()

    def close_and_reopen(self) -> None:
        self.log.sync()
        self.log.close()
        self.log = self.open()
        self.model.reopened()

    def read_all(self) -> list:
        out, offset = [], self.log.start_offset
        while offset < self.log.end_offset:
            batches = self.log.read(offset)
            out.extend(batches)
            offset = batches[-1].next_offset
        return out

    # --- retention, time and truncation ---------------------------------------------

    @rule(seconds=st.sampled_from([0.001, 1, 30, 600]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(
        retention_bytes=st.sampled_from([-1, 0, 400, 1500, 3000]),
        retention_ms=st.sampled_from([-1, 0, 1000, 60_000, 3_600_000]),
    )
    def apply_retention(self, retention_bytes: int, retention_ms: int) -> None:
        start = self.model.start
        self.config.retention_bytes, self.config.retention_ms = retention_bytes, retention_ms
        now_ms = int(self.clock() * 1000)

        dropped = self.log.apply_retention()

        self.model.retention(now_ms, retention_bytes, retention_ms)
        assert dropped == self.model.start - start
        event(f"retention dropped {'some' if dropped else 'nothing'}")
        if self.model.start > 0:
            with pytest.raises(OffsetOutOfRange):
                self.log.read(self.model.start - 1)

    @rule(data=st.data())
    def truncate_to(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(max(0, self.model.start - 2), self.model.end + 2))
        end = self.model.end
        self.log.truncate_to(offset)
        self.model.truncate(offset)
        event(f"truncate_to {'cut' if self.model.end < end else 'kept all'}")

    # --- invariants ---------------------------------------------------------------

    @invariant()
    def offsets_match_the_model(self) -> None:
        if self.log is None:
            return
        assert 0 <= self.log.start_offset <= self.log.end_offset
        assert (self.log.start_offset, self.log.end_offset) == (self.model.start, self.model.end)
        assert self.log.durable_offset == self.model.synced

    @invariant()
    def batches_are_contiguous(self) -> None:
        if self.log is None:
            return
        batches = self.model.batches()
        assert all(a.next == b.base for a, b in itertools.pairwise(batches))


class FileLogMachine(LogMachine):
    backend = "file"

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="conveyor-log-sm-")) / "t"

    crash_and_reopen = rule()(LogMachine.crash_and_reopen)
    close_and_reopen = rule()(LogMachine.close_and_reopen)

    @invariant()
    def segments_match_the_model(self) -> None:
        if self.log is None:
            return
        event(f"{min(len(self.log.segments), 4)}+ segments")
        assert [s.base_offset for s in self.log.segments] == [s.base for s in self.model.segments]
        assert [s.size for s in self.log.segments] == [self.model.size(s.batches) for s in self.model.segments]
        assert all(s.path.exists() for s in self.log.segments)
        # what age-based retention reads: the time of the newest batch still in each segment
        assert [
            s.last_timestamp_ms for s, m in zip(self.log.segments, self.model.segments, strict=True) if m.batches
        ] == [m.batches[-1].ts for m in self.model.segments if m.batches]
        assert len(list(self.directory.glob("*.log"))) == len(self.model.segments)


SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestFileLogStateMachine = FileLogMachine.TestCase
TestFileLogStateMachine.settings = SETTINGS
TestMemoryLogStateMachine = LogMachine.TestCase
TestMemoryLogStateMachine.settings = SETTINGS
