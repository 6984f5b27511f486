"""The no-op handler with one middleware that has both per-message hooks (a timing middleware's shape)."""

import time
from typing import Any

from conveyor.consumers import Message
from conveyor.decorators import consumer


class Timing:
    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    def before_handle(self, message: Any) -> None:
        self.started = time.perf_counter()

    def after_handle(self, message: Any, result: Any) -> None:
        self.seconds += time.perf_counter() - self.started


@consumer("bench-runner", group="middleware", prefetch=2000, middleware=[Timing()])
def noop(message: Message) -> None:
    return None
