"""End-to-end throughput and latency: a real broker, one producer, two consumers.

Run with ``python -m conveyor.benchmarks.e2e_bench``. Every party is its own process,
as in production: the broker (``python -m conveyor`` started by
``conveyor.testing.BrokerProcess`` on a free port, in a fresh data
directory per scenario), one producer process (``conveyor.Producer``)
and two consumer processes (low-level ``conveyor.broker.client.subscription.Subscription``,
one group, round-robin between them). Messages are 100 bytes.

Scenarios, under each fsync policy (``batch`` and ``none`` by default):

- max-rate: the producer sends 200,000 pre-built messages as fast as it can,
  once with ``send()`` (one call and one future per message) and once with
  ``send_many()`` (lists of 1,000). Producer throughput counts from the
  first send until ``flush()`` returns (every confirm in); end-to-end
  throughput from the first send until a consumer receives the last message.
- latency: the producer paces itself at a steady 5,000 msg/s for 10 s
  (50,000 messages) with ``linger_ms=1``; each value starts with its send
  time (``time.time_ns()``) and the consumers compute receive time minus
  send time (one machine, so one clock): p50, p99, p99.9 and max.

For every scenario: CPU seconds of each process (producer and consumers from
``time.process_time()`` in the process, the broker from /proc), and a
correctness check: each value carries a sequence number, and every number
must be received exactly once (duplicates, losses and redeliveries are
counted). Progress goes to stderr, a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import platform
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import cpu_seconds, machine_busy_seconds
from conveyor.benchmarks.suite.profile import start_profilers, stop_profilers

MESSAGE_BYTES = 100
TOPIC = "e2e"
GROUP = "bench"
CONSUMERS = 2
POLICIES = ("batch", "none")
APIS = ("send", "send_many")
SEND_MANY_CHUNK = 1000  # values per send_many() call
VALUE_HEAD = struct.Struct("<qI")  # send time in ns since the epoch (0: not stamped), sequence number
PADDING = b"." * (MESSAGE_BYTES - VALUE_HEAD.size)
START_TIMEOUT = 60.0  # processes and the broker must be ready within this
STALL_TIMEOUT = 5.0  # after the producer is done, give up when nothing arrives for this long
PY_SPY_RATE = 500  # samples per second per process
BUSY_MACHINE = 0.1  # warn when other processes used more than this many CPUs during a run

TARGETS = (
    # (scenario kind, fsync policy, metric, bound, "min" or "max")
    ("max-rate", "batch", "e2e_msg_per_s", 200_000, "min"),
    ("max-rate", "none", "e2e_msg_per_s", 250_000, "min"),
    ("latency", "batch", "p99_ms", 10.0, "max"),
    ("latency", "none", "p99_ms", 5.0, "max"),
)


BROKER_ARGS: list[str] = []  # extra broker options from --broker-arg


@dataclass(frozen=True, slots=True)
class Scenario:
    kind: str  # "max-rate" or "latency"
    fsync: str
    api: str  # "send" or "send_many"
    messages: int
    rate: float = 0.0  # msg/s for "latency"; 0 means as fast as possible
    linger_ms: float | None = None  # None: the Producer's default
    credit: int = 2000
    tick_ms: float = 0.0  # latency runs: the producer sleeps at least this long between sends (0: per message)

    @property
    def label(self) -> str:
        pace = f"{self.rate:,.0f} msg/s" if self.rate else "max rate"
        return f"{self.kind} fsync={self.fsync} api={self.api} ({self.messages:,} msgs, {pace})"


@dataclass(slots=True)
class ConsumerResult:
    index: int
    received: int
    redelivered: int
    last_received: float  # time.time() of the last batch
    cpu_seconds: float
    seqs: bytes  # array("I") of the sequence numbers received, in order
    latencies_ns: bytes  # array("q") of receive minus send times


@dataclass(slots=True)
class ProducerResult:
    started: float  # time.time() just before the first send
    flushed: float  # time.time() when flush() returned
    sent: int
    cpu_seconds: float
    linger_ms: float
    batch_size: int
    failed: int = 0


@dataclass(slots=True)
class Result:
    scenario: Scenario
    producer_msg_per_s: float
    e2e_msg_per_s: float
    send_seconds: float
    e2e_seconds: float
    received: int
    unique: int
    duplicates: int
    lost: int
    redelivered: int
    cpu: dict[str, float]
    linger_ms: float
    batch_size: int
    latency_ms: dict[str, float] = field(default_factory=dict)
    other_cpu: float = 0.0  # CPU seconds used meanwhile by processes outside the benchmark (a busy machine)
    wall_seconds: float = 0.0  # from the start signal until every process reported
    runs: list[dict[str, float]] = field(default_factory=list)  # with --repeat: every run's key numbers

    @property
    def correct(self) -> bool:
        return self.duplicates == 0 and self.lost == 0

    @property
    def p99_ms(self) -> float:
        return self.latency_ms.get("p99", float("nan"))


@dataclass(frozen=True, slots=True)
class TargetCheck:
    description: str
    bound: float
    measured: float
    direction: str

    @property
    def met(self) -> bool:
        return self.measured >= self.bound if self.direction == "min" else self.measured <= self.bound


# --- the processes -------------------------------------------------------------------------


def make_value(seq: int, sent_ns: int = 0) -> bytes:
    return VALUE_HEAD.pack(sent_ns, seq) + PADDING


def consumer_main(
    index: int,
    address: str,
    credit: int,
    ready: Event,
    go: Event,
    stop: Event,
    counter: Synchronized[int],
    results: multiprocessing.Queue[Any],
) -> None:
    """Receive and ack until told to stop; report what arrived and when."""
    from conveyor.broker.client.subscription import Subscription

    sub = Subscription(TOPIC, GROUP, address=address, credit=credit)
    deadline = time.monotonic() + START_TIMEOUT
    while not sub.subscribed and time.monotonic() < deadline:
        sub.receive(timeout=0.05)
    ready.set()
    go.wait(START_TIMEOUT)
    unpack = VALUE_HEAD.unpack_from
    seqs = array("I")
    latencies = array("q")
    received = redelivered = 0
    last = 0.0
    cpu0 = time.process_time()
    while not stop.is_set():
        batch = sub.receive(timeout=0.05)
        if not batch:
            continue
        now_ns = time.time_ns()
        last = now_ns / 1e9
        for message in batch:
            sent, seq = unpack(message.body)
            seqs.append(seq)
            if sent:
                latencies.append(now_ns - sent)
            if message.attempt > 1:
                redelivered += 1
        sub.ack(batch)
        received += len(batch)
        counter.value = received
    cpu = time.process_time() - cpu0
    results.put(ConsumerResult(index, received, redelivered, last, cpu, seqs.tobytes(), latencies.tobytes()))
    sub.close()


def producer_main(
    scenario: Scenario, address: str, ready: Event, go: Event, results: multiprocessing.Queue[Any]
) -> None:
    """Send the scenario's messages, flush, and report the times and the CPU used."""
    from conveyor.broker.client.producer import Producer

    options: dict[str, Any] = {}
    if scenario.linger_ms is not None:
        options["linger_ms"] = scenario.linger_ms
    producer = Producer(address, **options)
    # max-rate: values are made before the clock starts, so only the client is timed.
    values = [make_value(i) for i in range(scenario.messages)] if not scenario.rate else []
    ready.set()
    go.wait(START_TIMEOUT)
    cpu0 = time.process_time()
    started = time.time()
    if scenario.rate:
        paced_send(producer, scenario)
    elif scenario.api == "send_many":
        send_many = producer.send_many
        for i in range(0, len(values), SEND_MANY_CHUNK):
            send_many(TOPIC, values[i : i + SEND_MANY_CHUNK])
    else:
        send = producer.send
        for value in values:
            send(TOPIC, value)
    failed = 0
    try:
        producer.flush(timeout=60)
    except TimeoutError:
        failed = scenario.messages
    flushed = time.time()
    cpu = time.process_time() - cpu0
    result = ProducerResult(
        started, flushed, scenario.messages, cpu, producer.linger * 1000, producer.batch_size, failed
    )
    producer.close()
    results.put(result)


