"""Which partition a producer's message goes to (docs/partitions.md, "How keys map to partitions").

In order: an explicit ``partition=``; else the key's partition
(``conveyor.broker.wire.partitioning.partition_for_key``, the same in every
client); else sticky batching: messages without a key fill one partition's
batch, and when that batch leaves for the broker the next keyless message
starts a batch on the next partition (a batch is the unit: one frame, one
append, one partition).

A topic's partition count is asked of the broker (METADATA) the first time
the producer sends to it, and kept: partitions are fixed at creation. A topic
the broker does not have yet (auto-created by the first PUBLISH) has one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from conveyor.broker.wire.partitioning import partition_for_key

from conveyor.errors import ConveyorError, UnknownPartition
from conveyor.names import partition_log, split_log

log = logging.getLogger("conveyor.producer")

CountOf = Callable[[str], int]  # asks the broker how many partitions a topic has


class Partitioner:
    def __init__(self, count_of: CountOf) -> None:
        self._count_of = count_of
        self.counts: dict[str, int] = {}
        self._sticky: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self, topic: str) -> int:
        count = self.counts.get(topic)
        if count is None:
            try:
                count = max(1, self._count_of(topic))
            except ConveyorError as exc:  # the broker is away: a topic it would auto-create has one partition
                log.warning("partitions of %s unknown (%s): sending to partition 0", topic, exc)
                count = 1
            self.counts[topic] = count
        return count

    def route(self, topic: str, key: str | bytes | None, partition: int | None) -> str:
        """The log name (``topic`` or ``topic#k``) this message's batch is for."""
        count = self.counts.get(topic) or self.count(topic)
        if partition is not None:
            if not 0 <= partition < count:
                raise UnknownPartition(
                    f"topic {topic} has {count} partition{'s' if count != 1 else ''}, no partition {partition}",
                    topic=topic,
                    partition=partition,
                    partitions=count,
                )
            return partition_log(topic, partition)
        if count == 1:
            return topic
        if key is not None:
            return partition_log(topic, partition_for_key(key, count))
        sticky = self._sticky.get(topic)
        if sticky is None:
            sticky = self._sticky[topic] = hash(topic) % count
        return partition_log(topic, sticky)

    def batch_left(self, log_name: str) -> None:
        """A batch went to the broker: if it was the sticky one, the next keyless batch takes the next partition."""
        topic, partition = split_log(log_name)
        sticky = self._sticky.get(topic)
        if sticky == partition:
            self._sticky[topic] = (partition + 1) % self.counts.get(topic, 1)
