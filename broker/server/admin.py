"""ADMIN operations: request/response operations over the broker's topics and groups.

Kept out of the event loop's module: they are not part of the data path.
They see the broker through ``AdminHost``, the few things they need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.server.group_log import is_group_log
from conveyor.broker.server.group_table import GroupTable, resolve_position
from conveyor.broker.server.metadata import SINGLE_NODE_ID
from conveyor.broker.server.partition_logs import add_partition_logs, create_partitioned, set_partition_count
from conveyor.broker.server.partition_status import describe_partitions
from conveyor.broker.wire.partitioning import unknown_partition

from conveyor.errors import ConfigError, InvalidRequest, PartitionsUnsupported, UnknownGroup
from conveyor.names import PARTITION_MARK, dead_letter_topic, partition_log

if TYPE_CHECKING:
    from conveyor.broker.config.broker_settings import BrokerSettings
    from conveyor.broker.server.groups import Group
    from conveyor.broker.server.mirror import Mirror
    from conveyor.broker.server.partitions import Partitions
    from conveyor.broker.server.peers import Peers


class AdminHost(Protocol):
    """What ADMIN operations need of the broker (the broker is one)."""

    @property
    def store(self) -> Store: ...
    @property
    def groups(self) -> GroupTable: ...
    @property
    def peers(self) -> Peers: ...
    @property
    def mirror(self) -> Mirror | None: ...
    @property
    def to_dispatch(self) -> set[Group]: ...  # groups the loop dispatches this pass
    @property
    def settings(self) -> BrokerSettings: ...
    @property
    def partitions(self) -> Partitions | None: ...  # cluster mode only

    def check_topic_room(self, topic: str, logs: int = 1) -> None: ...  # TOPIC_LIMIT for ``logs`` more logs
    def partition_count(self, topic: str) -> int: ...  # in a cluster, its config record's count
    def topic_deleted(self, topic: str) -> None: ...  # answer what waited on it, forget its metrics
    def group_deleted(self, topic: str, name: str) -> None: ...
    def announce(self, topic: str, event: str, offset: int, *, partitions: int | None = None) -> None: ...


def answered_here(host: AdminHost, topic: str) -> list[int]:
    """The partitions of ``topic`` this broker answers ADMIN for: every one it holds on a single broker.

    In a cluster a partition's offsets and groups are its leader's: a node answers for the
    partitions it leads (for all it holds when it leads none, as a follower describes its copy),
    and a client with several leaders to ask merges their answers (``broker/client/admin.py``).
    """
    held = [n for n in range(host.partition_count(topic)) if partition_log(topic, n) in host.store.logs]
    if host.partitions is None:
        return held
    led = [n for n in held if host.partitions.leader_of(partition_log(topic, n)) is not None]
    return led or held


TOPIC_SUMS = ("end_offset", "durable_offset", "visible_offset", "segments", "size_bytes")  # summed over partitions


def describe_topic(host: AdminHost, name: str) -> dict[str, Any]:
    """The topic; for one partition, that log's fields as always. For several, ``end_offset``,
    ``durable_offset``, ``visible_offset``, ``segments`` and ``size_bytes`` are sums over the
    partitions answered here, and each row of ``partitions`` has its own (docs/partitions.md)."""
    numbers = answered_here(host, name)
    log = host.store.topic(partition_log(name, numbers[0]) if numbers and host.partitions is not None else name)
    count = host.partition_count(name)
    partitions = [_topic_row(host.store.topic(partition_log(name, number)), number, count > 1) for number in numbers]
    single = {
        "durable_offset": log.durable_offset,
        "visible_offset": log.visible_offset,
        "segments": log.segment_count(),
        "size_bytes": log.size_bytes(),
    }
    sums = {key: sum(row[key] for row in partitions) for key in TOPIC_SUMS[1:]} if count > 1 else single
    return {
        "name": name,
        "partition_count": count,  # in a cluster ``partitions`` has the ones led here
        "partitions": partitions,
        "start_offset": log.start_offset,
        "end_offset": sum(p["end_offset"] for p in partitions),
        **sums,
        "config": log.config.settings(),
        "config_errors": [error.to_dict() for error in host.store.config_errors.get(name, [])],
        "groups": host.groups.names_of_topic(name),
    }


def _topic_row(log: Any, number: int, full: bool) -> dict[str, Any]:
    """One partition's row: its bounds, and (of a topic with several) its durable and visible ends and size."""
    row = {"partition": number, "start_offset": log.start_offset, "end_offset": log.end_offset}
    if full:
        row.update(
            durable_offset=log.durable_offset,
            visible_offset=log.visible_offset,
            segments=log.segment_count(),
            size_bytes=log.size_bytes(),
        )
    return row


