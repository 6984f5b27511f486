"""The broker state the metrics collector reads at each scrape: offsets, lag, members, the mirror.

Read on the HTTP thread: every value is written by the loop and read whole;
the collections are copied before they are walked.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.group_log import is_group_log
from conveyor.broker.server.group_table import GroupIndex
from conveyor.broker.server.limits import TopicLimits
from conveyor.broker.server.partition_status import follower_lag
from conveyor.monitoring.health import STATUS_CODES

from conveyor.names import split_log

if TYPE_CHECKING:
    from conveyor.broker.server.cluster_node import ClusterNode
    from conveyor.broker.server.mirror import Mirror
    from conveyor.broker.server.partitions import Partitions
    from conveyor.broker.server.peers import Peers

Rows = list[tuple[tuple[str, ...], float]]


class StateHost(Protocol):
    """What the snapshot reads (the broker is one)."""

    @property
    def settings(self) -> BrokerSettings: ...
    @property
    def store(self) -> Store: ...
    @property
    def groups(self) -> GroupIndex: ...
    @property
    def peers(self) -> Peers: ...
    @property
    def mirror(self) -> Mirror | None: ...
    @property
    def topic_limits(self) -> TopicLimits: ...


def state_snapshot(host: StateHost) -> dict[str, Rows]:
    rows: dict[str, Rows] = {}

    def add(name: str, labels: tuple[str, ...], value: float) -> None:
        rows.setdefault(name, []).append((labels, float(value)))

    for topic_log in host.store:
        one = (topic_log.name,)
        add("conveyor_log_start_offset", one, topic_log.start_offset)
        add("conveyor_log_end_offset", one, topic_log.end_offset)
        add("conveyor_log_durable_offset", one, topic_log.durable_offset)
        add("conveyor_log_segments", one, topic_log.segment_count())
        add("conveyor_log_size_bytes", one, topic_log.size_bytes())
    now_ms = time.time() * 1000
    for (topic, group_name), group in list(host.groups.items()):
        log = host.store.logs.get(topic)
        if log is None:
            continue
        labels = (topic, group_name)
        committed = max(group.committed_offset, log.start_offset)  # below the start: deleted, not lag
        add("conveyor_group_committed_offset", labels, committed)
        add("conveyor_group_lag_messages", labels, max(0, log.end_offset - committed))
        add("conveyor_group_lag_seconds", labels, _lag_seconds(log, committed, now_ms))
        add("conveyor_group_in_flight_messages", labels, group.in_flight)
        add("conveyor_group_pending_redelivery_messages", labels, group.pending_messages)
        add("conveyor_group_credit_messages", labels, sum(m.credit for m in list(group.members)))
        add("conveyor_group_members", labels, len(group.members) + len(group.joining))
    add("conveyor_connected_clients", (), len(host.peers))
    _mirror_rows(host, add)
    with contextlib.suppress(OSError):
        add("conveyor_disk_free_bytes", (), shutil.disk_usage(host.settings.data_dir).free)
    add("conveyor_disk_free_min_bytes", (), host.settings.disk_free_min_bytes)
    add("conveyor_topic_limit", (), host.topic_limits.limit)
    return rows


def _mirror_rows(host: StateHost, add: Callable[[str, tuple[str, ...], float], None]) -> None:
    mirror = host.mirror
    if mirror is None:
        return
    upstream = mirror.settings.upstream
    add("conveyor_mirror_status", (upstream,), STATUS_CODES[mirror.status()])
    now_ms = time.time() * 1000
    for name, topic in list(mirror.topics.items()):
        lag = mirror.lag(topic)
        add("conveyor_mirror_lag_messages", (name, upstream), lag)
        behind = (now_ms - topic.last_append_ms) / 1000 if lag and topic.last_append_ms else 0.0
        add("conveyor_mirror_lag_seconds", (name, upstream), max(0.0, behind))


def _lag_seconds(log: TopicLog, committed: int, now_ms: float) -> float:
    if committed >= log.end_offset:
        return 0.0
    try:
        batches = log.read(committed, max_bytes=1)
    except Exception:
        return 0.0
    return max(0.0, (now_ms - batches[0].timestamp_ms) / 1000) if batches else 0.0


class ClusterHost(Protocol):
    """What the cluster series read (a broker in cluster mode is one)."""

    @property
    def store(self) -> Store: ...
    @property
    def partitions(self) -> Partitions | None: ...
    @property
    def cluster(self) -> ClusterNode | None: ...


def cluster_snapshot(host: ClusterHost) -> dict[str, Rows]:
    """The rows of ``monitoring.metrics.CLUSTER_GAUGES`` and ``CLUSTER_COUNTERS``: roles, ISR, HW, follower lag."""
    rows: dict[str, Rows] = {}

    def add(name: str, labels: tuple[str, ...], value: float) -> None:
        rows.setdefault(name, []).append((labels, float(value)))

    cluster = host.cluster
    if cluster is not None:
        add("conveyor_cluster_node_registered", (), cluster.registered)
        add("conveyor_cluster_controller", (), cluster.controller is not None and cluster.controller == cluster.node_id)
        add("conveyor_cluster_nodes", (), len(cluster.agent.snapshot().nodes))
        changes = cluster.roles.leader_changes
        for tp in list(cluster.roles.states):  # every partition known, from 0: a rate has two points from the start
            add("conveyor_partition_leader_changes", (tp.topic, str(tp.partition)), changes.get(tp, 0))
    partitions = host.partitions
    if partitions is None:
        return rows
    now = partitions.clock()
    for (topic, _number), leader in list(partitions.leading.items()):
        log = host.store.logs.get(topic)
        if log is None or is_group_log(topic):  # a group log shares its topic's replicas and ISR
            continue
        labels = _partition_labels(topic)  # the log "T#k" is partition k of T
        isr = len(leader.isr)
        add("conveyor_partition_leader", labels, 1)
        add("conveyor_partition_replicas", labels, len(leader.replicas))
        add("conveyor_partition_isr_size", labels, isr)
        add("conveyor_partition_min_insync_replicas", labels, leader.min_insync)
        add("conveyor_partition_under_replicated", labels, isr < len(leader.replicas))
        add("conveyor_partition_below_min_insync", labels, isr < leader.min_insync)
        add("conveyor_partition_high_watermark", labels, leader.hw)
        end = log.end_offset
        replicas = leader.replicas
        for node, state in list(leader.followers.items()):
            if node not in replicas:
                continue  # a replica moved away (topics reassign): no longer a follower
            messages, seconds = follower_lag(state, end, now)
            add("conveyor_replica_lag_messages", (*labels, node), messages)
            add("conveyor_replica_lag_seconds", (*labels, node), seconds)
    for topic, _number in list(partitions.following):
        if not is_group_log(topic):
            add("conveyor_partition_leader", _partition_labels(topic), 0)
    return rows


def _partition_labels(log_name: str) -> tuple[str, str]:
    """``topic`` and ``partition`` of a node's partition log: in a cluster each partition of T is the log
    ``T#k`` on the node, and the ``conveyor_partition_*`` series name it by topic and partition."""
    topic, number = split_log(log_name)
    return topic, str(number)
