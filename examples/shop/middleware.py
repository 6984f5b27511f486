"""``AuditLog``: the shop's own middleware, timing every message and summing up what happened.

Every handler of the service gets it (``middleware = [AuditLog()]`` in
``examples/shop/handlers.py``): whatever a handler does, the audit knows each
message's outcome (handled, retried, dead-lettered) and how long it took.
One line per message would drown the log, so a message gets a line of its own only
when it is slower than ``slow_ms`` (a warning: the first place to look when the lag
grows) or at DEBUG; when the runner stops, one line per topic sums it up.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from conveyor import Message, Middleware

log = logging.getLogger("examples.shop.audit")


@dataclass
class Tally:
    """One topic's outcomes so far."""

    handled: int = 0
    retried: int = 0  # failed attempts that will come again
    dead_lettered: int = 0
    slowest_ms: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.handled} handled, {self.retried} attempt(s) retried, {self.dead_lettered} dead-lettered; "
            f"slowest {self.slowest_ms:.1f} ms"
        )


class AuditLog(Middleware):
    def __init__(self, slow_ms: float = 500.0) -> None:
        self.slow_ms = slow_ms
        self.tallies: dict[str, Tally] = {}
        # Lanes run in parallel and a message's hooks run on its own lane: state per message, under a lock.
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def on_start(self, runner: Any) -> None:
        log.info(
            "audit log on for %d consumer(s); a message slower than %.0f ms is a warning",
            len(runner.consumers),
            self.slow_ms,
        )

    def before_handle(self, message: Message) -> None:
        self._started[id(message)] = time.perf_counter()

    def after_handle(self, message: Message, result: Any) -> None:
        took_ms = self._took_ms(message)
        with self._lock:
            tally = self._tally(message)
            tally.handled += 1
            tally.slowest_ms = max(tally.slowest_ms, took_ms)
        level = logging.WARNING if took_ms > self.slow_ms else logging.DEBUG
        log.log(level, "%s handled in %.1f ms (attempt %d)", where(message), took_ms, message.attempt)

    def on_error(self, message: Message, exc: BaseException) -> None:
        self._took_ms(message)

    def on_retry(self, message: Message, exc: BaseException, attempt: int) -> None:
        with self._lock:
            self._tally(message).retried += 1
        log.debug("%s failed on attempt %d, comes again: %s", where(message), attempt, exc)

    def on_dead_letter(self, message: Message, reason: str) -> None:
        with self._lock:
            self._tally(message).dead_lettered += 1
        log.debug("%s dead-lettered: %s", where(message), reason)

    def on_stop(self, runner: Any) -> None:
        with self._lock:
            for topic, tally in sorted(self.tallies.items()):
                log.info("audit %s: %s", topic, tally.summary())

    def _tally(self, message: Message) -> Tally:
        return self.tallies.setdefault(message.topic, Tally())

    def _took_ms(self, message: Message) -> float:
        started = self._started.pop(id(message), None)
        return 0.0 if started is None else (time.perf_counter() - started) * 1000


def where(message: Message) -> str:
    """``shop.orders@12``: the topic and offset a line is about (``topic[partition]@offset`` when partitioned)."""
    partition = f"[{message.partition}]" if message.partition else ""
    return f"{message.topic}{partition}@{message.offset}"
