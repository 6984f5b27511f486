"""Handlers that publish (tests/runner/test_publish_middleware.py): each writes what it did as a JSON line."""

from __future__ import annotations

import json
import os
from typing import Any

from conveyor import Message, consumer, context, publish, retry_policy

OUT = os.environ.get("CONVEYOR_TEST_OUT", "/tmp")


def record(name: str, **row: Any) -> None:
    with open(os.path.join(OUT, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


@consumer("pub-in", group="pub-in")
def relay(message: Message) -> None:
    publish("pub-out", {"n": message.value}, key=message.key, headers={"x-app": "relay"})


@consumer("pub-out", group="pub-out")
async def chain(message: Message) -> None:
    """An async handler publishing in its turn: the correlation id goes down the chain."""
    await_me = context().publish("pub-chain", message.value)
    record("chain", offset=message.offset, headers=message.headers, sent=await_me is not None)


@consumer("pub-batch", group="pub-batch", batch=True, batch_size=10)
def batch(messages: list[Message]) -> None:
    for message in messages:
        publish("pub-batch-out", message.value, cause=message)


@consumer("pub-guarded-in", group="pub-guarded-in")
@retry_policy(max_attempts=1000, initial_delay=0.05, backoff="fixed")
def guarded(message: Message) -> None:
    """Publishes to a topic the test makes read-only: the message must not be acked until a publish lands."""
    record("guarded", offset=message.offset, attempt=message.attempt)
    publish("pub-guarded", message.value)
