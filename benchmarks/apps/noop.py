"""Consumers that do nothing, to measure what the runner itself costs."""

from conveyor.consumers import Message
from conveyor.decorators import consumer


@consumer("bench-runner", group="runner", prefetch=2000)
def noop(message: Message) -> None:
    return None
