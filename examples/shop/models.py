"""The shop's messages: ``Order`` (on ``shop.orders``) and ``Invoice`` (on ``shop.invoices``).

Plain dataclasses: no dependency beyond Conveyor. A producer sends them as msgpack maps
(``Producer.send("shop.orders", order)``) and a handler annotated with them receives them
decoded and checked (README, "Typed messages"). ``Order.__post_init__`` holds the rules an
order must meet; an order that breaks one never reaches ``bill``: the runner dead-letters it
at once with the reason, since no retry would make it valid.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

ORDERS = "shop.orders"
INVOICES = "shop.invoices"

Currency = Literal["EUR", "USD", "GBP"]


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class OrderLine:
    sku: str
    quantity: int
    unit_price: Decimal  # money as a Decimal: sent as its string, so no float rounding on the way

    @property
    def amount(self) -> Decimal:
        return self.quantity * self.unit_price


@dataclass(frozen=True)
class Order:
    id: str
    customer: str  # the e-mail address the invoice goes to
    lines: list[OrderLine]
    currency: Currency = "EUR"
    placed_at: datetime.datetime = field(default_factory=now)

    def __post_init__(self) -> None:
        """The rules of a valid order; breaking one is a ``ValueError``, which decoding turns into a dead letter."""
        if not self.lines:
            raise ValueError(f"order {self.id} has no lines")
        for line in self.lines:
            if line.quantity < 1:
                raise ValueError(f"order {self.id}: {line.sku} has quantity {line.quantity}")
            if line.unit_price < 0:
                raise ValueError(f"order {self.id}: {line.sku} has a negative price")

    @property
    def total(self) -> Decimal:
        return sum((line.amount for line in self.lines), Decimal(0))


@dataclass(frozen=True)
class Invoice:
    number: str  # derived from the order id: billing the same order twice yields the same invoice
    order_id: str
    customer: str
    total: Decimal
    currency: Currency
    issued_at: datetime.datetime = field(default_factory=now)

    @classmethod
    def for_order(cls, order: Order) -> Invoice:
        return cls(
            number=invoice_number(order.id),
            order_id=order.id,
            customer=order.customer,
            total=order.total,
            currency=order.currency,
        )


def invoice_number(order_id: str) -> str:
    """``ord-0007`` -> ``INV-0007``: one number per order, however many times it is billed (at-least-once)."""
    return "INV-" + order_id.removeprefix("ord-")
