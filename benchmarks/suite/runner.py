"""Runs scenarios against systems: processes, sampling, collection, one result dict per run."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite import stats
from conveyor.benchmarks.suite.procstat import cpu_seconds, machine_busy_seconds, tree_cpu_seconds
from conveyor.benchmarks.suite.profile import start_profilers, stop_profilers
from conveyor.benchmarks.suite.scaleout import load_matched_identity, load_matched_scenario, per_broker_rate, scale_out
from conveyor.benchmarks.suite.scenario import Config, Scenario
from conveyor.benchmarks.suite.summary import process_cpu
from conveyor.benchmarks.suite.systems import NAMES, System, system
from conveyor.benchmarks.suite.systems.base import Server, Variant
from conveyor.benchmarks.suite.workers import (
    START_TIMEOUT,
    ConsumerReport,
    ProducerReport,
    WorkerError,
    consumer_main,
    producer_main,
)

STALL_SECONDS = 10.0  # producers done and nothing arrived for this long: count the rest as lost
SAMPLE_SECONDS = 0.2  # queue depth and progress samples


class Progress:
    """A progress bar on stderr: one line redrawn in place on a terminal, a line per run otherwise."""

    def __init__(self, total_runs: int, stream: Any = None, enabled: bool = True) -> None:
        self.total = max(1, total_runs)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.began = time.monotonic()
        self._last = ""

    def _bar(self, fraction: float, width: int = 24) -> str:
        filled = round(max(0.0, min(1.0, fraction)) * width)
        return "#" * filled + "-" * (width - filled)

    def update(self, label: str, fraction: float, detail: str = "") -> None:
        if not self.enabled or not self.tty:
            return
        overall = (self.done + max(0.0, min(1.0, fraction))) / self.total
        elapsed = time.monotonic() - self.began
        line = (
            f"\r[{self._bar(overall)}] {overall * 100:3.0f}% run {self.done + 1}/{self.total} {elapsed:4.0f}s "
            f"{label} [{self._bar(fraction, 10)}] {detail}"
        )
        line = line[:160].ljust(len(self._last))
        self._last = line
        self.stream.write(line)
        self.stream.flush()

    def finish_run(self, text: str) -> None:
        self.done += 1
        self.message(f"[{self.done}/{self.total}] {text}")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self._last = ""
        self.stream.write(text + "\n")
        self.stream.flush()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)


def select_variants(scenario: Scenario, sys_obj: System, wanted: Sequence[str] | None) -> list[Variant]:
    """The variants of a system for a scenario, narrowed by the scenario's ``systems`` and ``--systems``."""
    variants = sys_obj.variants(scenario)
    if wanted is not None and sys_obj.name not in wanted and not any(w.startswith(f"{sys_obj.name}:") for w in wanted):
        return []
    if wanted is not None:
        exact = [w for w in wanted if w.startswith(f"{sys_obj.name}:")]
        if exact:
            variants = [v for v in variants if v.id in exact]
    if scenario.systems:
        variants = [v for v in variants if v.system in scenario.systems or v.id in scenario.systems]
    named = set(scenario.systems) | set(wanted or ())
    return [v for v in variants if not v.explicit or v.id in named]


def missing_variants(
    config: Config,
    runs: Sequence[tuple[Scenario, System, Variant]],
    skipped: dict[str, str],
    wanted: Sequence[str] | None = None,
    systems: dict[str, System] | None = None,
) -> list[dict[str, str]]:
    """Variants a scenario names (``conveyor:r3``) that no run provides, each with the reason.

    The reason is the system's own when it is not installed; otherwise the
    config's ``settings.variants[id].pending`` (what will provide it), or that
    no system here offers it. With ``--systems``, only the variants it asks
    for count (the system's name or the variant's id); a variant it names
    that runs nowhere is reported once, as scenario ``*``.
    """
    planned = {(s.name, v.id) for s, _sys, v in runs}
    declared = config.settings.get("variants", {})

    systems = systems if systems is not None else {sys_obj.name: sys_obj for _s, sys_obj, _v in runs}

    def reason(variant: str) -> str:
        name = variant.split(":", 1)[0]
        if name in skipped:
            return skipped[name]
        if name not in NAMES:
            return f"no system is called {name!r}"
        own = systems[name].why_not(variant) if name in systems else None
        return str(own or declared.get(variant, {}).get("pending") or f"{name} has no variant {variant} here")

    def asked(variant: str) -> bool:
        return wanted is None or variant in wanted or variant.split(":", 1)[0] in wanted

    out = [
        {"scenario": scenario.name, "variant": variant, "reason": reason(variant)}
        for scenario in config.scenarios
        for variant in scenario.systems
        if ":" in variant and (scenario.name, variant) not in planned and asked(variant)
    ]
    ran = {v for _s, v in planned} | {m["variant"] for m in out}
    for variant in wanted or ():
        if ":" in variant and variant not in ran:
            out.append({"scenario": "*", "variant": variant, "reason": reason(variant)})
    return out


