"""``AsyncProducer`` against a real broker: confirms, back-pressure and what a refused batch fails with."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.log.syscalls import ENV_CONTROL

from conveyor import Admin
from conveyor.errors import BufferFull, RequestTimeout, StorageIOError
from conveyor.testing import BrokerProcess


@pytest.mark.timeout(60)
def test_send_resolves_to_offsets_in_order_and_flush_waits_for_every_confirm(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("a")

        async def main() -> list[int]:
            producer = await AsyncProducer(broker.address, linger_ms=2, batch_size=50).start()
            futures = [await producer.send("a", f"m{i}", key=f"k{i % 3}") for i in range(120)]
            first = await producer.send_and_wait("a", "last")
            await producer.flush(timeout=10)
            assert all(f.done() for f in futures)
            await producer.close()
            return [f.result() for f in futures] + [first]

        assert asyncio.run(main()) == list(range(121))
        fetched = Admin(broker.address).fetch("a", 0, 200)
        assert [m.value for m in fetched][:3] == ["m0", "m1", "m2"] and len(fetched) == 121
        assert fetched[4].key == "k1"


@pytest.mark.timeout(60)
def test_a_fast_sender_waits_for_room_then_gets_buffer_full(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as broker:
        Admin(broker.address).create_topic("a")

        async def main() -> None:
            producer = await AsyncProducer(
                broker.address, linger_ms=1, buffer_memory=4096, max_block_ms=400, request_timeout_ms=30_000
            ).start()
            await producer.send_and_wait("a", b"x" * 100)  # connected and confirming
            broker.signal(signal.SIGSTOP)
            try:
                accepted = []
                started = time.monotonic()
                with pytest.raises(BufferFull) as refused:
                    for _ in range(100):  # ~116 bytes each against 4 KiB: blocks after ~35
                        accepted.append(await producer.send("a", b"x" * 100))
                waited = time.monotonic() - started
                assert 0.35 <= waited < 5 and 20 < len(accepted) < 100, (waited, len(accepted))
                assert refused.value.code == 403 and refused.value.fields["buffer_memory"] == 4096
            finally:
                broker.signal(signal.SIGCONT)
            offsets = await asyncio.wait_for(asyncio.gather(*accepted), 20)
            assert offsets == list(range(1, len(accepted) + 1))  # nothing accepted is lost, nothing refused stored
            assert await producer.send_and_wait("a", b"after") == len(accepted) + 1
            await producer.close()

        asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_batch_refused_until_its_delivery_timeout_fails_with_the_brokers_last_error(tmp_path: Path) -> None:
    control = tmp_path / "faults"
    with BrokerProcess(tmp_path / "data", env={ENV_CONTROL: str(control)}) as broker:
        Admin(broker.address).create_topic("refused")
        control.write_text("write_eio,match=.log")

        async def main() -> BaseException | None:
            producer = await AsyncProducer(broker.address, linger_ms=1, delivery_timeout_ms=1500).start()
            future = await producer.send("refused", "x")
            try:
                await asyncio.wait_for(future, 15)
            except Exception as exc:  # the failure is what this test looks at
                return exc
            finally:
                await producer.close(timeout=5)
            return None

        failed = asyncio.run(main())
        assert type(failed) is StorageIOError, repr(failed)
        assert "delivery timed out after" in failed.message and failed.fields["topic"] == "refused"
        assert not isinstance(failed, RequestTimeout)
