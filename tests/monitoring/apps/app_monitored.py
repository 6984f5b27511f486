"""Consumers for the monitoring tests: one that succeeds, one that retries, one that dead-letters, one gated.

``CONVEYOR_TEST_GATE`` names a file: the ``hold`` consumer does not return until it exists, so a test can
look at in-flight and in-process gauges while messages are held, then open the gate and watch them drain.
"""

from __future__ import annotations

import os
import time

from conveyor import Message, consumer, retry_policy

GATE = os.environ.get("CONVEYOR_TEST_GATE", "")


@consumer("orders", group="billing", concurrency=2, prefetch=200)
def bill(message: Message) -> None:
    time.sleep(0.0002)


@consumer("payments", group="ledger", prefetch=100)
@retry_policy(max_attempts=3, initial_delay=0.02, backoff="fixed")
def post(message: Message) -> None:
    if message.attempt == 1 and int(message.value) % 5 == 0:
        raise ConnectionError(f"ledger busy on attempt {message.attempt}")


@consumer("doomed", group="graveyard", prefetch=100)
@retry_policy(max_attempts=2, initial_delay=0.01, backoff="fixed")
def refuse(message: Message) -> None:
    raise RuntimeError(f"cannot handle {message.value}")


@consumer("gated", group="gatekeepers", prefetch=50)
def hold(message: Message) -> None:
    deadline = time.monotonic() + 30  # never hang a test run for good
    while GATE and not os.path.exists(GATE) and time.monotonic() < deadline:
        time.sleep(0.01)