def paced_send(producer: Any, scenario: Scenario) -> None:
    """Send at ``scenario.rate``: whatever is due now, stamped, then sleep until the next one is due.

    With ``tick_ms``, sleep at least that long between rounds (fewer wake-ups, small bursts);
    each message is stamped when it is actually sent either way.
    """
    interval = 1.0 / scenario.rate
    tick = scenario.tick_ms / 1000
    start = time.monotonic()
    sent = 0
    total = scenario.messages
    pack = VALUE_HEAD.pack
    many = scenario.api == "send_many"
    while sent < total:
        due = min(total, int((time.monotonic() - start) / interval) + 1)
        if due > sent:
            if many:
                now_ns = time.time_ns()
                producer.send_many(TOPIC, [pack(now_ns, seq) + PADDING for seq in range(sent, due)])
            else:
                for seq in range(sent, due):
                    producer.send(TOPIC, pack(time.time_ns(), seq) + PADDING)
            sent = due
        pause = max(start + sent * interval - time.monotonic(), tick)
        if pause > 0:
            time.sleep(pause)


# --- one scenario ---------------------------------------------------------------------------


def run_scenario(
    root: Path, scenario: Scenario, report: Callable[[str], None], profile: Path | None = None, *, gil: bool = False
) -> Result:
    from conveyor.testing import BrokerProcess

    ctx: SpawnContext = multiprocessing.get_context("spawn")
    data_dir = Path(tempfile.mkdtemp(prefix=f"{scenario.kind}-{scenario.fsync}-", dir=root))
    broker = BrokerProcess(data_dir, fsync=scenario.fsync, extra=BROKER_ARGS).start()
    procs: list[multiprocessing.process.BaseProcess] = []
    profilers: list[subprocess.Popen[bytes]] = []
    try:
        results: multiprocessing.Queue[Any] = ctx.Queue()
        go, stop = ctx.Event(), ctx.Event()
        counters = [ctx.Value("q", 0, lock=False) for _ in range(CONSUMERS)]
        readies = [ctx.Event() for _ in range(CONSUMERS + 1)]
        for i in range(CONSUMERS):
            args = (i, broker.address, scenario.credit, readies[i], go, stop, counters[i], results)
            procs.append(ctx.Process(target=consumer_main, args=args, name=f"consumer-{i}"))
        args_p = (scenario, broker.address, readies[-1], go, results)
        procs.append(ctx.Process(target=producer_main, args=args_p, name="producer"))
        for proc in procs:
            proc.start()
        for ready in readies:
            if not ready.wait(START_TIMEOUT):
                raise RuntimeError(f"a process did not get ready in {START_TIMEOUT} s")
        if profile is not None:
            pids = {"broker": broker.pid, "producer": procs[-1].pid or 0}
            pids.update({f"consumer{i + 1}": procs[i].pid or 0 for i in range(CONSUMERS)})
            stem = f"{scenario.kind}-{scenario.fsync}-{scenario.api}"
            profilers = start_profilers(profile, stem, pids, rate=PY_SPY_RATE, threads=True, gil=gil)
        cpu0, busy0, own0, wall0 = (
            cpu_seconds(broker.pid),
            machine_busy_seconds(),
            time.process_time(),
            time.time(),
        )
        go.set()
        producer, consumers = _collect(scenario, results, counters, procs[-1], stop)
        broker_cpu = cpu_seconds(broker.pid) - cpu0
        busy, own, wall = machine_busy_seconds() - busy0, time.process_time() - own0, time.time() - wall0
    finally:
        stop_profilers(profilers)
        if procs:
            stop.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        broker.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    result = summarize(scenario, producer, consumers, broker_cpu)
    result.other_cpu = max(0.0, busy - own - sum(result.cpu.values()))
    result.wall_seconds = wall
    return result


