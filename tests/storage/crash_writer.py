"""The victim of the kill -9 test: append forever, print each synced end offset.

Usage: python crash_writer.py DIRECTORY SEED. Every record's value is derived from its
offset (``value_for``), so the test can check what survived without a copy of it.
"""

from __future__ import annotations

import random
import sys

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.wire.record import pack_records

CONFIG = TopicConfig(segment_bytes=64 * 1024, index_interval_bytes=1024)
SYNC_EVERY = 3


def value_for(offset: int) -> bytes:
    return b"%d:" % offset * (offset % 13 + 1)


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    log = FileLog("crash", directory, CONFIG, fsync=FsyncPolicy("batch"))
    appended = 0
    while True:
        count = rng.randint(1, 20)
        base = log.end_offset
        log.append(pack_records([(None, None, value_for(base + i)) for i in range(count)]), count)
        appended += 1
        if appended % SYNC_EVERY == 0:
            log.sync()
            print(log.durable_offset, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
