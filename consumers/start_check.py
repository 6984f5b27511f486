"""Where each consumer's group starts, said at start, and a warning before a new group replays a long topic.

A consumer's default group is its module-qualified function name, so renaming
the function starts a new group, which reads the topic from ``earliest``: every
message again. The runner logs each consumer's topic, group and start position,
and before subscribing asks the broker (one DESCRIBE of each topic) whether the
group exists; a new group that will start at ``earliest`` with more than
``--backlog-warning`` messages behind it is logged as a warning and counted in
``conveyor_runner_new_group_replays_total``. The decisions are pure; only
``check_new_groups`` talks to the broker, and a broker it cannot reach skips the
check (the runner starts without it and waits for the broker as always).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from conveyor.broker.client.admin import Admin
from conveyor.decorators.consumer import Consumer

from conveyor.errors import ConfigError, ConveyorError, UnknownTopic

log = logging.getLogger("conveyor.runner")

START_POSITIONS = ("earliest", "latest")
BACKLOG_WARNING = 10_000  # messages a new group may replay from earliest without a warning (--backlog-warning)
CHECK_TIMEOUT_MS = 2000  # the broker's answer to the check, at most; without one the runner starts unchecked


def check_default_start(value: str) -> str:
    if value not in START_POSITIONS:
        raise ConfigError(f"--default-start must be earliest or latest, not {value!r}")
    return value


def start_of(consumer: Consumer, default_start: str) -> Any:
    """Where a new group of ``consumer`` starts: its own ``start=``, else the runner's default."""
    return default_start if consumer.start is None else consumer.start


def backlog(described: Mapping[str, Any]) -> int:
    """Messages a group starting at ``earliest`` would read now: over the partitions, end minus start."""
    rows = described.get("partitions") or [described]
    return sum(max(0, int(row.get("end_offset", 0)) - int(row.get("start_offset", 0))) for row in rows)


def replay(described: Mapping[str, Any], group: str, threshold: int) -> int | None:
    """The backlog a new group would replay, when above ``threshold``; None if the group exists or it is small."""
    if threshold <= 0 or group in (described.get("groups") or ()):
        return None
    messages = backlog(described)
    return messages if messages > threshold else None


def check_new_groups(
    consumers: Iterable[Consumer],
    broker: str,
    *,
    default_start: str,
    threshold: int,
    on_replay: Callable[[Consumer, int], None],
    admin: Callable[[str], Admin] | None = None,
) -> None:
    """Log each consumer's topic, group and start; call ``on_replay`` for a new group about to replay a backlog."""
    todo = []
    for consumer in consumers:
        start = start_of(consumer, default_start)
        log.info(
            "consumer %s reads topic %s in group %s (a new group starts at %s)",
            consumer.name,
            consumer.topic,
            consumer.group,
            start,
            extra={"topic": consumer.topic, "group": consumer.group},
        )
        if start == "earliest" and threshold > 0:
            todo.append(consumer)
    if not todo:
        return
    try:
        with (admin or _admin)(broker) as client:
            described: dict[str, Any] = {}
            for consumer in todo:
                if consumer.topic not in described:
                    try:
                        described[consumer.topic] = client.describe_topic(consumer.topic)
                    except UnknownTopic:
                        described[consumer.topic] = {}
                messages = replay(described[consumer.topic], consumer.group, threshold)
                if messages is not None:
                    on_replay(consumer, messages)
    except ConveyorError as exc:
        log.warning("could not check for new groups replaying a long topic (%s); starting without the check", exc)


def _admin(broker: str) -> Admin:
    return Admin(broker, timeout_ms=CHECK_TIMEOUT_MS)


def warn_replay(consumer: Consumer, messages: int, threshold: int) -> None:
    log.warning(
        "consumer %s: group %s is new and starts at earliest: it will read all %d messages of topic %s "
        "(more than --backlog-warning %d). If the function or its module was renamed, its old group still "
        'holds the offsets: pass group= with the old name, or start="latest" (or --default-start latest) '
        "to skip the backlog",
        consumer.name,
        consumer.group,
        messages,
        consumer.topic,
        threshold,
        extra={"topic": consumer.topic, "group": consumer.group},
    )
