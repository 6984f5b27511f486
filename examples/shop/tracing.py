"""Tracing for the shop: OpenTelemetry spans printed to the console, one line each.

Set the standard ``OTEL_TRACES_EXPORTER=console`` (``make example`` does) with
``opentelemetry-sdk`` installed, and ``setup()`` configures a ``TracerProvider`` that
prints every span as it ends. Conveyor does the rest (README, "Tracing"): the producer
opens a ``send <topic>`` span and puts its context in the message's headers, the
runner opens a ``process <topic>`` span per message as its child, and what a handler
publishes continues the same trace. So one order is one trace across the processes::

    place_orders: checkout ord-0004 ─▶ send shop.orders
    runner:         process shop.orders ─▶ charge ord-0004 (GatewayTimeout: ERROR)
                    process shop.orders ─▶ charge ord-0004 ─▶ send shop.invoices   (the retry)
                    process shop.invoices                                          (notify)

Without the variable, or without the SDK, nothing is configured and ``span()`` is a
no-op: the shop runs the same, untraced. Configuring it only when asked, and not on
import alone, also keeps a test process that imports the handlers free to set its own
provider (OpenTelemetry allows one per process).
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

log = logging.getLogger("examples.shop")

_tracer: Any = None  # the shop's tracer once setup() configured a provider


def setup(service: str) -> bool:
    """A console-printing ``TracerProvider`` for ``service`` when ``OTEL_TRACES_EXPORTER=console``; True if set."""
    global _tracer
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() != "console":
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER=console needs opentelemetry-sdk: pip install 'conveyor[otel]' opentelemetry-sdk"
        )
        return False
    if _tracer is None:
        # One provider per process: one set already (`conveyor run --trace console`) is used as it is.
        if not isinstance(trace.get_tracer_provider(), TracerProvider):
            name = os.environ.get("OTEL_SERVICE_NAME") or service
            provider = TracerProvider(resource=Resource.create({"service.name": name}))
            # Simple, not batched: each span prints as it ends, between the log lines it belongs with.
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(formatter=one_line)))
            trace.set_tracer_provider(provider)
        _tracer = trace.get_tracer("examples.shop")
    return True


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A span of the shop's own around a block (a no-op while tracing is off)."""
    if _tracer is None:
        return nullcontext()
    return _tracer.start_as_current_span(name, attributes=attributes)


def one_line(span: Any) -> str:
    """``trace <id> span <id> parent <id|->  <name> (<kind>, <ms> ms[, ERROR ...])``: a span, short enough to read."""
    context = span.get_span_context()
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else "-" * 16
    took_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
    status = span.status.status_code.name
    error = f", ERROR {span.status.description or ''}".rstrip() if status == "ERROR" else ""
    kind = span.kind.name
    return (
        f"trace {context.trace_id:032x} span {context.span_id:016x} parent {parent}  "
        f"{span.name} ({kind}, {took_ms:.1f} ms{error})\n"
    )
