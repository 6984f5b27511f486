"""A handler typed with a msgspec Struct (the ``conveyor[msgspec]`` extra)."""

import msgspec
from conveyor.decorators import consumer


class Order(msgspec.Struct):
    id: int
    customer: str
    total: float
    note: str


@consumer("bench-runner", group="typed-msgspec", prefetch=2000)
def bill(order: Order) -> None:
    return None
