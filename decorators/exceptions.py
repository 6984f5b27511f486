"""What a handler can raise to steer its message, besides returning."""

from __future__ import annotations

import math
from typing import Any


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


class InvalidMessage(Reject):
    """The message does not decode into the model its handler is annotated with: dead-lettered at once.

    The runner raises it (consumers/typed.py) and never retries it: the same bytes would fail the same way.
    ``error`` (the validation error's text) goes into the dead letter's ``x-last-error`` header. For a batch
    handler, ``invalid`` pairs each invalid message with its error (the valid ones went to the handler), and
    ``handler_error`` is what the handler raised for the valid ones, if it raised.
    """

    def __init__(
        self,
        error: str,
        invalid: list[tuple[Any, str]] | None = None,
        handler_error: BaseException | None = None,
    ) -> None:
        super().__init__(error)
        self.error = error
        self.invalid = invalid
        self.handler_error = handler_error
