"""When a batch that is not full goes out: by default (``eager=True``) at once while the topic has nothing in flight.

An idle producer adds no linger to a message; a busy one lets the open batch
fill until a confirm returns, so batches grow with the broker's answer time.
``eager=False`` keeps Kafka's rule: wait out ``linger_ms`` every time. With one
broker, the caller's thread sends such a batch itself when the I/O thread is idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
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
def test_an_idle_producer_sends_at_once_by_default_and_eager_false_waits_out_the_linger(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("idle")
        with Producer(broker.address, linger_ms=LONG_LINGER_MS) as eager:
            assert eager.send("idle", b"now").result(timeout=LONG_LINGER_MS / 2000) == 0
        with Producer(broker.address, linger_ms=LONG_LINGER_MS, eager=False) as patient:
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
def test_an_idle_producer_sends_from_the_callers_thread(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker, Producer(broker.address) as producer:
        producer.send("direct", b"warm").result(timeout=10)
        senders = []
        real = producer._io._publish

        def publish(topic, buf):
            senders.append(threading.current_thread().name)
            real(topic, buf)

        producer._io._publish = publish  # type: ignore[method-assign]
        for i in range(20):
            # Idle: the I/O thread has finished the pass that resolved the last confirm and waits again.
            assert wait_for(lambda: not producer._io.lock.locked(), timeout=10)
            assert producer.send("direct", f"m{i}".encode()).result(timeout=10) == i + 1
        assert senders.count(threading.current_thread().name) >= 15, senders  # it may wake for something else


@pytest.mark.timeout(120)
def test_many_threads_sending_at_once_lose_nothing_and_keep_each_threads_order(tmp_path: Path) -> None:
    # The caller's threads and the I/O thread share the socket (under the I/O lock): every message
    # must be stored once, each thread's in the order it sent them, and every future resolved.
    with BrokerProcess(tmp_path / "data") as broker, Producer(broker.address, batch_size=7) as producer:

        def sender(n: int) -> list:
            out = []
            for i in range(400):
                out.append(producer.send("many", f"{n}:{i}".encode()))
                if i % 50 == 0:
                    time.sleep(0.001)  # idle moments: the caller's thread sends itself
            return out

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [f for fs in pool.map(sender, range(6)) for f in fs]
        offsets = [f.result(timeout=30) for f in futures]
        assert sorted(offsets) == list(range(6 * 400))
        stored = Admin(broker.address).fetch("many", 0, 6 * 400)
        values = [m.value.decode() for m in stored]
        assert len(values) == len(set(values)) == 6 * 400
        for n in range(6):
            mine = [int(v.split(":")[1]) for v in values if v.startswith(f"{n}:")]
            assert mine == list(range(400))


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


@pytest.mark.timeout(60)
def test_a_fast_sender_gets_full_batches_by_default(tmp_path: Path) -> None:
    # Eager sends at once only when the batch would not fill within linger_ms at the pace it fills. A
    # sender at a hundred thousand a second that pauses (so the I/O thread runs and confirms come back)
    # would otherwise send a round trip's worth per batch.
    with BrokerProcess(tmp_path / "data") as broker, Producer(broker.address, linger_ms=200) as producer:
        Admin(broker.address).create_topic("fast")
        futures = []
        for _ in range(100):
            futures += [producer.send("fast", b"x" * 100) for _ in range(200)]
            time.sleep(0.0005)  # 100,000 msg/s or more: 1,000 fill in 10 ms or less, well within 200 ms
        producer.flush(timeout=30)
        assert [f.result() for f in futures[:3]] == [0, 1, 2]
        assert batches(broker, "fast") <= 35, "batches of a round trip's worth, not of batch_size"
