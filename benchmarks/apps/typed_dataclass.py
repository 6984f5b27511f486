"""A handler typed with a dataclass: what decoding into a model costs the runner."""

from dataclasses import dataclass

from conveyor.decorators import consumer


@dataclass
class Order:
    id: int
    customer: str
    total: float
    note: str


@consumer("bench-runner", group="typed-dataclass", prefetch=2000)
def bill(order: Order) -> None:
    return None
