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


class DeadLettered(Exception):
    """Given to ``@error_handler`` hooks for a message the broker dead-lettered itself.

    That is past the group's ``max_deliveries``: every attempt was nacked
    (``Nack``), or runners died or hung holding it. ``reason`` is the last
    error the broker kept, ``deliveries`` how often it was delivered.
    """

    def __init__(self, reason: str, deliveries: int, dead_letter_topic: str = "") -> None:
        super().__init__(f"dead-lettered by the broker after {deliveries} deliveries: {reason}")
        self.reason = reason
        self.deliveries = deliveries
        self.dead_letter_topic = dead_letter_topic


class Reject(Exception):
    """Never retry: dead-letter the message now with ``reason``."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
