"""Every Conveyor metric is defined here, and nowhere else.

Names: the ``conveyor_`` prefix, base units (seconds, bytes), ``_total`` on
counters. Each family is built against an injected registry so tests use a
fresh one. Broker state that already lives in memory (offsets, lag,
in-flight, segments) is read at scrape time by a collector instead of being
copied into gauges on the hot path. Each registry also carries the standard
``process_*``, ``python_info`` and ``python_gc_*`` families, so dashboards can
show CPU, memory and file descriptors per broker and per runner.
"""

from __future__ import annotations

import itertools
import os
from bisect import bisect_left
from collections import Counter as Counter_
from collections.abc import Callable, Iterable
from typing import Any

from conveyor.monitoring.health import STATUS_CODES, check_statuses, safely
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HANDLER_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def build_info(registry: CollectorRegistry, component: str) -> Info:
    from conveyor.version import __version__

    info = Info("conveyor_build", "Conveyor version and component", registry=registry)
    info.info({"version": __version__, "component": component})
    return info


def register_runtime_collectors(registry: CollectorRegistry) -> None:
    """Add ``process_*``, ``python_info`` and ``python_gc_*`` to an injected registry.

    prometheus_client puts these on its global ``REGISTRY`` only; ours are
    separate registries, so without this the process panels would be empty.
    """
    if registry is REGISTRY:
        return  # already there: registering twice raises "Duplicated timeseries"
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


# --- series the broker's loop thread alone updates --------------------------------------------
#
# prometheus_client takes a lock on every update, and that lock is most of
# what an update costs: the broker's loop updates about fifteen series per
# small batch (publish, confirm, delivery, ack), some 30 µs of a ~300 µs
# pass at a paced rate. These keep a plain float (or a list of bucket
# counts) per child that only the loop thread writes; a scrape, on the HTTP
# thread, reads them (the GIL keeps each value whole) and builds the same
# families prometheus_client would.


