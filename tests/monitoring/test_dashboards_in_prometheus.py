"""Every query of every shipped dashboard returns data from a real Prometheus.

A real broker (whose log had a torn tail when it opened) and real `conveyor run` processes carry a few
thousand messages (`payments` has three partitions, its logs `payments`, `payments#1`, `payments#2`),
with retries, dead letters, a runner killed mid-traffic, a malformed request and a resent batch, while
a child broker mirrors every topic from it (`--upstream`, after reconnecting once while its parent was
down) and Prometheus scrapes the three every second. Then each panel query and each template variable
query is evaluated through Prometheus' HTTP API, with the variables substituted as Grafana would, and
must return at least one series. The `topic` variable lists topics, never a partition's log, and a
per-topic panel adds a topic's partitions up. The `job` and `instance` variables list the scraped brokers
(or runners; the scraped runner is a `--workers 2` supervisor, whose workers' metrics are merged), every panel
shows the parent and the child apart, and the limits drawn next to usage are
each broker's own (the child runs with a smaller --disk-free-min-bytes). Prometheus also loads the shipped alert rules
(monitoring/alerts.yml): every rule must evaluate cleanly on these series, and the torn tail and the
dead letters must raise their alerts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from conveyor.broker.wire.protocol import Command, Frame, decode, encode
from conveyor.broker.wire.record import pack_records
from conveyor.broker.wire.values import make_record

from conveyor import Admin, Producer
from conveyor.testing import BrokerProcess
from tests.helpers import publish, sample_value, scrape, wait_for
from tests.monitoring.dashboard_helpers import (
    Query,
    all_queries,
    label_values_query,
    listed_values,
    load_dashboards,
    substitute,
    variable_query,
    variables,
)
from tests.monitoring.monitoring_helpers import ALERT_RULES, PrometheusServer, runner_metrics_url

TRAFFIC_SECONDS = 8.0
PAYMENT_PARTITIONS = 3
CHILD_DISK_FREE_MIN = 64 * 1024 * 1024
VALUES = {
    "__rate_interval": "15s",  # Grafana: max(4 x scrape interval, ...) with a 1 s scrape
    "job": "conveyor-broker|conveyor-runner",
    "topic": "orders|payments|doomed",
    "group": "billing|ledger|graveyard",
    "handler": "app_monitored.bill|app_monitored.post|app_monitored.refuse",
}
# Queries that may legitimately return nothing in this test; each needs a reason. Keep it empty.
EXEMPT: dict[str, str] = {}
# A cluster's dashboard needs a cluster: test_cluster_dashboard_in_prometheus.py checks it against three nodes.
CLUSTER_DASHBOARD = "conveyor-cluster.json"


def tear_tail(topic_dir: Path, garbage: bytes) -> None:
    """A crash mid-write: half a batch at the end of the newest segment."""
    newest = max(topic_dir.glob("*.log"))
    with newest.open("ab") as f:
        f.write(garbage)


def bad_requests(address: str) -> None:
    """A malformed frame (an ERROR and a protocol error count) and one batch sent twice (a duplicate)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([b"not conveyor", b"?"])
        body = pack_records([make_record("resent")])
        for rid in (1, 2):
            sock.send_multipart(encode(Command.PUBLISH, {"rid": rid, "topic": "orders", "pid": 4242, "seq": 0}, body))
        replies: list[Frame] = []
        while len(replies) < 3 and sock.poll(5000):
            replies.append(decode(sock.recv_multipart()))
        assert [r.command for r in replies].count(Command.ERROR) == 1, replies
        assert [r.get("duplicate") for r in replies if r.command is Command.PUBLISHED] == [False, True], replies
    finally:
        sock.close()