GROUP_SUMS = (
    "committed_offset",
    "next_offset",
    "end_offset",
    "lag",
    "in_flight",
    "pending_redelivery",
    "skipped_by_retention",
)


def describe_group(host: AdminHost, topic: str, name: str) -> dict[str, Any]:
    """Partition 0's group, with ``partitions`` (a row each); for one partition its fields as always.

    For several, ``committed_offset``, ``next_offset``, ``end_offset``, ``lag``, ``in_flight``,
    ``pending_redelivery`` and ``skipped_by_retention`` are sums over the partitions (each row has its
    own); ``members`` are partition 0's (each member subscribes to every partition).
    """
    numbers = _group_partitions(host, topic, name)
    full = host.partition_count(topic) > 1
    rows = [_partition_row(n, _describe_one(host, partition_log(topic, n), name), full) for n in numbers]
    described = {**_describe_one(host, partition_log(topic, numbers[0]), name), "topic": topic}
    if not full:
        return {**described, "partitions": rows}
    return {**described, **{key: sum(row[key] for row in rows) for key in GROUP_SUMS}, "partitions": rows}


def _group_partitions(host: AdminHost, topic: str, name: str) -> list[int]:
    """The partitions answered here (``answered_here``) that hold the group; ``UNKNOWN_TOPIC`` or
    ``UNKNOWN_GROUP`` when none does, or, on a single broker, when partition 0 does not (as before partitions).
    In a cluster the first is whichever this node leads: the client merges every leader's rows."""
    numbers = [n for n in answered_here(host, topic) if host.groups.get((partition_log(topic, n), name)) is not None]
    if not numbers or (host.partitions is None and numbers[0] != 0):
        _group(host, topic, name)  # raises, as a single node says
    return numbers


def _partition_row(number: int, described: dict[str, Any], full: bool) -> dict[str, Any]:
    """A partition's row: committed offset, end, lag and in flight; of a topic with several, also its
    next offset and pending redeliveries (a single-partition topic's row is as it was)."""
    keys = GROUP_SUMS if full else ("committed_offset", "end_offset", "lag", "in_flight")
    return {"partition": number, **{key: described[key] for key in keys}}


def _describe_one(host: AdminHost, topic: str, name: str) -> dict[str, Any]:
    group = _group(host, topic, name)
    log = host.store.topic(topic)
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


def _group(host: AdminHost, topic: str, name: str) -> Group:
    host.store.topic(topic)
    group = host.groups.get((topic, name))
    if group is None:
        raise UnknownGroup(f"no group {name} on topic {topic}", topic=topic, group=name)
    return group


def reset_offsets(host: AdminHost, topic: str, name: str, to: Any, partition: int | None = None) -> dict[str, Any]:
    """Applies ``to`` to every partition of the topic (an offset: the same offset in each), or to
    ``partition`` alone. A negative offset is refused before anything changes."""
    _check_position(to)
    count = host.partition_count(topic)
    if partition is not None and not 0 <= partition < count:
        host.store.topic(topic)  # UNKNOWN_TOPIC first
        raise unknown_partition(topic, partition, count)
    if host.partitions is not None:  # the partitions led here; the client asks every leader
        if partition is not None and host.partitions.leader_of(partition_log(topic, partition)) is None:
            raise host.partitions.not_leader(partition_log(topic, partition))  # led elsewhere: never a no-op
        for number in answered_here(host, topic):
            if partition in (None, number):
                _reset_one(host, partition_log(topic, number), name, to)
        return describe_group(host, topic, name)
    if partition is not None:
        _reset_one(host, partition_log(topic, partition), name, to)
        for number in range(host.store.partition_count(topic)):  # a group it made: at the start elsewhere
            if host.groups.get((partition_log(topic, number), name)) is None:
                _reset_one(host, partition_log(topic, number), name, "earliest")
        return describe_group(host, topic, name)
    for number in range(1, host.store.partition_count(topic)):
        _reset_one(host, partition_log(topic, number), name, to)
    _reset_one(host, topic, name, to)
    return describe_group(host, topic, name)


def _check_position(to: Any) -> None:
    """A negative offset is no position: refused (it was taken as the start of every partition)."""
    offset = to.get("offset") if isinstance(to, dict) else to
    if isinstance(offset, str) and offset.lstrip("-").isdigit():
        offset = int(offset)
    if isinstance(offset, int) and not isinstance(offset, bool) and offset < 0:
        raise InvalidRequest(
            f"reset_offsets: an offset is 0 or more, not {offset} (or earliest, latest, {{'timestamp': ms}})",
            field="to",
        )


def _partition_arg(header: dict[str, Any]) -> int | None:
    value = header.get("partition")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"ADMIN 'partition' must be an int of 0 or more, not {value!r}", field="partition")
    return value


