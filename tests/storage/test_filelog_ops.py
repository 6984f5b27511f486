"""FileLog rolls, retention and truncation, step by step (the state machine explores the mixes)."""

from __future__ import annotations

import pytest
from conveyor.broker.wire.record import HEADER_SIZE, pack_records

from conveyor.errors import OffsetOutOfRange
from tests.storage.storage_helpers import file_log, segment_files

BODY = pack_records([(None, None, b"v" * 400)])  # three batches fill a 1500-byte segment
SIZE = HEADER_SIZE + len(BODY)


@pytest.fixture
def log(tmp_path, clock):
    log = file_log(tmp_path / "t", segment_bytes=1500, clock=clock)
    yield log
    log.close()


def fill(log, clock, batches: int, *, seconds_apart: float = 0) -> None:
    for _ in range(batches):
        log.append(BODY, 1)
        clock.advance(seconds_apart)


def test_a_segment_rolls_when_the_next_batch_would_not_fit(log, clock):
    fill(log, clock, 7)
    assert [s.base_offset for s in log.segments] == [0, 3, 6]
    assert [s.size for s in log.segments] == [3 * SIZE, 3 * SIZE, SIZE]
    assert [p.name for p in segment_files(log.directory)] == [f"{b:020d}.log" for b in (0, 3, 6)]


def test_retention_by_bytes_drops_whole_oldest_segments(log, clock):
    fill(log, clock, 7)
    log.config.retention_bytes = 4 * SIZE

    assert log.apply_retention() == 3

    assert log.start_offset == 3
    assert [s.base_offset for s in log.segments] == [3, 6]
    with pytest.raises(OffsetOutOfRange):
        log.read(2)


def test_retention_by_age_uses_the_newest_batch_of_each_segment(log, clock):
    # Given segments whose newest batches are 60 s apart
    fill(log, clock, 7, seconds_apart=20)
    log.config.retention_ms = 50_000
    # When retention runs right after the last append: the first segment's newest batch is 80 s old
    assert log.apply_retention() == 3
    # Then the second (newest batch 20 s old) stays, and the active segment is never dropped
    clock.advance(3600)
    log.apply_retention()
    assert [s.base_offset for s in log.segments] == [6]


def test_truncate_to_forgets_the_time_of_the_batches_it_cut(log, clock):
    # Given a segment whose newest batch is an hour newer than the one before it
    fill(log, clock, 1)
    clock.advance(3600)
    fill(log, clock, 1)
    first_ts = log.read(0)[0].timestamp_ms
    # When the newer batch is cut
    log.truncate_to(1)
    # Then age-based retention sees the time of the batch that is left
    assert log.segments[-1].last_timestamp_ms == first_ts


def test_sync_after_truncate_roll_and_retention(log, clock):
    # Given a rolled (not yet synced) segment made active again by truncate_to, then rolled again
    fill(log, clock, 4)
    log.truncate_to(1)
    fill(log, clock, 3)
    assert [s.base_offset for s in log.segments] == [0, 3]
    # When retention deletes it before the next group commit
    log.config.retention_bytes = 0
    assert log.apply_retention() == 3
    # Then the group commit still works and everything is durable
    log.sync()
    assert log.durable_offset == log.end_offset == 4


@pytest.mark.parametrize("storage", ["file", "memory"])
def test_a_read_for_a_few_messages_stops_at_the_batch_holding_the_last(tmp_path, storage):
    """From disk (no tail cache) as from the cache: a dispatch for a consumer's few credits reads the
    batches it needs, not a MiB of small ones on every pass."""
    if storage == "file":
        log = file_log(tmp_path / "t", cache_bytes=0)
    else:
        from conveyor.broker.config.fsync import FsyncPolicy
        from conveyor.broker.log.memory_log import MemoryLog
        from conveyor.broker.log.topic_log import TopicConfig

        log = MemoryLog("t", TopicConfig(storage="memory", cache_bytes=0), fsync=FsyncPolicy("none"))
    one = pack_records([(None, None, b"v")])
    for _ in range(500):
        log.append(one, 1)
    log.sync()
    try:
        assert [b.base_offset for b in log._read_from_storage(7, 1 << 20, 10)] == [7, 8, 9]  # what was read
        assert [b.base_offset for b in log.read(7, max_messages=3)] == [7, 8, 9]
        assert [b.base_offset for b in log.read(7, max_messages=1)] == [7]
        assert len(log._read_from_storage(7, 1 << 20)) == len(log.read(7)) == 493  # no limit: bytes only
    finally:
        log.close()
