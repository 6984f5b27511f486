"""Recovery of the newest segment: torn tails, garbage tails and stale indexes."""

from __future__ import annotations

import itertools
import random
import shutil
import struct
from pathlib import Path

import pytest
from conveyor.broker.log.segment import INDEX_ENTRY
from conveyor.broker.wire.record import HEADER_SIZE, Batch, encode_batch, encode_header, pack_records

from conveyor.errors import SegmentCorrupt
from tests.storage.storage_helpers import (
    Expected,
    append_random,
    assert_log_holds,
    batches_in,
    file_log,
    random_body,
    segment_files,
)

CONFIG = {"segment_bytes": 2048, "index_interval_bytes": 256}


def build(directory: Path, seed: int = 1, *, epochs: bool = False) -> list[Expected]:
    """A closed log of three or more segments whose newest holds at least eight batches.

    With ``epochs``, magic 1 batches come first, then magic 2 batches of rising leader epochs
    (a single-node log that joined a cluster), so both headers meet inside one segment.
    """
    rng = random.Random(seed)
    log = file_log(directory, **CONFIG)
    expected: list[Expected] = []
    while log.segment_count() < 3 or len(batches_in(expected, segment_files(directory)[-1])) < 8:
        n = len(expected)
        epoch = (None if n < 5 else 1 + n // 7) if epochs else None
        expected.append(append_random(log, rng, max_count=3, max_value=100, leader_epoch=epoch))
    log.sync()
    log.close()
    return expected


@pytest.fixture(scope="module", params=["magic1", "epochs"])
def built(tmp_path_factory, request) -> tuple[Path, list[Expected]]:
    directory = tmp_path_factory.mktemp("built") / "t"
    return directory, build(directory, epochs=request.param == "epochs")


def copy_of(built: tuple[Path, list[Expected]], target: Path) -> tuple[Path, Path, list[Expected]]:
    source, expected = built
    shutil.copytree(source, target)
    return target, segment_files(target)[-1], expected


def assert_append_continues(directory: Path, expected: list[Expected]) -> None:
    """A new append lands right after what survived and itself survives a reopen."""
    log = file_log(directory, **CONFIG)
    new = append_random(log, random.Random(99), max_count=3)
    assert new.base_offset == expected[-1].next_offset
    log.sync()
    log.close()
    reopened = file_log(directory, **CONFIG)
    assert reopened.truncated_bytes == 0
    assert_log_holds(reopened, [*expected, new], every_offset_from=new.base_offset)
    reopened.close()


def test_cut_at_every_byte_of_the_last_two_batches(built, tmp_path):
    source, expected = built
    newest = segment_files(source)[-1]
    placed = batches_in(expected, newest)
    newest_base = placed[0][1].base_offset
    older = [e for e in expected if e.base_offset < newest_base]
    first_cut = placed[-2][0]
    size = newest.stat().st_size
    assert size - first_cut > 2 * HEADER_SIZE  # the cuts cover two whole batches
    for cut in range(first_cut, size):
        # Given a copy of the log whose newest segment is cut at `cut`
        directory = tmp_path / f"cut-{cut}"
        shutil.copytree(source, directory)
        with open(directory / newest.name, "r+b") as f:
            f.truncate(cut)
        # When it is reopened
        log = file_log(directory, **CONFIG)
        # Then exactly the batches that end at or before the cut survive, and the rest is reported cut
        whole = [(pos, e) for pos, e in placed if pos + e.size <= cut]
        survivors = older + [e for _pos, e in whole]
        assert log.truncated_bytes == cut - (whole[-1][0] + whole[-1][1].size), f"cut at {cut}"
        assert_log_holds(log, survivors, every_offset_from=newest_base)
        log.close()
        assert_append_continues(directory, survivors)
        shutil.rmtree(directory)


GARBAGE_LENGTHS = [1, 7, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 300, 5000, 70_000]


@pytest.mark.parametrize("length", GARBAGE_LENGTHS)
def test_random_garbage_after_the_last_batch_is_cut(built, tmp_path, length):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    with open(newest, "ab") as f:
        f.write(random.Random(length).randbytes(length))

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == length
    assert_log_holds(log, expected)
    log.close()
    assert_append_continues(directory, expected)


def test_zeroed_tail_is_cut(built, tmp_path):
    # A file extended by the file system but never written reads back as zeros.
    directory, newest, expected = copy_of(built, tmp_path / "t")
    with open(newest, "ab") as f:
        f.write(bytes(8192))

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == 8192
    assert_log_holds(log, expected)


def test_a_header_claiming_a_huge_body_is_cut(built, tmp_path):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    body = b"\x91\x93\xc0\xc0\xc4\x01x"
    header = bytearray(encode_header(expected[-1].next_offset, 1, 0, body))
    struct.pack_into(">I", header, 8, 1 << 30)  # batch_length
    struct.pack_into(">I", header, 44, (1 << 30) - (HEADER_SIZE - 12))  # body_length, consistent with it
    with open(newest, "ab") as f:
        f.write(bytes(header) + body)

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == len(header) + len(body)
    assert_log_holds(log, expected)


def test_a_whole_batch_with_the_wrong_offset_is_corruption_not_a_torn_tail(built, tmp_path):
    # Given a whole, CRC-valid batch at the end whose offset does not follow (a write is never torn that way)
    directory, newest, expected = copy_of(built, tmp_path / "t")
    last = expected[-1]
    size = newest.stat().st_size
    stale = encode_batch(Batch(last.base_offset, last.count, 0, last.body))
    with open(newest, "ab") as f:
        f.write(stale)
    # When the log opens, it refuses and cuts nothing
    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)
    assert info.value.position == size
    assert newest.stat().st_size == size + len(stale)


