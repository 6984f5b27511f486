"""Example consumers: run them with ``conveyor run examples.handlers``.

Publish something to see them work::

    conveyor publish orders '{"id": 1, "total": 9.5}' --format json
"""

from __future__ import annotations

import logging
import time
from typing import Any

from conveyor import Message, Middleware, consumer, error_handler, publish, retry_policy

log = logging.getLogger("examples")


class Timing(Middleware):
    """Logs how long each message took, from before the handler to its ack (publishes confirmed)."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}  # lanes run in parallel: state per message

    def before_handle(self, message: Message) -> None:
        self.started[id(message)] = time.perf_counter()

    def after_handle(self, message: Message, result: Any) -> None:
        took = time.perf_counter() - self.started.pop(id(message), time.perf_counter())
        log.debug("%s offset %d handled in %.1f ms", message.topic, message.offset, took * 1000)

    def on_error(self, message: Message, exc: BaseException) -> None:
        self.started.pop(id(message), None)


middleware = [Timing()]  # `conveyor run examples.handlers` wraps every consumer below in it


@consumer("orders", group="billing", concurrency=4)
@retry_policy(max_attempts=5, backoff="exponential", initial_delay=0.5, max_delay=30, give_up_on=(ValueError,))
def bill(message: Message) -> None:
    """Charge an order; a ValueError (bad data) is not worth retrying."""
    order = message.value
    if not isinstance(order, dict) or "id" not in order:
        raise ValueError(f"not an order: {order!r}")
    log.info("billed order %s (attempt %d)", order["id"], message.attempt)
    # linked to this order by x-correlation-id and x-causation-id; acked once the invoice is confirmed
    publish("invoices", {"order": order["id"]}, key=str(order["id"]))


@error_handler(bill)
def bill_failed(message: Message, exc: BaseException) -> None:
    log.error("order at offset %d dead-lettered: %s", message.offset, exc)


@consumer("orders", group="audit", batch=True, batch_size=100)
async def audit(messages: list[Message]) -> None:
    """Batch handler: one call per up to 100 messages."""
    log.info("audited %d orders up to offset %d", len(messages), messages[-1].offset)
