"""The checks of `make compose-test` against a running compose stack (deploy/podman/compose-test.sh).

Standard library only: it runs with the host's python3 before any venv exists. Clients run as one-off
containers of the image on the host network, so every message goes through the broker's published port.
Each wait has a deadline; the first failed check exits non-zero with what was seen.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEADLINE_S = 120.0


def wait_for(what: str, check: Callable[[], Any], deadline_s: float = DEADLINE_S, every_s: float = 2.0) -> Any:
    """``check()``'s first truthy result; exits with ``what`` and the last error when the deadline passes."""
    end, last = time.monotonic() + deadline_s, None
    while time.monotonic() < end:
        try:
            result = check()
            if result:
                print(f"ok: {what}", flush=True)
                return result
        except Exception as exc:
            last = exc
        time.sleep(every_s)
    sys.exit(f"FAILED: {what} within {deadline_s:.0f} s (last error: {last!r})")


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)


CLIENT_LABEL: list[str] = []  # ["--label", "KEY=VALUE"]: compose-test.sh's teardown removes what a timeout left


def client(image: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A `conveyor` command in a one-off container of the image, on the host's network."""
    return podman("run", "--rm", *CLIENT_LABEL, "--network", "host", image, *args)


def prometheus_api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def query_value(base: str, expr: str) -> float | None:
    found = prometheus_api(base, "query", query=expr)["result"]
    return float(found[0]["value"][1]) if found else None


def main() -> None:
    try:
        run()
    except subprocess.TimeoutExpired as exc:
        sys.exit(f"FAILED: {' '.join(map(str, exc.cmd))} did not finish within {exc.timeout:.0f} s")


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image", required=True)
    parser.add_argument("--broker-port", required=True)
    parser.add_argument("--broker-container", required=True)
    parser.add_argument("--runner-container", required=True)
    parser.add_argument("--prometheus", required=True, help="http://HOST:PORT")
    parser.add_argument("--rules", type=Path, required=True, help="the rule file compose.yaml loads")
    parser.add_argument("--cluster-network", help="check the `cluster` profile's n1..n3, reached on this network")
    parser.add_argument("--client-label", help="KEY=VALUE put on each one-off client container")
    args = parser.parse_args()
    if args.client_label:
        CLIENT_LABEL[:] = ["--label", args.client_label]
    if args.cluster_network:
        check_cluster(args)
    else:
        check_single_node(args)


def check_cluster(args: argparse.Namespace) -> None:
    """etcd and n1..n3: three nodes alive, a replicated topic written and read back, Prometheus finds them."""
    nodes = "tcp://n1:5555,tcp://n2:5555,tcp://n3:5555"

    def on_network(*command: str) -> subprocess.CompletedProcess[str]:
        return podman("run", "--rm", *CLIENT_LABEL, "--network", args.cluster_network, args.image, *command)

    def alive() -> bool:
        status = json.loads(on_network("cluster", "status", "--broker", nodes, "--format", "json").stdout)
        return sum(node["alive"] for node in status["nodes"]) == 3

    wait_for("the cluster has 3 nodes alive (conveyor cluster status)", alive)
    wait_for(
        "a topic with 3 replicas is created",
        lambda: (
            on_network("topics", "create", "payments", "--replication-factor", "3", "--broker", nodes).returncode == 0
        ),
    )
    payment = json.dumps({"id": 17})
    wait_for(
        "publish to the replicated topic",
        lambda: on_network("publish", "--broker", nodes, "--format", "json", "payments", payment).returncode == 0,
    )
    tailed = on_network("tail", "--broker", nodes, "--from", "earliest", "--count", "1", "--format", "json", "payments")
    if tailed.returncode != 0 or "17" not in tailed.stdout:
        sys.exit(f"FAILED: tail of the replicated topic read {tailed.stdout!r}: {tailed.stderr}")
    print("ok: read the message back from the replicated topic", flush=True)
    wait_for(
        "Prometheus finds n1..n3 by DNS: 4 broker targets up",
        lambda: query_value(args.prometheus, 'count(up{job="conveyor-broker"} == 1)') == 4,
    )


def check_single_node(args: argparse.Namespace) -> None:
    broker = f"tcp://127.0.0.1:{args.broker_port}"

    wait_for(
        "the broker container is healthy (HEALTHCHECK on /livez)",
        lambda: podman("healthcheck", "run", args.broker_container).returncode == 0,
    )
    wait_for(
        "the consumer container is healthy (its /livez)",
        lambda: podman("healthcheck", "run", args.runner_container).returncode == 0,
    )

    order = json.dumps({"id": 21, "total": 9.5})
    wait_for(
        f"publish to {broker} through the published port",
        lambda: client(args.image, "publish", "--broker", broker, "--format", "json", "orders", order).returncode == 0,
    )
    tailed = client(
        args.image,
        "tail",
        "--broker",
        broker,
        "--from",
        "earliest",
        "--count",
        "1",
        "--idle-timeout",
        "30",
        "--format",
        "json",
        "orders",
    )
    if tailed.returncode != 0 or '"id": 21' not in tailed.stdout.replace('"id":21', '"id": 21'):
        sys.exit(f"FAILED: tail read back {tailed.stdout!r} (exit {tailed.returncode}): {tailed.stderr}")
    print("ok: consumed the message back through the published port", flush=True)

    base = args.prometheus
    wait_for("Prometheus is ready", lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=5).status == 200)
    for job in ("conveyor-broker", "conveyor-runner"):
        wait_for(
            f'Prometheus scrapes {job}: up{{job="{job}"}} == 1',
            lambda job=job: query_value(base, f'up{{job="{job}"}}') == 1,
        )

    # The example consumer joins its groups when it starts; publish again until its billing handler has
    # counted one message as ok (seen through Prometheus, so the runner's metrics are scraped too).
    def billed() -> bool:
        client(args.image, "publish", "--broker", broker, "--format", "json", "--quiet", "orders", order)
        value = query_value(base, 'sum(conveyor_runner_messages_total{group="billing", outcome="ok"})')
        return bool(value and value >= 1)

    wait_for("the example consumer handled orders (conveyor_runner_messages_total ok >= 1)", billed, every_s=5)

    expected = set(re.findall(r"^\s*-\s*alert:\s*(\S+)", args.rules.read_text(), flags=re.M))
    if not expected:
        sys.exit(f"FAILED: no alert in {args.rules}")

    def rules_evaluated() -> bool:
        rules = [rule for group in prometheus_api(base, "rules")["groups"] for rule in group["rules"]]
        loaded = {rule["name"] for rule in rules}
        if missing := expected - loaded:
            raise RuntimeError(f"not loaded: {sorted(missing)}")
        if unhealthy := {rule["name"]: rule.get("lastError") for rule in rules if rule.get("health") != "ok"}:
            raise RuntimeError(f"not evaluated or failing: {unhealthy}")
        return True

    wait_for(
        f"Prometheus loaded and evaluates all {len(expected)} rules of {args.rules} (/api/v1/rules)", rules_evaluated
    )


if __name__ == "__main__":
    main()
