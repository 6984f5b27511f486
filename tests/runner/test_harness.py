"""``conveyor.testing.run_consumers``, tested by using it: real broker, real runner, real handlers.

The broker is the session's shared one; each ``with`` runs on fresh topic and group names.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from conveyor.consumers.builtin_middleware import LoggingMiddleware, MetricsMiddleware
from conveyor.consumers.middleware import ChunkSummary, Failure, Hooks

from conveyor import Message, consumer, error_handler, publish, retry_policy
from conveyor.testing import run_consumers
from tests.helpers import wait_for

seen: list[dict[str, int]] = []
attempts: dict[int, int] = {}
given_up: list[tuple[int, str]] = []


@consumer("orders")
def bill(message: Message) -> None:
    seen.append(message.value)


@retry_policy(max_attempts=3, initial_delay=0.01, max_delay=0.05)
@consumer("orders")
def flaky(message: Message) -> None:
    """Fails the first attempt of every message, then succeeds."""
    order = message.value["id"]
    attempts[order] = attempts.get(order, 0) + 1
    if attempts[order] == 1:
        raise ConnectionError("the billing API is down")


@retry_policy(max_attempts=2, initial_delay=0.01, max_delay=0.05)
@consumer("payments")
def always_fails(message: Message) -> None:
    raise ValueError(f"card declined for order {message.value['id']}")


@error_handler(always_fails)
def alert(message: Message, exc: BaseException) -> None:
    given_up.append((message.value["id"], str(exc)))


@dataclass
class Order:
    id: int
    total: float


typed_orders: list[Order] = []


@consumer("typed-orders")
def ship(order: Order) -> None:
    typed_orders.append(order)


async_seen: list[int] = []


@consumer("async-orders")
async def bill_async(message: Message) -> None:
    async_seen.append(message.value["id"])


@consumer("orders")
def forward(message: Message) -> None:
    publish("shipments", {"id": message.value["id"]}).result(timeout=30)


class _Seen:
    """The module's own middleware, as `conveyor run tests.runner.test_harness` would wrap its consumers in."""

    def __init__(self) -> None:
        self.topics: list[str] = []

    def before_handle(self, message: Message) -> None:
        self.topics.append(message.topic)


middleware = [_Seen()]


@pytest.fixture(autouse=True)
def _forget() -> None:
    middleware[0].topics.clear()
    seen.clear()
    attempts.clear()
    given_up.clear()
    typed_orders.clear()
    async_seen.clear()


def test_a_handled_message_reaches_its_handler() -> None:
    with run_consumers(bill) as app:
        app.publish("orders", {"id": 1})
        handled = app.wait_handled(bill, count=1)
        assert seen == [{"id": 1}]
        assert handled[0].topic == app.topic("orders") != "orders"
        assert app.dead_letters("orders", count=0) == []


def test_each_with_sees_only_its_own_messages() -> None:
    with run_consumers(bill) as app:
        app.publish("orders", {"id": 1})
        app.wait_handled(bill, count=1)
    with run_consumers(bill) as app:
        app.publish("orders", {"id": 2})
        app.wait_handled(bill, count=1)
        assert [m.value for m in app.handled(bill)] == [{"id": 2}]
    assert seen == [{"id": 1}, {"id": 2}]


def test_a_retry_then_success() -> None:
    with run_consumers(flaky) as app:
        app.publish("orders", {"id": 7})
        app.wait_handled(flaky, count=1)
        assert attempts == {7: 2}
        assert len(app.retried(flaky)) == 1
        assert [type(e) for e in app.errors(flaky)] == [ConnectionError]
        assert app.dead_lettered(flaky) == []


def test_a_dead_letter_after_retries_calls_the_error_handler() -> None:
    with run_consumers(always_fails) as app:
        app.publish("payments", {"id": 9})
        app.wait_dead_lettered(always_fails, count=1)
        assert given_up == [(9, "card declined for order 9")]
        assert len(app.retried(always_fails)) == 1  # attempt 1 retried, attempt 2 gave up
        [dead] = app.dead_letters("payments", count=1)
        assert dead.value == {"id": 9}
        assert dead.topic == app.topic("payments.dlq")
        assert "card declined" in " ".join(dead.headers.values())


def test_a_typed_handler_receives_its_model() -> None:
    with run_consumers(ship) as app:
        app.publish("typed-orders", {"id": 3, "total": 12.5})
        app.wait_handled(ship, count=1)
        assert typed_orders == [Order(id=3, total=12.5)]


def test_a_message_that_does_not_decode_is_dead_lettered_without_retry() -> None:
    with run_consumers(ship) as app:
        app.publish("typed-orders", {"id": "not a number"})
        app.wait_dead_lettered(ship, count=1)
        assert app.retried(ship) == [] and typed_orders == []
        [dead] = app.dead_letters("typed-orders", count=1)
        assert dead.value == {"id": "not a number"}


def test_an_async_handler() -> None:
    with run_consumers(bill_async) as app:
        app.publish("async-orders", {"id": 5})
        app.wait_handled(bill_async, count=1)
        assert async_seen == [5]


