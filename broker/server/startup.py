"""What a broker opens at start: its store, its ROUTER socket, and the mirror of its parent if it has one.

Kept out of the loop's module: these run once, and each is given the
settings and the few objects it builds with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.net.security import ServerSecurity, check_server_options
from conveyor.broker.server.mirror import Mirror, MirrorHost, MirrorSettings
from conveyor.broker.server.topology import RegistryWatch

from conveyor.errors import ConfigError


def open_store(settings: BrokerSettings, metrics: Any) -> Store:
    """The data directory, recovered; what recovery found (cut tails, quarantined segments, lost offsets) is counted."""
    store = Store(
        settings.data_dir,
        fsync=FsyncPolicy.parse(settings.fsync),
        defaults=TopicConfig(
            segment_bytes=settings.segment_bytes,
            retention_bytes=settings.retention_bytes,
            retention_ms=settings.retention_ms,
        ),
        quarantine=settings.quarantine,
        offsets_write_errors=metrics.offsets_write_errors,
        topic_config_errors=metrics.topic_config_errors,
        create_in_background=True,
    )
    for topic in store:
        if topic.truncated_bytes:
            metrics.truncated_bytes.labels(topic.name).inc(topic.truncated_bytes)
        if topic.quarantined_segments:
            metrics.quarantined_segments.labels(topic.name).inc(topic.quarantined_segments)
        for lost in topic.lost_ranges:
            metrics.lost_offsets.labels(topic.name).inc(lost["end"] - lost["start"])
    return store


def bind_router(
    ctx: zmq.Context[Any], s: BrokerSettings, metrics: Any
) -> tuple[zmq.Socket[Any], ServerSecurity | None]:
    """The broker's ROUTER, bound (with CURVE when a secret key is set); a taken address is CONFIG_ERROR."""
    check_server_options(s.curve_secret_key, s.curve_authorized_keys, s.curve_allow_any_client)
    security = None
    if s.curve_secret_key:
        security = ServerSecurity(
            ctx,
            s.curve_secret_key,
            s.curve_authorized_keys,
            allow_any_client=s.curve_allow_any_client,
            failures=metrics.auth_failures,
        )
    sock = ctx.socket(zmq.ROUTER)
    if security is not None:
        security.apply(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, s.sndhwm)
    sock.setsockopt(zmq.RCVHWM, s.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, s.max_batch_bytes + 65536)
    try:
        sock.bind(s.bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError(
            f"cannot bind {s.bind}: {exc.strerror} (another broker there? "
            "--bind takes tcp://HOST:PORT, port * for any free one)",
            bind=s.bind,
        ) from None
    return sock, security


def open_mirror(
    s: BrokerSettings, host: MirrorHost, wake: Callable[[], None]
) -> tuple[Mirror | None, RegistryWatch | None]:
    """The mirror of the parent (``--upstream``, or the one the registry names) and the registry watcher."""
    patterns = tuple(p.strip() for p in s.mirror.split(",") if p.strip())
    watch = None
    upstream = s.upstream
    if s.registry:
        watch = RegistryWatch(s.registry, s.node, interval=s.registry_poll_ms / 1000, wake=wake)
        upstream = watch.read_parent() or s.upstream
    if not (upstream or s.registry):
        return None, watch
    if s.mirror_gap_policy not in ("resync", "stop"):
        raise ConfigError("--mirror-gap-policy must be resync or stop")
    settings = MirrorSettings(
        upstream=upstream,
        patterns=patterns or ("*",),
        gap_policy=s.mirror_gap_policy,
        lag_threshold=s.mirror_lag_threshold,
        unreachable_after=s.mirror_unreachable_after_ms / 1000,
    )
    # Without an upstream yet, the loop does not tick it: it waits for the registry to name a parent.
    return Mirror(host, settings), watch
