"""The broker's settings: every option with its safe default in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from broker.config import Option, check_address, parse_bool

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
    quarantine: bool = False
    sndhwm: int = 100_000
    rcvhwm: int = 100_000
    disk_free_min_bytes: int = 256 * MiB
    fsync_warn_seconds: float = 0.5
    log_level: str = "INFO"
    metrics: bool = True
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    upstream: str = ""
    mirror: str = ""
    mirror_gap_policy: str = "resync"
    mirror_lag_threshold: int = 10_000
    mirror_unreachable_after_ms: int = 30_000
    registry: str = ""
    node: str = ""
    registry_poll_ms: int = 5000

    def __post_init__(self) -> None:
        if self.upstream:
            check_address(self.upstream)


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
    "quarantine": "move a corrupt sealed segment aside instead of refusing to start",
    "sndhwm": "ZeroMQ send high-water mark (a backstop; credit is the flow control)",
    "rcvhwm": "ZeroMQ receive high-water mark",
    "disk_free_min_bytes": "free space under which /healthz says DEGRADED",
    "fsync_warn_seconds": "a group commit slower than this makes /healthz say DEGRADED",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "curve_secret_key": "the broker's CURVE certificate (.key_secret from `conveyor keys`): encrypt and authenticate",
    "curve_authorized_keys": "directory of client public certificates (.key) allowed in with CURVE",
    "metrics": "update metrics (--no-metrics only to measure what they cost; /healthz stays)",
    "upstream": "parent broker to mirror topics from (tcp://HOST:PORT)",
    "mirror": "topic patterns to mirror from the upstream (fnmatch; repeat or separate with commas)",
    "mirror_gap_policy": "when the parent's retention passed this log's end: resync (start over) or stop",
    "mirror_lag_threshold": "messages behind the parent before the mirror is DEGRADED",
    "mirror_unreachable_after_ms": "time without the parent before the mirror is UNHEALTHY",
    "registry": "URL of a topology registry that names this node's parent (instead of --upstream)",
    "node": "this node's name in the registry",
    "registry_poll_ms": "how often the registry is read",
}


def broker_options() -> list[Option]:
    out = []
    for f in fields(BrokerSettings):
        default: Any = f.default
        kind: Any = parse_bool if isinstance(default, bool) else type(default)
        out.append(
            Option(
                f.name.replace("_", "-"),
                default,
                HELP[f.name],
                kind,
                flag=isinstance(default, bool),
                repeat=f.name == "mirror",
            )
        )
    return out
