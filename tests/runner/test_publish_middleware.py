"""Publishing from handlers and middleware, with a real `conveyor run` process and a real broker (issue #20).

A handler's ``conveyor.publish()`` goes through the runner's producer, linked to the handled message by
x-correlation-id and x-causation-id; the handled message is acked only once what it published is confirmed.
Middleware hooks run in order around success, retry, error and dead letter, and at the runner's start and stop;
one that raises is logged and counted, and handling goes on.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from typing import Any

from conveyor.consumers.context import Publisher, PublishFailed, context, link_headers
from conveyor.consumers.lanes import Report, ThreadLane
from conveyor.consumers.middleware import Hooks, Middleware
from conveyor.decorators import consumer

from conveyor import Admin, Message, Producer
from conveyor.testing import scrape_metric
from tests.helpers import publish, wait_for
from tests.runner.runner_helpers import RunnerProcess


def rows(out, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fetched(address: str, topic: str, count: int) -> list[Message]:
    def fetch() -> list[Message]:
        with Admin(address) as admin:
            try:
                return admin.fetch(topic, 0, 100)
            except Exception:
                return []

    return wait_for(lambda: len(found := fetch()) >= count and found, 30, message=f"{count} messages in {topic}")


def committed(address: str, topic: str, group: str) -> int:
    with Admin(address) as admin:
        return int(admin.describe_group(topic, group)["committed_offset"])


def runner_metric(proc: RunnerProcess, name: str, labels: str = "") -> float:
    url = next(m.group(1) for line in proc.lines if (m := re.search(r"metrics (http://\S+)\)", line)))
    return scrape_metric(url, name, labels)


# --- real runner ---------------------------------------------------------------------------------


def test_a_handler_publishes_linked_messages_and_its_message_is_acked_only_once_they_are_confirmed(
    conveyor_broker, tmp_path
):
    address = conveyor_broker.address
    with Admin(address) as admin:  # the guarded handler's target refuses every publish for now
        admin.create_topic("pub-guarded")
        admin.alter_topic("pub-guarded", read_only=True)
    proc = RunnerProcess(address, tmp_path, "app_publish")
    try:
        with Producer(address, linger_ms=1) as producer:
            producer.send("pub-in", 1, key="a")
            producer.send("pub-in", 2, key="b", headers={"x-correlation-id": "order-7"})
            producer.send_many("pub-batch", [10, 11, 12])
            producer.send("pub-guarded-in", "precious")
            producer.flush(timeout=30)
        out = sorted(fetched(address, "pub-out", 2), key=lambda m: m.offset)
        assert [(m.key, m.value) for m in out] == [("a", {"n": 1}), ("b", {"n": 2})]
        assert [m.headers["x-causation-id"] for m in out] == ["pub-in/0/0", "pub-in/0/1"]
        assert [m.headers["x-correlation-id"] for m in out] == ["pub-in/0/0", "order-7"], "the chain's first id"
        assert all(m.headers["x-app"] == "relay" for m in out), "the handler's own headers come along"
        chain = sorted(fetched(address, "pub-chain", 2), key=lambda m: m.offset)
        by_cause = {m.headers["x-causation-id"]: m.headers["x-correlation-id"] for m in chain}
        assert by_cause == {"pub-out/0/0": "pub-in/0/0", "pub-out/0/1": "order-7"}, "an async handler, one link on"
        batch = fetched(address, "pub-batch-out", 3)
        assert sorted((m.value, m.headers["x-causation-id"]) for m in batch) == [
            (10, "pub-batch/0/0"),
            (11, "pub-batch/0/1"),
            (12, "pub-batch/0/2"),
        ], "cause= names the message of the batch"

        # confirm before ack: the publish is refused, so the handled message is retried, never acked
        wait_for(lambda: len(rows(tmp_path, "guarded")) >= 3, 30, message="three failed attempts")
        assert committed(address, "pub-guarded-in", "pub-guarded-in") == 0
        with Admin(address) as admin:
            assert admin.fetch("pub-guarded", 0, 10) == []
            admin.alter_topic("pub-guarded", read_only=False)
        [landed] = fetched(address, "pub-guarded", 1)
        assert landed.value == "precious"
        assert landed.headers["x-causation-id"] == "pub-guarded-in/0/0"
        wait_for(lambda: committed(address, "pub-guarded-in", "pub-guarded-in") == 1, 30, message="acked")
        attempts = [r["attempt"] for r in rows(tmp_path, "guarded")]
        assert attempts == list(range(1, len(attempts) + 1)) and len(attempts) >= 3
        assert runner_metric(proc, "conveyor_runner_retries_total", 'handler="app_publish.guarded"') >= 2
        assert proc.proc.poll() is None
    finally:
        proc.kill()


def _hook_lines(out, topic: str) -> list[str]:
    path = out / "hooks.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if f" {topic} " in line or line.endswith(f" {topic}")]


def test_middleware_hooks_run_in_order_and_a_failing_one_does_not_stop_handling(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    proc = RunnerProcess(address, tmp_path, "app_middleware", args=["--middleware", "app_middleware:Outer"])
    try:
        publish(address, "mw-ok", [1])
        publish(address, "mw-retry", [1])
        publish(address, "mw-dead", [1])
        publish(address, "mw-broken", [1, 2])
        publish(address, "mw-nacked", [1])
        wait_for(lambda: len(_hook_lines(tmp_path, "mw-ok")) >= 6, 30, message="mw-ok hooks")
        wait_for(lambda: len(_hook_lines(tmp_path, "mw-retry")) >= 10, 30, message="mw-retry hooks")
        wait_for(lambda: len(_hook_lines(tmp_path, "mw-dead")) >= 12, 30, message="mw-dead hooks")
        wait_for(lambda: len(_hook_lines(tmp_path, "mw-broken")) >= 10, 30, message="mw-broken hooks")
        wait_for(lambda: any("on_dead_letter" in x for x in _hook_lines(tmp_path, "mw-nacked")), 30, message="nacked")
        wait_for(
            lambda: runner_metric(proc, "conveyor_runner_middleware_errors_total", 'hook="after_handle"') == 2,
            30,
            message="counted",
        )
        assert runner_metric(proc, "conveyor_runner_middleware_errors_total", "app_middleware.Broken") == 4
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    lines = (tmp_path / "hooks.log").read_text().splitlines()
    starts = [line for line in lines if " on_start " in line]
    assert starts == ["outer on_start - -", "module on_start - -", "own on_start - -"]
    assert lines[:3] == starts, "on_start before any message"
    assert [line for line in lines if " on_stop " in line] == [
        "own on_stop - -",
        "module on_stop - -",
        "outer on_stop - -",
    ]
    assert lines[-3:] == ["own on_stop - -", "module on_stop - -", "outer on_stop - -"]
    assert _hook_lines(tmp_path, "mw-ok") == [
        "outer before_handle mw-ok 0",
        "module before_handle mw-ok 0",
        "own before_handle mw-ok 0",
        "own after_handle mw-ok 0 done-1",
        "module after_handle mw-ok 0 done-1",
        "outer after_handle mw-ok 0 done-1",
    ]
    assert _hook_lines(tmp_path, "mw-retry") == [
        "outer before_handle mw-retry 0",
        "module before_handle mw-retry 0",
        "module on_error mw-retry 0 ConnectionError",
        "outer on_error mw-retry 0 ConnectionError",
        "module on_retry mw-retry 0 1",
        "outer on_retry mw-retry 0 1",
        "outer before_handle mw-retry 0",
        "module before_handle mw-retry 0",
        "module after_handle mw-retry 0 None",
        "outer after_handle mw-retry 0 None",
    ]
    tried = [
        "outer before_handle mw-dead 0",
        "module before_handle mw-dead 0",
        "module on_error mw-dead 0 ValueError",
        "outer on_error mw-dead 0 ValueError",
    ]
    assert _hook_lines(tmp_path, "mw-dead") == [
        *tried,
        "module on_retry mw-dead 0 1",
        "outer on_retry mw-dead 0 1",
        *tried,
        "module on_dead_letter mw-dead 0 gave up after 2 attempts",
        "outer on_dead_letter mw-dead 0 gave up after 2 attempts",
    ]
    broken = _hook_lines(tmp_path, "mw-broken")
    assert [line for line in broken if line.startswith("handled")] == ["handled mw-broken 0", "handled mw-broken 1"]
    assert [line for line in broken if line.startswith("outer after_handle")] == [
        "outer after_handle mw-broken 0 None",
        "outer after_handle mw-broken 1 None",
    ], "a middleware that raised changes nothing for the others"
    assert any("app_middleware.Broken: before_handle raised" in line for line in proc.lines)
    nacked = [
        "outer before_handle mw-nacked 0",
        "module before_handle mw-nacked 0",
        "module on_error mw-nacked 0 Nack",
        "outer on_error mw-nacked 0 Nack",
    ]
    assert _hook_lines(tmp_path, "mw-nacked") == [
        *nacked,
        "module on_retry mw-nacked 0 1",
        "outer on_retry mw-nacked 0 1",
        *nacked,
        "module on_retry mw-nacked 0 2",
        "outer on_retry mw-nacked 0 2",
        "module on_dead_letter mw-nacked 0 DeadLettered",
        "outer on_dead_letter mw-nacked 0 DeadLettered",
    ], "the broker dead-lettered it past max_deliveries: on_dead_letter too"


# --- one module: the lane holds the ack while a publish is unconfirmed -----------------------------


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, dict[str, str]]] = []
        self.futures: list[Future[int]] = []
        self.times: list[dict[str, Any]] = []

    def send(
        self, topic: str, value: Any, *, key: Any = None, headers: Any = None, partition: Any = None, **times: Any
    ) -> Future:
        future: Future[int] = Future()
        self.sent.append((topic, value, headers))
        self.times.append(times)
        self.futures.append(future)
        return future


def _lane_with(fn, producer: _Producer, **options: Any) -> tuple[ThreadLane, list[Report], threading.Event]:
    publisher = Publisher("tcp://127.0.0.1:1")
    publisher._producer = producer  # type: ignore[assignment]
    reports: list[Report] = []
    got = threading.Event()

    def done(report: Report) -> None:
        reports.append(report)
        got.set()

    lane = ThreadLane(consumer("t", group="g", **options)(fn), done, threading.Event(), "t-0", publisher=publisher)
    return lane, reports, got


def test_the_lane_reports_an_ack_only_after_the_publish_is_confirmed_and_a_retry_when_it_fails():
    producer = _Producer()

    def handler(message: Message) -> None:
        context().publish("out", message.value)

    lane, reports, got = _lane_with(handler, producer)
    try:
        lane.submit("slot", [Message("t", 4, 0.0, None, {}, b"x")])
        wait_for(lambda: producer.futures, 30, message="published")
        assert not got.wait(0.2), "no report while the publish is unconfirmed"
        producer.futures[0].set_result(0)
        assert got.wait(30)
        assert (reports[0].acked, reports[0].retried) == ([4], [])
        assert producer.sent[0][2] == {"x-correlation-id": "t/0/4", "x-causation-id": "t/0/4"}
        got.clear()
        lane.submit("slot", [Message("t", 5, 0.0, None, {"x-correlation-id": "c"}, b"y")])
        wait_for(lambda: len(producer.futures) == 2, 30, message="published")
        producer.futures[1].set_exception(ConnectionError("gone"))
        assert got.wait(30)
        assert reports[1].acked == [] and [o for o, _d, _e in reports[1].retried] == [5]
        assert "PublishFailed" in reports[1].retried[0][2]
    finally:
        lane.close()


def test_a_handler_publishes_a_delayed_expiring_message_and_is_acked_on_its_confirm_not_its_delay():
    producer = _Producer()
    lane, reports, got = _lane_with(lambda m: context().publish("out", 1, delay=30, ttl=60), producer)
    try:
        lane.submit("slot", [Message("t", 0, 0.0, None, {}, b"x")])
        wait_for(lambda: producer.futures, 30, message="published")
        assert producer.times == [{"delay": 30, "ttl": 60}], "passed to the runner's producer as they came"
        producer.futures[0].set_result(0)
        assert got.wait(30) and reports[0].acked == [0]
    finally:
        lane.close()


def test_without_confirm_the_lane_acks_when_the_handler_returns():
    producer = _Producer()
    lane, reports, got = _lane_with(lambda m: context().publish("out", 1), producer, confirm_publishes=False)
    try:
        lane.submit("slot", [Message("t", 0, 0.0, None, {}, b"x")])
        assert got.wait(30) and reports[0].acked == [0]
    finally:
        lane.close()
        producer.futures[0].set_result(0)


def test_link_headers_and_publish_outside_a_handler():
    message = Message("orders", 9, 0.0, None, {"x-correlation-id": "root"}, b"", partition=2)
    assert link_headers(message) == {"x-correlation-id": "root", "x-causation-id": "orders/2/9"}
    try:
        context()
    except RuntimeError as exc:
        assert "only inside a handler" in str(exc)
    else:
        raise AssertionError("context() outside a handler")
    assert issubclass(PublishFailed, Exception)


def test_hooks_run_in_order_and_one_that_raises_is_counted_and_skipped():
    calls: list[str] = []
    failed: list[tuple[str, str]] = []

    class Tag:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def before_handle(self, message: Any) -> None:
            calls.append(f"{self.tag} before")

        def after_handle(self, message: Any, result: Any) -> None:
            calls.append(f"{self.tag} after {result}")

    class Boom:
        def before_handle(self, message: Any) -> None:
            raise RuntimeError("boom")

    hooks = Hooks([Tag("a"), Boom(), Tag("b")], lambda m, hook: failed.append((type(m).__name__, hook)))
    hooks.before(["m"])
    hooks.after(["m"], 3)
    assert calls == ["a before", "b before", "b after 3", "a after 3"]
    assert failed == [("Boom", "before_handle")]
    assert not Hooks([])
    assert Hooks([Tag("a")]).each_message

    class Counting(Middleware):  # the base class's no-op hooks are never called: no per-message call
        def after_chunk(self, consumer: Any, summary: Any) -> None: ...

    hooks = Hooks([Counting()])
    assert hooks and hooks.chunks and not hooks.each_message and hooks.calls["before_handle"] == []


def test_middleware_specs_resolve_classes_instances_and_lists_and_refuse_the_rest():
    import pytest
    from conveyor.consumers.middleware import parse_specs, resolve

    from conveyor.errors import ConfigError
    from tests.runner.apps import app_middleware

    assert parse_specs("a:B, c:D,,") == ["a:B", "c:D"]
    [outer] = resolve("tests.runner.apps.app_middleware:Outer")
    assert isinstance(outer, app_middleware.Outer) and outer.tag == "outer"
    assert resolve("tests.runner.apps.app_middleware") == app_middleware.middleware, "a module's list"
    for spec, says in (
        ("tests.runner.apps.app_middleware:nothing", "has no attribute 'nothing'"),
        ("tests.runner.apps.app_middleware:write", "has none of the middleware hooks"),
        ("no_such_module_here:X", "cannot import"),
    ):
        with pytest.raises(ConfigError, match=says):
            resolve(spec)
