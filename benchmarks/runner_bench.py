"""What the consumer runner costs: `conveyor run` against the low-level consumer.

A broker (its own process) holds a backlog of N messages of 100 bytes; then
two consumer processes drain it in one group, acking everything. Once with
two `conveyor run` processes whose handler does nothing, once with two
processes using the low-level ``Subscription`` directly. Throughput is
N / (time from the consumers being ready to the group's committed offset
reaching the end), read from the broker's admin API.

    python -m conveyor.benchmarks.runner_bench [--messages 200000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.producer import Producer

from conveyor.testing import BrokerProcess

TOPIC = "bench-runner"
LOW_LEVEL = """
import sys
from conveyor.broker.client.subscription import Subscription
sub = Subscription(sys.argv[2], sys.argv[3], address=sys.argv[1], credit=2000)
print("ready", flush=True)
idle = 0
while idle < 20:
    batch = sub.receive(timeout=0.1)
    idle = 0 if batch else idle + 1
    sub.ack(batch)
sub.close()
"""


def publish_backlog(address: str, count: int) -> None:
    payload = b"x" * 100
    with Producer(address, linger_ms=5, batch_size=2000) as producer:
        for _ in range(count):
            producer.send(TOPIC, payload)
        producer.flush(timeout=120)


def start(kind: str, address: str, group: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind == "runner":
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "run",
            "conveyor.benchmarks.apps.noop",
            "--broker",
            address,
            "--metrics-port",
            "-1",
            "--log-level",
            "WARNING",
        ]
    else:
        cmd = [sys.executable, "-c", LOW_LEVEL, address, TOPIC, group]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready" in line:
            return
    raise RuntimeError("consumer did not start")


def drain(kind: str, address: str, count: int, group: str) -> dict[str, float]:
    procs = [start(kind, address, group) for _ in range(2)]
    try:
        for proc in procs:
            wait_ready(proc)
        started = time.perf_counter()
        with Admin(address) as admin:
            deadline = started + 120
            while time.perf_counter() < deadline:
                try:
                    if admin.describe_group(TOPIC, group)["committed_offset"] >= count:
                        break
                except Exception:
                    pass
                time.sleep(0.02)
        elapsed = time.perf_counter() - started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    return {"seconds": elapsed, "msg_per_s": count / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=".") as data:
        broker = BrokerProcess(Path(data) / "broker", fsync="batch").start()
        try:
            print(f"publishing a backlog of {args.messages:,} messages ...", file=sys.stderr)
            publish_backlog(broker.address, args.messages)
            results = {}
            for kind, group in (("low-level", "lowlevel"), ("runner", "runner")):
                print(f"draining with 2 {kind} consumers ...", file=sys.stderr)
                results[kind] = drain(kind, broker.address, args.messages, group)
        finally:
            broker.stop()
    low, run = results["low-level"]["msg_per_s"], results["runner"]["msg_per_s"]
    cost = 1 - run / low
    print("| consumers (2 processes) | msg/s | seconds |\n|---|---:|---:|")
    for kind, r in results.items():
        print(f"| {kind} | {r['msg_per_s']:,.0f} | {r['seconds']:.2f} |")
    print(
        f"\nrunner cost: {cost:.0%} of the low-level throughput (target <= 25%): {'met' if cost <= 0.25 else 'NOT met'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"messages": args.messages, "results": results, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
