"""``Consumer`` and ``AsyncConsumer``: a plain loop over a topic for scripts, against a real broker process.

One broker for the file; each test has topics of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from conveyor import Admin, AsyncConsumer, Consumer, Message
from conveyor.testing import BrokerProcess
from tests.helpers import TIMEOUT, publish, wait_for


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("script-consumer")).start()
    yield process
    process.stop()


def committed(broker: BrokerProcess, topic: str, group: str) -> int:
    with Admin(broker.address) as admin:
        return int(admin.describe_group(topic, group)["committed_offset"])


def test_a_for_loop_yields_each_message_once_in_order_and_acks_move_the_group(broker):
    publish(broker.address, "script-orders", [{"id": i} for i in range(5)])
    got: list[Message] = []
    with Consumer("script-orders", group="audit", address=broker.address, credit=3) as c:
        for message in c:  # credit 3: five messages come in more than one batch
            got.append(message)
            c.ack(message)
            if len(got) == 5:
                break
        assert [m.value for m in got] == [{"id": i} for i in range(5)]
        assert [m.offset for m in got] == [0, 1, 2, 3, 4]
        assert all(m.attempt == 1 and m.topic == "script-orders" for m in got)
        c.timeout = 0.2
        assert list(c) == [], "with nothing left, the loop ends after `timeout` seconds without a message"
        assert c.receive(timeout=0) is None
    assert c.closed
    wait_for(lambda: committed(broker, "script-orders", "audit") == 5, message="the group committed past the acks")


def test_nack_with_a_delay_redelivers_the_message_with_the_next_attempt(broker):
    publish(broker.address, "script-retry", ["flaky", "fine"])
    with Consumer("script-retry", group="g", address=broker.address, timeout=TIMEOUT) as c:
        first = next(iter(c))
        assert (first.value, first.attempt) == ("flaky", 1)
        c.nack(first, delay=0.2, error="not yet")
        fine = next(iter(c))
        assert fine.value == "fine", "a delayed retry does not hold back the next message"
        c.ack(fine)
        again = next(iter(c))
        assert (again.offset, again.value, again.attempt) == (first.offset, "flaky", 2)
        c.ack(again)
    wait_for(lambda: committed(broker, "script-retry", "g") == 2, message="both acked")


def test_close_gives_back_what_was_not_acked_and_the_next_member_gets_it(broker):
    publish(broker.address, "script-close", ["a", "b", "c"])
    with Consumer("script-close", group="g", address=broker.address, timeout=TIMEOUT) as c:
        taken = c.receive(timeout=TIMEOUT)
        assert taken is not None and taken.value == "a"
        c.ack(taken)
        c.receive(timeout=TIMEOUT)  # handed out, never acked: redelivered after close
    with Consumer("script-close", group="g", address=broker.address, timeout=TIMEOUT) as again:
        values = []
        for message in again:
            values.append(message.value)
            again.ack(message)
            if len(values) == 2:
                break
    assert sorted(values) == ["b", "c"]
    wait_for(lambda: committed(broker, "script-close", "g") == 3, message="all acked")


def test_settling_or_reentering_after_close_is_a_clear_error_not_an_assertion(broker):
    publish(broker.address, "script-late", ["late"])
    with Consumer("script-late", group="g", address=broker.address, timeout=TIMEOUT) as c:
        late = c.receive(timeout=TIMEOUT)
        assert late is not None
    for settle in (c.ack, c.nack, c.in_progress, c.terminate):
        with pytest.raises(RuntimeError, match="closed"):
            settle(late)
    with pytest.raises(RuntimeError, match="closed"), c:
        pass

    async def late_ack() -> None:
        async with AsyncConsumer("script-late", group="g", address=broker.address, timeout=TIMEOUT) as ac:
            again = await ac.receive(timeout=TIMEOUT)
            assert again is not None and again.value == "late"
        with pytest.raises(RuntimeError, match="closed"):
            await ac.ack(again)

    asyncio.run(late_ack())


def test_stop_from_another_thread_ends_a_loop_blocked_on_an_empty_topic(broker):
    publish(broker.address, "script-stop", ["only"])
    ended = threading.Event()
    got: list[str] = []
    with Consumer("script-stop", group="g", address=broker.address) as c:  # no timeout: waits forever

        def loop() -> None:
            for message in c:
                got.append(message.value)
                c.ack(message)
            ended.set()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        wait_for(lambda: got == ["only"], message="the message")
        assert not ended.is_set()
        c.stop()
        assert ended.wait(TIMEOUT), "stop() woke the blocked loop"
        thread.join(TIMEOUT)
    assert c.receive(timeout=0) is None


def test_bad_settings_are_a_type_error_before_anything_is_sent(broker):
    with pytest.raises(TypeError, match="credit"):
        Consumer("script-bad", group="g", address=broker.address, credit=0)
    with pytest.raises(TypeError, match="timeout"):
        Consumer("script-bad", group="g", address=broker.address, timeout=-1)
    with Consumer("script-bad", group="g", address=broker.address) as c, pytest.raises(ValueError, match="delay"):
        c.nack([], delay=-1)


def test_the_async_twin_iterates_acks_nacks_and_closes(broker):
    publish(broker.address, "script-async", ["x", "y", "z"])

    async def main() -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        async with AsyncConsumer("script-async", group="g", address=broker.address, timeout=TIMEOUT) as c:
            async for message in c:
                seen.append((message.value, message.attempt))
                if message.value == "y" and message.attempt == 1:
                    await c.nack(message, delay=0.1)
                else:
                    await c.ack(message)
                if len(seen) == 4:
                    break
            c.timeout = 0.2
            assert [m async for m in c] == [], "the loop ends after `timeout` seconds without a message"
        assert c.closed
        return seen

    seen = asyncio.run(main())
    assert sorted(seen) == [("x", 1), ("y", 1), ("y", 2), ("z", 1)]
    wait_for(lambda: committed(broker, "script-async", "g") == 3, message="all acked")


def test_the_async_twin_stops_a_waiting_loop_and_lets_other_tasks_run(broker):
    publish(broker.address, "script-async-stop", ["one"])

    async def main() -> list[str]:
        got: list[str] = []
        async with AsyncConsumer("script-async-stop", group="g", address=broker.address) as c:

            async def loop() -> None:
                async for message in c:
                    got.append(message.value)
                    await c.ack(message)

            task = asyncio.create_task(loop())
            while not got:  # this task runs while the loop waits on the sockets
                await asyncio.sleep(0.01)
            c.stop()
            await asyncio.wait_for(task, TIMEOUT)
        return got

    assert asyncio.run(asyncio.wait_for(main(), 2 * TIMEOUT)) == ["one"]


def test_messages_nacked_past_max_deliveries_right_before_close_all_reach_the_dead_letter_topic(broker):
    """A script that nacks and exits at once: the broker may find it gone before reading its last NACK (an
    EVENT to it bounces), and then dead-letters what it held itself; that letter was once left unwritten."""

    def dead_letters(topic: str) -> int:
        with Admin(broker.address) as admin:
            names = {t["name"]: t for t in admin.list_topics()}
        return int(names[topic]["end_offset"]) if topic in names else 0

    for round_ in range(5):  # the race goes either way: a few rounds catch the bad order
        topic = f"script-dead-{round_}"
        publish(broker.address, topic, ["a", "b"])
        with Consumer(topic, group="g", address=broker.address, max_deliveries=1, timeout=TIMEOUT) as c:
            for n, message in enumerate(c, 1):
                c.nack(message, error="bad")
                if n == 2:
                    break
        wait_for(lambda t=topic: dead_letters(f"{t}.dlq") == 2, message=f"both dead letters of {topic}")
        wait_for(lambda t=topic: committed(broker, t, "g") == 2, message="the group past them")
