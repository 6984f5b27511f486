"""What a handler can raise to steer its message, besides returning."""

from __future__ import annotations


class Nack(Exception):
    """Give the message back; the broker redelivers it after ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, reason: str = "nack") -> None:
        super().__init__(reason)
        self.delay = delay
        self.reason = reason


class Reject(Exception):
    """Never retry: dead-letter the message now with ``reason``."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