def traffic(address: str, victim: Any) -> int:
    """About 50 messages every 100 ms for a few seconds; the victim runner is killed half way."""
    sent = 0
    started = time.monotonic()
    with Producer(address, linger_ms=2) as producer:
        while time.monotonic() - started < TRAFFIC_SECONDS:
            for _ in range(40):
                producer.send("orders", sent)
                sent += 1
            for _ in range(10):
                producer.send("payments", sent)
                sent += 1
            producer.send("doomed", sent)
            sent += 1
            if victim.proc.poll() is None and time.monotonic() - started > TRAFFIC_SECONDS / 2:
                victim.kill()  # SIGKILL: its unacked messages are redelivered (member_gone / unreachable)
            time.sleep(0.1)
        producer.flush(timeout=30)
    return sent


def target(metrics_url: str) -> str:
    return metrics_url.split("//", 1)[1].split("/", 1)[0]


def mirror_reconnects(child: BrokerProcess, upstream: str) -> float:
    return sample_value(scrape(child.metrics_url), "conveyor_mirror_reconnects_total", upstream=upstream) or 0.0


def by_topic(prometheus: PrometheusServer, expr: str) -> dict[str, float]:
    return {row["metric"]["topic"]: float(row["value"][1]) for row in prometheus.query(expr)}


def mirror_behind(prometheus: PrometheusServer, parent: str, child: str) -> str:
    """Empty when the child, as Prometheus last saw it, holds every offset of the parent's topics and is HEALTHY."""
    ends = by_topic(prometheus, f'conveyor_log_end_offset{{instance="{parent}"}}')
    copied = by_topic(prometheus, f'conveyor_log_end_offset{{instance="{child}"}}')
    fetched = by_topic(prometheus, f'conveyor_mirror_fetched_messages_total{{instance="{child}"}}')
    lag = by_topic(prometheus, f'conveyor_mirror_lag_messages{{instance="{child}"}}')
    status = [float(row["value"][1]) for row in prometheus.query(f'conveyor_mirror_status{{instance="{child}"}}')]
    nonempty = {topic: end for topic, end in ends.items() if end}  # an empty topic has no fetched series
    if not nonempty or copied != ends or fetched != nonempty or set(lag.values()) != {0.0} or status != [0.0]:
        return f"parent ends {ends}, child ends {copied}, fetched {fetched}, lag {lag}, status {status}"
    return ""


