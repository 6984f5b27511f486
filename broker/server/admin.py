"""ADMIN operations and the state the metrics collector reads.

Kept out of the event loop's module: these are request/response
operations over broker state, not part of the data path.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.broker.log.data_dir import check_name
from conveyor.broker.log.topic_log import TopicLog
from conveyor.monitoring.health import STATUS_CODES

from conveyor.errors import ConfigError, InvalidRequest, UnknownGroup

if TYPE_CHECKING:
    from conveyor.broker.server.broker import Broker
    from conveyor.broker.server.groups import Group

Rows = list[tuple[tuple[str, ...], float]]


def resolve_position(log: TopicLog, position: Any) -> int:
    """``earliest``, ``latest``, an offset, or ``{"timestamp": ms}`` to an offset."""
    if position in (None, "earliest"):
        return log.start_offset
    if position == "latest":
        return log.end_offset
    if isinstance(position, int) and not isinstance(position, bool):
        return min(max(position, log.start_offset), log.end_offset)
    if isinstance(position, dict):
        if "offset" in position:
            return resolve_position(log, int(position["offset"]))
        if "timestamp" in position:
            return log.offset_for_timestamp(int(position["timestamp"]))
    if isinstance(position, str) and position.lstrip("-").isdigit():
        return resolve_position(log, int(position))
    raise InvalidRequest(f"position must be earliest, latest, an offset or {{'timestamp': ms}}, not {position!r}")


def describe_topic(broker: Broker, name: str) -> dict[str, Any]:
    log = broker.store.topic(name)
    return {
        "name": name,
        "start_offset": log.start_offset,
        "end_offset": log.end_offset,
        "durable_offset": log.durable_offset,
        "segments": log.segment_count(),
        "size_bytes": log.size_bytes(),
        "config": log.config.settings(),
        "config_errors": [error.to_dict() for error in broker.store.config_errors.get(name, [])],
        "groups": broker.groups.names_of_topic(name),
    }


def describe_group(broker: Broker, topic: str, name: str) -> dict[str, Any]:
    group = _group(broker, topic, name)
    log = broker.store.topic(topic)
    committed = group.committed_offset
    return {
        "topic": topic,
        "group": name,
        "committed_offset": committed,
        "next_offset": group.next_offset,
        "end_offset": log.end_offset,
        "lag": max(0, log.end_offset - committed),
        "in_flight": group.in_flight,
        "pending_redelivery": group.pending_messages,
        "skipped_by_retention": group.skipped_by_retention,
        "members": [
            {"peer": m.peer.hex(), "sub": m.sub_id, "credit": m.credit, "in_flight": m.in_flight}
            for m in group.members + group.joining
        ],
        "settings": group.settings.to_dict(),
        "settings_changed": group.settings_changed,
    }


def _group(broker: Broker, topic: str, name: str) -> Group:
    broker.store.topic(topic)
    group = broker.groups.get((topic, name))
    if group is None:
        raise UnknownGroup(f"no group {name} on topic {topic}", topic=topic, group=name)
    return group


def reset_offsets(broker: Broker, topic: str, name: str, to: Any) -> dict[str, Any]:
    log = broker.store.topic(topic)
    group = broker.groups.get((topic, name))
    if group is None:
        broker.check_group_room(topic, name)
        group = broker._make_group(topic, check_name(name, "group"), {"committed_offset": log.start_offset})
    group.reset(resolve_position(log, to))
    broker.store.save_group(topic, name, {**group.settings.to_dict(), "committed_offset": group.next_offset})
    broker.store.write_groups()
    broker.to_dispatch.add(group)
    return describe_group(broker, topic, name)


def delete_group(broker: Broker, topic: str, name: str) -> dict[str, Any]:
    group = _group(broker, topic, name)
    for member in list(group.members + group.joining):
        peer = broker.peers.get(member.peer)
        if peer is not None:
            peer.members.pop(member.sub_id, None)
    del broker.groups[(topic, name)]
    broker.store.delete_group(topic, name)
    broker.store.write_groups()
    broker.group_deleted(topic, name)
    return {"deleted": name, "topic": topic}


def delete_topic(broker: Broker, name: str) -> dict[str, Any]:
    for group in broker.groups.of_topic(name):
        delete_group(broker, name, group.name)
    broker.store.delete_topic(name)
    broker.topic_deleted(name)
    return {"deleted": name}


def create_topic(broker: Broker, name: str, config: Any) -> dict[str, Any]:
    """Every setting is checked by the topic settings table before the topic's directory is made."""
    if name not in broker.store.logs:
        broker.check_topic_room(name)  # TOPIC_EXISTS stays the answer for a topic that is there
    broker.store.create_topic(name, config)  # durable when it answers: an operator may restart right after
    return describe_topic(broker, name)


