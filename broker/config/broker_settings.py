"""The broker's settings: every option with its safe default, its help and its schema in one place.

The schema (``RULES``) is what ``conveyor broker`` checks flags, variables and
TOML keys against, and what ``BrokerSettings`` checks its own fields against
when it is built in Python: one set of rules for both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from conveyor.broker.config import units
from conveyor.broker.config.addresses import (
    bind_endpoint,
    cluster_url,
    optional_endpoint,
    optional_endpoint_list,
    optional_url,
)
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.config.options import INT32_MAX, Option, nonempty, text
from conveyor.broker.config.topic_settings import TOPIC_SETTINGS

from conveyor.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    bind: str = "tcp://127.0.0.1:5555"
    data_dir: str = "./conveyor-data"
    fsync: str = "batch"
    metrics_port: int = 9100
    metrics_bind: str = "127.0.0.1"
    heartbeat_ms: int = 1000
    liveness: int = 3
    ack_timeout_ms: int = 30_000
    max_deliveries: int = 10
    max_message_bytes: int = 1 * MiB
    max_batch_bytes: int = 16 * MiB
    max_credit: int = 100_000
    default_credit: int = 1000
    max_fetch_wait_ms: int = 60_000
    segment_bytes: int = 128 * MiB
    retention_bytes: int = -1
    retention_ms: int = -1
    offsets_commit_ms: int = 100
    auto_create_topics: bool = True
    max_topics: int = 10_000
    max_groups: int = 100_000
    auto_create_rate: int = 100
    auto_create_client_rate: int = 20
    quarantine: bool = False
    sndhwm: int = 100_000
    rcvhwm: int = 100_000
    disk_free_min_bytes: int = 256 * MiB
    fsync_warn_seconds: float = 0.5
    log_level: str = "INFO"
    log_format: str = "text"
    log_config: str = ""
    metrics: bool = True
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    curve_allow_any_client: bool = False
    upstream: str = ""
    mirror: str = ""
    mirror_gap_policy: str = "resync"
    mirror_lag_threshold: int = 10_000
    mirror_unreachable_after_ms: int = 30_000
    registry: str = ""
    node: str = ""
    registry_poll_ms: int = 5000
    cluster: str = ""
    cluster_name: str = "default"
    node_id: str = ""
    advertise: str = ""
    cluster_lease_ms: int = 2000
    replica_lag_max_ms: int = 10_000
    default_replication_factor: int = 3
    min_insync_replicas: int = 2
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""

    def __post_init__(self) -> None:
        """The same rules as the command line: a broker built in Python cannot hold a value the CLI refuses."""
        problems = []
        for opt in broker_options():
            value = getattr(self, opt.dest)
            try:
                checked = opt.check(os.fspath(value) if isinstance(value, os.PathLike) else value)
            except (ValueError, ConfigError) as exc:
                problems.append(f"{opt.dest}={value!r}: {getattr(exc, 'message', exc)}")
                continue
            if checked != value or type(checked) is not type(value):
                object.__setattr__(self, opt.dest, checked)
        if not problems and self.default_credit > self.max_credit:
            problems.append(f"default_credit {self.default_credit} is above max_credit {self.max_credit}")
        if not problems and self.mirror.strip(", ") and not (self.upstream or self.registry):
            problems.append(
                f"--mirror {self.mirror!r} needs a parent to mirror from: give --upstream tcp://HOST:PORT "
                "(or --registry); without one nothing would be mirrored"
            )
        if not problems:
            problems.extend(cluster_problems(self))
        if problems:
            raise ConfigError("\n".join(problems), problems=problems)


def cluster_problems(settings: BrokerSettings) -> list[str]:
    """What a cluster node needs besides ``--cluster``: checked at start, before anything is opened."""
    if not settings.cluster:
        named = [f"--{name.replace('_', '-')}" for name in CLUSTER_ONLY if getattr(settings, name)]
        return (
            [f"{', '.join(named)} {'applies' if len(named) == 1 else 'apply'} only with --cluster etcd://HOST:PORT"]
            if named
            else []
        )
    problems = []
    if not settings.node_id:
        problems.append("--cluster needs --node-id NAME: the name this node registers under in etcd")
    advertised = settings.advertise or settings.bind
    host = advertised.removeprefix("tcp://").rpartition(":")[0]
    if not advertised.startswith("tcp://") or advertised.endswith(":*") or host in ("*", "0.0.0.0", "[::]"):
        problems.append(
            f"--advertise is needed: other nodes and clients cannot connect to {advertised!r}; "
            "give the tcp://HOST:PORT they reach this node at"
        )
    if settings.min_insync_replicas > settings.default_replication_factor:
        problems.append(
            f"--min-insync-replicas {settings.min_insync_replicas} is above "
            f"--default-replication-factor {settings.default_replication_factor}: no publish could be confirmed"
        )
    if bool(settings.etcd_cert) != bool(settings.etcd_key):
        problems.append("--etcd-cert and --etcd-key go together (the client certificate and its key)")
    return problems


CLUSTER_ONLY = ("node_id", "advertise", "etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")


HELP = {
    "bind": "ZeroMQ endpoint to bind (tcp://HOST:PORT, port * for any free port)",
    "data_dir": "directory for topics and group offsets",
    "fsync": "batch (group commit per loop pass), interval:MS, or none",
    "metrics_port": "port for /metrics and /healthz (0: any free port, -1: off)",
    "metrics_bind": "address for the metrics HTTP server",
    "heartbeat_ms": "heartbeat interval in both directions",
    "liveness": "heartbeats a peer may miss before it is evicted",
    "ack_timeout_ms": "default lease: unacked messages are redelivered after this",
    "max_deliveries": "default deliveries before a message is dead-lettered",
    "max_message_bytes": "largest message value accepted",
    "max_batch_bytes": "largest batch (one frame) accepted",
    "max_credit": "largest credit (unacked messages) a consumer may ask for",
    "default_credit": "credit when a SUBSCRIBE names none",
    "max_fetch_wait_ms": "longest a FETCH may wait for new data",
    "segment_bytes": "segment size before the log rolls to a new file",
    "retention_bytes": "default per-topic size limit (-1: unlimited)",
    "retention_ms": "default per-topic age limit (-1: unlimited)",
    "offsets_commit_ms": "how often group offsets are written to disk",
    "auto_create_topics": "create a topic on first publish or subscribe",
    "max_topics": "most topics the broker holds (lower if file descriptors allow fewer): TOPIC_LIMIT beyond",
    "max_groups": "most consumer groups the broker holds: GROUP_LIMIT beyond",
    "auto_create_rate": "topics auto-created per second by the whole broker: RATE_LIMITED beyond",
    "auto_create_client_rate": "topics auto-created per second by one connection: RATE_LIMITED beyond",
    "quarantine": "move a corrupt sealed segment aside instead of refusing to start",
    "sndhwm": "ZeroMQ send high-water mark (a backstop; credit is the flow control)",
    "rcvhwm": "ZeroMQ receive high-water mark",
    "disk_free_min_bytes": "free space under which /healthz says DEGRADED",
    "fsync_warn_seconds": "a group commit slower than this makes /healthz say DEGRADED",
    "log_level": "DEBUG, INFO, WARNING, ERROR or CRITICAL",
    "log_format": "text, or json: one JSON object per line (time, level, logger, message, topic...)",
    "log_config": "a logging.config.dictConfig file (.json, .toml, or .yaml with PyYAML): it decides everything",
    "curve_secret_key": "the broker's CURVE certificate (.key_secret from `conveyor keys`): encrypt and authenticate",
    "curve_authorized_keys": "directory of client public certificates (.key) allowed in with CURVE",
    "curve_allow_any_client": "with CURVE and no --curve-authorized-keys: encrypt, but let any client in",
    "metrics": "update metrics (--no-metrics only to measure what they cost; /healthz stays)",
    "upstream": "parent broker to mirror topics from (tcp://HOST:PORT), or a cluster's bootstrap list (a,b,c)",
    "mirror": "topic patterns to mirror from the upstream (fnmatch; repeat or separate with commas)",
    "mirror_gap_policy": "when the parent's retention passed this log's end: resync (start over) or stop",
    "mirror_lag_threshold": "messages behind the parent before the mirror is DEGRADED",
    "mirror_unreachable_after_ms": "time without the parent before the mirror is UNHEALTHY",
    "registry": "URL of a topology registry that names this node's parent (instead of --upstream)",
    "node": "this node's name in the registry",
    "registry_poll_ms": "how often the registry is read",
    "cluster": "etcd members of the cluster to join (etcd://HOST:PORT[,HOST:PORT...]); empty: a single node",
    "cluster_name": "the cluster's name: its keys in etcd live under /conveyor/NAME/",
    "node_id": "this node's id in the cluster (needed with --cluster)",
    "advertise": "the tcp://HOST:PORT other nodes and clients reach this node at (default: --bind)",
    "cluster_lease_ms": "this node's lease in etcd (whole seconds): a node silent this long is failed over",
    "replica_lag_max_ms": "a follower not caught up for this long leaves the in-sync set",
    "default_replication_factor": "replicas of a new topic (capped at the number of live nodes)",
    "min_insync_replicas": "default in-sync replicas a publish needs to be confirmed (capped at the replicas)",
    "etcd_ca": "CA bundle that signed etcd's certificate (https to etcd)",
    "etcd_cert": "client certificate for etcd (with --etcd-key)",
    "etcd_key": "client certificate key for etcd",
    "etcd_user": "etcd user (with --etcd-password-file)",
    "etcd_password_file": "file holding the etcd user's password",
}


def fsync_policy(value: Any) -> str:
    """batch, none or interval:MS."""
    return str(FsyncPolicy.parse(text(value)))


def topic_default(name: str) -> Callable[[Any], Any]:
    """The broker's default for a topic setting: checked by the topic settings table, as ``--set`` is."""
    setting = TOPIC_SETTINGS[name]

    def check(value: Any) -> Any:
        return setting.check(value)

    return check


