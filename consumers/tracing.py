"""Tracing in the runner: a CONSUMER span ``process <topic>`` around each message's handler.

``TracingMiddleware`` extracts the trace context the producer put in the message's
headers (``conveyor.broker.client.tracing``), opens the span as its child with the
messaging attributes (system ``conveyor``, topic, partition, consumer group, message
id ``topic/partition/offset``, offset, attempt, correlation id), and makes it current
while the handler runs: what the handler publishes with ``conveyor.publish()``, and
any span or log line it makes, belongs to the same trace. The span ends when the
message is settled: acked (after what it published was confirmed), or failed, with
the exception recorded, ERROR status and ``error.type``.

The runner puts it first in its middleware (outermost: the others' hooks and log
lines run inside the span) when an OpenTelemetry ``TracerProvider`` is configured as
it starts (``with_tracing``); give it yourself (``--middleware
conveyor.consumers.tracing:TracingMiddleware``) to have it regardless. Without
opentelemetry installed it is never added, and a runner pays nothing.
``conveyor run --trace console`` configures the provider itself (``configure``):
each span printed as one JSON line on stdout, for development and examples.

A span is current from ``before_handle`` until its message's ending hook, or until
the lane's next message starts: a plain handler's messages that published wait for
their confirms together at the end of the lane's chunk, so their spans end later
than the next handler call begins. A batch handler runs inside the span of its
batch's last message; every message of the batch still has its own span.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from conveyor.broker.client.tracing import Tracing, fail_span, process_attributes, tracing
from conveyor.consumers.context import current_consumer

from conveyor.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

# The message whose span this lane (its thread, or its task) made current, and the token that undoes it.
_attached: contextvars.ContextVar[tuple[Any, contextvars.Token[Context]] | None] = contextvars.ContextVar(
    "conveyor_tracing_attached", default=None
)


class TracingMiddleware:
    """One CONSUMER span per handled message, a child of the producer's span, current while its handler runs."""

    def __init__(self) -> None:
        api = tracing()
        if api is None:
            raise RuntimeError("TracingMiddleware needs OpenTelemetry: pip install 'conveyor[otel]'")
        self.api: Tracing = api
        self._spans: dict[int, tuple[Any, Span]] = {}  # id(message) -> (message, its open span)

    def before_handle(self, message: Any) -> None:
        self._detach()  # the lane's previous message is done running (its span may wait for confirms)
        tracer = self.api.tracer()
        if tracer is None:  # the provider went away (a test's reset): nothing to record
            return
        try:
            headers = message.headers
        except Exception:  # headers that do not decode: a new trace
            headers = None
        consumer = current_consumer()
        span = tracer.start_span(
            f"process {message.topic}",
            context=self.api.extract(headers),
            kind=self.api.consumer_kind,
            attributes=process_attributes(message, getattr(consumer, "group", None)),
        )
        self._spans[id(message)] = (message, span)
        token = self.api.context.attach(self.api.trace.set_span_in_context(span))
        _attached.set((message, token))

    def after_handle(self, message: Any, result: Any) -> None:
        self._end(message, None)

    def on_error(self, message: Any, exc: BaseException) -> None:
        self._end(message, exc)

    def on_stop(self, runner: Any) -> None:
        """Spans of messages whose handlers never came back (abandoned at the graceful timeout) end now,
        so the exporter still gets them."""
        for _, span in list(self._spans.values()):
            span.set_attribute("messaging.conveyor.abandoned", True)
            span.end()
        self._spans.clear()

    def _end(self, message: Any, exc: BaseException | None) -> None:
        entry = self._spans.pop(id(message), None)
        if entry is None or entry[0] is not message:  # no span (the broker dead-lettered it unseen)
            return
        span = entry[1]
        if exc is not None:
            fail_span(span, exc)
        span.end()
        attached = _attached.get()
        if attached is not None and attached[0] is message:
            self._detach()

    def _detach(self) -> None:
        attached = _attached.get()
        if attached is not None:
            _attached.set(None)
            self.api.context.detach(attached[1])


def with_tracing(middleware: list[Any], consumers_own: Iterable[Any] = ()) -> list[Any]:
    """The runner's middleware, with ``TracingMiddleware`` first when opentelemetry is installed, a
    TracerProvider is configured now, and none was given (to the runner, or to a consumer: ``consumers_own``,
    where a class may stand for its instance); else ``middleware`` as it is."""
    if any(isinstance(m, TracingMiddleware) or m is TracingMiddleware for m in (*middleware, *consumers_own)):
        return middleware
    api = tracing()
    if api is None or api.tracer() is None:
        return middleware
    return [TracingMiddleware(), *middleware]


TRACE_CHOICES = ("off", "console")  # conveyor run --trace
CONSOLE_DELAY_MS = 500  # how long the console exporter lets spans gather before it prints them


def configure(exporter: str) -> None:
    """``--trace console``: a global SDK TracerProvider that prints each span as one JSON line on stdout,
    from a background thread (flushed when the process exits). ``off``: conveyor configures nothing (a
    provider the application sets is used all the same)."""
    if exporter == "off":
        return
    if exporter != "console":
        raise ConfigError(f"--trace must be one of {', '.join(TRACE_CHOICES)}, not {exporter!r}")
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise ConfigError(
            "--trace console needs OpenTelemetry's SDK: pip install 'conveyor[otel]' opentelemetry-sdk"
        ) from None
    provider = TracerProvider()  # its resource from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    console = ConsoleSpanExporter(formatter=_one_line)
    provider.add_span_processor(BatchSpanProcessor(console, schedule_delay_millis=CONSOLE_DELAY_MS))
    trace.set_tracer_provider(provider)


def _one_line(span: Any) -> str:
    return str(span.to_json(indent=None)) + "\n"