def key_numbers(r: Result) -> dict[str, float]:
    numbers = {"producer_msg_per_s": r.producer_msg_per_s, "e2e_msg_per_s": r.e2e_msg_per_s, "other_cpu": r.other_cpu}
    numbers.update({f"{k}_ms": v for k, v in r.latency_ms.items() if k != "samples"})
    numbers.update({f"cpu_{k.replace(' ', '_')}": v for k, v in r.cpu.items()})
    return numbers


def median_run(results: Sequence[Result]) -> Result:
    """The run in the middle by the scenario's headline number (end-to-end msg/s, or p99), with every run's numbers."""
    if results[0].scenario.kind == "max-rate":
        ordered = sorted(results, key=lambda r: r.e2e_msg_per_s)
    else:
        ordered = sorted(results, key=lambda r: r.p99_ms)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.runs = [key_numbers(r) for r in results]
    return chosen


def _collect(
    scenario: Scenario,
    results: multiprocessing.Queue[Any],
    counters: Sequence[Synchronized[int]],
    producer_proc: multiprocessing.process.BaseProcess,
    stop: Event,
) -> tuple[ProducerResult, list[ConsumerResult]]:
    """Wait for the producer's report and for every message (or a stall), then stop the consumers."""
    producer: ProducerResult | None = None
    consumers: list[ConsumerResult] = []
    seen, progress_at = 0, time.monotonic()
    budget = time.monotonic() + START_TIMEOUT + (scenario.messages / scenario.rate if scenario.rate else 0)
    while True:
        try:
            item = results.get(timeout=0.01)
            if isinstance(item, ProducerResult):
                producer = item
            else:
                consumers.append(item)
        except queue.Empty:
            pass
        now = time.monotonic()
        total = sum(c.value for c in counters)
        if total != seen:
            seen, progress_at = total, now
        if producer is not None and total >= scenario.messages:
            break
        stalled = producer is not None and now - progress_at > STALL_TIMEOUT
        if stalled or now > budget or (producer is None and not producer_proc.is_alive() and results.empty()):
            break
    stop.set()
    deadline = time.monotonic() + 30
    while len(consumers) < len(counters) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            item = results.get(timeout=0.1)
            if isinstance(item, ProducerResult):
                producer = item
            else:
                consumers.append(item)
    if producer is None:
        raise RuntimeError("the producer did not report (see its traceback above)")
    if len(consumers) < len(counters):
        raise RuntimeError("a consumer did not report (see its traceback above)")
    return producer, consumers