def name_part(value: Any) -> str:
    """A node id or cluster name: it becomes one segment of an etcd key, so no ``/`` and no spaces."""
    name = text(value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise ValueError(f"{name!r}: use 1-100 letters, digits, '.', '_' or '-' (it names a key in etcd)")
    return name


def optional_name_part(value: Any) -> str:
    return "" if text(value) == "" else name_part(value)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")  # conveyor.monitoring.logs.FORMATS (config may not import monitoring)
PORT = {"minimum": -1, "maximum": 65535}

# Type, range and choices of each option (integers have a ceiling anyway: 2^31-1 for *_ms, 2^63-1 for others).
RULES: dict[str, dict[str, Any]] = {
    "bind": {"type": bind_endpoint},
    "data_dir": {"type": nonempty},
    "fsync": {"type": fsync_policy},
    "metrics_port": PORT,
    "metrics_bind": {"type": nonempty},
    "heartbeat_ms": {"minimum": 1},
    "liveness": {"minimum": 1},
    "ack_timeout_ms": {"minimum": 1},
    "max_deliveries": {"minimum": 1},
    "max_message_bytes": {"type": units.size_bytes, "minimum": 1, "maximum": INT32_MAX},
    "max_batch_bytes": {"type": units.size_bytes, "minimum": 1, "maximum": INT32_MAX},  # a 32-bit record length
    "max_credit": {"minimum": 1},
    "default_credit": {"minimum": 1},
    "max_fetch_wait_ms": {"minimum": 0},
    "max_topics": {"minimum": 1},
    "max_groups": {"minimum": 1},
    "auto_create_rate": {"minimum": 1},
    "auto_create_client_rate": {"minimum": 1},
    "segment_bytes": {"type": topic_default("segment_bytes"), "maximum": TOPIC_SETTINGS["segment_bytes"].maximum},
    "retention_bytes": {"type": topic_default("retention_bytes"), "maximum": TOPIC_SETTINGS["retention_bytes"].maximum},
    "retention_ms": {"type": topic_default("retention_ms"), "maximum": TOPIC_SETTINGS["retention_ms"].maximum},
    "offsets_commit_ms": {"minimum": 1},
    "sndhwm": {"minimum": 0, "maximum": INT32_MAX},
    "rcvhwm": {"minimum": 0, "maximum": INT32_MAX},
    "disk_free_min_bytes": {"type": units.size_bytes, "minimum": 0},
    "fsync_warn_seconds": {"minimum": 0},
    "log_level": {"choices": LOG_LEVELS},
    "log_format": {"choices": LOG_FORMATS},
    "upstream": {"type": optional_endpoint_list},
    "mirror_gap_policy": {"choices": ("resync", "stop")},
    "mirror_lag_threshold": {"minimum": 0},
    "mirror_unreachable_after_ms": {"minimum": 1},
    "registry": {"type": optional_url},
    "registry_poll_ms": {"minimum": 1},
    "cluster": {"type": cluster_url},
    "cluster_name": {"type": name_part},
    "node_id": {"type": optional_name_part},
    "advertise": {"type": optional_endpoint},
    "cluster_lease_ms": {"minimum": 1000, "maximum": 3_600_000},
    "replica_lag_max_ms": {"minimum": 1},
    "default_replication_factor": {"minimum": 1, "maximum": 255},
    "min_insync_replicas": {"minimum": 1, "maximum": 255},
}


def broker_options() -> list[Option]:
    out = []
    for f in fields(BrokerSettings):
        default: Any = f.default
        rules = {"type": type(default), **RULES.get(f.name, {})}
        out.append(
            Option(
                f.name.replace("_", "-"),
                default,
                HELP[f.name],
                flag=isinstance(default, bool),
                repeat=f.name == "mirror",
                **rules,
            )
        )
    return out