class _LoopCounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _LoopHistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _LoopFamily(Collector):
    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: str) -> Any:
        key = tuple(map(str, values))
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
            child = self._children[key] = self._new_child()
        return child

    def _new_child(self) -> Any:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_LoopFamily):
    """A counter family only one thread updates (exposed as ``NAME_total``)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Iterable[str] = (), *, registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)
        if not self.labelnames:
            self.inc = self.labels().inc

    def _new_child(self) -> _LoopCounterChild:
        return _LoopCounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in list(self._children.items()):
            family.add_metric(list(key), child.value)
        return [family]


class LoopHistogram(_LoopFamily):
    """A histogram family only one thread updates."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.bounds = tuple(sorted(buckets))
        super().__init__(name, documentation, labelnames, registry)
        if not self.labelnames:
            self.observe = self.labels().observe

    def _new_child(self) -> _LoopHistogramChild:
        return _LoopHistogramChild(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            family.add_metric(list(key), list(zip(les, itertools.accumulate(counts), strict=True)), total)
        return [family]


class BrokerMetrics:
    """Counters and histograms the broker updates once per batch, never per message."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._topics: dict[str, TopicMetrics] = {}
        self._groups: dict[tuple[str, str], GroupMetrics] = {}
        build_info(registry, "broker")
        register_runtime_collectors(registry)
        topic, group = ["topic"], ["topic", "group"]
        self.published_messages = LoopCounter(
            "conveyor_published_messages", "Messages appended by producers", topic, registry=registry
        )
        self.published_bytes = LoopCounter(
            "conveyor_published_bytes", "Batch body bytes appended by producers", topic, registry=registry
        )
        self.published_batches = LoopCounter(
            "conveyor_published_batches", "Batches appended by producers", topic, registry=registry
        )
        self.duplicate_batches = LoopCounter(
            "conveyor_duplicate_batches",
            "Batches resent by idempotent producers and answered with their original offsets",
            topic,
            registry=registry,
        )
        self.delivered_messages = LoopCounter(
            "conveyor_delivered_messages",
            "Messages delivered to consumers (first deliveries and redeliveries)",
            group,
            registry=registry,
        )
        self.delivered_bytes = LoopCounter(
            "conveyor_delivered_bytes", "Batch body bytes delivered to consumers", group, registry=registry
        )
        self.acked_messages = LoopCounter("conveyor_acked_messages", "Messages acked", group, registry=registry)
        self.nacked_messages = Counter("conveyor_nacked_messages", "Messages nacked", group, registry=registry)
        self.redelivered_messages = Counter(
            "conveyor_redelivered_messages",
            "Messages queued for redelivery, by reason (nack, released, lease_expired, member_gone, unreachable)",
            [*group, "reason"],
            registry=registry,
        )
        self.dead_lettered_messages = Counter(
            "conveyor_dead_lettered_messages", "Messages moved to a dead-letter topic", group, registry=registry
        )
        self.expired_messages = Counter(
            "conveyor_expired_messages",
            "Messages whose ttl ran out before delivery, moved to the dead-letter topic (reason expired)",
            group,
            registry=registry,
        )
        self.dead_letter_failures = Counter(
            "conveyor_dead_letter_failures",
            "Dead letters that could not be stored and wait for redelivery, by reason (read_only_topic, storage)",
            [*group, "reason"],
            registry=registry,
        )
        self.group_settings_changes = Counter(
            "conveyor_group_settings_changes",
            "Times a newer subscription changed a group's settings (max_deliveries, ack_timeout_ms, ...)",
            group,
            registry=registry,
        )
        self.internal_errors = Counter(
            "conveyor_internal_errors",
            "Exceptions contained inside the broker's loop (logged with a traceback; the broker went on), "
            "by the unit of work that raised (request, dispatch, dead_letter, leases, heartbeats, ...)",
            ["where"],
            registry=registry,
        )
        self.skipped_messages = Counter(
            "conveyor_group_skipped_messages",
            "Messages a group never got because they were deleted before it reached them, by reason (retention)",
            [*group, "reason"],
            registry=registry,
        )
        self.protocol_errors = Counter(
            "conveyor_protocol_errors",
            "Requests answered with ERROR, by stable code",
            ["code", "name"],
            registry=registry,
        )
        self.router_send_errors = Counter(
            "conveyor_router_send_errors",
            "ROUTER sends that failed: EAGAIN (peer busy) or EHOSTUNREACH (peer gone)",
            ["error"],
            registry=registry,
        )
        self.truncated_bytes = Counter(
            "conveyor_log_truncated_bytes", "Bytes of torn tails cut when the log opened", topic, registry=registry
        )
        self.quarantined_segments = Counter(
            "conveyor_log_quarantined_segments",
            "Corrupt segments moved to the topic's quarantine/ when the log opened (--quarantine)",
            topic,
            registry=registry,
        )
        self.lost_offsets = Counter(
            "conveyor_log_lost_offsets",
            "Offsets missing when the log opened although a group committed past them or an index named them: "
            "confirmed data lost; skipped, never reused",
            topic,
            registry=registry,
        )
        self.dispatch_errors = Counter(
            "conveyor_dispatch_errors",
            "Dispatches to a group that failed (a read error, by error name); the group pauses and retries",
            [*group, "error"],
            registry=registry,
        )
        self.publish_seconds = LoopHistogram(
            "conveyor_publish_duration_seconds",
            "From receiving a PUBLISH to sending its confirm (includes the group commit)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fsync_seconds = LoopHistogram(
            "conveyor_fsync_duration_seconds",
            "Duration of one group commit",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.append_seconds = LoopHistogram(
            "conveyor_append_duration_seconds",
            "Duration of one batch append (CRC and write)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.end_to_end_seconds = LoopHistogram(
            "conveyor_end_to_end_duration_seconds",
            "From a batch's append to the ack that settles it",
            ["topic", "group"],
            buckets=HANDLER_BUCKETS,
            registry=registry,
        )
        self.loop_seconds = LoopHistogram(
            "conveyor_loop_iteration_duration_seconds",
            "Busy time of one event-loop pass",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.mirror_fetched_messages = Counter(
            "conveyor_mirror_fetched_messages", "Messages copied from the upstream broker", topic, registry=registry
        )
        self.mirror_fetched_bytes = Counter(
            "conveyor_mirror_fetched_bytes",
            "Batch body bytes copied from the upstream broker",
            topic,
            registry=registry,
        )
        self.mirror_reconnects = Counter(
            "conveyor_mirror_reconnects", "Reconnections to the upstream broker", ["upstream"], registry=registry
        )
        self.mirror_gaps = Counter(
            "conveyor_mirror_gaps",
            "Times the upstream's log start passed this broker's end (retention), handled by the gap policy",
            topic,
            registry=registry,
        )
        self.descriptors_exhausted = Counter(
            "conveyor_descriptors_exhausted",
            "Operations refused because the process ran out of file descriptors (EMFILE): TOO_MANY_OPEN_FILES",
            registry=registry,
        )
        self.auth_failures = Counter(
            "conveyor_auth_failures",
            "CURVE handshakes the broker refused, by reason: unknown_key (not in --curve-authorized-keys), "
            "mechanism_mismatch (a client without CURVE), bad_handshake (a wrong broker key, a corrupt handshake)",
            ["reason"],
            registry=registry,
        )
        self.offsets_write_errors = Counter(
            "conveyor_offsets_write_errors",
            "Failed writes of a topic's group offsets file (groups.json); each is retried with backoff",
            topic,
            registry=registry,
        )
        self.topic_config_errors = Counter(
            "conveyor_topic_config_errors",
            "Stored topic settings (topic.json) refused at start; the topic uses the default for each",
            ["topic", "setting"],
            registry=registry,
        )

    def topic(self, topic: str) -> TopicMetrics:
        """The children of one topic, looked up once: ``labels()`` costs more than the update."""
        found = self._topics.get(topic)
        if found is None:
            found = self._topics[topic] = TopicMetrics(self, topic)
        return found

    def group(self, topic: str, group: str) -> GroupMetrics:
        found = self._groups.get((topic, group))
        if found is None:
            found = self._groups[(topic, group)] = GroupMetrics(self, topic, group)
        return found

    def forget_topic(self, topic: str) -> None:
        """Drop every series labelled with a deleted topic (its groups' too): none is left stale on /metrics."""
        self._topics.pop(topic, None)
        for key in [k for k in self._groups if k[0] == topic]:
            del self._groups[key]
        for family in self._families():
            _drop_children(family, ("topic",), (topic,))

    def forget_group(self, topic: str, group: str) -> None:
        """Drop every series of a deleted group."""
        self._groups.pop((topic, group), None)
        for family in self._families():
            _drop_children(family, ("topic", "group"), (topic, group))

    def _families(self) -> list[Any]:
        return [v for v in vars(self).values() if isinstance(v, _LoopFamily | MetricWrapperBase)]


def _label_names(family: Any) -> tuple[str, ...]:
    return tuple(family.labelnames if isinstance(family, _LoopFamily) else family._labelnames)


def _drop_children(family: Any, names: tuple[str, ...], values: tuple[str, ...]) -> None:
    """Remove the children of ``family`` whose leading labels ``names`` equal ``values``."""
    if _label_names(family)[: len(names)] != names:
        return
    n = len(values)
    if isinstance(family, _LoopFamily):
        for key in [k for k in list(family._children) if k[:n] == values]:
            family._children.pop(key, None)
        return
    with family._lock:  # prometheus_client's own children: removed under its lock, as remove() does
        for key in [k for k in family._metrics if k[:n] == values]:
            del family._metrics[key]


class TopicMetrics:
    """The per-batch counters of one topic."""

    __slots__ = ("duplicate_batches", "published_batches", "published_bytes", "published_messages")

    def __init__(self, metrics: BrokerMetrics, topic: str) -> None:
        self.published_messages = metrics.published_messages.labels(topic)
        self.published_bytes = metrics.published_bytes.labels(topic)
        self.published_batches = metrics.published_batches.labels(topic)
        self.duplicate_batches = metrics.duplicate_batches.labels(topic)


class GroupMetrics:
    """The per-delivery and per-ack series of one consumer group."""

    __slots__ = ("acked_messages", "delivered_bytes", "delivered_messages", "end_to_end_seconds")

    def __init__(self, metrics: BrokerMetrics, topic: str, group: str) -> None:
        self.delivered_messages = metrics.delivered_messages.labels(topic, group)
        self.delivered_bytes = metrics.delivered_bytes.labels(topic, group)
        self.acked_messages = metrics.acked_messages.labels(topic, group)
        self.end_to_end_seconds = metrics.end_to_end_seconds.labels(topic, group)


class StateCollector(Collector):
    """Reads live broker state at scrape time through ``snapshot()``.

    ``snapshot`` returns ``{metric name: [(label values, value), ...]}`` for
    the names declared in ``STATE_GAUGES``; a family with no rows still
    appears, so a group that empties reads zero instead of vanishing stale.
    """

    def __init__(self, snapshot: Callable[[], dict[str, list[tuple[tuple[str, ...], float]]]]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return [
            GaugeMetricFamily(name, help_text, labels=list(labels))
            for name, (help_text, labels) in STATE_GAUGES.items()
        ]

    def collect(self) -> Iterable[Metric]:
        state = self.snapshot()
        for name, (help_text, labels) in STATE_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=list(labels))
            for label_values, value in state.get(name, []):
                family.add_metric(list(label_values), value)
            yield family


TOPIC, GROUP = ("topic",), ("topic", "group")
STATE_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "conveyor_log_start_offset": ("First offset still stored (moves with retention)", TOPIC),
    "conveyor_log_end_offset": ("Next offset to be written", TOPIC),
    "conveyor_log_durable_offset": ("Offsets below this are fsynced under the topic's policy", TOPIC),
    "conveyor_log_segments": ("Segment files of the topic", TOPIC),
    "conveyor_log_size_bytes": ("Bytes of the topic's segments", TOPIC),
    "conveyor_group_committed_offset": ("Lowest offset not yet acked by the group", GROUP),
    "conveyor_group_lag_messages": ("Messages appended but not yet acked by the group", GROUP),
    "conveyor_group_lag_seconds": ("Age of the oldest message the group has not acked", GROUP),
    "conveyor_group_in_flight_messages": ("Messages delivered and not yet settled", GROUP),
    "conveyor_group_pending_redelivery_messages": ("Messages waiting to be delivered again", GROUP),
    "conveyor_group_credit_messages": ("Sum of the members' credit (max unacked messages)", GROUP),
    "conveyor_group_members": ("Consumers subscribed in the group", GROUP),
    "conveyor_connected_clients": ("Peers the broker heard from within the liveness window", ()),
    "conveyor_disk_free_bytes": ("Free bytes on the data directory's file system", ()),
    "conveyor_disk_free_min_bytes": (
        "The broker's --disk-free-min-bytes: free space under which its disk_space health check is DEGRADED",
        (),
    ),
    "conveyor_topic_limit": (
        "Most topics this broker holds: the smaller of --max-topics and what its file descriptors allow",
        (),
    ),
    "conveyor_mirror_lag_messages": (
        "Messages the upstream has that this mirror has not copied yet",
        ("topic", "upstream"),
    ),
    "conveyor_mirror_lag_seconds": (
        "Age of the newest message copied from upstream, while behind",
        ("topic", "upstream"),
    ),
    "conveyor_mirror_status": ("Upstream link: 0 HEALTHY, 1 DEGRADED, 2 UNHEALTHY", ("upstream",)),
}


class ClusterCollector(Collector):
    """Cluster mode's series, read at scrape time like ``StateCollector``'s (a single node registers none).

    ``snapshot`` returns ``{metric name: [(label values, value), ...]}`` for the
    names in ``CLUSTER_GAUGES`` and ``CLUSTER_COUNTERS``. Partition series are
    exposed by the partition's leader only (``conveyor_partition_leader`` also
    by its followers), so a sum over the nodes counts each partition once.
    """

    def __init__(self, snapshot: Callable[[], dict[str, list[tuple[tuple[str, ...], float]]]]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return list(self._families({}))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self.snapshot()))

    @staticmethod
    def _families(state: dict[str, list[tuple[tuple[str, ...], float]]]) -> Iterable[Metric]:
        kinds = [(CLUSTER_GAUGES, GaugeMetricFamily), (CLUSTER_COUNTERS, CounterMetricFamily)]
        for table, kind in kinds:
            for name, (help_text, labels) in table.items():
                family = kind(name, help_text, labels=list(labels))
                for label_values, value in state.get(name, []):
                    family.add_metric(list(label_values), value)
                yield family