def _reset_one(host: AdminHost, topic: str, name: str, to: Any) -> None:
    log = host.store.topic(topic)
    group = host.groups.get((topic, name))
    if group is None:
        host.groups.check_room(topic, name)
        group = host.groups.make(topic, check_name(name, "group"), {"committed_offset": log.start_offset})
    group.reset(resolve_position(log, to))
    host.store.save_group(topic, name, {**group.settings.to_dict(), "committed_offset": group.next_offset})
    host.store.write_groups()
    host.to_dispatch.add(group)


def delete_group(host: AdminHost, topic: str, name: str) -> dict[str, Any]:
    """The group on every partition answered here (in a cluster, those led here: the client asks every leader)."""
    numbers = _group_partitions(host, topic, name)
    for number in [*numbers[1:], numbers[0]]:  # the first (partition 0 on a single broker) last, as before
        _delete_one(host, partition_log(topic, number), name)
    return {"deleted": name, "topic": topic}


def _delete_one(host: AdminHost, topic: str, name: str) -> dict[str, Any]:
    group = _group(host, topic, name)
    for member in list(group.members + group.joining):
        host.peers.forget_subscription(member.peer, member.sub_id)
    del host.groups[(topic, name)]
    host.store.delete_group(topic, name)
    host.store.write_groups()
    host.group_deleted(topic, name)
    return {"deleted": name, "topic": topic}


def delete_topic(host: AdminHost, name: str) -> dict[str, Any]:
    """Every partition's log goes (partition 0 last: its topic.json holds the count)."""
    host.store.topic(name)
    for number in reversed(range(host.store.partition_count(name))):
        log_name = partition_log(name, number)
        if log_name in host.store.logs:
            delete_log(host, log_name)
    return {"deleted": name}


def delete_log(host: AdminHost, log_name: str) -> None:
    """One partition's log, with its groups (a cluster node drops the partitions it holds one by one)."""
    for group in host.groups.of_topic(log_name):
        _delete_one(host, log_name, group.name)
    host.store.delete_topic(log_name)
    host.topic_deleted(log_name)


def create_topic(host: AdminHost, name: str, config: Any, partitions: int = 1) -> dict[str, Any]:
    """Every setting is checked by the topic settings table before the topic's directory is made."""
    if name not in host.store.logs:
        host.check_topic_room(name, partitions)  # each partition is a log; TOPIC_EXISTS stays for one that is there
        host.store.defaults.with_settings(config)  # a bad setting is refused before any partition is made
    # durable when it answers: an operator may restart right after
    create_partitioned(host.store, check_name(name), partitions, config)
    return describe_topic(host, name)


def add_partitions(host: AdminHost, name: str, partitions: int) -> dict[str, Any]:
    """Grow ``name`` to ``partitions`` (the new total; only up); its description after (docs/partitions.md).

    The dead-letter topics of its groups that exist grow with it first, so partition k's dead
    letters keep going to partition k. Refused on a child broker's mirrored topic (the mirror
    follows its parent's count); a cluster node takes the op itself (``ClusterNode.add_partitions``).
    """
    if host.partitions is not None:
        raise PartitionsUnsupported(
            f"topic {name}: adding partitions is not supported in cluster mode yet (a single broker does it)",
            topic=name,
            partitions=partitions,
        )
    log_ = host.store.topic(name)
    if log_.config.extra.get("mirror_of"):
        raise InvalidRequest(f"topic {name} is mirrored: add partitions on the parent; this broker follows", topic=name)
    host.check_topic_room(name, partitions - host.store.partition_count(name))  # TOPIC_LIMIT: each new one is a log
    for group in host.groups.of_topic(name):
        target = dead_letter_topic(name, group.settings.dead_letter_topic)
        if target in host.store.logs and host.store.partition_count(target) < partitions:
            grow_topic(host, target, partitions)
    grow_topic(host, name, partitions)
    return describe_topic(host, name)


def grow_topic(host: AdminHost, name: str, partitions: int) -> None:
    """New partition logs, then the groups of partition 0 on each (at its start), then the count, then the news.

    Each step is durable before the next, so a crash leaves either the old count or the new one
    with every group in place. A group starts a new partition at its earliest offset: whatever
    a producer writes there before the group's members subscribe to it is delivered, never
    skipped (a consumer's ``start`` applies to a group it makes, not to partitions added later).
    Partition 0's subscribers get EVENT ``PARTITIONS``; the client then subscribes to the new ones.
    """
    made = add_partition_logs(host.store, name, partitions)
    for group in host.groups.of_topic(name):
        for log_name in made:
            if host.groups.get((log_name, group.name)) is None:
                state = {**group.settings.to_dict(), "committed_offset": host.store.topic(log_name).start_offset}
                host.groups.make(log_name, group.name, state)
                host.store.save_group(log_name, group.name, state)
    host.store.write_groups()
    set_partition_count(host.store, name, partitions)
    host.announce(name, "PARTITIONS", 0, partitions=partitions)