def run_one(
    sys_obj: System,
    variant: Variant,
    server: Server,
    scenario: Scenario,
    run_name: str,
    progress: Progress,
    profile: Path | None = None,
) -> dict[str, Any]:
    """One scenario against one system variant; the server is already running."""
    ctx: SpawnContext = multiprocessing.get_context("spawn")
    endpoint = server.prepare(run_name, scenario)
    results: Any = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    shares = scenario.per_producer
    firsts = [sum(shares[:i]) for i in range(len(shares))]
    p_counters = [ctx.Value("q", 0, lock=False) for _ in shares]
    c_counters = [[ctx.Value("q", 0, lock=False) for _ in range(scenario.consumers)] for _ in range(scenario.groups)]
    readies = []
    procs: list[Any] = []
    names: list[str] = []
    for g in range(scenario.groups):
        for i in range(scenario.consumers):
            ready = ctx.Event()
            readies.append(ready)
            args = (sys_obj.name, endpoint, scenario, g, i, ready, go, stop, c_counters[g][i], results)
            procs.append(ctx.Process(target=consumer_main, args=args, daemon=True))
            names.append(f"consumer {g + 1}.{i + 1}" if scenario.groups > 1 else f"consumer {i + 1}")
    for p, share in enumerate(shares):
        ready = ctx.Event()
        readies.append(ready)
        args_p = (sys_obj.name, endpoint, scenario, p, firsts[p], share, ready, go, p_counters[p], results)
        procs.append(ctx.Process(target=producer_main, args=args_p, daemon=True))
        names.append(f"producer {p + 1}")
    producer_reports: dict[int, ProducerReport] = {}
    consumer_reports: list[ConsumerReport] = []
    errors: list[str] = []
    samples: list[dict[str, Any]] = []
    label = f"{scenario.name} / {variant.id}"
    profilers: list[subprocess.Popen[bytes]] = []
    sampler_stop = threading.Event()
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + START_TIMEOUT
        for ready in readies:
            while not ready.wait(0.1):
                _drain(results, producer_reports, consumer_reports, errors)
                if errors or time.monotonic() > deadline:
                    raise RuntimeError("a client process did not get ready: " + "; ".join(errors or ["timeout"]))
        server_procs = server.processes() if not server.external else {}
        if profile is not None:
            targets = {name: proc.pid for name, proc in zip(names, procs, strict=True)}
            if sys_obj.name == "conveyor":
                for proc_name, pids in server_procs.items():
                    targets["broker" if proc_name == "server" else proc_name] = pids[0]
            profilers = start_profilers(profile, run_name, targets, gil=True)  # CPU, not waits for a core
        server_pids = server.cpu_pids()
        server_cpu0 = tree_cpu_seconds(server_pids)
        procs_cpu0 = {k: tree_cpu_seconds(v) for k, v in server_procs.items()}
        leaders = LeaderWatch(server, endpoint)
        busy0, own0 = machine_busy_seconds(), _own_cpu()
        t0 = time.time()
        go.set()
        expected_hint = scenario.messages

        def sample() -> None:
            while not sampler_stop.wait(SAMPLE_SECONDS):
                sent = sum(c.value for c in p_counters)
                consumed = [sum(c.value for c in group) for group in c_counters]
                depth = max(0, sent * scenario.groups - sum(consumed))
                point = {"t": round(time.time() - t0, 3), "sent": sent, "consumed": sum(consumed), "depth": depth}
                point.update(server.sample(endpoint))
                samples.append(point)
                leaders.sample()
                total = expected_hint * scenario.groups
                progress.update(
                    label, sum(consumed) / total if total else 1.0, f"{sum(consumed):,}/{total:,} depth {depth:,}"
                )

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        budget = time.monotonic() + scenario.duration + START_TIMEOUT + 60
        seen, progress_at = -1, time.monotonic()
        while True:
            _drain(results, producer_reports, consumer_reports, errors, timeout=0.02)
            if errors:
                break
            now = time.monotonic()
            consumed = [sum(c.value for c in group) for group in c_counters]
            if sum(consumed) != seen:
                seen, progress_at = sum(consumed), now
            if len(producer_reports) == len(shares):
                sent_total = sum(r.sent for r in producer_reports.values())
                expected_hint = sent_total
                if all(c >= sent_total for c in consumed):
                    break
                if now - progress_at > STALL_SECONDS:
                    errors.append(f"stalled: nothing received for {STALL_SECONDS:.0f} s")
                    break
            if now > budget:
                errors.append("over the time budget")
                break
            if not any(p.is_alive() for p in procs[-len(shares) :]) and len(producer_reports) < len(shares):
                _drain(results, producer_reports, consumer_reports, errors, timeout=0.5)
                if len(producer_reports) < len(shares):
                    errors.append("a producer died without reporting")
                    break
        stop.set()
        end_wall = time.time()
        server_cpu = tree_cpu_seconds(server_pids) - server_cpu0
        procs_cpu = {k: tree_cpu_seconds(v) - procs_cpu0[k] for k, v in server_procs.items()}
        stored = _stored(server, endpoint)
        background = server.background(endpoint)
        details = _details(server, endpoint)
        sampler_stop.set()
        sampler.join(2)
        leaders.finish()
        collect_until = time.monotonic() + 30
        while len(consumer_reports) < len(readies) - len(shares) and time.monotonic() < collect_until:
            _drain(results, producer_reports, consumer_reports, errors, timeout=0.1)
        busy = machine_busy_seconds() - busy0
        own = _own_cpu() - own0
    finally:
        sampler_stop.set()
        stop_profilers(profilers)
        stop.set()
        go.set()
        join_until = time.monotonic() + 10
        for proc in procs:
            if proc.pid is not None:
                proc.join(max(0.1, join_until - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        with contextlib.suppress(Exception):
            server.cleanup(endpoint)
    result = summarize(
        scenario,
        sys_obj,
        variant,
        server,
        producer_reports,
        consumer_reports,
        server_cpu,
        samples,
        errors,
        t0,
        end_wall,
    )
    clients_cpu = sum(v for k, v in result["cpu"].items() if k != "server")
    result["other_cpu"] = round(max(0.0, busy - own - clients_cpu - server_cpu), 3)
    add_process_cpu(result, procs_cpu)
    add_stored_cpu(result, procs_cpu, stored, background)
    if details:
        result["server_details"] = details
    result.update(leaders.result())
    return result


def _stored(server: Server, endpoint: dict[str, Any]) -> dict[str, int] | None:
    try:
        return server.stored(endpoint)
    except Exception as exc:  # a metrics scrape that failed: no per-stored figures, the run still counts
        sys.stderr.write(f"\ncould not read what each server stored: {exc}\n")
        return None


def _details(server: Server, endpoint: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    try:
        return server.details(endpoint)
    except Exception as exc:  # a diagnostic only: the run still counts
        sys.stderr.write(f"\ncould not read the servers' own counters: {exc}\n")
        return None


def add_stored_cpu(
    result: dict[str, Any],
    server_procs: dict[str, float],
    stored: dict[str, int] | None,
    background: dict[str, float] | None = None,
) -> None:
    """CPU µs per message each server process stored (its CPU over its own messages), and the highest of them.

    With partitions on several brokers each stores only its share: dividing its
    CPU by the run's total would make every broker look cheaper as brokers are
    added. ``max_server_us_per_stored_message`` is what the scale-out targets compare.
    With ``background`` (CPU s per s at rest), the same less what the process
    would have used at rest over the run's wall time: a broker's fixed cost per
    second weighs more per message the fewer messages it stores.
    """
    if not stored:
        return
    result["stored"] = dict(stored)
    rate = per_broker_rate(result)
    if rate:
        result["stored_per_broker_msg_per_s"] = rate
    per = {name: round(server_procs[name] * 1e6 / n, 3) for name, n in stored.items() if n and name in server_procs}
    result["cpu_us_per_stored_message"] = per
    if per:
        result["max_server_us_per_stored_message"] = max(per.values())
    if background:
        wall = float(result.get("wall_seconds") or 0.0)
        result["background_cpu_per_s"] = dict(background)
        result["cpu_us_per_stored_message_less_background"] = {
            name: round(max(0.0, server_procs[name] - background.get(name, 0.0) * wall) * 1e6 / stored[name], 3)
            for name in per
        }


class LeaderWatch:
    """Counts leader changes during a run from the server's ``leaders`` samples or ``leader_elections`` count."""

    def __init__(self, server: Server, endpoint: dict[str, Any]) -> None:
        self.server, self.endpoint = server, endpoint
        self.elections0 = self._elections()
        self.first = self._leaders()
        self.last = dict(self.first or {})
        self.seen = 0
        self.ended: dict[str, str] | None = None
        self.elections: int | None = None

    def _leaders(self) -> dict[str, str] | None:
        try:
            return self.server.leaders(self.endpoint)
        except Exception:  # busy or restarting: this sample is skipped
            return {}

    def _elections(self) -> int | None:
        try:
            return self.server.leader_elections()
        except Exception:
            return None

    def sample(self) -> None:
        if self.first is None:
            return
        now = self._leaders() or {}
        self.seen += changes(self.last, now)
        self.last.update(now)

    def finish(self) -> None:
        self.sample()
        self.ended = dict(self.last) if self.first is not None else None
        later = self._elections()
        if self.elections0 is not None and later is not None:
            self.elections = later - self.elections0

    def result(self) -> dict[str, Any]:
        """``leader_changes`` (None: the system has no leaders to report) and the leaders at start and end."""
        if self.elections is not None:
            counted: int | None = self.elections
        else:
            counted = self.seen if self.first is not None else None
        out: dict[str, Any] = {"leader_changes": counted}
        if self.first is not None:
            out["leaders"] = {"start": self.first, "end": self.ended, "changes_seen": self.seen}
        return out


def changes(before: dict[str, str], after: dict[str, str]) -> int:
    """How many leaders differ between two samples (a part missing from either sample is not compared)."""
    return sum(1 for k, v in after.items() if k in before and before[k] != v)


def add_process_cpu(result: dict[str, Any], server_procs: dict[str, float]) -> None:
    """Each server process's CPU seconds (several servers only) and CPU microseconds per message, per process."""
    if "cpu" not in result:
        return
    if len(server_procs) > 1:
        result["server_cpu"] = {k: round(v, 3) for k, v in server_procs.items()}
    per_process = process_cpu(result)
    unique = result.get("unique") or 0
    result["cpu_us_per_message"] = (
        {k: round(v * 1e6 / unique, 2) for k, v in {**per_process, "total": result["cpu_total"]}.items()}
        if unique
        else {}
    )
    if len(server_procs) > 1:  # the busiest single process, not the servers' sum
        name, seconds = max(per_process.items(), key=lambda kv: kv[1])
        wall = result.get("e2e_seconds") or 0
        result["bottleneck"] = {
            "process": name,
            "cpu_seconds": seconds,
            "busy_fraction": round(seconds / wall, 3) if wall else None,
        }


def _own_cpu() -> float:
    return cpu_seconds(os.getpid())


def _drain(
    results: Any,
    producers: dict[int, ProducerReport],
    consumers: list[ConsumerReport],
    errors: list[str],
    timeout: float = 0.0,
) -> None:
    while True:
        try:
            item = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            return
        timeout = 0.0
        if isinstance(item, ProducerReport):
            producers[item.index] = item
        elif isinstance(item, ConsumerReport):
            consumers.append(item)
        elif isinstance(item, WorkerError):
            errors.append(f"{item.role} {item.index + 1}: {item.error.strip().splitlines()[-1]}")
            sys.stderr.write(f"\n{item.role} {item.index + 1} failed:\n{item.error}\n")


def summarize(
    scenario: Scenario,
    sys_obj: System,
    variant: Variant,
    server: Server,
    producers: dict[int, ProducerReport],
    consumers: list[ConsumerReport],
    server_cpu: float,
    samples: list[dict[str, Any]],
    errors: list[str],
    t0: float,
    end_wall: float,
) -> dict[str, Any]:
    sent = sum(p.sent for p in producers.values())
    started = min((p.started for p in producers.values()), default=t0)
    flushed = max((p.flushed for p in producers.values()), default=end_wall)
    groups: list[list[array[int]]] = [[] for _ in range(scenario.groups)]
    latencies: array[int] = array("q")
    sent_ms: array[int] = array("q")
    for c in consumers:
        seqs: array[int] = array("I")
        seqs.frombytes(c.seqs)
        groups[c.group].append(seqs)
        latencies.frombytes(c.latencies_us)
        sent_ms.frombytes(c.sent_ms)
    check = stats.exactly_once([(p.first_seq, p.first_seq + p.sent) for p in producers.values()], groups)
    if len(consumers) < scenario.consumers * scenario.groups:
        check["exactly_once"] = False
        errors.append(f"only {len(consumers)} of {scenario.consumers * scenario.groups} consumers reported")
    last = max((c.last_received for c in consumers), default=started)
    send_seconds = max(1e-9, flushed - started)
    e2e_seconds = max(1e-9, last - started)
    unique = check["unique"]
    cpu: dict[str, float] = {"server": round(server_cpu, 3)} if not server.external else {}
    for p in sorted(producers.values(), key=lambda p: p.index):
        cpu[f"producer {p.index + 1}"] = round(p.cpu_seconds, 3)
    for c in sorted(consumers, key=lambda c: (c.group, c.index)):
        name = f"consumer {c.group + 1}.{c.index + 1}" if scenario.groups > 1 else f"consumer {c.index + 1}"
        cpu[name] = round(c.cpu_seconds, 3)
    e2e = unique / e2e_seconds if consumers else 0.0
    busiest = max(cpu.items(), key=lambda kv: kv[1]) if cpu else ("", 0.0)
    depth = [s["depth"] for s in samples]
    lags = [s["lag"] for s in samples if s.get("lag") is not None]
    in_flight = [s["in_flight"] for s in samples if s.get("in_flight") is not None]
    return {
        **_identity(scenario, variant),
        "producer_api": next(iter(producers.values())).api if producers else "",
        "paced": scenario.paced,
        "participants": scenario.participants,
        "sent": sent,
        "failed_confirms": sum(p.failed for p in producers.values()),
        "producer_msg_per_s": round(sent / send_seconds, 1) if producers else 0.0,
        "e2e_msg_per_s": round(e2e, 1),
        "e2e_mb_per_s": round(e2e * scenario.message_size / 1e6, 2),
        "efficiency_msg_per_s_per_participant": round(e2e / scenario.participants, 1),
        "msg_per_cpu_second": round(unique / sum(cpu.values()), 1) if cpu and sum(cpu.values()) else None,
        "send_seconds": round(send_seconds, 3),
        "e2e_seconds": round(e2e_seconds, 3),
        "latency_ms": {k: round(v, 3) for k, v in stats.percentiles_ms(latencies).items()},
        "latency_series": stats.latency_series(sent_ms, latencies, started * 1000),
        "max_depth": max(depth, default=0),
        "max_lag": max(lags) if lags else None,
        "max_in_flight": max(in_flight) if in_flight else None,
        "samples": samples,
        "cpu": cpu,
        "cpu_total": round(sum(cpu.values()), 3),
        "bottleneck": {
            "process": busiest[0],
            "cpu_seconds": busiest[1],
            "busy_fraction": round(busiest[1] / e2e_seconds, 3) if e2e_seconds else None,
        },
        "wall_seconds": round(end_wall - t0, 3),
        **check,
        "errors": errors,
        "ok": check["exactly_once"] and not errors,
    }


def plan(
    config: Config, systems: dict[str, System], wanted: Sequence[str] | None, repeat: int = 1
) -> list[tuple[Scenario, System, Variant]]:
    """Every scenario against every variant; with ``repeat``, rounds of all the variants in turn.

    Interleaving the rounds (A B C A B C, not A A B B C C) spreads the machine's
    slow moments over every system instead of charging them to one.
    """
    runs = []
    for scenario in config.scenarios:
        for _round in range(max(1, repeat)):
            for name in NAMES:
                if name in systems:
                    runs += [(scenario, systems[name], v) for v in select_variants(scenario, systems[name], wanted)]
    return runs


def key_metric(result: dict[str, Any]) -> tuple[str, float | None]:
    """What a repeated run is ranked by: p99 latency for a paced scenario, end-to-end msg/s otherwise."""
    if result.get("paced"):
        return "p99 ms", result.get("latency_ms", {}).get("p99")
    return "end-to-end msg/s", result.get("e2e_msg_per_s")


def median_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per scenario and variant: the run with the median key metric, with every run's value kept.

    A failed run (no numbers, or not exactly once) is never hidden: if any
    repetition failed, that one is reported.
    """
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for result in results:
        by_key.setdefault((result["scenario"], result["variant"]), []).append(result)
    chosen = []
    for runs in by_key.values():
        failed = [r for r in runs if not r.get("ok")]
        if len(runs) == 1 or failed:
            pick = failed[0] if failed else runs[0]
        else:
            ranked = sorted(runs, key=lambda r: key_metric(r)[1] or 0.0)
            pick = ranked[(len(ranked) - 1) // 2]
        if len(runs) > 1:
            name, _ = key_metric(pick)
            pick = {**pick, "repeats": {"metric": name, "values": [key_metric(r)[1] for r in runs]}}
            for key in (
                "cpu_us_per_stored_message",
                "cpu_us_per_stored_message_less_background",
                "stored_per_broker_msg_per_s",
            ):
                if any(key in r for r in runs):  # the scale-out figures of every run: it takes their medians
                    pick["repeats"][key] = [r.get(key) for r in runs]
        chosen.append(pick)
    return chosen


def run_bench(
    config: Config,
    *,
    wanted: Sequence[str] | None = None,
    broker: str = "",
    progress: Progress | None = None,
    workdir: str | None = None,
    profile: Path | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """Every scenario against every available system; the whole report as a dict.

    With ``repeat`` > 1 each run is made that many times and the median run is reported.
    """
    wanted_names = {w.split(":", 1)[0] for w in wanted} if wanted else set(NAMES)
    unknown = wanted_names - set(NAMES)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {', '.join(NAMES)}")
    systems: dict[str, System] = {}
    skipped: dict[str, str] = {}
    for name in NAMES:
        if name not in wanted_names:
            continue
        sys_obj = system(name, broker=broker) if name == "conveyor" else system(name)
        sys_obj.configure(config.settings.get("variants", {}))
        reason = sys_obj.unavailable()
        if reason:
            skipped[name] = reason
        else:
            systems[name] = sys_obj
    runs = plan(config, systems, wanted, repeat)
    missing = missing_variants(config, runs, skipped, wanted, systems)
    matching = _load_matching(config, runs)
    progress = progress or Progress(len(runs))
    progress.total = max(1, len(runs) + sum(1 for _s, _sys, v in runs if v.id in matching))
    for name, reason in skipped.items():
        progress.message(f"skipping {name}: {reason}")
    for m in missing:
        progress.message(f"skipping {m['variant']} in {m['scenario']}: {m['reason']}")
    results: list[dict[str, Any]] = []
    began = time.time()
    reused: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-", dir=workdir) as tmp:
        try:
            for n, (scenario, sys_obj, variant) in enumerate(runs):
                run_name = _safe(f"{scenario.name}-{variant.mode}-{n}")
                result = _start_and_run(sys_obj, variant, scenario, run_name, Path(tmp), progress, profile, reused)
                results.append(result)
                progress.finish_run(one_line(scenario, result))
                if on_result is not None:
                    on_result(result)
                if variant.id not in matching:
                    continue
                paced = load_matched_scenario(scenario, result)
                if paced is None:  # the run failed: nothing to match
                    progress.done += 1
                    continue
                base = matching[variant.id]
                progress.message(f"then one broker paced to {paced.total_rate:,.0f} msg/s, each broker's rate here")
                result = _start_and_run(
                    sys_obj, base, paced, f"{run_name}-matched", Path(tmp), progress, profile, reused
                )
                result.update(
                    load_matched_identity(base.id, variant.id, matching_k(config, variant.id), paced.total_rate)
                )
                results.append(result)
                progress.finish_run(one_line(paced, result))
                if on_result is not None:
                    on_result(result)
        finally:
            for server in reused.values():
                with contextlib.suppress(Exception):
                    server.stop()
            for sys_obj in systems.values():
                close = getattr(sys_obj, "close", None)
                if close is not None:
                    with contextlib.suppress(Exception):
                        close()
    report: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(began)),
        "duration_seconds": round(time.time() - began, 1),
        "config": config.source,
        "settings": config.settings,
        "machine": machine(),
        "systems": {
            name: {"title": s.title, "version": _quiet(s.version), "client": s.client_api()}
            for name, s in systems.items()
        },
        "skipped_systems": skipped,
        "skipped_variants": missing,
        "scenarios": [{**s.to_dict(), "label": s.label(), "participants": s.participants} for s in config.scenarios],
        "repeat": max(1, repeat),
        "results": median_runs(results),
    }
    section = scale_out(report)
    if section is not None:
        report["scale_out"] = section
    return report


def _start_and_run(
    sys_obj: System,
    variant: Variant,
    scenario: Scenario,
    run_name: str,
    tmp: Path,
    progress: Progress,
    profile: Path | None,
    reused: dict[str, Server],
) -> dict[str, Any]:
    """Start the variant's server (or reuse the kept one), run the scenario, stop it: the run's result."""
    rundir = tmp / _safe(run_name)
    rundir.mkdir()
    key = sys_obj.name
    try:
        if sys_obj.reuse_server:
            if key not in reused:
                progress.message(f"starting {sys_obj.title} (kept for every run)")
                reused[key] = sys_obj.start(variant, tmp)
            server = reused[key]
        else:
            if variant.explicit:  # a cluster: etcd and several brokers take seconds to start
                progress.message(f"starting {variant.id}: {variant.durability}")
            server = sys_obj.start(variant, rundir)
    except Exception as exc:
        result = _failed(scenario, variant, f"server did not start: {exc}")
    else:
        try:
            result = run_one(sys_obj, variant, server, scenario, _safe(run_name), progress, profile)
        except Exception as exc:
            result = _failed(scenario, variant, f"{type(exc).__name__}: {exc}")
        finally:
            if not sys_obj.reuse_server:
                with contextlib.suppress(Exception):
                    server.stop()
            shutil.rmtree(rundir, ignore_errors=True)  # a run's data is not needed after it
    result["description"] = scenario.description
    return result


def matching_k(config: Config, variant_id: str) -> int:
    """The partition count a scale-out variant sets (``settings.variants[id].partitions``); 0 when none."""
    return int(config.settings.get("variants", {}).get(variant_id, {}).get("partitions", 0))


def _load_matching(config: Config, runs: Sequence[tuple[Scenario, System, Variant]]) -> dict[str, Variant]:
    """With ``settings.scale_out.load_matched``: each variant of k > 1 partitions -> the baseline variant to pace.

    Every run of such a variant is followed by a run of the baseline (one
    broker) paced to the rate each of its brokers stored at
    (``scaleout.load_matched_scenario``). Empty without the setting or when
    the baseline is not among the runs' systems' variants.
    """
    settings = config.settings.get("scale_out") or {}
    if not settings.get("load_matched"):
        return {}
    out = {}
    for scenario, sys_obj, variant in runs:
        if matching_k(config, variant.id) <= 1:
            continue
        base = next((v for v in sys_obj.variants(scenario) if v.id == settings.get("baseline")), None)
        if base is not None:
            out[variant.id] = base
    return out


def _quiet(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception:
        return ""


def _identity(scenario: Scenario, variant: Variant) -> dict[str, Any]:
    """What every result says about which run it is, failed or not."""
    return {
        "scenario": scenario.name,
        "system": variant.system,
        "variant": variant.id,
        "title": variant.title,
        "durability": variant.durability,
        "matching_durability": variant.matches,
        "fsync": scenario.fsync,
    }


def _failed(scenario: Scenario, variant: Variant, error: str) -> dict[str, Any]:
    return {
        **_identity(scenario, variant),
        "errors": [error],
        "ok": False,
        "exactly_once": False,
    }


def one_line(scenario: Scenario, r: dict[str, Any]) -> str:
    head = f"{scenario.name} / {r['variant']}:"
    if "e2e_msg_per_s" not in r:
        return f"{head} FAILED: {'; '.join(r['errors'])}"
    lat = r.get("latency_ms", {})
    verdict = "exactly once" if r["exactly_once"] else f"{r['duplicates']} duplicates, {r['lost']} lost"
    errors = f" ({'; '.join(r['errors'])})" if r["errors"] else ""
    return (
        f"{head} producer {r['producer_msg_per_s']:,.0f} msg/s, end-to-end {r['e2e_msg_per_s']:,.0f} msg/s, "
        f"p50 {lat.get('p50', 0):.2f} ms, p99 {lat.get('p99', 0):.2f} ms; {verdict}{errors}"
    )


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().split()[1]
        info["memory_gib"] = round(int(mem) / 1024 / 1024, 1)
    return info
