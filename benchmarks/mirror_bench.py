"""What a mirror hop costs: latency added per level and throughput through a hop.

Three brokers, each its own process: root -> L2 -> L3 (``--upstream``,
``--mirror '*'``). A producer process publishes at the root; consumer
processes (low-level ``Subscription``) read the same topic at the root, at
L2 and at L3, each in its own group.

- Latency: a paced producer (5,000 msg/s) stamps ``time.time_ns()`` into each
  100-byte value; each consumer records receive time minus send time. The
  added latency of a hop is the difference of the p50s of adjacent levels.
- Throughput: a backlog-free max-rate run of N messages; end-to-end msg/s
  at the root (a single broker) and at L2 (one hop), from the first send to
  the last message received.

    python -m conveyor.benchmarks.mirror_bench [--levels 2|3] [--repeat N] [--messages 200000] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import cpu_seconds
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.testing import BrokerProcess

STAMP = struct.Struct(">q")
LEVELS = ("root", "L2", "L3")


def consume(address: str, topic: str, group: str, expected: int, out: Any) -> None:
    sub = Subscription(topic, group, address=address, credit=2000)
    cpu0 = time.process_time()
    latencies: list[float] = []
    first = last = 0.0
    count = 0
    deadline = time.monotonic() + 120
    while count < expected and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.5)
        if not batch:
            continue
        now = time.time_ns()
        first = first or time.time()
        last = time.time()
        latencies += [(now - STAMP.unpack_from(m.body)[0]) / 1e6 for m in batch]
        count += len(batch)
        sub.ack(batch)
    sub.close()
    cpu = time.process_time() - cpu0
    out.put({"group": group, "count": count, "first": first, "last": last, "latencies_ms": latencies, "cpu_s": cpu})


def produce(address: str, topic: str, count: int, rate: float | None) -> float:
    pad = b"x" * (100 - STAMP.size)
    started = time.time()
    with Producer(address, linger_ms=1 if rate else 5, batch_size=1000) as producer:
        for i in range(count):
            if rate:
                due = started + i / rate
                wait = due - time.time()
                if wait > 0:
                    time.sleep(wait)
            producer.send(topic, STAMP.pack(time.time_ns()) + pad)
        producer.flush(timeout=120)
    return started


def run(levels: list[BrokerProcess], topic: str, count: int, rate: float | None) -> dict[str, Any]:
    out: Any = mp.Queue()
    names = LEVELS[: len(levels)]
    consumers = [
        mp.Process(target=consume, args=(b.address, topic, f"bench-{name}", count, out))
        for b, name in zip(levels, names, strict=True)
    ]
    for proc in consumers:
        proc.start()
    time.sleep(1.5)  # subscribed (and the topic discovered downstream) before the first send
    brokers0 = [cpu_seconds(b.pid) for b in levels]
    wall0, producer0 = time.monotonic(), time.process_time()
    started = produce(levels[0].address, topic, count, rate)
    producer_cpu = time.process_time() - producer0
    results = {r["group"].removeprefix("bench-"): r for r in (out.get(timeout=180) for _ in consumers)}
    wall = time.monotonic() - wall0
    brokers_cpu = [cpu_seconds(b.pid) - c for b, c in zip(levels, brokers0, strict=True)]
    for proc in consumers:
        proc.join(30)
    summary: dict[str, Any] = {}
    for name in names:
        r = results[name]
        lat = sorted(r["latencies_ms"])
        summary[name] = {
            "received": r["count"],
            "msg_per_s": r["count"] / max(1e-9, r["last"] - started),
            "p50_ms": statistics.median(lat) if lat else None,
            "p99_ms": lat[int(len(lat) * 0.99) - 1] if lat else None,
        }
    cpu = {f"broker {n}": round(c, 2) for n, c in zip(names, brokers_cpu, strict=True)}
    cpu["producer"] = round(producer_cpu, 2)
    cpu.update({f"consumer {n}": round(results[n]["cpu_s"], 2) for n in names})
    summary["cpu_seconds"] = cpu
    summary["wall_seconds"] = round(wall, 2)
    return summary


def hop_costs(paced: dict[str, Any], maxed: dict[str, Any], names: tuple[str, ...]) -> tuple[list[float], float]:
    """Added p50 per hop (adjacent levels' difference) and throughput at L2 over the root's."""
    hops = [paced[b]["p50_ms"] - paced[a]["p50_ms"] for a, b in itertools.pairwise(names)]
    return hops, maxed["L2"]["msg_per_s"] / maxed["root"]["msg_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--paced", type=int, default=25_000, help="messages in the 5,000 msg/s latency run")
    parser.add_argument(
        "--levels", type=int, choices=(2, 3), default=3, help="brokers in the chain (2: root -> L2, fewer processes)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds (paced, then max rate); report the median")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(dir=".") as data:
        root = BrokerProcess(Path(data) / "root").start()
        l2 = BrokerProcess(Path(data) / "l2", extra=["--upstream", root.address, "--mirror", "*"]).start()
        chain = [root, l2]
        if args.levels == 3:
            chain.append(BrokerProcess(Path(data) / "l3", extra=["--upstream", l2.address, "--mirror", "*"]).start())
        names = LEVELS[: len(chain)]
        try:
            for i in range(args.repeat):
                tag = f" (round {i + 1} of {args.repeat})" if args.repeat > 1 else ""
                print(f"paced 5,000 msg/s through {' -> '.join(names)}{tag} ...", file=sys.stderr)
                paced = run(chain, f"paced-{i}", args.paced, 5000.0)
                print(f"max rate, {args.messages:,} messages{tag} ...", file=sys.stderr)
                rounds.append((paced, run([root, l2], f"max-{i}", args.messages, None)))
        finally:
            for broker in reversed(chain):
                broker.stop()
    costs = [hop_costs(paced, maxed, names) for paced, maxed in rounds]
    middle = sorted(range(len(rounds)), key=lambda i: costs[i][0][0])[len(rounds) // 2]  # the median first hop
    paced, maxed = rounds[middle]
    hops, ratio = costs[middle]
    print("| level | p50 ms @5k/s | p99 ms @5k/s | max-rate msg/s |\n|---|---:|---:|---:|")
    for name in names:
        tp = maxed.get(name, {}).get("msg_per_s")
        print(f"| {name} | {paced[name]['p50_ms']:.2f} | {paced[name]['p99_ms']:.2f} | {f'{tp:,.0f}' if tp else '-'} |")
    named = ", ".join(f"{hop:.2f} ms ({a}->{b})" for hop, (a, b) in zip(hops, itertools.pairwise(names), strict=False))
    print(f"\nadded p50 per hop: {named}; target <= 2 ms")
    print(f"throughput through one hop: {ratio:.0%} of the single broker's; target >= 80%")
    if len(rounds) > 1:
        print(
            f"the median of {len(rounds)} rounds by the first hop; every round: "
            + "; ".join(
                "hops " + ", ".join(f"{h:.2f}" for h in round_hops) + f" ms, {round_ratio:.0%}"
                for round_hops, round_ratio in costs
            )
        )
    cpu = paced["cpu_seconds"]
    busy = sum(cpu.values()) / paced["wall_seconds"]
    print(
        f"CPU seconds in the paced run ({paced['wall_seconds']:.1f} s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
        + f"; {busy:.2f} CPUs busy of the {os.cpu_count()}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "paced": paced,
                    "max": maxed,
                    "hop_ms": hops,
                    "hop_throughput_ratio": ratio,
                    "rounds": [
                        {"paced": p, "max": m, "hop_ms": h, "hop_throughput_ratio": r}
                        for (p, m), (h, r) in zip(rounds, costs, strict=True)
                    ],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