def _topics(host: AdminHost) -> list[str]:
    """The topics a user made (a partition's log ``T#k`` is shown as part of ``T``).

    In a cluster, a topic's group log ``__groups.<topic>`` is internal, as Kafka's
    ``__consumer_offsets``: clients may not write it, so it is not listed (``describe_topic``
    still shows it by name). A single broker has none, and a user topic of that name stays listed.
    """
    internal = is_group_log if host.partitions is not None else _never
    return sorted(name for name in host.store.logs if PARTITION_MARK not in name and not internal(name))


def _never(name: str) -> bool:
    return False


def alter_topic(host: AdminHost, name: str, config: Any) -> dict[str, Any]:
    """Change settings live (retention at its next pass, segment size at the next roll), on every partition.

    Partition 0 first: a refused setting is refused there, before any other partition changes.
    """
    host.store.topic(name)
    if not config:
        raise ConfigError(f"alter_topic {name}: no settings given (config is a map of setting to value)", topic=name)
    for log_ in host.store.partition_logs(name):
        host.store.alter_topic(log_.name, config)
    return describe_topic(host, name)


def refresh_topic(host: AdminHost, topic: str) -> dict[str, Any]:
    if host.mirror is None:
        raise InvalidRequest("this broker mirrors nothing: refresh a topic on a child broker")
    return host.mirror.refresh(topic)


def partitions_of(host: AdminHost, topic: str | None) -> dict[str, Any]:
    """This node's partitions: what it leads (with each follower's lag) and what it follows."""
    partitions = host.partitions
    node = partitions.node_id if partitions is not None else host.settings.node or SINGLE_NODE_ID
    return describe_partitions(partitions, host.store, node, topic)


def _topic(header: dict[str, Any]) -> str:
    """The op's ``topic``: a topic's name, never a partition's log (``T#k`` is ``INVALID_NAME`` as before)."""
    return check_name(_arg(header, "topic", str))


def _arg(header: dict[str, Any], key: str, kind: type) -> Any:
    value = header.get(key)
    if not isinstance(value, kind):
        raise InvalidRequest(f"ADMIN needs {key!r} ({kind.__name__})", field=key)
    return value


GROUP_OPS = frozenset({"describe_group", "reset_offsets", "delete_group"})  # in a cluster: on the topic's leader

OPS: dict[str, Callable[[AdminHost, dict[str, Any]], Any]] = {
    "list_topics": lambda b, h: [describe_topic(b, name) for name in _topics(b)],
    "describe_topic": lambda b, h: describe_topic(b, _topic(h)),
    "create_topic": lambda b, h: create_topic(b, _topic(h), h.get("config") or {}, h.get("partitions", 1)),
    "alter_topic": lambda b, h: alter_topic(b, _topic(h), h.get("config")),
    "add_partitions": lambda b, h: add_partitions(b, _topic(h), _arg(h, "partitions", int)),
    "delete_topic": lambda b, h: delete_topic(b, _topic(h)),
    "list_groups": lambda b, h: [
        describe_group(b, t, g)
        for (t, g) in sorted(b.groups)
        if h.get("topic") in (None, t) and PARTITION_MARK not in t
    ],
    "describe_group": lambda b, h: describe_group(b, _topic(h), _arg(h, "group", str)),
    "reset_offsets": lambda b, h: reset_offsets(b, _topic(h), _arg(h, "group", str), h.get("to"), _partition_arg(h)),
    "delete_group": lambda b, h: delete_group(b, _topic(h), _arg(h, "group", str)),
    "refresh_topic": lambda b, h: refresh_topic(b, _topic(h)),
    "mirror_status": lambda b, h: b.mirror.health() if b.mirror else None,
    "describe_partitions": lambda b, h: partitions_of(b, h.get("topic")),
    "reassign_topic": lambda b, h: _cluster_only("reassign_topic"),
}


def _cluster_only(op: str) -> Any:
    """An op a cluster's controller carries out (``ClusterNode`` takes it first): a single node refuses it."""
    raise InvalidRequest(f"{op} needs cluster mode (conveyor broker --cluster ...)", field="op")


def run(host: AdminHost, op: str, header: dict[str, Any]) -> Any:
    handler = OPS.get(op)
    if handler is None:
        raise InvalidRequest(f"unknown ADMIN op {op!r}; known: {', '.join(sorted(OPS))}", field="op")
    return handler(host, header)
