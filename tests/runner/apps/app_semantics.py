"""Consumers for tests/runner/test_semantics.py: each writes every call and outcome under $CONVEYOR_TEST_OUT.

Select one with ``conveyor run app_semantics:NAME``.
"""

from __future__ import annotations

import os

import tenacity

from conveyor import Message, Nack, consumer, error_handler, retry_policy

OUT = os.environ.get("CONVEYOR_TEST_OUT", "/tmp")
FAIL_EVERY = int(os.environ.get("CONVEYOR_TEST_FAIL_EVERY", "10"))
RETRY_DELAY = float(os.environ.get("CONVEYOR_TEST_RETRY_DELAY", "0.3"))


def record(name: str, message: Message, extra: str = "") -> None:
    line = f"{name} {os.getpid()} {message.offset} {message.attempt} {message.key} {message.value} {extra}\n"
    with open(os.path.join(OUT, f"{name}.log"), "a") as f:
        f.write(line)


@consumer("kf", group="kf", key_ordered=True, concurrency=4, prefetch=200)
@retry_policy(max_attempts=3, initial_delay=RETRY_DELAY, backoff="fixed")
def keyed_flaky(message: Message) -> None:
    """Every FAIL_EVERY-th value fails on its first attempt only."""
    record("kf-call", message)
    if message.value % FAIL_EVERY == 0 and message.attempt == 1:
        raise ConnectionError(f"first attempt of {message.value} fails")
    record("kf-done", message)


@consumer("kn", group="kn", key_ordered=True, concurrency=2, prefetch=100)
def keyed_nack(message: Message) -> None:
    """A Nack(delay) on the head of a key: the key's next messages wait for it."""
    record("kn-call", message)
    if message.value == 0 and message.attempt == 1:
        raise Nack(delay=RETRY_DELAY, reason="not yet")
    record("kn-done", message)


@consumer("kk", group="kk", key_ordered=True, concurrency=2, prefetch=100)
@retry_policy(max_attempts=5, initial_delay=RETRY_DELAY, backoff="fixed")
def keyed_killed(message: Message) -> None:
    """The first message of key k0 fails once with a long delay: the runner is killed while k0 waits."""
    record("kk-call", message)
    if message.value == 0 and message.attempt == 1:
        raise ConnectionError("the head of k0 fails once")
    record("kk-done", message)


@consumer("fifteen", group="fifteen")
@retry_policy(stop=tenacity.stop_after_attempt(15), wait=tenacity.wait_fixed(0.01))
def fifteen(message: Message) -> None:
    record("fifteen-call", message)
    raise RuntimeError("always")


@error_handler(fifteen)
def fifteen_dead(message: Message, exc: BaseException) -> None:
    record("fifteen-dead", message, type(exc).__name__)


@consumer("delayed", group="delayed")
@retry_policy(stop=tenacity.stop_after_delay(1.5), wait=tenacity.wait_fixed(0.2))
def delayed(message: Message) -> None:
    record("delayed-call", message)
    raise RuntimeError("always")


@error_handler(delayed)
def delayed_dead(message: Message, exc: BaseException) -> None:
    record("delayed-dead", message, type(exc).__name__)


@consumer("nacked", group="nacked")
@retry_policy(max_attempts=3)
def nacked(message: Message) -> None:
    """Nack never gives up by itself: the broker dead-letters at the policy's limit."""
    record("nacked-call", message)
    raise Nack(delay=0.02, reason="still not ready")


@error_handler(nacked)
def nacked_dead(message: Message, exc: BaseException) -> None:
    record("nacked-dead", message, f"{type(exc).__name__}:{getattr(exc, 'deliveries', '')}")


@consumer("rd", group="rd", ack_timeout_ms=30_000)
@retry_policy(max_attempts=3)
def redeploy_v1(message: Message) -> None:
    record("rd-v1", message)


@consumer("rd", group="rd", key_ordered=True, ack_timeout_ms=20_000)
@retry_policy(max_attempts=6)
def redeploy_v2(message: Message) -> None:
    record("rd-v2", message)


@consumer("kb", group="kb", key_ordered=True, batch=True, batch_size=5, concurrency=2, prefetch=100)
@retry_policy(max_attempts=3, initial_delay=RETRY_DELAY, backoff="fixed")
def keyed_batch(messages: list[Message]) -> None:
    """A batch holding value 0 fails on its first attempt: its keys' later messages wait for it."""
    for message in messages:
        record("kb-call", message)
    if any(m.value == 0 and m.attempt == 1 for m in messages):
        raise ConnectionError("a batch with 0 fails once")
    for message in messages:
        record("kb-done", message)


@consumer("ka", group="ka", key_ordered=True, concurrency=2, prefetch=100)
@retry_policy(max_attempts=3, initial_delay=RETRY_DELAY, backoff="fixed")
async def keyed_async(message: Message) -> None:
    record("ka-call", message)
    if message.value % FAIL_EVERY == 0 and message.attempt == 1:
        raise ConnectionError(f"first attempt of {message.value} fails")
    record("ka-done", message)


@consumer("poison", group="poison")
@retry_policy(max_attempts=2)
def poison(message: Message) -> None:
    """Kills its runner: the broker counts each death and dead-letters it at the policy's limit."""
    record("poison-call", message)
    os._exit(17)


@error_handler(poison)
def poison_dead(message: Message, exc: BaseException) -> None:
    record("poison-dead", message, f"{type(exc).__name__}:{getattr(exc, 'deliveries', '')}")
