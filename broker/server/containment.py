"""Containment: an exception in one unit of the loop's work ends that unit, not the broker.

The broker's loop does many independent units of work each pass: one
request, one group's dispatch or leases, one dead letter, the heartbeats,
fetch expiry, the offsets commit, retention, the group commit. A bug or a
poison record in one of them must not take the others (and every client)
down with the process. Each unit runs inside ``Containment.guard(where,
**context)``: an exception there is logged with its context and traceback,
counted in ``conveyor_internal_errors_total{where}``, and shown in
``/healthz`` as a DEGRADED ``internal_errors`` check; the loop goes on.

The guard is for units of work (per group, per pass), never per message.
``BaseException`` (SystemExit, KeyboardInterrupt) still ends the process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger("conveyor.broker")

HEALTH_WINDOW_SECONDS = 300.0  # /healthz stays DEGRADED this long after the last internal error
LOG_EVERY_SECONDS = 10.0  # per place: a unit failing every pass logs its traceback at most this often


@dataclass(slots=True)
class _Place:
    count: int = 0
    last_at: float = 0.0
    last_error: str = ""
    last_context: str = ""
    logged_at: float = float("-inf")
    unlogged: int = 0


class Containment:
    """Catches, logs and counts exceptions from units of loop work; feeds the ``internal_errors`` check."""

    def __init__(self, counter: Any = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter  # conveyor_internal_errors_total{where}, or None
        self.clock = clock
        self.places: dict[str, _Place] = {}

    def guard(self, where: str, **context: Any) -> _Guard:
        """``with containment.guard("dispatch", topic=t, group=g): ...`` swallows and records an exception."""
        return _Guard(self, where, context)

    def record(self, where: str, exc: BaseException, context: dict[str, Any] | None = None) -> None:
        """Count and log one contained exception (also for callers with their own ``except``)."""
        now = self.clock()
        place = self.places.get(where)
        if place is None:
            place = self.places[where] = _Place()
        place.count += 1
        place.last_at = now
        place.last_error = f"{type(exc).__name__}: {exc}"[:500]
        place.last_context = " ".join(f"{k}={v}" for k, v in (context or {}).items())
        if self._counter is not None:
            self._counter.labels(where).inc()
        if now - place.logged_at >= LOG_EVERY_SECONDS:
            more = f" ({place.unlogged} more since the last report)" if place.unlogged else ""
            log.error(
                "internal error in %s%s%s, contained: the broker goes on%s",
                where,
                " " if place.last_context else "",
                place.last_context,
                more,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
            place.logged_at = now
            place.unlogged = 0
        else:
            place.unlogged += 1

    @property
    def total(self) -> int:
        return sum(p.count for p in list(self.places.values()))  # list(): /healthz reads from another thread

    def check(self) -> dict[str, Any]:
        """The ``internal_errors`` health check: DEGRADED while an error is recent."""
        now = self.clock()
        recent = {
            where: {
                "count": p.count,
                "seconds_ago": round(now - p.last_at, 3),
                "error": p.last_error,
                "context": p.last_context,
            }
            for where, p in list(self.places.items())  # a copy: the loop may add a place meanwhile
            if now - p.last_at < HEALTH_WINDOW_SECONDS
        }
        return {"status": "DEGRADED" if recent else "HEALTHY", "total": self.total, "recent": recent}


class _Guard:
    __slots__ = ("_containment", "_context", "_where")

    def __init__(self, containment: Containment, where: str, context: dict[str, Any]) -> None:
        self._containment = containment
        self._where = where
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self._containment.record(self._where, exc, self._context)
        return True
