"""Append and read throughput of the topic log, per fsync policy and batch size.

Run with ``python -m conveyor.benchmarks.log_bench`` (or ``make bench-log``). The
design says per-message Python work on the hot path is a defect; this is the
number that shows it. For 100-byte messages in batches of 1, 10, 100 and
1000, under each fsync policy, it measures:

- appends to a ``FileLog`` (bodies are pre-built, as the producer builds
  them, so only the log's own work is timed);
- reading everything back from the tail cache with ``read(offset,
  max_bytes=...)``, advancing by the batches returned;
- reading the same data from the segment files (a log reopened with
  ``cache_bytes=0``; the OS page cache is warm unless ``--cold``).

Each phase of a cell stops at a message cap or a time budget, whichever
comes first, so the whole run stays well under two minutes. MB/s counts
message payload (100 bytes a message, MB = 10**6 bytes), not framing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.topic_log import MiB, TopicConfig
from conveyor.broker.wire.record import pack_records

MESSAGE_BYTES = 100
BATCH_SIZES = (1, 10, 100, 1000)
POLICIES = ("none", "batch", "interval:10")
SYNC_EVERY = 10  # under ``batch``: one group commit per this many appends, like one per loop iteration
READ_MAX_BYTES = 1 * MiB  # what a FETCH or a dispatcher asks for at once
BODY_POOL = 64  # distinct pre-built bodies per cell, cycled so memory stays flat at any message count
HUGE_CACHE = 1 << 40  # a tail cache bound that never evicts: the cache read must find every batch

Record = tuple[bytes | str | None, dict[str, Any] | None, bytes]  # what ``pack_records`` takes

TARGET_BATCH = 100
TARGETS = (
    # (phase, policy or None for the slowest policy, minimum msg/s)
    ("append", "none", 1_000_000),
    ("append", "batch", 500_000),
    ("cache_read", None, 2_000_000),
)


@dataclass(frozen=True, slots=True)
class Limits:
    """How far one phase of one cell may go: whichever limit is hit first."""

    max_messages: int
    max_seconds: float


@dataclass(frozen=True, slots=True)
class Measure:
    """One timed phase: how many messages moved in how long."""

    messages: int
    seconds: float

    @property
    def msg_per_s(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.msg_per_s * MESSAGE_BYTES / 1e6


@dataclass(frozen=True, slots=True)
class Cell:
    """The three phases measured for one (fsync policy, batch size)."""

    policy: str
    batch_size: int
    append: Measure
    cache_read: Measure
    disk_read: Measure
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class TargetCheck:
    description: str
    required: float
    measured: float

    @property
    def met(self) -> bool:
        return self.measured >= self.required


# --- building input -----------------------------------------------------------


def build_bodies(batch_size: int, pool: int = BODY_POOL) -> list[bytes]:
    """Distinct msgpack bodies made the producer's way, before any timing starts."""
    bodies = []
    for b in range(pool):
        records: list[Record] = [(None, None, _value(b * batch_size + i)) for i in range(batch_size)]
        bodies.append(pack_records(records))
    return bodies


