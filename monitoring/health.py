"""Health reports and the three probes built on them.

A health report is ``{"status": S, "checks": {name: {"status": S, ...}}}``
with ``S`` one of HEALTHY, DEGRADED, UNHEALTHY; the overall status is the
worst of the checks. The HTTP server turns it into three probes with
Kubernetes semantics:

- ``/healthz``: the report; 503 when UNHEALTHY.
- ``/livez``: is the process's loop still turning? Only a wedged loop fails
  it (503): restarting helps then, and nothing else is a reason to restart.
- ``/readyz``: should this process get work? 503 while starting, stopping,
  or UNHEALTHY (a broker whose disk fails, a runner without its broker).

Each check is also the gauge ``conveyor_health_status{check}`` (0, 1, 2),
with ``check="overall"`` for the whole (``monitoring.metrics.HealthCollector``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HEALTHY, DEGRADED, UNHEALTHY = "HEALTHY", "DEGRADED", "UNHEALTHY"
STATUS_CODES = {HEALTHY: 0, DEGRADED: 1, UNHEALTHY: 2}

Report = dict[str, Any]
HealthCheck = Callable[[], Report]


def worst(*statuses: str) -> str:
    """The worst of some statuses (HEALTHY when there are none)."""
    return max(statuses, key=STATUS_CODES.__getitem__, default=HEALTHY)


def report(checks: dict[str, dict[str, Any]]) -> Report:
    """A report whose status is the worst of its checks'."""
    return {"status": worst(*(check["status"] for check in checks.values())), "checks": checks}


def failed_report(exc: BaseException) -> Report:
    """A health check that raised is itself a finding: UNHEALTHY, with the error."""
    return {"status": UNHEALTHY, "checks": {"health_check_error": f"{type(exc).__name__}: {exc}"}}


def safely(check: HealthCheck) -> Report:
    try:
        return check()
    except Exception as exc:
        return failed_report(exc)


def check_statuses(found: Report) -> dict[str, str]:
    """``{check: status}`` for every check that has one, and ``overall``."""
    statuses = {
        name: str(detail["status"])
        for name, detail in found.get("checks", {}).items()
        if isinstance(detail, dict) and detail.get("status") in STATUS_CODES
    }
    statuses["overall"] = str(found.get("status", UNHEALTHY))
    return statuses


def loop_check(lag: float, *, degraded_after: float, unhealthy_after: float) -> dict[str, Any]:
    """An event loop that has not passed for ``lag`` seconds beyond its longest wait."""
    status = UNHEALTHY if lag > unhealthy_after else DEGRADED if lag > degraded_after else HEALTHY
    return {"status": status, "lag_seconds": round(lag, 6), "wedged_after_seconds": unhealthy_after}


def live(found: Report, loop_check_name: str = "event_loop") -> Report:
    """``/livez`` from a report: live unless the loop check says the loop is wedged."""
    loop = found.get("checks", {}).get(loop_check_name)
    wedged = isinstance(loop, dict) and loop.get("status") == UNHEALTHY
    return {"live": not wedged, **({loop_check_name: loop} if isinstance(loop, dict) else {})}


def ready(found: Report, *, serving: bool, why_not: str = "starting or stopping") -> Report:
    """``/readyz`` from a report: ready while serving and not UNHEALTHY."""
    status = found.get("status", UNHEALTHY)
    if not serving:
        return {"ready": False, "status": status, "reason": why_not}
    if status == UNHEALTHY:
        failing = [name for name, s in check_statuses(found).items() if s == UNHEALTHY and name != "overall"]
        return {"ready": False, "status": status, "reason": "unhealthy: " + ", ".join(failing)}
    return {"ready": True, "status": status}
