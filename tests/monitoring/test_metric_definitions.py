"""Every metric monitoring/ defines, against a fresh registry: name, type, labels and what it records."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.server.broker import Broker
from conveyor.monitoring.http import MetricsServer
from conveyor.monitoring.metrics import (
    HANDLER_BUCKETS,
    LATENCY_BUCKETS,
    STATE_GAUGES,
    BrokerMetrics,
    RunnerMetrics,
    StateCollector,
    WorkerPoolMetrics,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import http_get
from tests.monitoring.monitoring_helpers import registered_families

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"
TOPIC, GROUP = ("topic",), ("topic", "group")
HANDLER = ("handler", "topic", "group")

# attribute -> (family name, type, labels)
BROKER: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "published_messages": ("conveyor_published_messages", "counter", TOPIC),
    "published_bytes": ("conveyor_published_bytes", "counter", TOPIC),
    "published_batches": ("conveyor_published_batches", "counter", TOPIC),
    "duplicate_batches": ("conveyor_duplicate_batches", "counter", TOPIC),
    "delivered_messages": ("conveyor_delivered_messages", "counter", GROUP),
    "delivered_bytes": ("conveyor_delivered_bytes", "counter", GROUP),
    "acked_messages": ("conveyor_acked_messages", "counter", GROUP),
    "nacked_messages": ("conveyor_nacked_messages", "counter", GROUP),
    "redelivered_messages": ("conveyor_redelivered_messages", "counter", (*GROUP, "reason")),
    "dead_lettered_messages": ("conveyor_dead_lettered_messages", "counter", GROUP),
    "expired_messages": ("conveyor_expired_messages", "counter", GROUP),
    "dead_letter_failures": ("conveyor_dead_letter_failures", "counter", (*GROUP, "reason")),
    "group_settings_changes": ("conveyor_group_settings_changes", "counter", GROUP),
    "internal_errors": ("conveyor_internal_errors", "counter", ("where",)),
    "skipped_messages": ("conveyor_group_skipped_messages", "counter", (*GROUP, "reason")),
    "protocol_errors": ("conveyor_protocol_errors", "counter", ("code", "name")),
    "router_send_errors": ("conveyor_router_send_errors", "counter", ("error",)),
    "truncated_bytes": ("conveyor_log_truncated_bytes", "counter", TOPIC),
    "quarantined_segments": ("conveyor_log_quarantined_segments", "counter", TOPIC),
    "lost_offsets": ("conveyor_log_lost_offsets", "counter", TOPIC),
    "dispatch_errors": ("conveyor_dispatch_errors", "counter", (*GROUP, "error")),
    "publish_seconds": ("conveyor_publish_duration_seconds", "histogram", ()),
    "fsync_seconds": ("conveyor_fsync_duration_seconds", "histogram", ()),
    "append_seconds": ("conveyor_append_duration_seconds", "histogram", ()),
    "end_to_end_seconds": ("conveyor_end_to_end_duration_seconds", "histogram", GROUP),
    "loop_seconds": ("conveyor_loop_iteration_duration_seconds", "histogram", ()),
    "mirror_fetched_messages": ("conveyor_mirror_fetched_messages", "counter", TOPIC),
    "mirror_fetched_bytes": ("conveyor_mirror_fetched_bytes", "counter", TOPIC),
    "mirror_reconnects": ("conveyor_mirror_reconnects", "counter", ("upstream",)),
    "mirror_gaps": ("conveyor_mirror_gaps", "counter", TOPIC),
    "offsets_write_errors": ("conveyor_offsets_write_errors", "counter", TOPIC),
    "descriptors_exhausted": ("conveyor_descriptors_exhausted", "counter", ()),
    "topic_config_errors": ("conveyor_topic_config_errors", "counter", ("topic", "setting")),
    "auth_failures": ("conveyor_auth_failures", "counter", ("reason",)),
}
RUNNER: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "handled": ("conveyor_runner_messages", "counter", (*HANDLER, "outcome")),
    "retries": ("conveyor_runner_retries", "counter", HANDLER),
    "invalid": ("conveyor_runner_invalid_messages", "counter", HANDLER),
    "duration": ("conveyor_runner_handler_duration_seconds", "histogram", HANDLER),
    "in_process": ("conveyor_runner_in_process_messages", "gauge", HANDLER),
    "new_group_replays": ("conveyor_runner_new_group_replays", "counter", HANDLER),
    "middleware_errors": ("conveyor_runner_middleware_errors", "counter", ("middleware", "hook")),
}
STATE: dict[str, tuple[str, ...]] = {
    "conveyor_log_start_offset": TOPIC,
    "conveyor_log_end_offset": TOPIC,
    "conveyor_log_durable_offset": TOPIC,
    "conveyor_log_segments": TOPIC,
    "conveyor_log_size_bytes": TOPIC,
    "conveyor_group_committed_offset": GROUP,
    "conveyor_group_lag_messages": GROUP,
    "conveyor_group_lag_seconds": GROUP,
    "conveyor_group_in_flight_messages": GROUP,
    "conveyor_group_pending_redelivery_messages": GROUP,
    "conveyor_group_credit_messages": GROUP,
    "conveyor_group_members": GROUP,
    "conveyor_connected_clients": (),
    "conveyor_disk_free_bytes": (),
    "conveyor_disk_free_min_bytes": (),
    "conveyor_topic_limit": (),
    "conveyor_mirror_lag_messages": ("topic", "upstream"),
    "conveyor_mirror_lag_seconds": ("topic", "upstream"),
    "conveyor_mirror_status": ("upstream",),
}
RUNTIME = {
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "python_info": "gauge",
    "python_gc_collections": "counter",
    "python_gc_objects_collected": "counter",
    "python_gc_objects_uncollectable": "counter",
}
NON_BASE_UNITS = re.compile(r"_(ms|millis|milliseconds|us|microseconds|ns|minutes|hours|kb|kib|mb|mib|gb|percent)$")


def families(registry: CollectorRegistry) -> dict[str, Any]:
    return {family.name: family for family in registry.collect()}


def label_values(labels: tuple[str, ...]) -> list[str]:
    return [f"{label}-value" for label in labels]


def exercise(metric: Any, kind: str, labels: tuple[str, ...]) -> None:
    child = metric.labels(*label_values(labels)) if labels else metric
    if kind == "counter":
        child.inc(3)
    elif kind == "gauge":
        child.inc(5)
        child.dec(2)
    else:
        child.observe(0.003)
        child.observe(0.2)


def check_recorded(registry: CollectorRegistry, name: str, kind: str, labels: tuple[str, ...]) -> None:
    values = dict(zip(labels, label_values(labels), strict=True))
    family = families(registry)[name]
    assert family.type == kind, f"{name} is a {family.type}, not a {kind}"
    if kind == "counter":
        assert registry.get_sample_value(f"{name}_total", values) == 3
    elif kind == "gauge":
        assert registry.get_sample_value(name, values) == 3
    else:
        assert registry.get_sample_value(f"{name}_count", values) == 2
        assert registry.get_sample_value(f"{name}_sum", values) == pytest.approx(0.203)
        assert registry.get_sample_value(f"{name}_bucket", {**values, "le": "+Inf"}) == 2
    for sample in family.samples:
        assert set(sample.labels) - {"le"} == set(labels), f"{sample.name} has labels {sorted(sample.labels)}"


# --- the broker's and the runner's families -------------------------------------------------------------


@pytest.mark.parametrize("attribute", sorted(BROKER))
def test_broker_metric(attribute: str) -> None:
    registry = CollectorRegistry()
    metrics = BrokerMetrics(registry)
    name, kind, labels = BROKER[attribute]
    exercise(getattr(metrics, attribute), kind, labels)
    check_recorded(registry, name, kind, labels)


@pytest.mark.parametrize("attribute", sorted(RUNNER))
def test_runner_metric(attribute: str) -> None:
    registry = CollectorRegistry()
    metrics = RunnerMetrics(registry)
    name, kind, labels = RUNNER[attribute]
    exercise(getattr(metrics, attribute), kind, labels)
    check_recorded(registry, name, kind, labels)


POOL: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "workers": ("conveyor_runner_workers", "gauge", ()),
    "worker_restarts": ("conveyor_runner_worker_restarts", "counter", ()),
}


@pytest.mark.parametrize("attribute", sorted(POOL))
def test_worker_pool_metric(attribute: str) -> None:
    registry = CollectorRegistry()
    metrics = WorkerPoolMetrics(registry, list)
    name, kind, labels = POOL[attribute]
    exercise(getattr(metrics, attribute), kind, labels)
    check_recorded(registry, name, kind, labels)


def test_worker_pool_process_metrics_add_up_the_workers() -> None:
    import subprocess
    import sys

    # Given a supervisor's registry with one worker process alive
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        alone, pool = CollectorRegistry(), CollectorRegistry()
        WorkerPoolMetrics(alone, list)
        WorkerPoolMetrics(pool, lambda: [worker.pid])
        # Then memory is the sum of both processes, descriptors the most either holds, the start time the supervisor's
        rss = pool.get_sample_value("process_resident_memory_bytes") or 0
        assert rss > (alone.get_sample_value("process_resident_memory_bytes") or 0)
        assert pool.get_sample_value("process_open_fds") == alone.get_sample_value("process_open_fds")
        assert pool.get_sample_value("process_start_time_seconds") == alone.get_sample_value(
            "process_start_time_seconds"
        )
        assert (pool.get_sample_value("process_cpu_seconds_total") or 0) >= (
            alone.get_sample_value("process_cpu_seconds_total") or 0
        )
        names = {family.name: family.type for family in pool.collect()}
        assert names == {
            **{n: k for n, k, _ in POOL.values()},
            "conveyor_build": "info",
            "conveyor_runner_workers": "gauge",
            **RUNTIME,
        }
    finally:
        worker.kill()
        worker.wait()


def test_build_info_names_the_component() -> None:
    from conveyor.version import __version__

    for component, build in (("broker", BrokerMetrics), ("runner", RunnerMetrics)):
        registry = CollectorRegistry()
        build(registry)
        assert families(registry)["conveyor_build"].type == "info"
        labels = {"component": component, "version": __version__}
        assert registry.get_sample_value("conveyor_build_info", labels) == 1


def test_registries_hold_exactly_the_known_families_plus_the_process_collectors() -> None:
    broker, runner = CollectorRegistry(), CollectorRegistry()
    BrokerMetrics(broker)
    broker.register(StateCollector(lambda: {}))
    RunnerMetrics(runner)
    expected_broker = {n: k for n, k, _ in BROKER.values()} | dict.fromkeys(STATE, "gauge")
    expected_runner = {n: k for n, k, _ in RUNNER.values()}
    for registry, expected in ((broker, expected_broker), (runner, expected_runner)):
        found = {name: family.type for name, family in families(registry).items()}
        assert found == {**expected, "conveyor_build": "info", **RUNTIME}


def test_process_metrics_have_values_on_an_injected_registry() -> None:
    registry = CollectorRegistry()
    RunnerMetrics(registry)
    assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
    assert (registry.get_sample_value("process_open_fds") or 0) > 0


def test_the_global_registry_is_not_given_the_process_collectors_twice() -> None:
    from conveyor.monitoring.metrics import register_runtime_collectors
    from prometheus_client import REGISTRY

    register_runtime_collectors(REGISTRY)  # would raise "Duplicated timeseries" if it registered again


def test_names_follow_the_conventions() -> None:
    for name, kind in registered_families().items():
        if name in RUNTIME:
            continue
        assert name.startswith("conveyor_"), name
        assert not NON_BASE_UNITS.search(name), f"{name}: use base units (seconds, bytes)"
        assert not name.endswith("_total"), f"{name}: prometheus_client adds _total to counters"
        if kind == "histogram":
            assert name.endswith("_seconds"), f"{name}: our histograms measure durations in seconds"
    exposition = generate_latest(_full_broker_registry()).decode()
    counters = [f.name for f in text_string_to_metric_families(exposition) if f.type == "counter"]
    for family in text_string_to_metric_families(exposition):
        if family.name in counters:
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name


def test_buckets_cover_sub_millisecond_to_a_minute() -> None:
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS) and LATENCY_BUCKETS[0] <= 0.0001
    assert list(HANDLER_BUCKETS) == sorted(HANDLER_BUCKETS) and HANDLER_BUCKETS[-1] >= 60


def test_every_metric_is_documented() -> None:
    docs = DOCS.read_text()
    for name, kind in registered_families().items():
        if name in RUNTIME:
            continue
        exposed = name + {"counter": "_total", "info": "_info"}.get(kind, "")
        assert f"`{exposed}`" in docs, f"docs/monitoring.md does not list {exposed}"


def _full_broker_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = BrokerMetrics(registry)
    for attribute, (_name, kind, labels) in BROKER.items():
        exercise(getattr(metrics, attribute), kind, labels)
    return registry


# --- the state collector ----------------------------------------------------------------------------------


class FakeBrokerState:
    """What ``metrics_state.state_snapshot`` returns, as a test can change it between scrapes."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], dict[str, float]] = {}
        self.topics: dict[str, float] = {}

    def snapshot(self) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        rows: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        for topic, end in self.topics.items():
            rows.setdefault("conveyor_log_end_offset", []).append(((topic,), end))
        for labels, values in self.groups.items():
            for name, value in values.items():
                rows.setdefault(name, []).append((labels, value))
        rows["conveyor_connected_clients"] = [((), float(len(self.groups)))]
        return rows


