"""One progress line for long work: done, rate, total, what Spark is doing.

On a terminal the line is rewritten in place; in a log it is printed every
``every`` seconds. The count comes from a callable (the topic's end offset
for ingest, the query's progress for archive), so nothing is counted twice.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["Progress", "spark_tasks"]


def spark_tasks(spark: Any) -> str:
    """``tasks 3/8`` over the active stages, or '' when none run."""
    try:
        tracker = spark.sparkContext.statusTracker()
        done = total = 0
        for stage_id in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
    except Exception:  # the JVM may be going away; progress is best effort
        return ""
    return f"tasks {done}/{total}" if total else ""


class Progress:
    """``with Progress("ingest orders", poll, total=N):`` prints while the block runs."""

    def __init__(
        self,
        label: str,
        poll: Callable[[], int],
        *,
        total: int | None = None,
        unit: str = "messages",
        extra: Callable[[], str] | None = None,
        every: float = 2.0,
        stream: IO[str] | None = None,
    ) -> None:
        self.label = label
        self.poll = poll
        self.total = total
        self.unit = unit
        self.extra = extra
        self.every = every
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._started = time.monotonic()
        self._base = 0
        self.done = 0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.done - self._base) / elapsed
        text = f"{self.label}: {self.done - self._base:,} {self.unit}"
        if self.total:
            text += f" of {self.total:,} ({100 * (self.done - self._base) / self.total:.0f}%)"
        text += f", {rate:,.0f}/s, {elapsed:.0f}s"
        extra = self.extra() if self.extra else ""
        return text + (f", {extra}" if extra else "")

    def _sample(self) -> None:
        try:
            self.done = self.poll()
        except Exception:  # a broker restarting: keep the last count
            pass

    def _run(self) -> None:
        interval = 0.5 if self.tty else self.every
        while not self._stop.wait(interval):
            self._sample()
            self._print(self.line(), final=False)

    def _print(self, text: str, *, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        self._sample()
        self._base = self.done
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        self._print(self.line() + (" (failed)" if exc[0] else " (done)"), final=True)
