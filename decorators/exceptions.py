"""What a handler can raise to steer its message, besides returning."""

from __future__ import annotations

import math


class Nack(Exception):
    """Give the message back; the broker redelivers it after ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, reason: str = "nack") -> None:
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < math.inf:
            # nan or inf would fail later, inside the runner, as a float that is no count of milliseconds
            raise TypeError(f"Nack delay must be a finite number of seconds, at least 0, not {delay!r}")
        super().__init__(reason)
        self.delay = delay
        self.reason = reason


class Reject(Exception):
    """Never retry: dead-letter the message now with ``reason``."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