@pytest.fixture
def state() -> Iterator[tuple[FakeBrokerState, CollectorRegistry]]:
    fake = FakeBrokerState()
    registry = CollectorRegistry()
    registry.register(StateCollector(fake.snapshot))
    yield fake, registry


def test_collector_describes_every_state_gauge() -> None:
    assert {name: list(labels) for name, (_help, labels) in STATE_GAUGES.items()} == {
        name: list(labels) for name, labels in STATE.items()
    }
    described = {f.name: f.type for f in StateCollector(lambda: {}).describe()}
    assert described == dict.fromkeys(STATE, "gauge")


def test_empty_families_still_appear_so_nothing_reads_stale(state: tuple[FakeBrokerState, CollectorRegistry]) -> None:
    _fake, registry = state
    text = generate_latest(registry).decode()
    for name in STATE:
        assert f"# TYPE {name} gauge" in text, name
    assert registry.get_sample_value("conveyor_group_lag_messages", {"topic": "t", "group": "g"}) is None


def test_collector_reads_state_at_scrape_time(state: tuple[FakeBrokerState, CollectorRegistry]) -> None:
    fake, registry = state
    labels = {"topic": "orders", "group": "billing"}
    fake.topics["orders"] = 10
    fake.groups[("orders", "billing")] = {"conveyor_group_in_flight_messages": 5, "conveyor_group_lag_messages": 10}
    assert registry.get_sample_value("conveyor_group_in_flight_messages", labels) == 5
    assert registry.get_sample_value("conveyor_log_end_offset", {"topic": "orders"}) == 10
    # When the consumer acks everything, the gauges read zero: the rows stay, with 0
    fake.groups[("orders", "billing")] = {"conveyor_group_in_flight_messages": 0, "conveyor_group_lag_messages": 0}
    assert registry.get_sample_value("conveyor_group_in_flight_messages", labels) == 0
    assert registry.get_sample_value("conveyor_group_lag_messages", labels) == 0


