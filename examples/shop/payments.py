"""A stand-in for the payment provider ``bill`` calls, with the two failures a real one has.

- ``GatewayTimeout``: transient. The provider times out on the first try of every
  fourth order (``ord-0004``, ``ord-0008``, ...); the same charge a moment later goes
  through. ``bill``'s ``@retry_policy`` retries it through the broker.
- ``CardDeclined``: final. Orders above ``CARD_LIMIT`` are declined, and no retry will
  change that: ``bill`` rejects them to the dead-letter topic.

Deterministic on purpose, so the example's output and its tests are the same every run.
"""

from __future__ import annotations

from decimal import Decimal

from examples.shop.models import Order

CARD_LIMIT = Decimal("5000")
TIMEOUT_EVERY = 4  # the first attempt of every fourth order times out


class GatewayTimeout(ConnectionError):
    """The provider did not answer in time: worth trying again."""


class CardDeclined(Exception):
    """The provider said no: not worth trying again."""


def times_out(order_id: str, attempt: int) -> bool:
    """Whether the provider times out on this attempt at charging this order."""
    number = order_id.rpartition("-")[2]
    return attempt == 1 and number.isdigit() and int(number) % TIMEOUT_EVERY == 0


def charge(order: Order, attempt: int) -> str:
    """Charge ``order``'s total to its customer; the provider's payment id."""
    if times_out(order.id, attempt):
        raise GatewayTimeout(f"payment provider timed out charging {order.id}")
    if order.total > CARD_LIMIT:
        raise CardDeclined(f"card of {order.customer} declined: {order.currency} {order.total} is over the limit")
    return f"pay-{order.id}"