def _value(n: int) -> bytes:
    """A 100-byte value that differs per message, so no CRC sees the same bytes twice in a row."""
    stamp = n.to_bytes(8, "big")
    return (stamp * (MESSAGE_BYTES // len(stamp) + 1))[:MESSAGE_BYTES]


# --- the phases -----------------------------------------------------------------


def open_log(directory: Path, policy: str, cache_bytes: int) -> FileLog:
    return FileLog("bench", directory, TopicConfig(cache_bytes=cache_bytes), fsync=FsyncPolicy.parse(policy))


def time_appends(log: FileLog, bodies: Sequence[bytes], batch_size: int, limits: Limits) -> Measure:
    """Append in rounds of ``SYNC_EVERY`` batches, as a broker loop iteration would.

    Under ``batch`` each round ends with the group commit; under
    ``interval`` the log syncs itself when due. The final sync is timed too:
    a producer's confirm waits for it.
    """
    group_commit = log.fsync.mode == "batch"
    n_bodies = len(bodies)
    appended = i = 0
    start = time.perf_counter()
    deadline = start + limits.max_seconds
    while appended < limits.max_messages and time.perf_counter() < deadline:
        for _ in range(SYNC_EVERY):
            log.append(bodies[i % n_bodies], batch_size)
            i += 1
        appended += SYNC_EVERY * batch_size
        if group_commit:
            log.sync()
    log.sync()
    return Measure(appended, time.perf_counter() - start)


def time_reads(log: FileLog, limits: Limits) -> Measure:
    """Read from offset 0 to the end, advancing past the batches each read returns."""
    offset, end = log.start_offset, log.end_offset
    read = 0
    start = time.perf_counter()
    deadline = start + limits.max_seconds
    while offset < end and read < limits.max_messages and time.perf_counter() < deadline:
        batches = log.read(offset, max_bytes=READ_MAX_BYTES)
        next_offset = batches[-1].next_offset
        read += next_offset - offset
        offset = next_offset
    return Measure(read, time.perf_counter() - start)


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the (synced, so clean) segment pages: reads then hit the device."""
    for path in directory.glob("*.log"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_cell(root: Path, policy: str, batch_size: int, limits: Limits, *, cold: bool) -> Cell:
    """Append, read back from the cache, then reopen without a cache and read from disk."""
    directory = Path(tempfile.mkdtemp(prefix=f"b{batch_size}-", dir=root))
    try:
        bodies = build_bodies(batch_size)
        log = open_log(directory, policy, HUGE_CACHE)
        append = time_appends(log, bodies, batch_size, limits)
        cache_read = time_reads(log, limits)
        stored = log.size_bytes()
        log.sync(force=True)
        log.close()
        if cold:
            drop_page_cache(directory)
        disk_log = open_log(directory, policy, 0)
        disk_read = time_reads(disk_log, limits)
        disk_log.close()
        return Cell(policy, batch_size, append, cache_read, disk_read, stored)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- targets and reporting -----------------------------------------------------------


def check_targets(cells: Sequence[Cell]) -> list[TargetCheck]:
    """The design's speed claims for batches of 100, each against its cell(s)."""
    at_target = [c for c in cells if c.batch_size == TARGET_BATCH]
    checks = []
    for phase, policy, required in TARGETS:
        chosen = [c for c in at_target if policy is None or c.policy == policy]
        if not chosen:
            continue
        measured = min(getattr(c, phase).msg_per_s for c in chosen)
        checks.append(TargetCheck(_describe(phase, policy), required, measured))
    return checks


def _describe(phase: str, policy: str | None) -> str:
    where = f"fsync={policy}" if policy else "every fsync policy"
    if policy == "batch":
        where += f" (sync every {SYNC_EVERY} batches)"
    what = "append" if phase == "append" else "tail-cache read"
    return f"{what}, batches of {TARGET_BATCH}, {where}"


def markdown_table(cells: Sequence[Cell]) -> str:
    head = (
        "| fsync | batch | append msg/s | append MB/s | cache read msg/s | cache read MB/s "
        "| disk read msg/s | disk read MB/s | messages |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [_row(c) for c in cells]
    return "\n".join([head, *rows])


def _row(c: Cell) -> str:
    policy = f"batch (sync/{SYNC_EVERY})" if c.policy == "batch" else c.policy
    nums = [c.append, c.cache_read, c.disk_read]
    fields = [f"{m.msg_per_s:,.0f} | {m.mb_per_s:,.1f}" for m in nums]
    return f"| {policy} | {c.batch_size} | {' | '.join(fields)} | {c.append.messages:,} |"


def targets_markdown(checks: Sequence[TargetCheck]) -> str:
    lines = ["| target | required msg/s | measured msg/s | met |", "|---|---:|---:|---|"]
    for t in checks:
        lines.append(f"| {t.description} | {t.required:,.0f} | {t.measured:,.0f} | {'yes' if t.met else '**NO**'} |")
    met = sum(t.met for t in checks)
    lines.append(f"\nTargets met: {met}/{len(checks)}")
    return "\n".join(lines)


def progress(cell: Cell) -> str:
    return (
        f"[log_bench] fsync={cell.policy:<12} batch={cell.batch_size:<5} "
        f"append {cell.append.msg_per_s:>12,.0f} msg/s  "
        f"cache read {cell.cache_read.msg_per_s:>12,.0f} msg/s  "
        f"disk read {cell.disk_read.msg_per_s:>12,.0f} msg/s  ({cell.append.messages:,} msgs)"
    )


def to_json(cells: Sequence[Cell], checks: Sequence[TargetCheck], settings: dict[str, object]) -> dict[str, object]:
    """Plain data for dashboards and regressions: every measure with its derived rates."""

    def measure(m: Measure) -> dict[str, float]:
        return {"messages": m.messages, "seconds": m.seconds, "msg_per_s": m.msg_per_s, "mb_per_s": m.mb_per_s}

    return {
        "settings": settings,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "cells": [
            {
                "policy": c.policy,
                "batch_size": c.batch_size,
                "stored_bytes": c.stored_bytes,
                "append": measure(c.append),
                "cache_read": measure(c.cache_read),
                "disk_read": measure(c.disk_read),
            }
            for c in cells
        ],
        "targets": [{**asdict(t), "met": t.met} for t in checks],
    }


# --- command line ------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.log_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run (a smoke test, not a measurement)")
    parser.add_argument("--dir", metavar="DIR", help="where to put the temporary logs (default: the system temp dir)")
    parser.add_argument("--cold", action="store_true", help="drop the segments from the page cache before disk reads")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    return parser.parse_args(argv)


def limits_for(quick: bool) -> Limits:
    return Limits(max_messages=100_000, max_seconds=0.3) if quick else Limits(max_messages=2_000_000, max_seconds=1.5)


def run_all(root: Path, limits: Limits, *, cold: bool, report: Callable[[str], None]) -> list[Cell]:
    cells = []
    for policy in POLICIES:
        for batch_size in BATCH_SIZES:
            cell = run_cell(root, policy, batch_size, limits, cold=cold)
            report(progress(cell))
            cells.append(cell)
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    limits = limits_for(args.quick)

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="conveyor-log-bench-", dir=args.dir) as tmp:
        report(f"[log_bench] logs in {tmp}; per phase at most {limits.max_messages:,} msgs or {limits.max_seconds} s")
        cells = run_all(Path(tmp), limits, cold=args.cold, report=report)
    checks = check_targets(cells)
    print(f"Topic log, {MESSAGE_BYTES}-byte messages; fsync=batch syncs once every {SYNC_EVERY} batches; ", end="")
    print(f"reads ask for max_bytes={READ_MAX_BYTES:,}; disk reads {'cold' if args.cold else 'page-cache warm'}.\n")
    print(markdown_table(cells))
    print()
    print(targets_markdown(checks))
    if args.json:
        settings = {**asdict(limits), "message_bytes": MESSAGE_BYTES, "sync_every": SYNC_EVERY, "cold": args.cold}
        Path(args.json).write_text(json.dumps(to_json(cells, checks, settings), indent=2) + "\n")
    return 1 if args.check and not all(t.met for t in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