def alter_topic(broker: Broker, name: str, config: Any) -> dict[str, Any]:
    """Change settings live (retention at its next pass, segment size at the next roll)."""
    broker.store.topic(name)
    if not config:
        raise ConfigError(f"alter_topic {name}: no settings given (config is a map of setting to value)", topic=name)
    broker.store.alter_topic(name, config)
    return describe_topic(broker, name)


def refresh_topic(broker: Broker, topic: str) -> dict[str, Any]:
    if broker.mirror is None:
        raise InvalidRequest("this broker mirrors nothing: refresh a topic on a child broker")
    return broker.mirror.refresh(topic)


def _arg(header: dict[str, Any], key: str, kind: type) -> Any:
    value = header.get(key)
    if not isinstance(value, kind):
        raise InvalidRequest(f"ADMIN needs {key!r} ({kind.__name__})", field=key)
    return value


OPS: dict[str, Callable[[Broker, dict[str, Any]], Any]] = {
    "list_topics": lambda b, h: [describe_topic(b, name) for name in sorted(b.store.logs)],
    "describe_topic": lambda b, h: describe_topic(b, _arg(h, "topic", str)),
    "create_topic": lambda b, h: create_topic(b, _arg(h, "topic", str), h.get("config") or {}),
    "alter_topic": lambda b, h: alter_topic(b, _arg(h, "topic", str), h.get("config")),
    "delete_topic": lambda b, h: delete_topic(b, _arg(h, "topic", str)),
    "list_groups": lambda b, h: [describe_group(b, t, g) for (t, g) in sorted(b.groups) if h.get("topic") in (None, t)],
    "describe_group": lambda b, h: describe_group(b, _arg(h, "topic", str), _arg(h, "group", str)),
    "reset_offsets": lambda b, h: reset_offsets(b, _arg(h, "topic", str), _arg(h, "group", str), h.get("to")),
    "delete_group": lambda b, h: delete_group(b, _arg(h, "topic", str), _arg(h, "group", str)),
    "refresh_topic": lambda b, h: refresh_topic(b, _arg(h, "topic", str)),
    "mirror_status": lambda b, h: b.mirror.health() if b.mirror else None,
}


def run(broker: Broker, op: str, header: dict[str, Any]) -> Any:
    handler = OPS.get(op)
    if handler is None:
        raise InvalidRequest(f"unknown ADMIN op {op!r}; known: {', '.join(sorted(OPS))}", field="op")
    return handler(broker, header)


# --- state for the metrics collector ---------------------------------------------------


def state_snapshot(broker: Broker) -> dict[str, Rows]:
    rows: dict[str, Rows] = {}

    def add(name: str, labels: tuple[str, ...], value: float) -> None:
        rows.setdefault(name, []).append((labels, float(value)))

    for topic_log in broker.store:
        one = (topic_log.name,)
        add("conveyor_log_start_offset", one, topic_log.start_offset)
        add("conveyor_log_end_offset", one, topic_log.end_offset)
        add("conveyor_log_durable_offset", one, topic_log.durable_offset)
        add("conveyor_log_segments", one, topic_log.segment_count())
        add("conveyor_log_size_bytes", one, topic_log.size_bytes())
    now_ms = time.time() * 1000
    for (topic, group_name), group in list(broker.groups.items()):
        log = broker.store.logs.get(topic)
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
    add("conveyor_connected_clients", (), len(broker.peers))
    _mirror_rows(broker, add)
    with contextlib.suppress(OSError):
        add("conveyor_disk_free_bytes", (), shutil.disk_usage(broker.settings.data_dir).free)
    add("conveyor_topic_limit", (), broker.topic_limits.limit)
    return rows


def _mirror_rows(broker: Broker, add: Callable[[str, tuple[str, ...], float], None]) -> None:
    mirror = broker.mirror
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
