"""The broker's health checks: what ``/healthz``, ``/livez``, ``/readyz`` and ``conveyor_health_status`` say.

- ``storage``: the last real append, fsync, offsets write and topic creation
  (``conveyor.broker.log.io_health``); a failure is UNHEALTHY until the same operation on
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
- ``replication`` (cluster mode): a partition this node leads with fewer
  in-sync replicas than replicas is DEGRADED (a follower is down or behind:
  one more loss and confirmed data may rest on fewer copies); one below its
  ``min_insync_replicas`` is UNHEALTHY (its publishes get
  NOT_ENOUGH_REPLICAS). Followed partitions count on their own leader.
- ``cluster`` (cluster mode): DEGRADED while this node is not registered in
  etcd (starting, or its lease lost); ``/readyz`` fails until it is.

``/livez`` reads the event loop only: another node's death never makes a
container restart this one.

Read on the HTTP thread: every value here is written by the loop (or the
offsets writer, under ``IoHealth``'s lock) and read whole.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.containment import Containment
from conveyor.broker.server.group_log import is_group_log
from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY, Report, live, loop_check, ready, report

if TYPE_CHECKING:
    from conveyor.broker.server.cluster_node import ClusterNode
    from conveyor.broker.server.mirror import Mirror
    from conveyor.broker.server.partitions import Partitions


@dataclass(slots=True)
class LoopTimes:
    """What the loop writes for the health checks: when it last passed, how long its last fsync took."""

    last_pass: float = 0.0
    fsync_seconds: float = 0.0


class HealthHost(Protocol):
    """What the health checks read (the broker is one); read live, so a changed setting counts at once."""

    @property
    def settings(self) -> BrokerSettings: ...
    @property
    def store(self) -> Store: ...
    @property
    def containment(self) -> Containment: ...
    @property
    def mirror(self) -> Mirror | None: ...
    @property
    def loop_times(self) -> LoopTimes: ...
    @property
    def running(self) -> bool: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def partitions(self) -> Partitions | None: ...  # cluster mode only
    @property
    def cluster(self) -> ClusterNode | None: ...


def broker_health(host: HealthHost) -> Report:
    checks: dict[str, dict[str, Any]] = {
        "storage": host.store.io_health.check(),
        "disk_space": _disk_space(host.settings),
        "fsync_latency": _fsync_latency(host.loop_times, host.settings),
        "event_loop": _event_loop(host),
    }
    if host.mirror is not None:
        checks["upstream"] = host.mirror.health()
    checks["internal_errors"] = host.containment.check()
    checks["lost_data"] = _lost_data(host.store)
    if host.partitions is not None:
        checks["replication"] = replication_check(host.partitions)
    if host.cluster is not None:
        checks["cluster"] = _cluster(host.cluster)
    return report(checks)


def replication_check(partitions: Partitions) -> dict[str, Any]:
    """The partitions this node leads that lack in-sync replicas: under-replicated, or below min_insync."""
    under: dict[str, dict[str, Any]] = {}
    below: list[str] = []
    for (topic, number), leader in list(partitions.leading.items()):
        if is_group_log(topic):
            continue  # a topic's group log shares its replicas and ISR: the topic's row says it
        isr, replicas = sorted(set(leader.isr)), leader.replicas
        if len(isr) < len(replicas):
            name = f"{topic}/{number}"
            under[name] = {"isr": isr, "replicas": list(replicas), "min_insync_replicas": leader.min_insync}
            if len(isr) < leader.min_insync:
                below.append(name)
    status = UNHEALTHY if below else DEGRADED if under else HEALTHY
    found: dict[str, Any] = {"status": status, "led": len(partitions.leading)}
    if under:
        found["under_replicated"] = under
    if below:
        found["below_min_insync"] = sorted(below)
    return found


def _cluster(cluster: ClusterNode) -> dict[str, Any]:
    if cluster.registered:
        return {"status": HEALTHY, "node": cluster.node_id, "controller": cluster.controller}
    return {"status": DEGRADED, "node": cluster.node_id, "error": "not registered in etcd"}


def _lost_data(store: Store) -> dict[str, Any]:
    lost = {topic.name: topic.lost_ranges for topic in list(store.logs.values()) if topic.lost_ranges}
    return {"status": DEGRADED, "topics": lost} if lost else {"status": HEALTHY}


def broker_live(host: HealthHost) -> Report:
    """Only a wedged loop fails liveness: a bad disk is not cured by a restart."""
    return live({"checks": {"event_loop": _event_loop(host)}})


def broker_ready(host: HealthHost) -> Report:
    """Ready while the loop serves, nothing is UNHEALTHY, and (in a cluster) this node is registered in etcd.

    A failing disk takes the node out of rotation; so does a partition it leads
    below ``min_insync_replicas``, which could take no publish anyway.
    """
    found = broker_health(host)
    if host.running and host.cluster is not None and not host.cluster.registered:
        return ready(found, serving=False, why_not="not registered in etcd")
    return ready(found, serving=host.running)


def _disk_space(settings: BrokerSettings) -> dict[str, Any]:
    minimum = settings.disk_free_min_bytes
    try:
        free = shutil.disk_usage(settings.data_dir).free
    except OSError as exc:  # the data directory is gone or unreadable: not a question of space
        return {"status": UNHEALTHY, "error": str(exc)}
    return {"status": DEGRADED if free < minimum else HEALTHY, "free_bytes": free, "min_bytes": minimum}


def _fsync_latency(times: LoopTimes, settings: BrokerSettings) -> dict[str, Any]:
    last, warn = times.fsync_seconds, settings.fsync_warn_seconds
    return {"status": DEGRADED if last > warn else HEALTHY, "last_seconds": round(last, 6), "warn_seconds": warn}


def _event_loop(host: HealthHost) -> dict[str, Any]:
    heartbeat = host.settings.heartbeat_ms / 1000
    # The loop passes at least every housekeeping interval; a longer gap means it is busy or stuck.
    lag = max(0.0, host.clock() - host.loop_times.last_pass - min(heartbeat, 0.25))
    return loop_check(lag, degraded_after=heartbeat, unhealthy_after=5 * heartbeat)
