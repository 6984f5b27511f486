"""Every query of the Cluster dashboard returns data from a real Prometheus scraping a real cluster.

Three brokers on a real etcd carry two replicated topics while Prometheus
scrapes the three every second; one follower is then killed, so the
under-replicated, below-min-ISR and follower-lag panels have something to
show. Each panel query and the ``job``, ``instance`` and ``topic`` variables are evaluated
through Prometheus' HTTP API as Grafana would, and must return at least one series;
the cluster-wide sums must be the cluster's, and the Up panel must show the killed node DOWN
(0, which the panel paints red). Prometheus also loads the shipped alert rules: each must
evaluate cleanly on a cluster's series, and the partitions below min ISR and under-replicated must
raise their (pending) alerts.
"""

from __future__ import annotations

import time
from pathlib import Path

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata

from conveyor import Producer
from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.monitoring.dashboard_helpers import (
    label_values_query,
    load_dashboards,
    queries,
    substitute,
    variable_query,
    variables,
)
from tests.monitoring.monitoring_helpers import ALERT_RULES, PrometheusServer

DASHBOARD = "conveyor-cluster.json"
VALUES = {"__rate_interval": "15s", "topic": "orders|strict", "job": "conveyor-broker"}


def target(metrics_url: str) -> str:
    return metrics_url.split("//", 1)[1].split("/", 1)[0]


def scalar(prometheus: PrometheusServer, expr: str) -> float | None:
    rows = prometheus.query(expr)
    return float(rows[0]["value"][1]) if rows else None


def up_of(prometheus: PrometheusServer, expr: str) -> dict[str, float]:
    return {row["metric"]["instance"]: float(row["value"][1]) for row in prometheus.query(expr)}


def in_sync(cluster: ClusterProcess, topic: str) -> str | None:
    partition = Metadata(cluster.bootstrap).refresh([topic]).topics.get(topic, {}).get(0)
    return partition.leader if partition is not None and len(partition.isr) == 3 else None


def traffic(bootstrap: str, seconds: float) -> None:
    started = time.monotonic()
    with Producer(bootstrap, linger_ms=2) as producer:
        sent = 0
        while time.monotonic() - started < seconds:
            for _ in range(20):
                producer.send("orders", sent)
                sent += 1
            time.sleep(0.1)
        producer.flush(timeout=60)


def test_every_cluster_dashboard_query_returns_data(tmp_path: Path) -> None:
    cluster = ClusterProcess(tmp_path / "cluster", nodes=3)
    prometheus: PrometheusServer | None = None
    try:
        # Given three nodes, "orders" (min_insync 2) and "strict" (min_insync 3), all in sync
        cluster.start()
        with Admin(cluster.bootstrap) as admin:
            admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
            admin.create_topic("strict", replication_factor=3, min_insync_replicas=3)
        leaders = {t: wait_for(lambda t=t: in_sync(cluster, t), message=f"{t} in sync") for t in ("orders", "strict")}
        # And Prometheus scraping the three every second
        targets = [target(cluster.node(node).metrics_url) for node in cluster.node_ids]
        values = {**VALUES, "instance": "|".join(targets)}
        prometheus = PrometheusServer(
            tmp_path / "prometheus", {"conveyor-broker": targets}, rule_files=(ALERT_RULES,)
        ).start()
        wait_for(prometheus.targets_up, timeout=20, message="all targets up")
        # When traffic flows, then a follower of both topics is killed and traffic goes on
        traffic(cluster.bootstrap, 3.0)
        victim = next(node for node in cluster.node_ids if node not in leaders.values())
        cluster.node(victim).kill()
        traffic(cluster.bootstrap, 3.0)
        # Then Prometheus sees one controller, both partitions under-replicated, "strict" below min ISR
        under = 'sum(conveyor_partition_under_replicated{topic=~"orders|strict"})'
        wait_for(lambda: scalar(prometheus, under) == 2, message="two under-replicated partitions in Prometheus")
        assert scalar(prometheus, "sum(conveyor_cluster_controller)") == 1
        assert scalar(prometheus, "sum(conveyor_partition_below_min_insync)") == 1
        assert scalar(prometheus, f'max(conveyor_replica_lag_seconds{{follower="{victim}"}})') > 0  # type: ignore[operator]
        time.sleep(2)  # a few more scrapes of the final state
        # And the variables list the job, the three nodes and both topics
        dashboard = load_dashboards()[DASHBOARD]
        problems = []
        expected = {"job": {"conveyor-broker"}, "instance": set(targets), "topic": {"orders", "strict"}}
        for variable in variables(dashboard):
            if variable["type"] == "query":
                selector, label = label_values_query(substitute(variable_query(variable), values))
                listed = prometheus.label_values(label, selector)
                if not expected[label] <= set(listed):
                    problems.append(f"${variable['name']} lists {listed}")
        # And every panel query returns data
        every = list(queries(DASHBOARD, dashboard))
        assert len(every) >= 15, "fewer queries than the dashboard holds"
        for query in every:
            if not prometheus.query(substitute(query.expr, values)):
                problems.append(f"no data: {query}")
        assert not problems, "\n".join(problems)
        # And the Up panel shows the killed node DOWN (the panel maps 0 to red), the two others UP
        up_query = substitute(next(q.expr for q in every if q.panel == "Up"), values)
        killed = target(cluster.node(victim).metrics_url)
        wait_for(lambda: up_of(prometheus, up_query).get(killed) == 0, message="the killed node DOWN in Prometheus")
        assert up_of(prometheus, up_query) == {t: 0.0 if t == killed else 1.0 for t in targets}
        # And every alert rule evaluates cleanly; the partitions' alerts are raised (pending: they have a `for`)
        rule_problems = prometheus.rule_problems()
        assert not rule_problems, "\n".join(rule_problems)
        below = [a["labels"]["topic"] for a in prometheus.active_alerts("ConveyorPartitionBelowMinInsync")]
        under_alerts = [a["labels"]["topic"] for a in prometheus.active_alerts("ConveyorPartitionUnderReplicated")]
        assert "strict" in below and "orders" not in below, below
        assert {"orders", "strict"} <= set(under_alerts), under_alerts
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.kill()
