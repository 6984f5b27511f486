"""Flipped bytes: sealed segments refuse to open (or are quarantined), reads never serve corrupt data."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conveyor.broker.log.file_log import QUARANTINE_DIR

from conveyor.errors import OffsetOutOfRange, SegmentCorrupt
from tests.storage.storage_helpers import (
    Expected,
    append_random,
    assert_log_holds,
    batches_in,
    file_log,
    flip_byte,
    segment_files,
)

# One index entry per segment (its first batch): recovery of the newest segment checks all of it.
CONFIG = {"segment_bytes": 1500, "index_interval_bytes": 1 << 20}

# Byte offsets inside a batch: every header field, then the body.
FIELDS = {
    "base_offset_high": 0,
    "base_offset_low": 7,
    "batch_length": 10,
    "magic": 12,
    "attributes": 13,
    "reserved": 15,
    "crc": 17,
    "count": 23,
    "timestamp": 30,
    "producer_id": 35,
    "sequence": 43,
    "body_length": 46,
    "body_first": 48,
}


def build(directory: Path, seed: int = 7) -> list[Expected]:
    rng = random.Random(seed)
    log = file_log(directory, **CONFIG)
    expected = []
    while log.segment_count() < 5 or len(batches_in(expected, segment_files(directory)[-1])) < 5:
        expected.append(append_random(log, rng, max_count=3, max_value=120))
    log.sync()
    log.close()
    return expected


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[Expected]]:
    directory = tmp_path_factory.mktemp("built") / "t"
    return directory, build(directory)


@pytest.fixture
def copy(built, tmp_path) -> tuple[Path, list[Expected]]:
    source, expected = built
    shutil.copytree(source, tmp_path / "t")
    return tmp_path / "t", expected


def target(directory: Path, expected: list[Expected], segment: int, batch: str) -> tuple[Path, int, Expected]:
    """(segment file, batch position, batch) for the first, a middle or the last batch of a segment."""
    path = segment_files(directory)[segment]
    placed = batches_in(expected, path)
    position, hit = {"first": placed[0], "middle": placed[len(placed) // 2], "last": placed[-1]}[batch]
    return path, position, hit


def test_the_built_log_has_several_multi_batch_segments(built):
    source, expected = built
    assert all(len(batches_in(expected, path)) >= 3 for path in segment_files(source))


@pytest.mark.parametrize("field", [*FIELDS, "body_last"])
@pytest.mark.parametrize(("segment", "batch"), [(0, "middle"), (1, "first"), (2, "last"), (3, "middle")])
def test_a_flipped_byte_in_a_sealed_segment_refuses_to_open(copy, field, segment, batch):
    directory, expected = copy
    path, position, hit = target(directory, expected, segment, batch)
    at = position + hit.size - 1 if field == "body_last" else position + FIELDS[field]
    flip_byte(path, at, 0x01)

    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)

    assert info.value.path == str(path)
    assert info.value.position == position
    assert path.name in str(info.value) and f"position {position}" in str(info.value)


@pytest.mark.parametrize("field", ["base_offset_low", "magic", "reserved", "crc", "count", "body_first"])
@pytest.mark.parametrize("segment", [0, 1, 3])
def test_quarantine_moves_the_corrupt_segment_away_and_reports_the_gap(copy, field, segment):
    # Given a sealed segment with one flipped byte
    directory, expected = copy
    path, position, _hit = target(directory, expected, segment, "middle")
    flip_byte(path, position + FIELDS[field])
    bases = [int(p.stem) for p in segment_files(directory)]
    lost = (bases[segment], bases[segment + 1])
    # When the log opens with quarantine on
    log = file_log(directory, quarantine=True, **CONFIG)
    # Then the segment sits in quarantine/, the gap is reported and the rest reads back intact
    assert {p.name for p in (directory / QUARANTINE_DIR).iterdir()} == {path.name, path.with_suffix(".index").name}
    assert not path.exists()
    assert log.gaps == [lost]
    kept = [e for e in expected if not lost[0] <= e.base_offset < lost[1]]
    assert (log.start_offset, log.end_offset) == (kept[0].base_offset, expected[-1].next_offset)
    by_base = {e.base_offset: e for e in kept}
    for offset in range(log.start_offset, log.end_offset):
        for batch in log.read(offset, max_bytes=300):
            assert bytes(batch.body) == by_base[batch.base_offset].body  # never a batch from the gap
    # And appends continue after the end
    assert log.append(expected[0].body, expected[0].count).base_offset == expected[-1].next_offset
    log.sync()
    log.close()
    # And a later start without --quarantine accepts the gap the quarantine left (a lost start is just the start)
    reopened = file_log(directory, **CONFIG)
    assert (reopened.start_offset, reopened.gaps) == (log.start_offset, [] if segment == 0 else [lost])


def test_quarantined_first_segment_moves_the_start(copy):
    directory, expected = copy
    path, position, _hit = target(directory, expected, 0, "middle")
    flip_byte(path, position + FIELDS["crc"])

    log = file_log(directory, quarantine=True, **CONFIG)

    second = int(segment_files(directory)[0].stem)
    assert log.start_offset == second
    with pytest.raises(OffsetOutOfRange):
        log.read(0)


def test_two_quarantined_segments_report_two_gaps(copy):
    directory, expected = copy
    for segment in (1, 3):
        path, position, _hit = target(directory, expected, segment, "first")
        flip_byte(path, position + FIELDS["body_first"])
    bases = [int(p.stem) for p in segment_files(directory)]

    log = file_log(directory, quarantine=True, **CONFIG)

    assert log.gaps == [(bases[1], bases[2]), (bases[3], bases[4])]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


@pytest.mark.parametrize("field", [*FIELDS, "body_last"])
@pytest.mark.parametrize("batch", ["first", "middle"])
def test_a_flipped_byte_mid_newest_segment_is_corruption_and_nothing_is_cut(copy, field, batch):
    # Given the newest segment with a byte flipped in a batch that valid batches follow
    directory, expected = copy
    path, position, hit = target(directory, expected, -1, batch)
    at = position + hit.size - 1 if field == "body_last" else position + FIELDS[field]
    flip_byte(path, at, 0x01)
    before = snapshot(directory)
    # When it opens, it refuses, naming the file and the bad batch's position
    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)
    assert (info.value.path, info.value.position) == (str(path), position)
    assert path.name in str(info.value) and f"position {position}" in str(info.value)
    assert info.value.end_offset == expected[-1].next_offset
    # Then not a byte changed: no confirmed batch after it was cut
    assert snapshot(directory) == before


def test_a_flip_at_every_byte_before_the_last_batch_of_the_newest_segment_is_corruption(built, tmp_path):
    source, expected = built
    path = segment_files(source)[-1]
    placed = batches_in(expected, path)
    original = path.read_bytes()
    directory = tmp_path / "t"
    shutil.copytree(source, directory)
    newest = directory / path.name
    for at in range(placed[-1][0]):
        damaged = bytearray(original)
        damaged[at] ^= 0x01
        newest.write_bytes(bytes(damaged))
        with pytest.raises(SegmentCorrupt) as info:
            file_log(directory, **CONFIG).close()
        position = max(p for p, _e in placed if p <= at)
        assert info.value.position == position, at
        assert newest.read_bytes() == bytes(damaged), at


@pytest.mark.parametrize(
    ("field", "corrupt"),
    [
        # Bytes outside the CRC: the batch is still whole by its CRC, so it was written whole
        ("base_offset_low", True),
        ("batch_length", True),
        ("magic", True),
        ("reserved", True),
        # Bytes inside the CRC (or the CRC itself): the same as a write cut short, cut and counted
        ("crc", False),
        ("count", False),
        ("body_length", False),
        ("body_last", False),
    ],
)
def test_a_flip_in_the_last_batch_is_corruption_only_if_the_batch_is_provably_whole(copy, field, corrupt):
    directory, expected = copy
    path, position, hit = target(directory, expected, -1, "last")
    at = position + hit.size - 1 if field == "body_last" else position + FIELDS[field]
    flip_byte(path, at, 0x01)
    if corrupt:
        with pytest.raises(SegmentCorrupt) as info:
            file_log(directory, **CONFIG)
        assert info.value.position == position
        assert path.stat().st_size == position + hit.size
    else:
        log = file_log(directory, **CONFIG)
        assert log.truncated_bytes == hit.size
        assert_log_holds(log, expected[:-1], every_offset_from=int(path.stem))


@pytest.mark.parametrize("field", ["base_offset_low", "magic", "crc", "count", "body_first"])
def test_with_quarantine_a_corrupt_newest_segment_is_moved_aside_and_its_offsets_never_reused(copy, field):
    # Given the newest segment with a flipped byte in its middle batch
    directory, expected = copy
    path, position, _hit = target(directory, expected, -1, "middle")
    flip_byte(path, position + FIELDS[field])
    base = int(path.stem)
    # When the log opens with quarantine on
    log = file_log(directory, quarantine=True, **CONFIG)
    # Then the segment sits in quarantine/, counted, and the log goes on after every offset it held
    assert (directory / QUARANTINE_DIR / path.name).exists()
    assert log.quarantined_segments == 1
    assert log.gaps == [(base, expected[-1].next_offset)]
    assert log.end_offset == expected[-1].next_offset
    for e in expected:  # what came before the quarantined segment still reads back; its offsets read nothing
        if e.base_offset < base:
            assert bytes(log.read(e.base_offset, max_bytes=1)[0].body) == e.body
        else:
            assert log.read(e.base_offset) == []
    new = log.append(expected[0].body, expected[0].count)
    assert new.base_offset == expected[-1].next_offset
    log.sync()
    log.close()
    # And it reopens as it was left
    reopened = file_log(directory, **CONFIG)
    assert (reopened.end_offset, reopened.truncated_bytes) == (new.base_offset + new.count, 0)


def test_with_quarantine_a_log_whose_only_segment_is_corrupt_starts_after_it(tmp_path):
    directory = tmp_path / "t"
    log = file_log(directory, **CONFIG)
    rng = random.Random(5)
    expected = [append_random(log, rng, max_count=2, max_value=40) for _ in range(4)]
    log.sync()
    log.close()
    path = segment_files(directory)[0]
    flip_byte(path, FIELDS["body_first"])

    log = file_log(directory, quarantine=True, **CONFIG)

    assert log.start_offset == log.end_offset == expected[-1].next_offset
    assert log.append(expected[0].body, expected[0].count).base_offset == expected[-1].next_offset


@pytest.mark.parametrize("field", [*FIELDS, "body_last"])
@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_a_batch_corrupted_after_open_is_never_served_from_disk(copy, field, cache_bytes):
    # Given an open log (with or without a tail cache: a fresh open has nothing cached)
    directory, expected = copy
    log = file_log(directory, cache_bytes=cache_bytes, **CONFIG)
    assert_log_holds(log, expected)
    # When a byte of a stored batch flips underneath it
    path, position, hit = target(directory, expected, 1, "middle")
    at = position + hit.size - 1 if field == "body_last" else position + FIELDS[field]
    flip_byte(path, at, 0x01)
    # Then reading any offset of that batch raises instead of returning data
    for offset in range(hit.base_offset, hit.next_offset):
        with pytest.raises(SegmentCorrupt) as info:
            log.read(offset)
        assert info.value.path == str(path)
    # And batches before it still read back
    before = [e for e in expected if int(path.stem) <= e.base_offset < hit.base_offset]
    for e in before:
        assert bytes(log.read(e.base_offset, max_bytes=1)[0].body) == e.body


def test_fresh_appends_are_served_from_the_cache_without_touching_disk(tmp_path):
    log = file_log(tmp_path / "t", **CONFIG)
    rng = random.Random(0)
    first = append_random(log, rng)
    path = segment_files(tmp_path / "t")[0]
    flip_byte(path, 60)  # the disk copy is bad, the cached one is what was appended

    assert bytes(log.read(first.base_offset)[0].body) == first.body


@pytest.mark.parametrize("field", ["base_offset_low", "magic", "count", "crc", "body_first"])
def test_a_flip_behind_the_newest_segments_last_index_entry_is_caught_at_open(tmp_path, field):
    # Given a newest segment indexed often: recovery once trusted its synced start without checking CRCs
    rng = random.Random(3)
    directory = tmp_path / "t"
    log = file_log(directory, segment_bytes=1 << 20, index_interval_bytes=200)
    expected = [append_random(log, rng, max_count=2, max_value=100) for _ in range(20)]
    log.sync()
    log.close()
    path = segment_files(directory)[0]
    position, _hit = batches_in(expected, path)[3]
    flip_byte(path, position + FIELDS[field], 0x01)
    # When it opens, the bad batch is found there and then, not when a consumer reaches it
    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, segment_bytes=1 << 20, index_interval_bytes=200)
    assert info.value.position == position
