"""Read each replica's log from its data directory (brokers stopped) and compare them."""

from __future__ import annotations

from pathlib import Path

from conveyor.broker.log.data_dir import Store
from conveyor.broker.wire.record import unpack_records


def records(data_dir: Path, topic: str) -> list[tuple[int, bytes]]:
    """(offset, value) of every record the replica holds, in offset order."""
    store = Store(data_dir)
    try:
        log_ = store.topic(topic)
        found: list[tuple[int, bytes]] = []
        offset = log_.start_offset
        while offset < log_.end_offset:
            batches = log_.read(offset, max_bytes=1 << 20)
            if not batches:
                break
            for batch in batches:
                for i, (_key, _headers, value) in enumerate(unpack_records(batch.body)):
                    found.append((batch.base_offset + i, bytes(value)))
                offset = batch.base_offset + batch.count
        return found
    finally:
        store.close()
