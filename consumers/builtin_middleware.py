"""The runner's own metrics and failure log lines, as middleware: ``MetricsMiddleware`` and ``LoggingMiddleware``.

Every ``Runner`` puts ``default_middleware()`` outermost in every consumer's chain (after
``TracingMiddleware`` when tracing adds it, so their lines belong to the span's trace): they are
``runner.middleware[...]`` like any other, and ``Runner(default_middleware=[...])`` replaces them,
``default_middleware=()`` drops them (dramatiq's ``default_middleware``). Without ``MetricsMiddleware`` the
runner records no ``conveyor_runner_messages_total``, retries, invalid messages or handler durations (it still
counts what it holds, new groups replaying, and middleware errors: those are the runner's, not the handlers');
without ``LoggingMiddleware`` no line is logged for a retry, a give-up or a message that does not decode.

Neither has a per-message hook, so they cost what the runner's own code did: ``MetricsMiddleware`` records a
whole chunk at once from ``after_chunk`` (called on the runner's I/O thread once the chunk is settled), and
``LoggingMiddleware`` writes from ``on_failure``, called only for handler calls that failed.
"""

from __future__ import annotations

import logging
from typing import Any

from conveyor.consumers.middleware import ChunkSummary, Failure
from conveyor.decorators.exceptions import InvalidMessage, Nack, Reject
from conveyor.monitoring.metrics import RunnerMetrics, observe_many

log = logging.getLogger("conveyor.runner")

OUTCOMES = ("ok", "retried", "dead_lettered", "failed")


class MetricsMiddleware:
    """``conveyor_runner_messages_total`` by outcome, retries, invalid messages and handler durations, per chunk."""

    def __init__(self) -> None:
        self.metrics: RunnerMetrics | None = None
        self._labels: dict[int, tuple[str, str, str]] = {}

    def on_start(self, runner: Any) -> None:
        """Show every handler's series in /metrics (and dashboards) before its first message."""
        self.metrics = runner.metrics
        for consumer in runner.consumers:
            self._declare(consumer)

    def after_chunk(self, consumer: Any, summary: ChunkSummary) -> None:
        m = self.metrics
        if m is None:  # not started by a runner
            return
        labels = self._labels.get(id(consumer)) or self._declare(consumer)
        for outcome, count in (
            ("ok", summary.ok),
            ("retried", summary.retried),
            ("dead_lettered", summary.dead_lettered),
            ("failed", summary.failed),
        ):
            if count:
                m.handled.labels(*labels, outcome).inc(count)
        if summary.retried:
            m.retries.labels(*labels).inc(summary.retried)
        if summary.invalid:
            m.invalid.labels(*labels).inc(summary.invalid)
        observe_many(m.duration.labels(*labels), summary.durations)

    def _declare(self, consumer: Any) -> tuple[str, str, str]:
        labels = self._labels[id(consumer)] = (consumer.name, consumer.topic, consumer.group)
        m = self.metrics
        assert m is not None
        for outcome in OUTCOMES:
            m.handled.labels(*labels, outcome)
        m.retries.labels(*labels)
        m.invalid.labels(*labels)
        m.duration.labels(*labels)
        return labels


class LoggingMiddleware:
    """A warning for each retry the retry policy schedules, an error (with the traceback) for each give-up,
    a warning for each message that does not decode; on the logger ``conveyor.runner``, inside the lane, so
    ``--log-format json`` lines carry the handled messages' topic, group, offset, attempt and trace id."""

    def on_failure(self, consumer: Any, messages: list[Any], failure: Failure) -> None:
        exc = failure.exc
        if isinstance(exc, InvalidMessage):
            for message in messages:
                log.warning(
                    "%s: %s offset %d does not decode, dead-lettered without retry: %s",
                    consumer.name,
                    message.topic,
                    message.offset,
                    exc.error,
                )
        elif isinstance(exc, Nack | Reject):
            return  # the handler asked for it: nothing went wrong
        elif failure.retry:
            log.warning(
                "%s failed on attempt %d (%s: %s); again in %d ms",
                consumer.name,
                failure.attempt,
                type(exc).__name__,
                exc,
                failure.delay_ms,
            )
        else:
            log.error("%s gave up on attempt %d: %s", consumer.name, failure.attempt, failure.reason, exc_info=exc)


def default_middleware() -> list[Any]:
    """What every runner starts with, outermost first, unless told otherwise (``Runner(default_middleware=)``)."""
    return [MetricsMiddleware(), LoggingMiddleware()]
