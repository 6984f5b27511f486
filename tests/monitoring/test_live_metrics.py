"""Metrics and health of a real broker and real `conveyor run` processes, read over HTTP."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from conveyor.consumers.runner import Runner
from conveyor.monitoring.metrics import STATE_GAUGES
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conveyor import Admin, consumer
from tests.helpers import publish, sample_value, scrape, wait_for
from tests.monitoring.monitoring_helpers import health, label_sets, promtool_check_metrics, runner_metrics_url

GATED = {"topic": "gated", "group": "gatekeepers"}
HOLD = {"handler": "app_monitored.hold", **GATED}


def test_broker_and_runner_expositions_pass_promtool(conveyor_broker: Any, runner_factory: Any) -> None:
    # Given a broker and a runner that handled some traffic, retries and dead letters included
    runner = runner_factory(conveyor_broker.address)
    publish(conveyor_broker.address, "orders", range(200))
    publish(conveyor_broker.address, "payments", range(20))
    publish(conveyor_broker.address, "doomed", range(3))
    graveyard = {"topic": "doomed", "group": "graveyard"}
    wait_for(
        lambda: (
            sample_value(scrape(conveyor_broker.metrics_url), "conveyor_dead_lettered_messages_total", **graveyard) == 3
        ),
        message="3 dead letters",
    )
    broker_text, runner_text = scrape(conveyor_broker.metrics_url), scrape(runner_metrics_url(runner))
    # Then promtool finds nothing to complain about in either
    for name, text in (("broker", broker_text), ("runner", runner_text)):
        checked = promtool_check_metrics(text)
        assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), (
            f"promtool check metrics on the {name}: {checked.stdout}{checked.stderr}"
        )
    # And every state gauge and the process metrics are in the broker's exposition
    names = {f.name for f in text_string_to_metric_families(broker_text)}
    assert set(STATE_GAUGES) | {"conveyor_build_info", "process_cpu_seconds", "python_gc_collections"} <= names
    ledger = {"handler": "app_monitored.post", "topic": "payments", "group": "ledger"}
    assert sample_value(runner_text, "conveyor_runner_retries_total", **ledger) == 4  # values 0, 5, 10, 15
    assert (sample_value(runner_text, "process_resident_memory_bytes") or 0) > 0


def test_in_flight_and_in_process_return_to_zero_and_a_deleted_group_vanishes(
    conveyor_broker: Any, runner_factory: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    runner = runner_factory(conveyor_broker.address, env={"CONVEYOR_TEST_GATE": str(gate)})
    broker_url, runner_url = conveyor_broker.metrics_url, runner_metrics_url(runner)
    # Given five messages the handler holds until the gate opens
    publish(conveyor_broker.address, "gated", range(5))

    def broker_gauge(name: str) -> float | None:
        return sample_value(scrape(broker_url), name, **GATED)

    wait_for(lambda: broker_gauge("conveyor_group_in_flight_messages") == 5, message="5 in flight")
    assert broker_gauge("conveyor_group_lag_messages") == 5
    assert broker_gauge("conveyor_group_members") == 1
    assert (broker_gauge("conveyor_group_lag_seconds") or 0) > 0
    wait_for(
        lambda: sample_value(scrape(runner_url), "conveyor_runner_in_process_messages", **HOLD) == 5,
        message="5 in process",
    )
    # When the gate opens and the handler acks everything
    gate.touch()
    # Then the gauges read zero again (the rows stay, with 0)
    wait_for(lambda: broker_gauge("conveyor_group_in_flight_messages") == 0, message="0 in flight")
    wait_for(lambda: broker_gauge("conveyor_group_lag_messages") == 0, message="lag 0")
    assert broker_gauge("conveyor_group_lag_seconds") == 0
    assert broker_gauge("conveyor_group_committed_offset") == 5
    wait_for(
        lambda: sample_value(scrape(runner_url), "conveyor_runner_in_process_messages", **HOLD) == 0,
        message="0 in process",
    )
    # When the runner leaves, the group has no members but still exists
    runner.terminate()
    assert runner.wait(20) == 0
    wait_for(lambda: broker_gauge("conveyor_group_members") == 0, message="0 members")
    # And when the group is deleted, its rows disappear while the topic's stay
    with Admin(conveyor_broker.address) as admin:
        admin.delete_group("gated", "gatekeepers")
    text = scrape(broker_url)
    for name, (_help, labels) in STATE_GAUGES.items():
        if "group" in labels:
            assert GATED not in label_sets(text, name), f"{name} still has a row for the deleted group"
    assert sample_value(text, "conveyor_log_end_offset", topic="gated") == 5


def test_healthz_of_a_live_broker_and_runner(conveyor_broker: Any, runner_factory: Any) -> None:
    runner = runner_factory(conveyor_broker.address)
    runner_url = runner_metrics_url(runner)
    # Given both processes up
    status, report = health(conveyor_broker.metrics_url)
    assert (status, report["status"]) == (200, "HEALTHY"), report
    assert report["checks"]["storage"] == {"status": "HEALTHY", "failing": {}}
    assert report["checks"]["disk_space"]["free_bytes"] > 0
    status, report = wait_for(lambda: _healthy(runner_url), message="runner HEALTHY")
    assert set(report["checks"]) == {
        "event_loop",
        "app_monitored.bill",
        "app_monitored.post",
        "app_monitored.refuse",
        "app_monitored.hold",
    }
    assert all(check.get("subscribed", True) for check in report["checks"].values())
    # When the broker freezes, the runner reconnects and is not subscribed: DEGRADED, still 200
    conveyor_broker.signal(signal.SIGSTOP)
    try:
        status, report = wait_for(
            lambda: (r := health(runner_url))[1]["status"] == "DEGRADED" and r, timeout=15, message="DEGRADED"
        )
        assert status == 200
        assert not all(check.get("subscribed", True) for check in report["checks"].values())
    finally:
        conveyor_broker.signal(signal.SIGCONT)
    # Then it recovers on its own
    wait_for(lambda: _healthy(runner_url), timeout=15, message="runner HEALTHY again")


def _healthy(url: str) -> tuple[int, dict[str, Any]] | None:
    status, report = health(url)
    return (status, report) if report["status"] == "HEALTHY" else None


def test_runner_health_is_unhealthy_with_503_when_its_io_thread_stalls(conveyor_broker: Any) -> None:
    # Given an in-process runner whose I/O thread is not running its loop
    noop = consumer("stalled", group="stalled")(lambda message: None)
    runner = Runner([noop], broker=conveyor_broker.address, metrics_port=0, registry=CollectorRegistry())
    runner._start()
    try:
        url = f"http://127.0.0.1:{runner.metrics_server.port}/metrics" if runner.metrics_server else ""
        # When its loop has not passed for much longer than its longest wait
        runner._last_pass -= 60
        # Then /healthz says UNHEALTHY with a 503
        status, report = health(url)
        assert (status, report["status"]) == (503, "UNHEALTHY"), report
    finally:
        runner._close()
