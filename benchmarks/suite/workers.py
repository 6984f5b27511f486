"""The producer and consumer processes: the same loop for every system, only the client differs."""

from __future__ import annotations

import time
import traceback
from array import array
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

from conveyor.benchmarks.suite import payload
from conveyor.benchmarks.suite.procstat import self_cpu_seconds
from conveyor.benchmarks.suite.scenario import Scenario

START_TIMEOUT = 60.0


@dataclass(slots=True)
class ProducerReport:
    index: int
    started: float  # time.time() just before the first send
    flushed: float  # time.time() once every message was confirmed
    sent: int
    failed: int
    cpu_seconds: float
    api: str
    first_seq: int = 0  # this producer sent sequence numbers [first_seq, first_seq + sent)


@dataclass(slots=True)
class ConsumerReport:
    group: int
    index: int
    received: int
    first_received: float
    last_received: float
    cpu_seconds: float
    seqs: bytes = b""  # array("I"): sequence numbers, in arrival order
    latencies_us: bytes = b""  # array("q"): receive minus send time, microseconds
    sent_ms: bytes = b""  # array("q"): send time, ms since the epoch (for latency over time)


@dataclass(slots=True)
class WorkerError:
    role: str
    index: int
    error: str
    extra: dict[str, Any] = field(default_factory=dict)


def producer_main(
    system: str,
    endpoint: dict[str, Any],
    scenario: Scenario,
    index: int,
    first_seq: int,
    count: int,
    ready: Event,
    go: Event,
    counter: Synchronized[int],
    results: Queue[Any],
) -> None:
    try:
        from conveyor.benchmarks.suite.systems import module

        client = module(system).make_producer(endpoint, scenario, index)
        pad = payload.padding(scenario.message_size)
        ready.set()
        if not go.wait(START_TIMEOUT):
            return
        cpu0 = self_cpu_seconds()
        started = time.time()
        if scenario.paced:
            sent = _paced(client, scenario, first_seq, count, pad, counter)
        else:
            sent = _max_rate(client, scenario, first_seq, count, pad, counter)
        failed = client.flush()
        flushed = time.time()
        cpu = self_cpu_seconds() - cpu0
        results.put(ProducerReport(index, started, flushed, sent, failed, cpu, client.api, first_seq))
        client.close()
    except BaseException:
        results.put(WorkerError("producer", index, traceback.format_exc()))
        raise


def _max_rate(client: Any, scenario: Scenario, first: int, count: int, pad: bytes, counter: Synchronized[int]) -> int:
    deadline = time.monotonic() + scenario.duration
    chunk = scenario.batch_size
    send, make = client.send, payload.make_values
    sent = 0
    while sent < count:
        n = min(chunk, count - sent)
        send(make(range(first + sent, first + sent + n), pad))
        sent += n
        counter.value = sent
        if time.monotonic() > deadline:
            break
    return sent


def _paced(client: Any, scenario: Scenario, first: int, count: int, pad: bytes, counter: Synchronized[int]) -> int:
    """Whatever is due now goes out at once, stamped with when it was due; then sleep until the next is due."""
    interval = scenario.producers / scenario.total_rate
    interval_ns = interval * 1e9
    start = time.monotonic()
    start_ns = time.time_ns()  # the wall-clock time of ``start``: the consumer compares stamps with its own clock
    end = start + scenario.duration
    send, make = client.send, payload.make_scheduled_values
    sent = 0
    while sent < count:
        now = time.monotonic()
        if now > end:
            break
        due = min(count, int((now - start) / interval) + 1)
        if due > sent:
            send(make(range(first + sent, first + due), pad, start_ns + int(sent * interval_ns), interval_ns))
            sent = due
            counter.value = sent
        pause = start + sent * interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return sent


def consumer_main(
    system: str,
    endpoint: dict[str, Any],
    scenario: Scenario,
    group: int,
    index: int,
    ready: Event,
    go: Event,
    stop: Event,
    counter: Synchronized[int],
    results: Queue[Any],
) -> None:
    try:
        from conveyor.benchmarks.suite.systems import module

        client = module(system).make_consumer(endpoint, scenario, group, index)
        ready.set()
        if not go.wait(START_TIMEOUT):
            return
        cpu0 = self_cpu_seconds()
        seqs, latencies, sent_ms = array("I"), array("q"), array("q")
        unpack = payload.STAMP.unpack_from
        received = 0
        first = last = 0.0
        receive, ack = client.receive, client.ack
        while not stop.is_set():
            values = receive(0.05)
            if not values:
                continue
            now_ns = time.time_ns()
            for value in values:  # the "handler": read the stamp of every message
                sent_ns, seq = unpack(value)
                seqs.append(seq)
                latencies.append((now_ns - sent_ns) // 1000)
                sent_ms.append(sent_ns // 1_000_000)
            ack()
            received += len(values)
            counter.value = received
            last = now_ns / 1e9
            if not first:
                first = last
        cpu = self_cpu_seconds() - cpu0
        client.close()
        results.put(
            ConsumerReport(
                group, index, received, first, last, cpu, seqs.tobytes(), latencies.tobytes(), sent_ms.tobytes()
            )
        )
    except BaseException:
        results.put(WorkerError("consumer", index, traceback.format_exc(), {"group": group}))
        raise