def test_rows_of_a_deleted_group_disappear(state: tuple[FakeBrokerState, CollectorRegistry]) -> None:
    fake, registry = state
    fake.groups[("orders", "billing")] = {"conveyor_group_members": 2}
    fake.groups[("orders", "audit")] = {"conveyor_group_members": 1}
    assert registry.get_sample_value("conveyor_connected_clients") == 2
    del fake.groups[("orders", "billing")]
    assert registry.get_sample_value("conveyor_group_members", {"topic": "orders", "group": "billing"}) is None
    assert registry.get_sample_value("conveyor_group_members", {"topic": "orders", "group": "audit"}) == 1
    assert registry.get_sample_value("conveyor_connected_clients") == 1


# --- health over HTTP -------------------------------------------------------------------------------------


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(registry: CollectorRegistry, health: Any) -> str:
        server = MetricsServer(registry, health, host="127.0.0.1", port=0).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}"

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize(("status", "code"), [("HEALTHY", 200), ("DEGRADED", 200), ("UNHEALTHY", 503)])
def test_healthz_status_codes(serve: Any, status: str, code: int) -> None:
    url = serve(CollectorRegistry(), lambda: {"status": status, "checks": {"disk": "ok"}})
    got, body = http_get(f"{url}/healthz")
    assert got == code
    assert json.loads(body) == {"status": status, "checks": {"disk": "ok"}}


