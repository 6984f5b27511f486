"""Typed handlers for tests/runner/test_typed.py: each writes what it got as a JSON line under $CONVEYOR_TEST_OUT."""

from __future__ import annotations

import json
import os
from typing import Any

from typed_models import DataclassOrder, PydanticOrder, StructOrder

from conveyor import Message, consumer, error_handler, retry_policy

OUT = os.environ.get("CONVEYOR_TEST_OUT", "/tmp")


def record(name: str, order: Any, message: Message | None = None, **extra: Any) -> None:
    row = {"type": type(order).__name__, "id": getattr(order, "id", None), "total": getattr(order, "total", None)}
    if message is not None:
        row.update(offset=message.offset, attempt=message.attempt)
    with open(os.path.join(OUT, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps({**row, **extra}) + "\n")


@consumer("typed-pydantic", group="typed-pydantic")
def pydantic_order(order: PydanticOrder) -> None:
    record("pydantic", order)


@consumer("typed-dataclass", group="typed-dataclass")
def dataclass_order(order: DataclassOrder) -> None:
    record("dataclass", order)


@consumer("typed-struct", group="typed-struct")
async def struct_order(order: StructOrder) -> None:
    record("struct", order)


@consumer("typed-message", group="typed-message")
def message_order(message: Message[PydanticOrder]) -> None:
    record("message", message.value, message, key=message.key)


@consumer("typed-batch", group="typed-batch", batch=True, batch_size=10)
def batch_orders(messages: list[Message[StructOrder]]) -> None:
    for message in messages:
        record("batch", message.value, message)


@consumer("typed-async-batch", group="typed-async-batch", batch=True, batch_size=10)
async def async_batch_orders(orders: list[DataclassOrder]) -> None:
    for order in orders:
        record("async-batch", order)


@consumer("typed-strict", group="typed-strict")
@retry_policy(max_attempts=5, initial_delay=0.05, backoff="fixed")
def strict_order(order: PydanticOrder) -> None:
    record("strict", order)


@error_handler(strict_order)
def strict_dead(message: Message, exc: BaseException) -> None:
    record("strict-dead", None, message, error=type(exc).__name__)