def summarize(
    scenario: Scenario, producer: ProducerResult, consumers: Sequence[ConsumerResult], broker_cpu: float
) -> Result:
    counts = bytearray(scenario.messages)
    received = duplicates = extra = 0
    latencies = array("q")
    for c in consumers:
        seqs = array("I")
        seqs.frombytes(c.seqs)
        received += len(seqs)
        for seq in seqs:
            if seq >= scenario.messages:
                extra += 1
            elif counts[seq]:
                duplicates += 1
            else:
                counts[seq] = 1
        latencies.frombytes(c.latencies_ns)
    unique = sum(counts)
    last = max((c.last_received for c in consumers), default=producer.started)
    send_seconds = producer.flushed - producer.started
    e2e_seconds = max(last, producer.started) - producer.started
    cpu = {"producer": producer.cpu_seconds, "broker": broker_cpu}
    for c in sorted(consumers, key=lambda c: c.index):
        cpu[f"consumer {c.index + 1}"] = c.cpu_seconds
    return Result(
        scenario=scenario,
        producer_msg_per_s=scenario.messages / send_seconds if send_seconds > 0 else 0.0,
        e2e_msg_per_s=unique / e2e_seconds if e2e_seconds > 0 else 0.0,
        send_seconds=send_seconds,
        e2e_seconds=e2e_seconds,
        received=received,
        unique=unique,
        duplicates=duplicates + extra,
        lost=scenario.messages - unique,
        redelivered=sum(c.redelivered for c in consumers),
        cpu=cpu,
        linger_ms=producer.linger_ms,
        batch_size=producer.batch_size,
        latency_ms=percentiles(latencies),
    )


def percentiles(latencies_ns: array[int]) -> dict[str, float]:
    """Nearest-rank p50, p99, p99.9 and max, in milliseconds."""
    if not latencies_ns:
        return {}
    ordered = sorted(latencies_ns)
    n = len(ordered)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(n * p / 100) - 1))] / 1e6

    return {"p50": rank(50), "p99": rank(99), "p99.9": rank(99.9), "max": ordered[-1] / 1e6, "samples": float(n)}


# --- targets and reporting -------------------------------------------------------------------


def check_targets(results: Sequence[Result]) -> list[TargetCheck]:
    """The issue's targets, each against every matching scenario (one line per producer API)."""
    checks = []
    for kind, policy, metric, bound, direction in TARGETS:
        for r in results:
            if r.scenario.kind != kind or r.scenario.fsync != policy:
                continue
            what = "end-to-end msg/s" if metric == "e2e_msg_per_s" else f"p99 ms at {r.scenario.rate:,.0f} msg/s"
            description = f"{what}, fsync={policy}, {r.scenario.api}()"
            checks.append(TargetCheck(description, bound, float(getattr(r, metric)), direction))
    return checks