def test_metrics_endpoint_serves_the_injected_registry(serve: Any) -> None:
    registry = CollectorRegistry()
    RunnerMetrics(registry).retries.labels("h", "t", "g").inc()
    url = serve(registry, lambda: {"status": "HEALTHY", "checks": {}})
    with urllib.request.urlopen(f"{url}/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        assert 'conveyor_runner_retries_total{group="g",handler="h",topic="t"} 1.0' in response.read().decode()
    assert http_get(f"{url}/nothing")[0] == 404


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(BrokerSettings(data_dir=str(tmp_path / "data"), metrics_port=-1), registry=CollectorRegistry())
    yield broker
    broker.store.close()


def test_broker_health_turns_unhealthy_when_the_loop_is_stuck(broker: Broker, serve: Any) -> None:
    # Given a broker whose event loop just passed
    url = serve(broker.registry, broker.health)
    status, body = http_get(f"{url}/healthz")
    report = json.loads(body)
    assert (status, report["status"]) == (200, "HEALTHY"), report
    assert set(report["checks"]) == {
        "storage",
        "disk_space",
        "fsync_latency",
        "event_loop",
        "internal_errors",
        "lost_data",
    }
    # When the loop has not passed for much longer than the heartbeat
    now = broker.clock()
    broker.clock = lambda: now + 60
    # Then /healthz says UNHEALTHY with a 503
    status, body = http_get(f"{url}/healthz")
    assert status == 503 and json.loads(body)["status"] == "UNHEALTHY"


def test_broker_health_is_degraded_when_disk_is_short(broker: Broker) -> None:
    broker.settings = dataclasses.replace(broker.settings, disk_free_min_bytes=1 << 62)
    assert broker.health()["status"] == "DEGRADED"


def test_broker_state_snapshot_covers_topics_and_groups(broker: Broker) -> None:
    broker.store.create_topic("orders")
    broker.groups.make("orders", "billing", {})
    registry = broker.registry
    assert registry.get_sample_value("conveyor_log_end_offset", {"topic": "orders"}) == 0
    assert registry.get_sample_value("conveyor_group_lag_messages", {"topic": "orders", "group": "billing"}) == 0
    assert registry.get_sample_value("conveyor_group_members", {"topic": "orders", "group": "billing"}) == 0
    assert (registry.get_sample_value("conveyor_disk_free_bytes") or 0) > 0
    assert registry.get_sample_value("conveyor_disk_free_min_bytes") == broker.settings.disk_free_min_bytes


def test_a_failing_health_check_reads_unhealthy(serve: Any) -> None:
    def broken() -> dict[str, Any]:
        raise OSError("data directory gone")

    status, body = http_get(f"{serve(CollectorRegistry(), broken)}/healthz")
    assert status == 503
    assert json.loads(body) == {"status": "UNHEALTHY", "checks": {"health_check_error": "OSError: data directory gone"}}


def test_a_server_never_started_stops_at_once() -> None:
    server = MetricsServer(CollectorRegistry(), lambda: {"status": "HEALTHY", "checks": {}}, host="127.0.0.1", port=0)
    server.stop()  # would wait forever for a serve_forever() that never ran
