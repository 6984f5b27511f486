"""Scrapes, health checks, promtool and a real Prometheus for the monitoring tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from conveyor.monitoring.metrics import (
    BrokerMetrics,
    ClusterCollector,
    HealthCollector,
    RunnerMetrics,
    StateCollector,
    WorkerPoolMetrics,
)
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, http_get, wait_for
from tests.runner.runner_helpers import RunnerProcess

__all__ = ["RunnerProcess", "start_runner"]

APPS = Path(__file__).parent / "apps"
ALERT_RULES = Path(__file__).resolve().parents[2] / "monitoring" / "alerts.yml"
RUNNER_READY = re.compile(r"\(metrics (http://\S+/metrics)\)")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


# --- processes ---------------------------------------------------------------------------------------------


def start_runner(
    address: str, out: Path, *, env: dict[str, str] | None = None, args: list[str] | None = None
) -> RunnerProcess:
    """``conveyor run app_monitored`` against ``address``, with a random metrics port."""
    return RunnerProcess(address, out, "app_monitored", env={"PYTHONPATH": str(APPS), **(env or {})}, args=args)


def runner_metrics_url(runner: RunnerProcess) -> str:
    """The runner prints ``(metrics http://127.0.0.1:PORT/metrics)`` in its ready line."""
    for line in runner.lines:
        match = RUNNER_READY.search(line)
        if match:
            return match.group(1)
    raise AssertionError("runner printed no metrics URL:\n" + "".join(runner.lines))


def healthz_url(metrics_url: str) -> str:
    return metrics_url.rsplit("/", 1)[0] + "/healthz"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make deps` (Debian's prometheus package)")
    return path


# --- scraping ---------------------------------------------------------------------------------------------


def health(metrics_url: str) -> tuple[int, dict[str, Any]]:
    status, body = http_get(healthz_url(metrics_url))
    return status, json.loads(body)


def label_sets(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


# --- what monitoring/ registers ---------------------------------------------------------------------------


def registered_families() -> dict[str, str]:
    """Family name -> type, for everything a broker, a runner and a `run --workers` supervisor expose, built on
    fresh registries."""
    broker, runner, pool = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    BrokerMetrics(broker)
    broker.register(StateCollector(lambda: {}))
    broker.register(ClusterCollector(lambda: {}))  # a broker in cluster mode
    RunnerMetrics(runner)
    WorkerPoolMetrics(pool, list)
    registries = (broker, runner, pool)
    for registry in registries:
        registry.register(HealthCollector(lambda: {"status": "HEALTHY", "checks": {}}))
    return {family.name: family.type for registry in registries for family in registry.collect()}


def exposed_names() -> set[str]:
    """Every sample name Prometheus can see: family names with their type's suffixes."""
    return {name + suffix for name, kind in registered_families().items() for suffix in SUFFIXES[kind]}


# --- the shipped alert rules ------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    """The alerting rules of monitoring/alerts.yml, every group's, in file order."""
    groups = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


# --- a real Prometheus ------------------------------------------------------------------------------------


class PrometheusServer:
    """Debian's ``prometheus`` on a free loopback port, scraping some targets every second.

    ``rule_files`` are loaded as prometheus.yml's ``rule_files`` and evaluated at the scrape interval.
    """

    def __init__(
        self,
        workdir: Path,
        targets: dict[str, list[str]],
        *,
        scrape_interval: str = "1s",
        rule_files: tuple[Path, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(_config(targets, scrape_interval, rule_files))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> PrometheusServer:
        binary = require_tool("prometheus")
        for _ in range(5):  # the free port may be taken between probing and binding
            self.port = free_port()
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={self.config}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError("prometheus did not start:\n" + self.log.read_text()[-3000:])

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if http_get(f"{self.url}/-/ready", timeout=1)[0] == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def api(self, path: str, **params: str) -> Any:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10)
        reply = json.loads(body)
        if status != 200 or reply.get("status") != "success":
            raise AssertionError(f"Prometheus rejected {path} {params}: {reply.get('error', body[:500])}")
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def label_values(self, label: str, match: str) -> list[str]:
        return list(self.api(f"label/{label}/values", **{"match[]": match}))

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule, each with its group's name under ``group``: ``health``, ``lastError``, ``alerts``."""
        return [{**rule, "group": group["name"]} for group in self.api("rules")["groups"] for rule in group["rules"]]

    def rules_evaluated(self) -> list[dict[str, Any]]:
        """The rules once each has been evaluated (health no longer ``unknown``), else an empty list."""
        rules = self.rules()
        return rules if rules and all(rule["health"] != "unknown" for rule in rules) else []

    def active_alerts(self, name: str) -> list[dict[str, Any]]:
        """The pending or firing alerts of the rule ``name``."""
        return [alert for rule in self.rules() if rule.get("name") == name for alert in rule.get("alerts", [])]

    def rule_problems(self) -> list[str]:
        """Once every rule has been evaluated: each one not evaluated cleanly (health "ok"), or one missing.

        A rule's query can be valid and still fail on real series (a many-to-many match, say); only
        evaluating it against what the brokers export shows that.
        """
        rules = wait_for(self.rules_evaluated, timeout=30, message="every alert rule evaluated once")
        problems = [
            f"{r['group']}/{r['name']}: {r['health']} {r.get('lastError', '')}" for r in rules if r["health"] != "ok"
        ]
        missing = {rule["alert"] for rule in alert_rules()} - {r["name"] for r in rules}
        if missing:
            problems.append(f"rules Prometheus did not load: {sorted(missing)}")
        return problems

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _config(targets: dict[str, list[str]], scrape_interval: str, rule_files: tuple[Path, ...] = ()) -> str:
    rules = f"rule_files: [{', '.join(repr(str(path)) for path in rule_files)}]\n" if rule_files else ""
    jobs = "".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: [{', '.join(repr(t) for t in hosts)}]\n"
        for job, hosts in targets.items()
    )
    return (
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        f"{rules}scrape_configs:\n{jobs}"
    )
