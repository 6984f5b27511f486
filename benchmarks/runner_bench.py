"""What the consumer runner costs: `conveyor run` against the low-level consumer.

A broker (its own process) holds a backlog of N messages, each an order as a
msgpack map of about 100 bytes (what a producer sends for a model); then two
consumer processes drain it in one group each, acking everything, one kind
after the other in one run:

- ``low-level``: the ``Subscription`` directly (receive, ack the batch);
- ``runner``: ``conveyor run`` with a handler that does nothing (``Message``);
- ``runner+middleware``: the same with one middleware with both per-message hooks;
- ``typed:dataclass``, ``typed:pydantic``, ``typed:msgspec``: a handler annotated
  with the model, decoded for each message (pydantic and msgspec when installed).

Throughput is N / (time from the consumers being ready to the group's
committed offset reaching the end), read from the broker's admin API.

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


APPS = {  # kind -> (the module ``conveyor run`` loads, its group); the low-level kind has no module
    "runner": ("conveyor.benchmarks.apps.noop", "runner"),
    "runner+middleware": ("conveyor.benchmarks.apps.middleware", "middleware"),
    "typed:dataclass": ("conveyor.benchmarks.apps.typed_dataclass", "typed-dataclass"),
    "typed:pydantic": ("conveyor.benchmarks.apps.typed_pydantic", "typed-pydantic"),
    "typed:msgspec": ("conveyor.benchmarks.apps.typed_msgspec", "typed-msgspec"),
}
EXTRAS = {"typed:pydantic": "pydantic", "typed:msgspec": "msgspec"}


def order(i: int) -> dict[str, object]:
    """An order of about 100 bytes once packed: the same value for every kind."""
    return {"id": i, "customer": f"customer-{i % 1000:04d}", "total": 9.5 + i % 100, "note": "x" * 40}


def publish_backlog(address: str, count: int) -> None:
    with Producer(address, linger_ms=5, batch_size=2000) as producer:
        for start in range(0, count, 1000):
            producer.send_many(TOPIC, [order(i) for i in range(start, min(count, start + 1000))])
        producer.flush(timeout=120)


def kinds() -> list[str]:
    """Every kind whose extra is installed."""
    import importlib.util

    out = ["low-level"]
    for kind in APPS:
        extra = EXTRAS.get(kind)
        if extra is None or importlib.util.find_spec(extra) is not None:
            out.append(kind)
        else:
            print(f"{kind}: skipped ({extra} is not installed: pip install 'conveyor[{extra}]')", file=sys.stderr)
    return out


def start(kind: str, address: str, group: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind in APPS:
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "run",
            APPS[kind][0],
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
            for kind in kinds():
                print(f"draining with 2 {kind} consumers ...", file=sys.stderr)
                group = APPS[kind][1] if kind in APPS else "lowlevel"
                results[kind] = drain(kind, broker.address, args.messages, group)
        finally:
            broker.stop()
    low, run = results["low-level"]["msg_per_s"], results["runner"]["msg_per_s"]
    cost = 1 - run / low
    print("| consumers (2 processes) | msg/s | seconds | vs low-level | vs runner |\n|---|---:|---:|---:|---:|")
    for kind, r in results.items():
        print(
            f"| {kind} | {r['msg_per_s']:,.0f} | {r['seconds']:.2f} | {r['msg_per_s'] / low:.2f}x "
            f"| {r['msg_per_s'] / run:.2f}x |"
        )
    print(
        f"\nrunner cost: {cost:.0%} of the low-level throughput (target <= 25%): {'met' if cost <= 0.25 else 'NOT met'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"messages": args.messages, "results": results, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
