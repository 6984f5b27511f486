"""OpenTelemetry tracing (issue #20): one trace from a producer through a handler to what it publishes.

In-process runs use the real runner and a real broker (``run_consumers``) with the SDK's
``InMemorySpanExporter``; a ``conveyor run`` subprocess prints its spans with the console
exporter and its JSON log lines name the span they were made in. Without opentelemetry
installed (hidden in a subprocess), producers and the runner work as before and import nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from conveyor.broker.client.tracing import process_attributes, send_attributes
from conveyor.consumers.tracing import TracingMiddleware, with_tracing
from conveyor.decorators import consumer, retry_policy
from conveyor.monitoring import logs
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from conveyor import Admin, AsyncProducer, Message, Producer, publish
from conveyor.testing import run_consumers
from tests.helpers import publish as send
from tests.helpers import wait_for
from tests.runner.runner_helpers import RunnerProcess


def set_global_provider(provider: TracerProvider | None) -> None:
    """opentelemetry lets a process set its TracerProvider once; a test sets and removes it, as opentelemetry's
    own test utilities do, so the tests after it run without tracing."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_provider(provider)
    try:
        yield exporter
    finally:
        set_global_provider(None)
        provider.shutdown()


def finished(exporter: InMemorySpanExporter, *names: str) -> dict[str, list[ReadableSpan]]:
    """Wait until a span of each name has ended; every ended span by name."""

    def by_name() -> dict[str, list[ReadableSpan]] | None:
        spans: dict[str, list[ReadableSpan]] = {}
        for span in exporter.get_finished_spans():
            spans.setdefault(span.name, []).append(span)
        return spans if all(name in spans for name in names) else None

    return wait_for(by_name, 30, message=f"spans {names}")


