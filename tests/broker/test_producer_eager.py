"""When a batch that is not full goes out with ``eager=True``: at once while the topic has nothing in flight.

An idle producer adds no linger to a message; a busy one lets the open batch
fill until a confirm returns, so batches grow with the broker's answer time.
The default keeps Kafka's rule: wait out ``linger_ms`` every time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
from pathlib import Path

import pytest
from conveyor.broker.client.async_producer import AsyncProducer

from conveyor import Admin, Producer
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for

LONG_LINGER_MS = 3000


def batches(broker: BrokerProcess, topic: str) -> float:
    return broker.metric("conveyor_published_batches_total", f'topic="{topic}"')


@pytest.mark.timeout(60)
def test_an_eager_idle_producer_sends_at_once_and_the_default_waits_out_the_linger(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("idle")
        with Producer(broker.address, linger_ms=LONG_LINGER_MS, eager=True) as eager:
            assert eager.send("idle", b"now").result(timeout=LONG_LINGER_MS / 2000) == 0
        with Producer(broker.address, linger_ms=LONG_LINGER_MS) as patient:
            started = time.monotonic()
            future = patient.send("idle", b"later")
            with pytest.raises(concurrent.futures.TimeoutError):
                future.result(timeout=LONG_LINGER_MS / 2000)  # still lingering
            assert future.result(timeout=LONG_LINGER_MS / 1000 + 10) == 1
            assert time.monotonic() - started >= LONG_LINGER_MS / 1000 * 0.9


@pytest.mark.timeout(60)
def test_messages_sent_while_a_batch_is_in_flight_go_as_one_batch_when_it_is_confirmed(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("busy")
        with Producer(broker.address, linger_ms=60_000, eager=True) as producer:
            broker.signal(signal.SIGSTOP)  # the first batch stays in flight
            try:
                first = producer.send("busy", b"first")
                assert wait_for(lambda: len(producer._io.in_flight) == 1, timeout=5)
                rest = [producer.send("busy", f"m{i}".encode()) for i in range(99)]
                time.sleep(0.3)
                assert len(producer._io.in_flight) == 1, "the others wait for the confirm, not for 60 s of linger"
            finally:
                broker.signal(signal.SIGCONT)
            assert first.result(timeout=10) == 0
            assert [f.result(timeout=10) for f in rest] == list(range(1, 100))
        assert batches(broker, "busy") == 2


@pytest.mark.timeout(60)
def test_async_producer_is_eager_the_same_way(tmp_path: Path) -> None:
    async def scenario(broker: BrokerProcess) -> None:
        async with AsyncProducer(broker.address, linger_ms=60_000, eager=True) as producer:
            assert await asyncio.wait_for(await producer.send("aio", b"now"), LONG_LINGER_MS / 2000) == 0
            broker.signal(signal.SIGSTOP)
            try:
                first = await producer.send("aio", b"first")
                await asyncio.sleep(0.1)  # shipped on the next loop turn: in flight now
                rest = [await producer.send("aio", f"m{i}".encode()) for i in range(99)]
                await asyncio.sleep(0.3)
                assert not first.done() and not any(f.done() for f in rest)
            finally:
                broker.signal(signal.SIGCONT)
            assert await asyncio.wait_for(first, 10) == 1
            assert await asyncio.wait_for(asyncio.gather(*rest), 10) == list(range(2, 101))

    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("aio")
        asyncio.run(scenario(broker))
        assert batches(broker, "aio") == 3
