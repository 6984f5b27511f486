"""Partitioned topics on one broker: which log a request names, and making a topic's partition logs.

Partition 0 of ``T`` is the log ``T`` as it always was; partition k > 0 is the
log ``T#k`` (conveyor/names.py), a log of its own with its own offsets,
segments, retention, groups.json and idempotence table. Everything below the
handlers (store, groups, dispatch, dead letters, fetch waits) works on log
names, so a partition is served by the code that serves a topic; only the
handlers map ``(topic, p)`` to a log here. The count is ``partitions`` in
the topic's ``topic.json`` (its ``extra``), absent for one partition, so an
existing data directory and every single-partition topic.json are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.wire.partitioning import unknown_partition
from conveyor.broker.wire.protocol import Frame
from conveyor.broker.wire.protocol import field as hfield

from conveyor.errors import InvalidRequest, TopicExists
from conveyor.names import MAX_PARTITIONS, partition_log, split_log


def log_for(store: Store, frame: Frame, count_of: Callable[[str], int] | None = None) -> str:
    """The log a PUBLISH, SUBSCRIBE or FETCH names: its ``topic`` (checked) and partition ``p`` (default 0).

    ``count_of`` gives a topic's partition count: the local topic.json's on a single broker; in a
    cluster, the topic's config record (a node may hold partition 3 of a topic and not partition 0).
    """
    topic = check_name(hfield(frame, "topic", str))
    partition = hfield(frame, "p", int, 0)
    if partition == 0:
        return topic
    count = (count_of or store.partition_count)(topic)
    if partition >= count:
        raise unknown_partition(topic, partition, count)
    return partition_log(topic, partition)


def create_partitioned(
    store: Store, name: str, partitions: int, config: Mapping[str, Any] | None = None, **more: Any
) -> TopicLog:
    """Make ``name`` with ``partitions`` logs (each made durable before this returns, like a topic).

    Partition 0 is made last: its topic.json records the count, so a crash part way leaves
    partition logs that the next create (or a dead-letter write) finds and keeps.
    """
    if name in store.logs:
        raise TopicExists(f"topic {name} exists", topic=name)
    extra = {"partitions": partitions} if partitions > 1 else None
    for number in range(1, partitions):
        log_name = partition_log(name, number)
        if log_name not in store.logs:
            store.create_topic(log_name, config, extra={"partition_of": name}, **more)
    return store.create_topic(name, config, extra=extra, **more)


def check_growth(topic: str, current: int, wanted: int) -> None:
    """``INVALID_REQUEST`` unless ``wanted`` is more partitions than ``current`` and at most ``MAX_PARTITIONS``.

    Partitions are only added: removing one would drop its messages and its groups' offsets.
    """
    if not current < wanted <= MAX_PARTITIONS:
        raise InvalidRequest(
            f"topic {topic} has {current} partition{'s' if current != 1 else ''}: add_partitions takes the new "
            f"total, more than {current} and at most {MAX_PARTITIONS} (partitions are only added), not {wanted}",
            field="partitions",
            topic=topic,
            partitions=current,
        )


def add_partition_logs(store: Store, name: str, partitions: int) -> list[str]:
    """Make the logs of ``name``'s partitions from its count up to ``partitions`` (durable when this returns).

    Each gets partition 0's settings. The count in partition 0's topic.json is not changed here:
    the caller does that last (``set_partition_count``), once whatever else the new logs need is
    durable too, so a crash part way leaves logs past the count, which no request can reach
    (``p`` past the count is ``UNKNOWN_PARTITION``) and the next add (or create) finds and keeps.
    """
    current = store.partition_count(name)
    check_growth(name, current, partitions)
    settings = store.topic(name).config.settings()
    made = [partition_log(name, number) for number in range(current, partitions)]
    for log_name in made:
        if log_name not in store.logs:
            store.create_topic(log_name, settings, extra={"partition_of": name})
    return made


def set_partition_count(store: Store, name: str, partitions: int) -> None:
    """Record ``partitions`` in ``name``'s topic.json (replaced atomically): from now on requests may name them."""
    store.alter_topic(name, extra={"partitions": partitions})


def dead_letter_target(store: Store, log_name: str, target: str) -> TopicLog:
    """The log dead letters of ``log_name`` go to (``target``, its partition of the DLQ topic), made if need be.

    The dead-letter topic of a partitioned topic gets as many partitions as its origin, and
    partition k's dead letters go to its partition k, so the dead letters of one key stay in order.
    A single-partition topic's is made as it always was.
    """
    topic, partition = split_log(log_name)
    count = store.partition_count(topic)
    if count == 1 and not partition:
        return store.get_or_create(target)
    if target not in store.logs:
        dlq_topic, _ = split_log(target)
        if dlq_topic not in store.logs:
            create_partitioned(store, dlq_topic, count)
        if target not in store.logs:  # the DLQ topic was there with fewer partitions: it grows to its origin's
            grown = max(count, store.partition_count(dlq_topic))
            add_partition_logs(store, dlq_topic, grown)
            set_partition_count(store, dlq_topic, grown)
    return store.topic(target)
