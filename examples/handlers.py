"""Example consumers: run them with ``conveyor run examples.handlers``.

Publish something to see them work::

    conveyor publish orders '{"id": 1, "total": 9.5}' --format json
"""

from __future__ import annotations

import logging

from conveyor import Message, consumer, error_handler, retry_policy

log = logging.getLogger("examples")


@consumer("orders", group="billing", concurrency=4)
@retry_policy(max_attempts=5, backoff="exponential", initial_delay=0.5, max_delay=30, give_up_on=(ValueError,))
def bill(message: Message) -> None:
    """Charge an order; a ValueError (bad data) is not worth retrying."""
    order = message.value
    if not isinstance(order, dict) or "id" not in order:
        raise ValueError(f"not an order: {order!r}")
    log.info("billed order %s (attempt %d)", order["id"], message.attempt)


@error_handler(bill)
def bill_failed(message: Message, exc: BaseException) -> None:
    log.error("order at offset %d dead-lettered: %s", message.offset, exc)


@consumer("orders", group="audit", batch=True, batch_size=100)
async def audit(messages: list[Message]) -> None:
    """Batch handler: one call per up to 100 messages."""
    log.info("audited %d orders up to offset %d", len(messages), messages[-1].offset)
