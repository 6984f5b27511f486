"""Recovery against evidence: offsets a group committed (or a left index names) are never cut silently nor reused."""

from __future__ import annotations

import random
from pathlib import Path

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.wire.record import HEADER_SIZE

from tests.storage.storage_helpers import append_random, file_log, segment_files


def reopen(directory: Path, committed: dict[str, int] | None = None, **config: object) -> FileLog:
    return FileLog("t", directory, TopicConfig(**config), fsync=FsyncPolicy("batch"), committed=committed)  # type: ignore[arg-type]


def stored(directory: Path, batches: int = 4, **config: object) -> list:
    log = file_log(directory, **config)
    rng = random.Random(3)
    expected = [append_random(log, rng, max_count=3) for _ in range(batches)]
    log.sync()
    log.close()
    return expected


def flip_last_batch(directory: Path, expected: list) -> None:
    path = segment_files(directory)[-1]
    data = bytearray(path.read_bytes())
    data[len(data) - len(expected[-1].body) + 1] ^= 0xFF  # in the last batch's body: its CRC fails
    path.write_bytes(bytes(data))


def test_a_cut_below_a_committed_offset_is_recorded_kept_and_skipped(tmp_path):
    expected = stored(tmp_path)
    end = expected[-1].next_offset
    flip_last_batch(tmp_path, expected)

    log = reopen(tmp_path, {"g": end})

    cut_at = expected[-1].base_offset
    assert log.lost_ranges == [{"start": cut_at, "end": end, "evidence": [f"group g committed offset {end}"]}]
    assert log.end_offset == end and log.append(b"\x91\x93\xc0\xc0\xa1x", 1).base_offset == end
    kept = tmp_path / "quarantine" / f"{cut_at:020d}.log.lost"
    assert kept.stat().st_size == HEADER_SIZE + len(expected[-1].body)
    log.sync()
    log.close()
    # Reopened with the same evidence: the gap is known, nothing more is lost, the start is not refused
    again = reopen(tmp_path, {"g": end})
    assert again.lost_ranges == [] and again.end_offset == end + 1
    again.close()


def test_a_torn_tail_nobody_saw_is_cut_as_before(tmp_path):
    expected = stored(tmp_path)
    flip_last_batch(tmp_path, expected)

    log = reopen(tmp_path, {"g": expected[-2].next_offset})

    assert log.lost_ranges == [] and log.end_offset == expected[-2].next_offset
    assert not (tmp_path / "quarantine").exists()
    log.close()


def test_an_index_left_of_a_deleted_newest_log_keeps_its_offsets_from_reuse(tmp_path):
    stored(tmp_path, batches=60, segment_bytes=1024, index_interval_bytes=64)
    newest = segment_files(tmp_path)[-1]
    assert newest.with_suffix(".index").stat().st_size > 8
    newest.unlink()

    log = reopen(tmp_path, segment_bytes=1024, index_interval_bytes=64)

    assert len(log.lost_ranges) == 1 and log.lost_ranges[0]["start"] == int(newest.stem)
    assert log.end_offset > int(newest.stem) + 1  # past the index's plausible entries, not only its base
    log.close()


def test_a_garbage_index_left_alone_counts_only_for_its_base(tmp_path):
    stored(tmp_path, batches=60, segment_bytes=1024, index_interval_bytes=64)
    newest = segment_files(tmp_path)[-1]
    newest.with_suffix(".index").write_bytes(bytes(range(8)) * 4 + b"\xff" * 8)
    newest.unlink()

    log = reopen(tmp_path, segment_bytes=1024, index_interval_bytes=64)

    assert log.end_offset == int(newest.stem) + 1
    log.close()
