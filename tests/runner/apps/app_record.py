"""Test consumers that write what they handled to files under $CONVEYOR_TEST_OUT."""

from __future__ import annotations

import asyncio
import os
import time

from conveyor import Message, consumer, error_handler, retry_policy

OUT = os.environ.get("CONVEYOR_TEST_OUT", "/tmp")
SLOW = float(os.environ.get("CONVEYOR_TEST_SLOW", "0"))


def record(name: str, message: Message, extra: str = "") -> None:
    line = f"{name} {os.getpid()} {message.offset} {message.attempt} {message.key} {message.value} {extra}\n"
    with open(os.path.join(OUT, f"{name}.log"), "a") as f:
        f.write(line)


@consumer("work", group="workers", concurrency=2, prefetch=20)
def work(message: Message) -> None:
    if SLOW:
        time.sleep(SLOW)
    record("work", message)


@consumer("flaky", group="flaky")
@retry_policy(max_attempts=5, initial_delay=0.05, backoff="fixed")
def flaky(message: Message) -> None:
    record("flaky-attempt", message)
    if message.attempt < 3:
        raise ConnectionError(f"transient failure on attempt {message.attempt}")
    record("flaky", message)


@retry_policy(max_attempts=3, initial_delay=0.05, backoff="exponential", max_delay=0.2)
@consumer("doomed", group="doomed")
def doomed(message: Message) -> None:
    record("doomed-attempt", message)
    raise RuntimeError(f"cannot handle {message.value}")


@error_handler(doomed)
def doomed_dead(message: Message, exc: BaseException) -> None:
    record("doomed-dead", message, type(exc).__name__)


@consumer("async-work", group="async")
async def async_work(message: Message) -> None:
    await asyncio.sleep(0)
    record("async", message)


@consumer("batched", group="batched", batch=True, batch_size=25)
def batched(messages: list[Message]) -> None:
    assert len(messages) <= 25
    for message in messages:
        record("batched", message, str(len(messages)))


@consumer("keyed", group="keyed", concurrency=8, key_ordered=True, prefetch=400)
def keyed(message: Message) -> None:
    time.sleep(0.001 * (hash(message.key) % 3))
    record("keyed", message)