PARTITION, FOLLOWER = ("topic", "partition"), ("topic", "partition", "follower")
CLUSTER_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "conveyor_cluster_node_registered": ("1 while this node's key is in etcd (its lease alive), else 0", ()),
    "conveyor_cluster_controller": ("1 while this node is the cluster's controller, else 0", ()),
    "conveyor_cluster_nodes": ("Nodes registered in etcd, as this node sees them", ()),
    "conveyor_partition_leader": ("1 for a partition this node leads, 0 for one it follows", PARTITION),
    "conveyor_partition_replicas": ("Replicas assigned to a partition this node leads", PARTITION),
    "conveyor_partition_isr_size": ("In-sync replicas of a partition this node leads (itself included)", PARTITION),
    "conveyor_partition_min_insync_replicas": (
        "In-sync replicas a publish needs on a partition this node leads",
        PARTITION,
    ),
    "conveyor_partition_under_replicated": (
        "1 when a partition this node leads has fewer in-sync replicas than replicas, else 0",
        PARTITION,
    ),
    "conveyor_partition_below_min_insync": (
        "1 when a partition this node leads has fewer in-sync replicas than min_insync_replicas "
        "(publishes get NOT_ENOUGH_REPLICAS), else 0",
        PARTITION,
    ),
    "conveyor_partition_high_watermark": (
        "High watermark of a partition this node leads: offsets below it are durable on every in-sync replica",
        PARTITION,
    ),
    "conveyor_replica_lag_messages": (
        "Messages a follower is behind this leader's log end, by follower",
        FOLLOWER,
    ),
    "conveyor_replica_lag_seconds": (
        "Seconds since a follower was last caught up with this leader (0 while it is), by follower",
        FOLLOWER,
    ),
}
CLUSTER_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "conveyor_partition_leader_changes": (
        "Times this node saw a partition get a new leader (a higher leader epoch) since it started",
        PARTITION,
    ),
}


