"""A handler typed with a pydantic model (the ``conveyor[pydantic]`` extra)."""

from conveyor.decorators import consumer
from pydantic import BaseModel


class Order(BaseModel):
    id: int
    customer: str
    total: float
    note: str


@consumer("bench-runner", group="typed-pydantic", prefetch=2000)
def bill(order: Order) -> None:
    return None