def _cpu_cells(r: Result) -> str:
    consumers = [v for k, v in r.cpu.items() if k.startswith("consumer")]
    per_msg = sum(r.cpu.values()) / r.scenario.messages * 1e6
    cells = " | ".join(f"{v:.2f}" for v in [r.cpu["producer"], r.cpu["broker"], *consumers])
    return f"{cells} | {per_msg:.1f} | {r.other_cpu:.2f}"


def _check_cells(r: Result) -> str:
    return f"{r.unique:,} | {r.duplicates:,} | {r.lost:,} | {r.redelivered:,}"


def throughput_table(results: Sequence[Result]) -> str:
    head = (
        "| fsync | API | linger ms / batch | producer msg/s | end-to-end msg/s | CPU s producer | CPU s broker "
        "| CPU s consumer 1 | CPU s consumer 2 | CPU µs/msg (all) | CPU s other | received once | duplicates | lost "
        "| redelivered |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {r.scenario.fsync} | {r.scenario.api}() | {r.linger_ms:g} / {r.batch_size} | {r.producer_msg_per_s:,.0f} "
        f"| {r.e2e_msg_per_s:,.0f} | {_cpu_cells(r)} | {_check_cells(r)} |"
        for r in results
        if r.scenario.kind == "max-rate"
    ]
    return "\n".join([head, *rows])


def latency_table(results: Sequence[Result]) -> str:
    head = (
        "| fsync | API | rate msg/s | linger ms | messages | p50 ms | p99 ms | p99.9 ms | max ms | CPU s producer "
        "| CPU s broker | CPU s consumer 1 | CPU s consumer 2 | CPU µs/msg (all) | CPU s other | received once "
        "| duplicates | lost | redelivered |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for r in results:
        if r.scenario.kind != "latency":
            continue
        lat = " | ".join(f"{r.latency_ms.get(k, float('nan')):.2f}" for k in ("p50", "p99", "p99.9", "max"))
        rows.append(
            f"| {r.scenario.fsync} | {r.scenario.api}() | {r.scenario.rate:,.0f} | {r.linger_ms:g} "
            f"| {r.scenario.messages:,} | {lat} | {_cpu_cells(r)} | {_check_cells(r)} |"
        )
    return "\n".join([head, *rows])


def targets_markdown(checks: Sequence[TargetCheck]) -> str:
    lines = ["| target | bound | measured | met |", "|---|---:|---:|---|"]
    for t in checks:
        sign = ">=" if t.direction == "min" else "<="
        fmt = ",.0f" if t.bound >= 1000 else ".2f"
        lines.append(
            f"| {t.description} | {sign} {t.bound:{fmt}} | {t.measured:{fmt}} | {'yes' if t.met else '**NO**'} |"
        )
    lines.append(f"\nTargets met: {sum(t.met for t in checks)}/{len(checks)}")
    return "\n".join(lines)


def progress(r: Result) -> str:
    line = f"[e2e_bench] {r.scenario.label}: "
    if r.scenario.kind == "max-rate":
        line += f"producer {r.producer_msg_per_s:,.0f} msg/s, end-to-end {r.e2e_msg_per_s:,.0f} msg/s"
    else:
        lat = r.latency_ms
        line += (
            f"p50 {lat.get('p50', 0):.2f} ms, p99 {lat.get('p99', 0):.2f} ms, "
            f"p99.9 {lat.get('p99.9', 0):.2f} ms, max {lat.get('max', 0):.2f} ms"
        )
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu.items())
    verdict = "exactly once" if r.correct else f"{r.duplicates} DUPLICATES, {r.lost} LOST"
    return f"{line}; CPU s: {cpu}; other processes {r.other_cpu:.2f} CPU s in {r.wall_seconds:.1f} s; {verdict}"