def parent_of(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.parent is not None and parent.context is not None and child.context is not None
    return child.parent.span_id == parent.context.span_id and child.context.trace_id == parent.context.trace_id


# --- the handlers --------------------------------------------------------------------------------


@consumer("orders", group="billing")
def bill(message: Any) -> None:
    publish("invoices", {"order": message.value["id"]})


@consumer("invoices", group="mailer")
def mail(message: Any) -> None:
    pass


@consumer("payments", group="settle")
@retry_policy(max_attempts=2, initial_delay=0.01, max_delay=0.05)
def settle(message: Any) -> None:
    raise ValueError(f"card declined on attempt {message.attempt}")


@consumer("async-orders", group="async-billing")
async def bill_async(message: Any) -> None:
    publish("async-invoices", {"order": message.value["id"]})


@consumer("async-invoices", group="async-mailer")
async def mail_async(message: Any) -> None:
    pass


entered, release = threading.Event(), threading.Event()


@consumer("stuck", group="stuck")
def stuck(message: Any) -> None:
    entered.set()
    release.wait(60)


# --- in-process: the real runner, the in-memory exporter --------------------------------------------


def test_one_trace_runs_from_the_producer_through_the_handler_to_what_it_publishes(exporter):
    with run_consumers(bill, mail) as app:
        orders, invoices = app.topic("orders"), app.topic("invoices")
        with trace.get_tracer("test").start_as_current_span("checkout"):
            offset = app.publish("orders", {"id": 7})
        app.wait_handled(mail)
        spans = finished(exporter, f"process {orders}", f"process {invoices}")
    (checkout,) = spans["checkout"]
    (send_order,) = spans[f"send {orders}"]
    (process_order,) = spans[f"process {orders}"]
    (send_invoice,) = spans[f"send {invoices}"]
    (process_invoice,) = spans[f"process {invoices}"]
    chain = [checkout, send_order, process_order, send_invoice, process_invoice]
    assert len({span.context.trace_id for span in chain if span.context}) == 1
    for parent, child in itertools.pairwise(chain):
        assert parent_of(child, parent), (child.name, parent.name)
    assert [span.kind for span in chain[1:]] == [SpanKind.PRODUCER, SpanKind.CONSUMER] * 2
    assert dict(send_order.attributes or {}) == {
        "messaging.system": "conveyor",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": orders,
        "messaging.destination.partition.id": "0",
        "messaging.message.id": f"{orders}/0/{offset}",  # set when the broker confirmed it
    }
    assert dict(process_order.attributes or {}) == {
        "messaging.system": "conveyor",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": orders,
        "messaging.destination.partition.id": "0",
        "messaging.consumer.group.name": app.consumer(bill).group,
        "messaging.message.id": f"{orders}/0/{offset}",
        "messaging.conveyor.offset": offset,
        "messaging.conveyor.attempt": 1,
    }
    # the handler's publish carries the correlation id: the conversation the spans name
    assert (send_invoice.attributes or {})["messaging.message.conversation_id"] == f"{orders}/0/{offset}"
    assert (process_invoice.attributes or {})["messaging.consumer.group.name"] == app.consumer(mail).group
    assert all(span.status.status_code is StatusCode.UNSET for span in chain)


def test_a_failing_handler_records_the_exception_on_each_attempts_span(exporter):
    with run_consumers(settle) as app:
        payments = app.topic("payments")
        app.publish("payments", "pay 10")
        app.wait_dead_lettered(settle)
        spans = finished(exporter, f"process {payments}")
        spans = wait_for(lambda: len(s := finished(exporter)[f"process {payments}"]) >= 2 and s, 30, message="2")
    (send,) = finished(exporter)[f"send {payments}"]
    assert sorted((s.attributes or {})["messaging.conveyor.attempt"] for s in spans) == [1, 2]
    for span in spans:
        assert parent_of(span, send)
        assert span.status.status_code is StatusCode.ERROR
        assert "ValueError: card declined" in (span.status.description or "")
        assert (span.attributes or {})["error.type"] == "builtins.ValueError"
        assert [event.name for event in span.events] == ["exception"]


def test_an_async_handler_publishes_inside_its_span(exporter):
    with run_consumers(bill_async, mail_async) as app:
        orders, invoices = app.topic("async-orders"), app.topic("async-invoices")
        app.publish("async-orders", {"id": 1})  # no span current: the producer's span starts the trace
        app.wait_handled(mail_async)
        spans = finished(exporter, f"process {orders}", f"process {invoices}")
    chain = [spans[f"send {orders}"][0], spans[f"process {orders}"][0], spans[f"send {invoices}"][0]]
    chain.append(spans[f"process {invoices}"][0])
    assert chain[0].parent is None
    for parent, child in itertools.pairwise(chain):
        assert parent_of(child, parent), (child.name, parent.name)


def test_the_span_of_a_handler_abandoned_at_shutdown_ends_when_the_runner_stops(exporter):
    try:
        with run_consumers(stuck, graceful_timeout=0.2) as app:
            topic = app.topic("stuck")
            app.publish("stuck", b"x")
            assert entered.wait(30)
        (span,) = finished(exporter, f"process {topic}")[f"process {topic}"]
        assert (span.attributes or {})["messaging.conveyor.abandoned"] is True
    finally:
        release.set()


def test_the_runner_adds_tracing_only_when_a_tracer_provider_is_configured(exporter):
    ours = TracingMiddleware()
    assert with_tracing([ours]) == [ours]
    added = with_tracing([])
    assert len(added) == 1 and isinstance(added[0], TracingMiddleware)
    assert with_tracing([], [TracingMiddleware]) == []  # a consumer has it already: not twice
    set_global_provider(None)
    assert with_tracing([]) == []


def test_send_many_has_one_span_and_every_message_its_context(exporter, conveyor_broker):
    with Producer(conveyor_broker.address, linger_ms=0) as producer:
        futures = producer.send_many("traced-many", [b"a", b"b", b"c"], headers={"h": "1"})
        offsets = [f.result(timeout=30) for f in futures]
    (span,) = finished(exporter, "send traced-many")["send traced-many"]
    assert (span.attributes or {})["messaging.batch.message_count"] == 3
    with Admin(conveyor_broker.address) as admin:
        stored = admin.fetch("traced-many", offsets[0], 3)
    assert span.context is not None
    for message in stored:
        assert message.headers["h"] == "1"
        ids = span.context
        assert message.headers["traceparent"] == f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"


def test_the_async_producer_opens_a_span_that_ends_with_the_confirm(exporter, conveyor_broker):
    async def produce() -> int:
        async with AsyncProducer(conveyor_broker.address, linger_ms=0) as producer:
            return int(await producer.send_and_wait("traced-async", b"a"))

    offset = asyncio.run(produce())
    (span,) = finished(exporter, "send traced-async")["send traced-async"]
    assert span.kind is SpanKind.PRODUCER
    assert (span.attributes or {})["messaging.message.id"] == f"traced-async/0/{offset}"
    with Admin(conveyor_broker.address) as admin:
        (stored,) = admin.fetch("traced-async", offset, 1)
    assert span.context is not None and f"{span.context.span_id:016x}" in stored.headers["traceparent"]


def test_without_a_provider_the_producer_adds_nothing_even_under_a_current_context(conveyor_broker):
    """No SDK, no per-message work: a context made current by someone else is not looked for (that cost
    1.7 µs per send, more than the send) and the headers go as given."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    remote = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True, TraceFlags(1))
    with Producer(conveyor_broker.address, linger_ms=0) as producer:
        assert producer.send.__func__ is Producer.send  # not wrapped: nothing at all per message
        plain = producer.send("untraced", b"plain").result(timeout=30)
        with trace.use_span(NonRecordingSpan(remote)):
            given = producer.send("untraced", b"given", headers={"a": "b"}).result(timeout=30)
            many = producer.send_many("untraced", [b"m"], headers={"c": "d"})[0].result(timeout=30)
    with Admin(conveyor_broker.address) as admin:
        first, second, third = admin.fetch("untraced", plain, 3)
    assert first.headers == {}
    assert second.headers == {"a": "b"}
    assert third.headers == {"c": "d"}
    assert (given, many) == (plain + 1, plain + 2)


def test_a_span_the_sampler_leaves_out_sends_its_context_unsampled_and_records_nothing(conveyor_broker):
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_provider(provider)
    try:
        with Producer(conveyor_broker.address, linger_ms=0) as producer:
            offset = producer.send("unsampled", b"x").result(timeout=30)
    finally:
        set_global_provider(None)
        provider.shutdown()
    with Admin(conveyor_broker.address) as admin:
        (stored,) = admin.fetch("unsampled", offset, 1)
    flags = int(stored.headers["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # not sampled: the consumers' spans are left out too
    assert exporter.get_finished_spans() == ()


def test_log_records_made_inside_a_span_carry_its_ids(exporter):
    logs.install_record_factory()
    with trace.get_tracer("test").start_as_current_span("work") as span:
        record = logging.getLogRecordFactory()("app", logging.INFO, __file__, 1, "inside", (), None)
    outside = logging.getLogRecordFactory()("app", logging.INFO, __file__, 1, "outside", (), None)
    fields = logs.record_fields(record)
    assert fields["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert fields["span_id"] == f"{span.get_span_context().span_id:016x}"
    assert "trace_id" not in logs.record_fields(outside) and "span_id" not in logs.record_fields(outside)


def test_the_attributes_follow_the_messaging_conventions():
    message = Message("orders", 5, 0.0, None, {"x-correlation-id": "orders/0/1"}, b"", attempt=3, partition=2)
    assert process_attributes(message, "billing") == {
        "messaging.system": "conveyor",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "2",
        "messaging.consumer.group.name": "billing",
        "messaging.message.id": "orders/2/5",
        "messaging.conveyor.offset": 5,
        "messaging.conveyor.attempt": 3,
        "messaging.message.conversation_id": "orders/0/1",
    }
    assert send_attributes("orders", None, partition=1, count=4) == {
        "messaging.system": "conveyor",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "1",
        "messaging.batch.message_count": 4,
    }


# --- a real `conveyor run --trace console` process: spans and log lines, one JSON object a line ----------

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def test_a_runner_process_prints_its_spans_and_its_json_log_lines_name_them(conveyor_broker, tmp_path):
    args = ["--log-format", "json", "--trace", "console"]
    runner = RunnerProcess(conveyor_broker.address, tmp_path, "app_tracing", args=args)
    try:
        send(conveyor_broker.address, "traced-orders", ["order 1"], headers={"traceparent": TRACEPARENT})
        wait_for(lambda: any('"process traced-invoices"' in line for line in runner.lines), 30, message="spans")
    finally:
        runner.terminate()
        assert runner.wait(60) == 0, "".join(runner.lines)
    lines = [json.loads(line) for line in runner.lines]  # spans and log lines alike: one JSON object each
    spans = {span["name"]: span for span in lines if "context" in span}
    process_order, send_invoice = spans["process traced-orders"], spans["send traced-invoices"]
    process_invoice = spans["process traced-invoices"]
    assert {span["context"]["trace_id"] for span in spans.values()} == {f"0x{TRACE}"}
    assert process_order["parent_id"] == "0x00f067aa0ba902b7"  # the producer's traceparent
    assert send_invoice["parent_id"] == process_order["context"]["span_id"]
    assert process_invoice["parent_id"] == send_invoice["context"]["span_id"]
    assert process_order["kind"] == "SpanKind.CONSUMER"
    assert process_order["attributes"]["messaging.consumer.group.name"] == "traced-billing"
    logged = {line["message"]: line for line in lines if "level" in line}
    billing, mailing = logged["billing order 1"], logged["mailing order 1"]
    assert (billing["trace_id"], "0x" + billing["span_id"]) == (TRACE, process_order["context"]["span_id"])
    assert (mailing["trace_id"], "0x" + mailing["span_id"]) == (TRACE, process_invoice["context"]["span_id"])
    assert (billing["topic"], billing["group"]) == ("traced-orders", "traced-billing")


# --- without opentelemetry ------------------------------------------------------------------------

HIDDEN = """
import sys
sys.modules["opentelemetry"] = None  # as if it were not installed: importing it raises ImportError
import logging
from conveyor import Producer
from conveyor.consumers.tracing import with_tracing
from conveyor.monitoring import logs

with Producer(sys.argv[1], linger_ms=0) as producer:
    assert "send" not in vars(producer) and "send_many" not in vars(producer)  # the class's own methods
    offset = producer.send("untraced-hidden", b"x", headers={"a": "b"}).result(timeout=30)
assert with_tracing([]) == []
logs.install_record_factory()
assert logs.current_span_ids() is None
assert logs.record_fields(logging.getLogRecordFactory()("a", 20, "f", 1, "m", (), None)).keys() == {
    "time", "level", "logger", "message"}
assert not [name for name in sys.modules if name.startswith("opentelemetry") and sys.modules[name] is not None]
print("ok", offset)
"""


def test_without_opentelemetry_producers_and_the_runner_work_and_import_nothing(conveyor_broker):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HIDDEN), conveyor_broker.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok ")