class HealthCollector(Collector):
    """``conveyor_health_status{check}``: each health check's status at scrape time, and ``overall``.

    0 HEALTHY, 1 DEGRADED, 2 UNHEALTHY, from the same report ``/healthz``
    serves (``health``), so an alert and a probe never disagree.
    """

    NAME = "conveyor_health_status"
    HELP = 'Health by check (and check="overall"): 0 HEALTHY, 1 DEGRADED, 2 UNHEALTHY'

    def __init__(self, health: Callable[[], dict[str, Any]]) -> None:
        self.health = health

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["check"])]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["check"])
        for check, status in sorted(check_statuses(safely(self.health)).items()):
            family.add_metric([check], STATUS_CODES[status])
        yield family


def fresh_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class RunnerMetrics:
    """The consumer runner's metrics, labelled like FastStream's: handler, topic, group."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        build_info(registry, "runner")
        register_runtime_collectors(registry)
        labels = ["handler", "topic", "group"]
        self.handled = Counter(
            "conveyor_runner_messages",
            "Messages handled, by outcome: ok, retried, dead_lettered, failed (dropped after the last attempt)",
            [*labels, "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "conveyor_runner_retries", "Retries scheduled (nacks with a delay)", labels, registry=registry
        )
        self.invalid = Counter(
            "conveyor_runner_invalid_messages",
            "Messages that did not decode into their typed handler's model: dead-lettered at once, never retried",
            labels,
            registry=registry,
        )
        self.duration = Histogram(
            "conveyor_runner_handler_duration_seconds",
            "Time spent in the handler per call (one message, or one batch for batch handlers)",
            labels,
            buckets=HANDLER_BUCKETS,
            registry=registry,
        )
        self.in_process = Gauge(
            "conveyor_runner_in_process_messages",
            "Messages received and not yet settled (queued or running)",
            labels,
            registry=registry,
            # Under --workers, the sum over the live workers: a dead worker's messages went back to the broker.
            multiprocess_mode="livesum",
        )
        self.new_group_replays = Counter(
            "conveyor_runner_new_group_replays",
            "Runner starts where a consumer's group was new and about to read more than --backlog-warning "
            "messages from earliest (a renamed function's new group replaying the topic?)",
            labels,
            registry=registry,
        )
        self.middleware_errors = Counter(
            "conveyor_runner_middleware_errors",
            "Middleware hooks that raised (logged and ignored: the message is handled as usual)",
            ["middleware", "hook"],
            registry=registry,
        )


class WorkerPoolMetrics:
    """The supervisor's own series under ``conveyor run --workers N`` (consumers/supervisor.py).

    The workers' ``RunnerMetrics`` reach the supervisor's registry through prometheus_client's
    multiprocess files, merged; these are what only the supervisor knows: its workers, their restarts,
    and the ``process_*`` families of the whole pool (``PoolProcessCollector``).
    """

    def __init__(self, registry: CollectorRegistry, pids: Callable[[], list[int]]) -> None:
        self.registry = registry
        build_info(registry, "runner")
        registry.register(PoolProcessCollector(pids))
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.workers = Gauge(
            "conveyor_runner_workers",
            "Worker processes of a `conveyor run --workers N` running now (N while all are up)",
            registry=registry,
        )
        self.worker_restarts = Counter(
            "conveyor_runner_worker_restarts",
            "Worker processes of a `conveyor run --workers N` that died without being asked and were started again",
            registry=registry,
        )


class PoolProcessCollector(Collector):
    """``process_*`` for a supervisor and its workers together, so a runner's CPU and memory panels stay true.

    CPU adds the live processes' time to what the supervisor's reaped children used (``RUSAGE_CHILDREN``), so
    the counter does not fall when a worker is replaced. Memory is the sum; descriptors are the most any one
    process holds, next to the per-process limit (``process_max_fds``), which is what EMFILE is about; the
    start time is the supervisor's.
    """

    SUMMED = frozenset({"process_cpu_seconds", "process_resident_memory_bytes", "process_virtual_memory_bytes"})

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids

    def collect(self) -> Iterable[Metric]:
        import resource

        merged: dict[str, Metric] = {}
        for pid in [os.getpid(), *self.pids()]:
            for family in ProcessCollector(pid=_constant(str(pid)), registry=None).collect():
                first = merged.setdefault(family.name, family)
                if first is family or not family.samples:
                    continue
                value = family.samples[0].value
                if family.name in self.SUMMED:
                    first.samples[0] = first.samples[0]._replace(value=first.samples[0].value + value)
                elif family.name == "process_open_fds":
                    first.samples[0] = first.samples[0]._replace(value=max(first.samples[0].value, value))
        cpu = merged.get("process_cpu_seconds")
        if cpu is not None and cpu.samples:
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.samples[0] = cpu.samples[0]._replace(value=cpu.samples[0].value + children.ru_utime + children.ru_stime)
        return list(merged.values())


def _constant(value: str) -> Callable[[], str]:
    return lambda: value


class _NoOp:
    """Stands in for any metric child: every update does nothing."""

    def labels(self, *args: object, **kwargs: object) -> _NoOp:
        return self

    def __call__(self, *args: object) -> _NoOp:  # NullMetrics().topic(name)
        return self

    def __getattr__(self, name: str) -> _NoOp:  # ... .published_messages
        return self

    def inc(self, *args: object) -> None:
        return None

    dec = observe = set = inc


class NullMetrics:
    """Metrics switched off (``--no-metrics``): to measure what metrics cost."""

    def __getattr__(self, name: str) -> _NoOp:
        return _NoOp()


def observe_many(histogram: Any, values: list[float]) -> None:
    """Observe many values with one update per bucket instead of one lock per value.

    The runner reports handler durations per chunk; at hundreds of thousands
    of messages per second, one ``observe()`` each would cost more than the
    handlers. Falls back to ``observe()`` if the client library changes shape.
    """
    if not values:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = Counter_(bisect_left(bounds, value) for value in values)
    for index, count in counts.items():
        buckets[index].inc(count)
    total.inc(sum(values))
