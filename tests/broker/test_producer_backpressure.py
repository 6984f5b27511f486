"""Producer back-pressure against a real broker: ``buffer_memory`` bounds what waits unconfirmed.

A caller that sends faster than the broker confirms blocks in ``send()`` /
``send_many()`` until confirms free room; past ``max_block_ms`` the call
raises ``BufferFull`` and none of it is queued. Nothing already accepted is
lost either way.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from conveyor.broker.client.producer import Producer, _encode_record

from conveyor import Admin
from conveyor.errors import BufferFull
from conveyor.testing import BrokerProcess

VALUE = b"v" * 100
RECORD = len(_encode_record(VALUE, None, None))  # what one send() holds: the value and its msgpack framing


@pytest.mark.timeout(60)
def test_a_fast_sender_is_held_to_buffer_memory_and_loses_nothing(tmp_path: Path) -> None:
    limit = 64 * 1024
    with BrokerProcess(tmp_path / "data", fsync="batch") as broker:
        Admin(broker.address).create_topic("bp")
        producer = Producer(broker.address, linger_ms=2, batch_size=100, buffer_memory=limit, max_block_ms=20_000)
        peak = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, producer._held)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        futures = []
        for _ in range(40):
            futures += producer.send_many("bp", [VALUE] * 250)  # 40 calls of ~25 KB: 1 MB, 16x the buffer
        producer.flush(timeout=30)
        done.set()
        watcher.join()
        offsets = sorted(f.result() for f in futures)
        producer.close()
        assert offsets == list(range(10_000))
        assert 0 < peak <= limit, peak  # held to the bound, and the bound was reached
        assert producer._held == 0
        assert Admin(broker.address).describe_topic("bp")["end_offset"] == 10_000


@pytest.mark.timeout(60)
def test_send_blocks_for_max_block_ms_then_raises_buffer_full_and_queues_nothing(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", fsync="batch") as broker:
        Admin(broker.address).create_topic("bp")
        producer = Producer(
            broker.address,
            linger_ms=1,
            buffer_memory=10 * RECORD,
            max_block_ms=400,
            request_timeout_ms=30_000,
            delivery_timeout_ms=60_000,
        )
        try:
            producer.send("bp", VALUE).result(timeout=10)  # connected and confirming
            broker.signal(signal.SIGSTOP)  # alive but answering nobody: confirms stop
            accepted = [producer.send("bp", VALUE) for _ in range(10)]  # exactly fills the buffer
            started = time.monotonic()
            with pytest.raises(BufferFull) as refused:
                producer.send("bp", VALUE)
            waited = time.monotonic() - started
            assert 0.35 <= waited < 5, waited
            assert refused.value.code == 403 and refused.value.retriable
            assert refused.value.fields["held"] == 10 * RECORD
            with pytest.raises(BufferFull):
                producer.send_many("bp", [VALUE] * 3)  # all or nothing: none of the three queued
            assert producer._held == 10 * RECORD
            broker.signal(signal.SIGCONT)
            assert sorted(f.result(timeout=20) for f in accepted) == list(range(1, 11))
            producer.flush(timeout=10)
            assert producer._held == 0
            assert producer.send("bp", VALUE).result(timeout=10) == 11  # room again: nothing refused was stored
        finally:
            broker.signal(signal.SIGCONT)
            producer.close(timeout=5)


def test_a_call_larger_than_the_whole_buffer_goes_through_when_the_buffer_is_empty(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", fsync="none") as broker:
        Admin(broker.address).create_topic("bp")
        with Producer(broker.address, linger_ms=1, buffer_memory=1024, max_block_ms=5000) as producer:
            futures = producer.send_many("bp", [VALUE] * 50)  # 5 KB against a 1 KiB buffer
            assert [f.result(timeout=10) for f in futures] == list(range(50))
