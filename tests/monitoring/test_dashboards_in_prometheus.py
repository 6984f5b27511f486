"""Every query of every shipped dashboard returns data from a real Prometheus.

A real broker (whose log had a torn tail when it opened) and real `conveyor run` processes carry a few
thousand messages, with retries, dead letters, a runner killed mid-traffic, a malformed request and a
resent batch, while Prometheus scrapes them every second. Then each panel query and each template
variable query is evaluated through Prometheus' HTTP API, with the variables substituted as Grafana
would, and must return at least one series.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq
from dashboard_helpers import (
    all_queries,
    label_values_query,
    load_dashboards,
    substitute,
    variable_query,
    variables,
)
from monitoring_helpers import PrometheusServer, publish, runner_metrics_url, wait_for

from broker.client import Producer
from broker.codec import make_record
from broker.protocol import Command, Frame, decode, encode
from broker.record import pack_records
from consumers.testing import BrokerProcess

TRAFFIC_SECONDS = 8.0
VALUES = {
    "__rate_interval": "15s",  # Grafana: max(4 x scrape interval, ...) with a 1 s scrape
    "topic": "orders|payments|doomed",
    "group": "billing|ledger|graveyard",
    "handler": "app_monitored.bill|app_monitored.post|app_monitored.refuse",
}
# Queries that may legitimately return nothing in this test; each needs a reason. Keep it empty.
EXEMPT: dict[str, str] = {}


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


def test_every_dashboard_query_returns_data(tmp_path: Path, runner_factory: Any) -> None:
    broker = BrokerProcess(tmp_path / "broker")
    prometheus: PrometheusServer | None = None
    try:
        # Given a broker that recovered a torn tail at startup
        broker.start()
        publish(broker.address, "orders", range(10))
        broker.stop()
        tear_tail(tmp_path / "broker" / "topics" / "orders", b"\x00\x01torn" * 7)
        broker.restart()
        # And a runner, plus a second one in the same groups that will die mid-traffic
        runner = runner_factory(broker.address)
        victim = runner_factory(broker.address)
        # And Prometheus scraping the broker and the surviving runner every second
        prometheus = PrometheusServer(
            tmp_path / "prometheus",
            {"conveyor-broker": [target(broker.metrics_url)], "conveyor-runner": [target(runner_metrics_url(runner))]},
        ).start()
        wait_for(prometheus.targets_up, timeout=20, message="both targets up")
        # When traffic flows, with a malformed request and a resent batch
        bad_requests(broker.address)
        sent = traffic(broker.address, victim)
        time.sleep(3)  # a few more scrapes of the final state
        # Then every template variable lists values
        problems = check_variables(prometheus)
        # And every panel query returns data
        queries = all_queries()
        assert len(queries) >= 60, "fewer queries than the dashboards hold: did the loader miss some?"
        for query in queries:
            if str(query) in EXEMPT:
                continue
            result = prometheus.query(substitute(query.expr, VALUES))
            if not result:
                problems.append(f"no data: {query}")
        assert not problems, f"{len(problems)} queries without data after {sent} messages:\n" + "\n".join(problems)
        # And the numbers are the traffic's, not just present
        truncated = prometheus.query('sum(conveyor_log_truncated_bytes_total{topic="orders"})')
        assert float(truncated[0]["value"][1]) == len(b"\x00\x01torn" * 7)
        assert float(prometheus.query("sum(conveyor_log_end_offset)")[0]["value"][1]) >= sent
    finally:
        if prometheus is not None:
            prometheus.stop()
        broker.stop()


def check_variables(prometheus: PrometheusServer) -> list[str]:
    problems = []
    for name, dashboard in load_dashboards().items():
        for variable in variables(dashboard):
            if variable["type"] != "query":
                continue
            selector, label = label_values_query(substitute(variable_query(variable), VALUES))
            values = prometheus.label_values(label, selector)
            expected = set(VALUES[label].split("|"))
            if not expected <= set(values):
                problems.append(f"{name}: ${variable['name']} lists {values}, not all of {sorted(expected)}")
    return problems
