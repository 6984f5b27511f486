"""The workers' health, seen from their supervisor (``conveyor run --workers N``).

Only the supervisor serves ``/healthz``, ``/livez`` and ``/readyz``, so each worker writes its
runner's health report (the one ``/healthz`` would show for a single process: ``event_loop`` and one
check per consumer) to ``health-<pid>.json`` in the supervisor's metrics directory, once a second,
from a thread of its own: a wedged I/O loop still shows as the report's ``event_loop``, and a
process that stops writing altogether (stopped, stuck in C) goes stale. The supervisor merges the
reports at each request: every check is the worst of the workers', with each worker's own under
``workers``, so the single runner's check names, alerts and probes keep their meaning.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from conveyor.monitoring.health import UNHEALTHY, Report, safely, worst

REPORT_EVERY = 1.0  # seconds between two reports of a worker
STALE_AFTER = 6.0  # a report older than this: the worker is wedged (the runner's own wedged_after is 5 s past its 1 s)


def report_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"health-{pid}.json")


def start_reporting(directory: str, health: Callable[[], Report], stop: threading.Event) -> threading.Thread:
    """Write ``health()`` to this process's report file every ``REPORT_EVERY`` seconds until ``stop`` is set."""
    path = report_path(directory, os.getpid())

    def loop() -> None:
        while not stop.is_set():
            write_report(path, safely(health))
            stop.wait(REPORT_EVERY)

    thread = threading.Thread(target=loop, name="conveyor-worker-health", daemon=True)
    thread.start()
    return thread


def write_report(path: str, found: Report) -> None:
    """Replace the file at once (write, rename): the supervisor never reads half a report."""
    temporary = f"{path}.tmp"
    with contextlib.suppress(OSError):  # the directory is gone: the supervisor is stopping
        with open(temporary, "w") as f:
            json.dump(found, f)
        os.replace(temporary, path)


def read_report(path: str, now: float | None = None) -> tuple[Report | None, float]:
    """A worker's last report and its age in seconds (None and infinity when there is none yet)."""
    try:
        with open(path) as f:
            found = json.load(f)
        age = (time.time() if now is None else now) - os.stat(path).st_mtime
    except (OSError, ValueError):
        return None, float("inf")
    return found, max(0.0, age)


def merge_reports(reports: Mapping[int, tuple[Report | None, float]]) -> dict[str, dict[str, Any]]:
    """Worker number -> (its report, its age): each check as the worst of the workers', with theirs under
    ``workers``. A report older than ``STALE_AFTER`` (or none) makes that worker's ``event_loop`` UNHEALTHY."""
    merged: dict[str, dict[str, Any]] = {}
    for index, (found, age) in sorted(reports.items()):
        checks = dict(found.get("checks", {})) if found else {}
        if age > STALE_AFTER:
            silent = None if age == float("inf") else round(age, 3)
            checks["event_loop"] = {"status": UNHEALTHY, "silent_seconds": silent, "stale_after_seconds": STALE_AFTER}
        for name, check in checks.items():
            if not isinstance(check, dict) or "status" not in check:
                continue
            entry = merged.setdefault(name, {"status": check["status"], "workers": {}})
            entry["status"] = worst(entry["status"], check["status"])
            entry["workers"][str(index)] = check
    return merged
