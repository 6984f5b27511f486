"""The broker's health checks: what ``/healthz``, ``/livez``, ``/readyz`` and ``conveyor_health_status`` say.

- ``storage``: the last real append, fsync, offsets write and topic creation
  (``broker.iohealth``); a failure is UNHEALTHY until the same operation on
  the same topic works again.
- ``disk_space``: free space under ``--disk-free-min-bytes`` is an early
  DEGRADED warning only: writes still work, and if they stop, ``storage``
  says so.
- ``fsync_latency``: the last group commit slower than ``--fsync-warn-seconds``.
- ``event_loop``: how long since the loop last passed, beyond its longest
  wait; over five heartbeats it is wedged (UNHEALTHY, and ``/livez`` fails).
- ``upstream``: a mirroring broker's link to its parent.
- ``internal_errors``: an exception contained in the loop recently (DEGRADED).
- ``lost_data``: offsets recovery found missing although a group had
  committed past them or an index named them (confirmed data lost at the
  last start): DEGRADED until the next restart, with each topic's range.

Read on the HTTP thread: every value here is written by the loop (or the
offsets writer, under ``IoHealth``'s lock) and read whole.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY, Report, live, loop_check, ready, report

if TYPE_CHECKING:
    from conveyor.broker.server.broker import Broker


def broker_health(broker: Broker) -> Report:
    checks: dict[str, dict[str, Any]] = {
        "storage": broker.store.io_health.check(),
        "disk_space": _disk_space(broker),
        "fsync_latency": _fsync_latency(broker),
        "event_loop": _event_loop(broker),
    }
    if broker.mirror is not None:
        checks["upstream"] = broker.mirror.health()
    checks["internal_errors"] = broker.containment.check()
    checks["lost_data"] = _lost_data(broker)
    return report(checks)


def _lost_data(broker: Broker) -> dict[str, Any]:
    lost = {topic.name: topic.lost_ranges for topic in list(broker.store.logs.values()) if topic.lost_ranges}
    return {"status": DEGRADED, "topics": lost} if lost else {"status": HEALTHY}


def broker_live(broker: Broker) -> Report:
    """Only a wedged loop fails liveness: a bad disk is not cured by a restart."""
    return live({"checks": {"event_loop": _event_loop(broker)}})


def broker_ready(broker: Broker) -> Report:
    """Ready while the loop serves and nothing is UNHEALTHY (a failing disk takes it out of rotation)."""
    return ready(broker_health(broker), serving=broker.running)


def _disk_space(broker: Broker) -> dict[str, Any]:
    minimum = broker.settings.disk_free_min_bytes
    try:
        free = shutil.disk_usage(broker.settings.data_dir).free
    except OSError as exc:  # the data directory is gone or unreadable: not a question of space
        return {"status": UNHEALTHY, "error": str(exc)}
    return {"status": DEGRADED if free < minimum else HEALTHY, "free_bytes": free, "min_bytes": minimum}


def _fsync_latency(broker: Broker) -> dict[str, Any]:
    last, warn = broker._last_fsync_seconds, broker.settings.fsync_warn_seconds
    return {"status": DEGRADED if last > warn else HEALTHY, "last_seconds": round(last, 6), "warn_seconds": warn}


def _event_loop(broker: Broker) -> dict[str, Any]:
    heartbeat = broker.settings.heartbeat_ms / 1000
    # The loop passes at least every housekeeping interval; a longer gap means it is busy or stuck.
    lag = max(0.0, broker.clock() - broker._last_pass - min(heartbeat, 0.25))
    return loop_check(lag, degraded_after=heartbeat, unhealthy_after=5 * heartbeat)
