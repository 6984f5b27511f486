"""Place orders: ``python -m examples.shop.place_orders --count 10 [--bad 2] [--broker ADDR]``.

Sends ``--count`` valid orders to ``shop.orders`` as typed ``Order`` messages, keyed by
customer, and waits until the broker confirmed each. ``--bad N`` mixes in N orders that
end in the dead-letter topic: the first has no lines (an old client: it fails ``Order``'s
checks), the second is over the card limit (the provider declines it), and so on.

Order numbers go on from the topic's end offset, so running it again places new orders.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from concurrent.futures import Future
from decimal import Decimal
from typing import Any

from conveyor import Admin, Producer
from conveyor.errors import UnknownTopic
from examples.shop import tracing
from examples.shop.models import ORDERS, Order, OrderLine
from examples.shop.payments import CARD_LIMIT

CUSTOMERS = ("alice@example.com", "bob@example.com", "carol@example.com", "dave@example.com")
CATALOGUE = (
    ("mug", Decimal("8.50")),
    ("tea-earl-grey", Decimal("4.20")),
    ("teapot", Decimal("32.00")),
    ("coffee-beans-1kg", Decimal("21.90")),
    ("grinder", Decimal("89.00")),
)


def order(number: int) -> Order:
    """Order ``number``: the same order every time, so a run's output can be told in advance."""
    lines = [
        OrderLine(sku, quantity=1 + (number + i) % 3, unit_price=price)
        for i, (sku, price) in enumerate(CATALOGUE)
        if (number + i) % 3 == 0 or i == number % len(CATALOGUE)
    ]
    return Order(id=order_id(number), customer=CUSTOMERS[number % len(CUSTOMERS)], lines=lines)


def bad_order(number: int, kind: int) -> dict[str, Any] | Order:
    """A bad order: kind 0 has no lines (dead-lettered as invalid), kind 1 is over the card limit (declined)."""
    if kind % 2 == 0:
        return {"id": order_id(number), "customer": "eve@example.com", "lines": []}
    return Order(
        id=order_id(number),
        customer="mallory@example.com",
        lines=[OrderLine("espresso-machine", quantity=3, unit_price=CARD_LIMIT)],
    )


def order_id(number: int) -> str:
    return f"ord-{number:04d}"


def plan(first: int, count: int, bad: int) -> list[dict[str, Any] | Order]:
    """``count`` good orders and ``bad`` bad ones spread among them, numbered from ``first``."""
    total = count + bad
    bad_at = {(j + 1) * total // (bad + 1) for j in range(bad)} if bad else set()
    kinds = itertools.count()
    return [bad_order(first + i, next(kinds)) if i in bad_at else order(first + i) for i in range(total)]


def first_number(broker: str | None) -> int:
    """The next order number: one past the orders the topic holds (1 on a new topic)."""
    try:
        with Admin(broker) as admin:
            return int(admin.describe_topic(ORDERS)["end_offset"]) + 1
    except UnknownTopic:  # the first send creates it
        return 1


def describe(placed: dict[str, Any] | Order) -> str:
    if isinstance(placed, Order):
        return f"{placed.id} for {placed.customer}: {len(placed.lines)} line(s), {placed.currency} {placed.total}"
    return f"{placed['id']} for {placed['customer']}: {len(placed['lines'])} line(s) (not a valid order)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.shop.place_orders", description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10, help="valid orders to place (default 10)")
    parser.add_argument("--bad", type=int, default=0, help="bad orders to mix in, for the dead-letter topic")
    parser.add_argument("--broker", default=None, help="broker address (default: CONVEYOR_BROKER or :5555)")
    args = parser.parse_args(argv)
    tracing.setup("storefront")  # spans to the console when OTEL_TRACES_EXPORTER=console
    orders = plan(first_number(args.broker), args.count, args.bad)
    with Producer(args.broker) as producer:
        sent = [(placed, checkout(producer, placed)) for placed in orders]
        for placed, future in sent:
            say(f"placed {describe(placed)} (offset {future.result(timeout=30)})")
    say(f"placed {len(orders)} order(s) on {ORDERS}, {args.bad} of them bad")
    return 0


def checkout(producer: Producer, placed: dict[str, Any] | Order) -> Future[int]:
    """Send one order, in a span of its own when tracing: the trace every later step of this order joins."""
    order_id = placed.id if isinstance(placed, Order) else str(placed["id"])
    with tracing.span(f"checkout {order_id}", **{"order.id": order_id}):
        return producer.send(ORDERS, placed, key=customer(placed))


def say(line: str) -> None:
    """One write per line: the console exporter prints spans from the producer's I/O thread meanwhile."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def customer(placed: dict[str, Any] | Order) -> str:
    return placed.customer if isinstance(placed, Order) else str(placed["customer"])


if __name__ == "__main__":
    sys.exit(main())