def to_json(results: Sequence[Result], checks: Sequence[TargetCheck], settings: dict[str, Any]) -> dict[str, Any]:
    out = []
    for r in results:
        item = asdict(r)
        item["correct"] = r.correct
        out.append(item)
    return {
        "settings": settings,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "results": out,
        "targets": [{**asdict(t), "met": t.met} for t in checks],
    }


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.e2e_bench", description=doc.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run (a smoke test, not a measurement)")
    parser.add_argument(
        "--fsync",
        action="append",
        metavar="POLICY",
        help="broker fsync policy; repeat for several (default: batch, none)",
    )
    parser.add_argument(
        "--api", action="append", choices=APIS, help="producer API for max-rate runs; repeat (default: both)"
    )
    parser.add_argument("--messages", type=int, help="messages per max-rate run (default 200,000; --quick 50,000)")
    parser.add_argument("--rate", type=float, default=5000.0, help="paced rate of the latency runs, msg/s")
    parser.add_argument("--duration", type=float, help="seconds per latency run (default 10; --quick 2)")
    parser.add_argument("--linger-ms", type=float, default=1.0, help="producer linger of the latency runs")
    parser.add_argument("--credit", type=int, default=2000, help="credit of each consumer")
    parser.add_argument(
        "--tick-ms", type=float, default=0.0, help="latency runs: least sleep between sends (default 0: per message)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each scenario N times and report the median run (default 1)"
    )
    parser.add_argument("--no-latency", action="store_true", help="skip the latency runs")
    parser.add_argument("--no-max-rate", action="store_true", help="skip the max-rate runs")
    parser.add_argument("--dir", metavar="DIR", help="where the broker's data goes (default: the system temp dir)")
    parser.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra broker option, e.g. --broker-arg=--no-metrics (repeatable); clients take "
        "CURVE keys from CONVEYOR_CURVE_SERVER_KEY / CONVEYOR_CURVE_KEY",
    )
    parser.add_argument(
        "--py-spy", metavar="DIR", help="profile every process with py-spy (raw collapsed stacks into DIR)"
    )
    parser.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed or a message is lost")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> list[Scenario]:
    from conveyor.broker.client.producer import Producer

    messages = args.messages or (50_000 if args.quick else 200_000)
    duration = args.duration or (2.0 if args.quick else 10.0)
    apis = [a for a in (args.api or APIS) if a != "send_many" or hasattr(Producer, "send_many")]
    scenarios = []
    for policy in args.fsync or POLICIES:
        if not args.no_max_rate:
            scenarios += [Scenario("max-rate", policy, api, messages, credit=args.credit) for api in apis]
        if not args.no_latency:
            count = max(1, round(args.rate * duration))
            scenarios.append(
                Scenario("latency", policy, "send", count, args.rate, args.linger_ms, args.credit, args.tick_ms)
            )
    return scenarios


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    BROKER_ARGS[:] = args.broker_arg
    scenarios = plan(args)

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="conveyor-e2e-bench-", dir=args.dir) as tmp:
        report(f"[e2e_bench] {len(scenarios)} scenarios; broker data in {tmp}")
        for scenario in scenarios:
            runs = []
            for i in range(max(1, args.repeat)):
                report(
                    f"[e2e_bench] running {scenario.label}"
                    + (f", run {i + 1}/{args.repeat}" if args.repeat > 1 else "")
                )
                profile = Path(args.py_spy) if args.py_spy else None
                runs.append(run_scenario(Path(tmp), scenario, report, profile, gil=args.py_spy_gil))
                report(progress(runs[-1]))
            results.append(median_run(runs))
    checks = check_targets(results)
    print(
        f"Conveyor end to end: 1 producer, broker, {CONSUMERS} consumers (one group, credit {args.credit}), "
        f"each its own process; {MESSAGE_BYTES}-byte messages; {os.cpu_count()} CPUs; "
        f"{time.monotonic() - began:.0f} s in all.\n"
    )
    if any(r.scenario.kind == "max-rate" for r in results):
        print("Max rate (producer: first send to flush() done; end-to-end: first send to last message received):\n")
        print(throughput_table(results))
        print()
    if any(r.scenario.kind == "latency" for r in results):
        print("Latency at a steady rate (send to receive, across processes on one clock):\n")
        print(latency_table(results))
        print()
    print(targets_markdown(checks))
    busy = [r for r in results if r.other_cpu > BUSY_MACHINE * r.wall_seconds]
    if busy:
        worst = max(r.other_cpu / r.wall_seconds for r in busy)
        print(
            f"\n**Warning:** other processes used up to {worst:.2f} CPUs during {len(busy)} of these runs "
            "(see the 'CPU s other' column); on a shared machine the numbers are pessimistic."
        )
    if args.json:
        settings = {
            "message_bytes": MESSAGE_BYTES,
            "consumers": CONSUMERS,
            "send_many_chunk": SEND_MANY_CHUNK,
            "quick": args.quick,
            "credit": args.credit,
        }
        Path(args.json).write_text(json.dumps(to_json(results, checks, settings), indent=2) + "\n")
    failed = not all(t.met for t in checks) or not all(r.correct for r in results)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
