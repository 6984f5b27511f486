"""Plain helpers shared by the storage tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.topic_log import TopicConfig, TopicLog
from conveyor.broker.wire.record import HEADER_SIZE, HEADER_SIZE_V2, pack_records


@dataclass(frozen=True)
class Expected:
    """What a test appended: enough to check a read and to find it on disk."""

    base_offset: int
    count: int
    body: bytes
    leader_epoch: int = 0  # 0: stored as magic 1

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    @property
    def size(self) -> int:
        return (HEADER_SIZE_V2 if self.leader_epoch else HEADER_SIZE) + len(self.body)


def random_body(rng: random.Random, count: int, *, max_value: int = 200) -> bytes:
    """A valid batch body of ``count`` records with varied keys, headers and sizes."""
    records = []
    for i in range(count):
        key = rng.choice([None, b"k%d" % i, f"key-{i}"])
        headers = rng.choice([None, {"n": i}, {"content-type": "application/octet-stream"}])
        records.append((key, headers, rng.randbytes(rng.randint(0, max_value))))
    return pack_records(records)


def file_log(directory: Path, **config: object) -> FileLog:
    fsync = config.pop("fsync", FsyncPolicy("batch"))
    quarantine = bool(config.pop("quarantine", False))
    clock = config.pop("clock", None)
    monotonic = config.pop("monotonic", None)
    return FileLog(
        "t",
        directory,
        TopicConfig(**config),  # type: ignore[arg-type]
        fsync=fsync,  # type: ignore[arg-type]
        quarantine=quarantine,
        clock=clock,  # type: ignore[arg-type]
        monotonic=monotonic,  # type: ignore[arg-type]
    )


def append_random(
    log: TopicLog, rng: random.Random, *, max_count: int = 4, max_value: int = 200, leader_epoch: int | None = None
) -> Expected:
    count = rng.randint(1, max_count)
    body = random_body(rng, count, max_value=max_value)
    result = log.append(body, count, leader_epoch=leader_epoch)
    return Expected(result.base_offset, count, body, leader_epoch or 0)


def read_everything(log: TopicLog) -> list:
    """Every batch from the log start to its end, in order."""
    out = []
    offset = log.start_offset
    while offset < log.end_offset:
        batches = log.read(offset)
        assert batches, f"read({offset}) returned nothing below end {log.end_offset}"
        out.extend(batches)
        offset = batches[-1].next_offset
    return out


def assert_log_holds(log: TopicLog, expected: list[Expected], *, every_offset_from: int = 0) -> None:
    """The log holds exactly ``expected``: offsets, bodies, and reads at every offset (from ``every_offset_from``)."""
    assert log.start_offset == (expected[0].base_offset if expected else log.start_offset)
    assert log.end_offset == (expected[-1].next_offset if expected else log.start_offset)
    got = [(b.base_offset, b.count, bytes(b.body), b.leader_epoch) for b in read_everything(log)]
    assert got == [(e.base_offset, e.count, e.body, e.leader_epoch) for e in expected]
    for e in expected:
        for offset in range(max(e.base_offset, every_offset_from), e.next_offset):
            first = log.read(offset, max_bytes=1)[0]
            assert (first.base_offset, bytes(first.body)) == (e.base_offset, e.body)


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def batches_in(expected: list[Expected], segment: Path) -> list[tuple[int, Expected]]:
    """(file position, batch) for each expected batch stored in ``segment``."""
    base = int(segment.stem)
    bases = sorted({int(p.stem) for p in segment.parent.glob("*.log")})
    later = [b for b in bases if b > base]
    end = later[0] if later else None
    position, out = 0, []
    for e in expected:
        if e.base_offset >= base and (end is None or e.base_offset < end):
            out.append((position, e))
            position += e.size
    assert position == segment.stat().st_size, f"{segment.name}: expected batches do not fill the file"
    return out


def flip_byte(path: Path, position: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        old = f.read(1)[0]
        f.seek(position)
        f.write(bytes([old ^ mask]))


def crash(log: FileLog) -> None:
    """Drop a FileLog like a dying process would: no sync, no index flush, fds just closed."""
    for segment in log.segments:
        if segment._fd >= 0:
            os.close(segment._fd)
            segment._fd = -1


def crash_store(store: Store) -> None:
    """Drop a Store like a dying process would: staged offsets unwritten, files and the data-dir lock let go."""
    store._offsets.close()  # gives up whatever is still pending
    for topic_log in store.logs.values():
        if isinstance(topic_log, FileLog):
            crash(topic_log)
    store.lock.release()