def test_a_good_batch_after_garbage_is_corruption(built, tmp_path):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    last = expected[-1]
    size = newest.stat().st_size
    good = encode_batch(Batch(last.next_offset, 1, 0, random_body(random.Random(3), 1)))
    with open(newest, "ab") as f:
        f.write(b"\x00garbage" + good)

    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)

    assert (info.value.position, info.value.valid_position) == (size, size + 8)
    assert newest.stat().st_size == size + 8 + len(good)


def test_a_batch_inside_a_torn_batchs_body_does_not_make_it_corruption(built, tmp_path):
    # Given a torn last batch whose body carries a whole batch with an offset no later batch could have
    directory, newest, expected = copy_of(built, tmp_path / "t")
    last = expected[-1]
    inner = encode_batch(Batch(10**9, 1, 0, random_body(random.Random(4), 1)))
    body = pack_records([(None, None, inner)])
    torn = (encode_header(last.next_offset, 1, 0, body) + body)[:-1]
    with open(newest, "ab") as f:
        f.write(torn)
    # When the log opens, the torn batch is cut
    log = file_log(directory, **CONFIG)
    assert log.truncated_bytes == len(torn)
    assert_log_holds(log, expected)


# --- the index is a hint --------------------------------------------------------------


def index_entries(path: Path) -> list[tuple[int, int]]:
    data = path.read_bytes()
    return [INDEX_ENTRY.unpack_from(data, i) for i in range(0, len(data) - len(data) % 8, 8)]


def write_index(path: Path, entries: list[tuple[int, int]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(INDEX_ENTRY.pack(*e) for e in entries) + tail)


def index_of(newest: Path) -> Path:
    return newest.with_suffix(".index")


def test_the_built_index_has_entries_inside_the_cut_range(built):
    # Precondition of the tests above: cutting the last two batches leaves index entries past the cut.
    source, expected = built
    newest = segment_files(source)[-1]
    entries = index_entries(index_of(newest))
    assert len(entries) >= 3
    assert entries[0] == (0, 0)
    assert entries[-1][1] >= batches_in(expected, newest)[-2][0]


def test_index_entries_past_the_data_are_ignored(built, tmp_path):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    entries = index_entries(index_of(newest))
    size = newest.stat().st_size
    write_index(index_of(newest), [*entries, (entries[-1][0] + 50, size), (entries[-1][0] + 90, size + 4000)])

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == 0
    assert_log_holds(log, expected)
    log.close()
    assert_append_continues(directory, expected)


@pytest.mark.parametrize("length", [3, 8, 64, 1001])
def test_an_index_of_random_bytes_is_rebuilt(built, tmp_path, length):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    index_of(newest).write_bytes(random.Random(length).randbytes(length))

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == 0
    assert_log_holds(log, expected)
    log.close()
    assert_append_continues(directory, expected)


def test_an_index_with_plausible_but_wrong_entries_is_rebuilt(built, tmp_path):
    # Given an index whose entries are in order and inside the file, but some of them point
    # between batches or name the wrong offset (e.g. left from before a truncation)
    directory, newest, expected = copy_of(built, tmp_path / "t")
    real = index_entries(index_of(newest))
    bogus = []
    for (rel, pos), (next_rel, next_pos) in itertools.pairwise(real):
        bogus += [(rel, pos), (rel + 1, pos + 5), (next_rel + 3, (pos + next_pos) // 2)]
    bogus.append(real[-1])
    write_index(index_of(newest), bogus)
    # When the log opens
    log = file_log(directory, **CONFIG)
    # Then every offset still reads back right
    assert log.truncated_bytes == 0
    assert_log_holds(log, expected)
    log.close()
    assert_append_continues(directory, expected)


def test_a_missing_or_empty_index_is_rebuilt(built, tmp_path):
    directory, newest, expected = copy_of(built, tmp_path / "t")
    index_of(newest).unlink()
    for sealed in segment_files(directory)[:-1]:
        index_of(sealed).write_bytes(b"")

    log = file_log(directory, **CONFIG)

    assert_log_holds(log, expected)
    log.close()
    assert index_entries(index_of(newest))[0] == (0, 0)


def test_stale_index_after_cut_and_different_appends(built, tmp_path):
    # Given the index from before a crash, while the log was cut and refilled with other batches
    directory, newest, expected = copy_of(built, tmp_path / "t")
    old_index = index_of(newest).read_bytes()
    placed = batches_in(expected, newest)
    keep = expected[: expected.index(placed[1][1])]
    log = file_log(directory, **CONFIG)
    log.truncate_to(keep[-1].next_offset)
    rng = random.Random(5)
    refill = [append_random(log, rng, max_count=2, max_value=40) for _ in range(12)]
    log.sync()
    new_index = index_of(newest).read_bytes()
    log.close()
    index_of(newest).write_bytes(old_index + new_index[len(INDEX_ENTRY.pack(0, 0)) :])
    # When it is reopened
    reopened = file_log(directory, **CONFIG)
    # Then the log is what the .log file says
    survivors = keep + refill
    assert reopened.truncated_bytes == 0
    assert_log_holds(reopened, survivors)


def test_a_good_batch_far_behind_the_damage_is_found(built, tmp_path):
    # Given more garbage than one search window (8 MiB) before a whole batch that follows the log
    directory, newest, expected = copy_of(built, tmp_path / "t")
    size = newest.stat().st_size
    garbage = random.Random(5).randbytes(9 << 20)
    good = encode_batch(Batch(expected[-1].next_offset, 1, 0, random_body(random.Random(3), 1)))
    with open(newest, "ab") as f:
        f.write(garbage + good)
    # When the log opens, it is corruption, found where it is
    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)
    assert (info.value.position, info.value.valid_position) == (size, size + len(garbage))