def test_every_dashboard_query_returns_data(tmp_path: Path, runner_factory: Any) -> None:
    broker = BrokerProcess(tmp_path / "broker")
    child: BrokerProcess | None = None
    prometheus: PrometheusServer | None = None
    try:
        # Given a broker that recovered a torn tail at startup
        broker.start()
        with Admin(broker.address) as admin:
            admin.create_topic("payments", partitions=PAYMENT_PARTITIONS)
        publish(broker.address, "orders", range(10))
        broker.stop()
        # And a child broker mirroring every topic, started while its parent was down: it reconnected once
        child = BrokerProcess(
            tmp_path / "child",
            extra=["--upstream", broker.address, "--mirror", "*", "--disk-free-min-bytes", str(CHILD_DISK_FREE_MIN)],
        ).start()
        wait_for(lambda: mirror_reconnects(child, broker.address) >= 1, timeout=10, message="a mirror reconnect")
        tear_tail(tmp_path / "broker" / "topics" / "orders", b"\x00\x01torn" * 7)
        broker.restart()
        # And a runner of two worker processes (one scrape shows both, merged), plus a second runner in the same
        # groups that will die mid-traffic
        runner = runner_factory(broker.address, args=["--workers", "2"])
        victim = runner_factory(broker.address)
        # And Prometheus scraping both brokers and the surviving runner every second
        parent_target, child_target = target(broker.metrics_url), target(child.metrics_url)
        runner_target = target(runner_metrics_url(runner))
        values = {**VALUES, "instance": "|".join((parent_target, child_target, runner_target))}
        prometheus = PrometheusServer(
            tmp_path / "prometheus",
            {"conveyor-broker": [parent_target, child_target], "conveyor-runner": [runner_target]},
            rule_files=(ALERT_RULES,),
        ).start()
        wait_for(prometheus.targets_up, timeout=20, message="all targets up")
        # When traffic flows, with a malformed request and a resent batch
        bad_requests(broker.address)
        sent = traffic(broker.address, victim)
        time.sleep(3)  # a few more scrapes of the final state
        # Then every template variable lists values
        problems = check_variables(
            prometheus, values, {"broker": {parent_target, child_target}, "runner": {runner_target}}
        )
        # And every panel query returns data
        queries = [query for query in all_queries() if query.dashboard != CLUSTER_DASHBOARD]
        assert len(queries) >= 60, "fewer queries than the dashboards hold: did the loader miss some?"
        for query in queries:
            if str(query) in EXEMPT:
                continue
            result = prometheus.query(substitute(query.expr, values))
            if not result:
                problems.append(f"no data: {query}")
        assert not problems, f"{len(problems)} queries without data after {sent} messages:\n" + "\n".join(problems)
        # And a per-topic panel adds a partitioned topic's partitions up; the per-partition panel shows each
        check_partitions(prometheus, queries, {**values, "instance": parent_target})
        # And the parent and the child are shown apart, each with its own limits, the torn tail the parent's
        check_per_broker(prometheus, queries, values, parent_target, child_target)
        # And the numbers are the traffic's, not just present
        parent = f'instance="{parent_target}"'
        truncated = prometheus.query(f'sum(conveyor_log_truncated_bytes_total{{{parent}, topic="orders"}})')
        assert float(truncated[0]["value"][1]) == len(b"\x00\x01torn" * 7)
        assert float(prometheus.query(f"sum(conveyor_log_end_offset{{{parent}}})")[0]["value"][1]) >= sent
        # And the child copied every offset of every topic, is HEALTHY, and counted its reconnect
        deadline = time.monotonic() + 15
        while (behind := mirror_behind(prometheus, parent_target, child_target)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not behind, f"the child did not catch up: {behind}"
        link = f'instance="{child_target}", upstream="{broker.address}"'
        assert float(prometheus.query(f"conveyor_mirror_reconnects_total{{{link}}}")[0]["value"][1]) >= 1
        # And every alert rule evaluates cleanly; the torn tail and the dead letters raise their alerts
        rule_problems = prometheus.rule_problems()
        assert not rule_problems, "\n".join(rule_problems)
        check_alerts(prometheus, parent_target)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if child is not None:
            child.stop()
        broker.stop()


def check_alerts(prometheus: PrometheusServer, parent: str) -> None:
    """The alerts this traffic must raise, each on the series that caused it (neither waits out a ``for``)."""
    torn = [a["labels"] for a in prometheus.active_alerts("ConveyorTornTailAtStartup")]
    assert [(a["instance"], a["topic"]) for a in torn] == [(parent, "orders")], torn
    dead = {
        (a["labels"]["instance"], a["labels"]["group"]) for a in prometheus.active_alerts("ConveyorDeadLettersArriving")
    }
    assert (parent, "graveyard") in dead, dead


def panel_query(queries: list[Query], title: str, values: dict[str, str], dashboard: str = "", ref: int = 0) -> str:
    """The ``ref``-th query of the first panel called ``title`` (on ``dashboard``, if given), as Grafana sends it."""
    found = [q.expr for q in queries if q.panel == title and q.dashboard.startswith(dashboard)]
    return substitute(found[ref], values)


def by_instance(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {row["metric"]["instance"]: float(row["value"][1]) for row in rows}


def check_per_broker(
    prometheus: PrometheusServer, queries: list[Query], values: dict[str, str], parent: str, child: str
) -> None:
    """Up and Health per target; disk free and open files next to each broker's own limit; torn tail per broker."""
    up = by_instance(prometheus.query(panel_query(queries, "Up", values, "conveyor-broker-overview")))
    assert up[parent] == up[child] == 1.0, up
    health = by_instance(prometheus.query(panel_query(queries, "Health", values, "conveyor-broker-overview")))
    assert {parent, child} <= set(health) and set(health.values()) <= {0.0, 1.0, 2.0}, health
    sizes = by_instance(prometheus.query(panel_query(queries, "Log size", values, "conveyor-storage")))
    assert set(sizes) == {parent, child} and all(sizes.values()), f"the stat adds the two brokers up: {sizes}"
    disk = "Disk free vs threshold, by broker"
    free = by_instance(prometheus.query(panel_query(queries, disk, values, "conveyor-storage")))
    threshold = by_instance(prometheus.query(panel_query(queries, disk, values, "conveyor-storage", ref=1)))
    assert threshold == {parent: 256 * 1024 * 1024, child: CHILD_DISK_FREE_MIN}, threshold
    assert free[parent] > 0 and free[child] > 0, free
    files = "Open files vs limit, by broker"
    open_fds = by_instance(prometheus.query(panel_query(queries, files, values, "conveyor-broker-overview")))
    max_fds = by_instance(prometheus.query(panel_query(queries, files, values, "conveyor-broker-overview", ref=1)))
    assert set(open_fds) == set(max_fds) == {parent, child}, (open_fds, max_fds)
    assert all(0 < open_fds[i] < max_fds[i] for i in open_fds), (open_fds, max_fds)
    torn_panel = "Torn tail cut at the last startup, by broker and topic"
    torn = {
        (row["metric"]["instance"], row["metric"]["topic"]): float(row["value"][1])
        for row in prometheus.query(panel_query(queries, torn_panel, values, "conveyor-storage"))
    }
    assert torn[(parent, "orders")] == len(b"\x00\x01torn" * 7), torn
    assert not any(value for (instance, _), value in torn.items() if instance == child), torn


def check_partitions(prometheus: PrometheusServer, queries: list[Query], values: dict[str, str]) -> None:
    at = str(time.time())  # one evaluation time: both sides see the same samples
    per_topic = prometheus.api("query", query=panel_query(queries, "Messages published / s, by topic", values), time=at)
    rates = {row["metric"]["topic"]: float(row["value"][1]) for row in per_topic["result"]}
    assert set(rates) == {"orders", "payments", "doomed"}, rates
    logs = f'rate(conveyor_published_messages_total{{topic=~"payments(#[0-9]+)?"}}[{VALUES["__rate_interval"]}])'
    by_log = prometheus.api("query", query=f"sum by (topic) ({logs})", time=at)["result"]
    assert len(by_log) == PAYMENT_PARTITIONS, by_log
    assert rates["payments"] == pytest.approx(sum(float(row["value"][1]) for row in by_log))
    lags = prometheus.query(panel_query(queries, "Lag (messages), by partition", values))
    shown = {row["metric"]["topic"] for row in lags if row["metric"]["group"] == "ledger"}
    assert shown == {"payments", *(f"payments#{k}" for k in range(1, PAYMENT_PARTITIONS))}, shown


def check_variables(prometheus: PrometheusServer, chosen: dict[str, str], targets: dict[str, set[str]]) -> list[str]:
    """Each variable lists what it must: ``targets`` are the instances of each component (broker, runner)."""
    problems = []
    for name, dashboard in load_dashboards().items():
        if name == CLUSTER_DASHBOARD:
            continue
        for variable in variables(dashboard):
            if variable["type"] != "query":
                continue
            query = variable_query(variable)
            selector, label = label_values_query(substitute(query, chosen))
            values = listed_values(variable, prometheus.label_values(label, selector))
            component = "broker" if 'component="broker"' in query else "runner"
            expected = {
                "job": {f"conveyor-{component}"},
                "instance": targets[component],
            }.get(label, set(chosen.get(label, "").split("|")))
            if label in ("job", "instance") and set(values) != expected:
                problems.append(f"{name}: ${variable['name']} lists {values}, not the {component}s {sorted(expected)}")
            if not expected <= set(values):
                problems.append(f"{name}: ${variable['name']} lists {values}, not all of {sorted(expected)}")
            if label == "topic" and any("#" in value for value in values):
                problems.append(f"{name}: $topic lists a partition's log: {values}")
    return problems
