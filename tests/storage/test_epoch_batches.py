"""Magic 2 batches (with a leader epoch) on disk: recovery, corruption, reads and the tail cache."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.wire.record import HEADER_SIZE_V2, MAGIC, MAGIC_EPOCH, Batch, encode_batch, pack_records

from conveyor.errors import SegmentCorrupt
from tests.storage.storage_helpers import (
    Expected,
    append_random,
    assert_log_holds,
    batches_in,
    file_log,
    flip_byte,
    random_body,
    segment_files,
)

CONFIG = {"segment_bytes": 1500, "index_interval_bytes": 1 << 20}

# Byte offsets inside a magic 2 batch
FIELDS = {
    "base_offset_low": 7,
    "batch_length": 10,
    "magic": 12,
    "reserved": 15,
    "crc": 17,
    "count": 23,
    "sequence": 43,
    "leader_epoch": 46,
    "body_length": 50,
    "body_first": 52,
}


def build(directory: Path, seed: int = 11) -> list[Expected]:
    """Magic 1 batches, then magic 2 batches of rising epochs; the newest segment holds five or more."""
    rng = random.Random(seed)
    log = file_log(directory, **CONFIG)
    expected: list[Expected] = []
    while log.segment_count() < 4 or len(batches_in(expected, segment_files(directory)[-1])) < 5:
        epoch = None if len(expected) < 3 else 1 + len(expected) // 6
        expected.append(append_random(log, rng, max_count=3, max_value=120, leader_epoch=epoch))
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


def test_the_built_log_mixes_both_magics_and_its_newest_segment_is_magic_2(built):
    source, expected = built
    files = segment_files(source)
    assert files[0].read_bytes()[12] == MAGIC
    newest = batches_in(expected, files[-1])
    assert all(e.leader_epoch > 0 for _p, e in newest)
    assert {files[-1].read_bytes()[p + 12] for p, _e in newest} == {MAGIC_EPOCH}


def test_a_reopened_log_reads_every_batch_with_its_epoch(copy):
    directory, expected = copy
    log = file_log(directory, **CONFIG)
    assert log.truncated_bytes == 0
    assert_log_holds(log, expected)


def test_appends_after_reopen_continue_in_the_newest_epoch(copy):
    directory, expected = copy
    log = file_log(directory, **CONFIG)
    new = append_random(log, random.Random(5), leader_epoch=99)
    log.sync()
    log.close()
    assert_log_holds(file_log(directory, **CONFIG), [*expected, new])


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
        assert info.value.position == max(p for p, _e in placed if p <= at), at
        assert newest.read_bytes() == bytes(damaged), at


@pytest.mark.parametrize(
    ("field", "mask", "corrupt"),
    [
        # Outside the CRC: the batch is whole by its CRC, so it was written whole
        ("base_offset_low", 0x01, True),
        ("batch_length", 0x01, True),
        ("magic", 0x01, True),  # 2 -> 3: unknown
        ("magic", 0x03, True),  # 2 -> 1: read as the wrong layout
        ("reserved", 0x01, True),
        # Inside it: as a write cut short
        ("crc", 0x01, False),
        ("count", 0x01, False),
        ("sequence", 0x01, False),
        ("leader_epoch", 0x01, False),
        ("body_length", 0x01, False),
        ("body_last", 0x01, False),
    ],
)
def test_a_flip_in_the_last_magic_2_batch_is_corruption_only_if_provably_whole(copy, field, mask, corrupt):
    directory, expected = copy
    path = segment_files(directory)[-1]
    position, hit = batches_in(expected, path)[-1]
    at = position + hit.size - 1 if field == "body_last" else position + FIELDS[field]
    flip_byte(path, at, mask)
    if corrupt:
        with pytest.raises(SegmentCorrupt) as info:
            file_log(directory, **CONFIG)
        assert info.value.position == position
        assert path.stat().st_size == position + hit.size
    else:
        log = file_log(directory, **CONFIG)
        assert log.truncated_bytes == hit.size
        assert_log_holds(log, expected[:-1], every_offset_from=int(path.stem))


def test_a_good_magic_2_batch_after_garbage_is_corruption(copy):
    directory, expected = copy
    newest = segment_files(directory)[-1]
    size = newest.stat().st_size
    good = encode_batch(Batch(expected[-1].next_offset, 1, 0, random_body(random.Random(3), 1), leader_epoch=9))
    with open(newest, "ab") as f:
        f.write(b"\x00garbage" + good)

    with pytest.raises(SegmentCorrupt) as info:
        file_log(directory, **CONFIG)

    assert (info.value.position, info.value.valid_position) == (size, size + 8)


def test_a_torn_magic_2_header_is_cut(copy):
    directory, expected = copy
    newest = segment_files(directory)[-1]
    body = pack_records([(None, None, b"x")])
    torn = encode_batch(Batch(expected[-1].next_offset, 1, 0, body, leader_epoch=9))[: HEADER_SIZE_V2 - 2]
    with open(newest, "ab") as f:
        f.write(torn)

    log = file_log(directory, **CONFIG)

    assert log.truncated_bytes == len(torn)
    assert_log_holds(log, expected)


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_reads_from_the_cache_and_from_disk_carry_the_epoch(tmp_path, cache_bytes):
    log = file_log(tmp_path / "t", cache_bytes=cache_bytes)
    body = pack_records([(None, None, b"v")])
    log.append(body, 1)
    log.append(body, 1, producer_id=4, sequence=0, leader_epoch=2)
    log.sync()

    assert [(b.leader_epoch, b.producer_id, b.sequence) for b in log.read(0)] == [(0, -1, -1), (2, 4, 0)]


def test_the_memory_backend_keeps_the_epoch():
    log = MemoryLog("t", TopicConfig(storage="memory", cache_bytes=0), fsync=FsyncPolicy("none"))
    body = pack_records([(None, None, b"v")])
    log.append(body, 1, leader_epoch=3)

    assert log.read(0)[0].leader_epoch == 3