def test_a_module_runs_all_its_consumers() -> None:
    with run_consumers(sys.modules[__name__]) as app:
        app.publish("orders", {"id": 6})
        for handler in (bill, flaky, forward):  # three groups of one topic: each gets the message
            app.wait_handled(handler, count=1)
        assert seen == [{"id": 6}]
        # the module's `middleware` runs, as with conveyor run (flaky's two attempts: 4 calls)
        assert middleware[0].topics == [app.topic("orders")] * 4
    middleware[0].topics.clear()
    with run_consumers("tests.runner.test_harness:bill") as app:
        app.publish("orders", {"id": 7})
        app.wait_handled(bill, count=1)
        assert middleware[0].topics == [app.topic("orders")]
    with run_consumers(bill) as app:  # a function alone: no module's middleware
        app.publish("orders", {"id": 8})
        app.wait_handled(bill, count=1)
        assert len(middleware[0].topics) == 1


def test_what_a_handler_publishes_stays_under_the_prefix() -> None:
    with run_consumers(forward) as app:
        app.publish("orders", {"id": 4})
        app.wait_handled(forward, count=1)
        [shipment] = app.messages("shipments", count=1)
        assert shipment.value == {"id": 4}
        assert shipment.topic == app.topic("shipments")


def test_publish_takes_the_delivery_times_and_the_partition_as_send_does() -> None:
    with run_consumers(bill) as app:
        app.publish("orders", {"id": 11}, delay=0.2, ttl=60, partition=0)
        [handled] = app.wait_handled(bill, count=1)
        assert handled.not_before is not None and handled.expires is not None
        assert handled.expires - handled.not_before > 50


def test_the_pytest_fixture_is_run_consumers(conveyor_consumers: Callable[..., Any]) -> None:
    assert conveyor_consumers is run_consumers


def test_a_handler_test_after_the_first_takes_well_under_a_second() -> None:
    with run_consumers(bill) as app:  # warm-up: the session's broker is up after this
        app.publish("orders", {"id": 0})
        app.wait_handled(bill)
    times = []
    for i in range(3):
        started = time.perf_counter()
        with run_consumers(bill) as app:
            app.publish("orders", {"id": i})
            app.wait_handled(bill)
        times.append(time.perf_counter() - started)
    print(f"run_consumers with-block after warm-up: {', '.join(f'{t * 1000:.0f} ms' for t in times)}")
    assert max(times) < 1.5  # generous for loaded CI machines; typically far less


class _Chunks:
    """A middleware of the two chunk- and failure-level hooks only: it costs no call per message."""

    def __init__(self) -> None:
        self.summaries: list[ChunkSummary] = []
        self.failures: list[Failure] = []

    def after_chunk(self, consumer: Any, summary: ChunkSummary) -> None:
        self.summaries.append(summary)

    def on_failure(self, consumer: Any, messages: list[Message], failure: Failure) -> None:
        self.failures.append(failure)


def _total(summaries: list[ChunkSummary], outcome: str) -> int:
    return sum(getattr(s, outcome) for s in list(summaries))


def _handled_total(app: Any, handler: Any, outcome: str) -> float | None:
    c = app.consumer(handler)
    labels = {"handler": c.name, "topic": c.topic, "group": c.group, "outcome": outcome}
    return app.runner.registry.get_sample_value("conveyor_runner_messages_total", labels)


def test_a_middleware_sees_each_settled_chunk_and_each_failure_and_the_builtins_count_and_log(caplog) -> None:
    chunks = _Chunks()
    assert not Hooks([chunks]).each_message, "no per-message call for it"
    caplog.set_level(logging.WARNING, logger="conveyor.runner")
    with run_consumers(flaky, middleware=[chunks]) as app:
        assert [type(m) for m in app.runner.middleware[:2]] == [MetricsMiddleware, LoggingMiddleware]
        app.publish("orders", {"id": 21})
        app.wait_handled(flaky, count=1)
        wait_for(lambda: _total(chunks.summaries, "ok") == 1, message="the chunk of the second attempt")
        assert _total(chunks.summaries, "retried") == 1
        assert len([d for s in chunks.summaries for d in s.durations]) == 2
        [failure] = chunks.failures
        assert isinstance(failure.exc, ConnectionError) and failure.retry and failure.attempt == 1
        wait_for(lambda: _handled_total(app, flaky, "ok") == 1, message="counted by MetricsMiddleware")
        assert _handled_total(app, flaky, "retried") == 1
    assert any(
        "failed on attempt 1 (ConnectionError: the billing API is down); again in" in r.getMessage()
        for r in caplog.records
    ), "logged by LoggingMiddleware"


def test_without_the_default_middleware_the_runner_neither_counts_nor_logs_handled_messages(caplog) -> None:
    chunks = _Chunks()
    caplog.set_level(logging.WARNING, logger="conveyor.runner")
    with run_consumers(flaky, middleware=[chunks], default_middleware=()) as app:
        assert app.runner.middleware == [chunks]
        app.publish("orders", {"id": 22})
        app.wait_handled(flaky, count=1)
        wait_for(lambda: _total(chunks.summaries, "ok") == 1, message="settled")
        for outcome in ("ok", "retried", "dead_lettered", "failed"):
            assert _handled_total(app, flaky, outcome) is None
        assert app.runner.registry.get_sample_value("conveyor_runner_retries_total", {}) is None
    assert not [r for r in caplog.records if "failed on attempt" in r.getMessage()]
