"""Which partition a producer's message goes to (docs/partitions.md, "How keys map to partitions").

In order: an explicit ``partition=``; else the key's partition
(``conveyor.broker.wire.partitioning.partition_for_key``, the same in every
client); else sticky batching: messages without a key fill one partition's
batch, and when that batch leaves for the broker the next keyless message
starts a batch on the next partition (a batch is the unit: one frame, one
append, one partition).

A topic's partition count is asked of the broker (METADATA) the first time
the producer sends to it (at most 2 s), and kept: partitions change only
when an operator adds some (``Admin.add_partitions``), and the broker's
confirm of a partitioned topic's batch carries its count, so a producer
learns of added partitions from its next confirm (``confirmed``). A topic
the broker does not have yet (auto-created by the first PUBLISH) has one.
The count is asked again, on a thread of its own so that
``send()`` never waits for it, when what the producer knew may no longer hold:

- the broker did not answer the first time: the topic is taken as one
  partition (everything to partition 0) and asked again by the first send
  after a back-off (1 s, doubling to 30 s while there is still no answer);
- the broker answered ``UNKNOWN_PARTITION`` (``stale``): the topic was made
  again with fewer partitions;
- ``MAX_AGE`` (5 minutes, as Kafka's ``metadata.max.age.ms``) after the last
  answer: the topic may have been made again with more, or had some added
  (the next confirm already says so; this is the net for a broker that does
  not).

``route`` (per message) looks at nothing of this; ``batch_left`` (per
batch, the unit) looks up when the topic is due and starts the ask.
A topic name is checked once, when its count is first asked: ``T#k`` is the
broker's name of partition k of ``T``, so it is ``INVALID_NAME`` here, as it
was before partitions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from conveyor.broker.wire.partitioning import partition_for_key, unknown_partition

from conveyor.errors import ConveyorError
from conveyor.names import check_name, check_partition, partition_log, split_log

log = logging.getLogger("conveyor.producer")

CountOf = Callable[[str], int]  # asks the broker how many partitions a topic has

FIRST_RETRY = 1.0  # seconds before a topic taken as single (no answer) is asked again
MAX_RETRY = 30.0
MAX_AGE = 300.0  # seconds after an answer before a batch asks the count again
MAX_AGE_NEVER = float("inf")


class Partitioner:
    def __init__(self, count_of: CountOf, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._count_of = count_of
        self._clock = clock
        self.counts: dict[str, int] = {}
        self._sticky: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}  # topic -> when a batch asks its count again
        self._guessed: set[str] = set()  # topics whose count is a guess (the broker did not answer)
        self._wait: dict[str, float] = {}  # topic -> the back-off after the next failed ask
        self._asking: set[str] = set()  # topics a thread is asking about now
        self._lock = threading.Lock()

    def count(self, topic: str) -> int:
        """The partition count of ``topic``, asked of the broker the first time (``InvalidName`` for a bad name)."""
        count = self.counts.get(topic)
        if count is None:
            check_name(topic)
            count = self._ask(topic)
            if count is None:
                count = 1
            self.counts[topic] = count
        return count

    def stale(self, topic: str) -> None:
        """What the producer knows of ``topic`` may be wrong (``UNKNOWN_PARTITION``): ask again, off this thread."""
        if topic in self.counts:
            with self._lock:
                self._retry_at[topic] = 0.0
                self._wait.pop(topic, None)

    def guessed(self, topic: str) -> bool:
        """Whether ``topic``'s count is a guess (no answer yet): an explicit partition then goes as asked."""
        return topic in self._guessed

    def _ask(self, topic: str) -> int | None:
        """The broker's count, or None when it did not answer (then asked again after a back-off)."""
        try:
            count = max(1, self._count_of(topic))
        except ConveyorError as exc:  # the broker is away: a topic it would auto-create has one partition
            with self._lock:
                wait = self._wait.get(topic, FIRST_RETRY)
                self._wait[topic] = min(MAX_RETRY, wait * 2)
                self._retry_at[topic] = self._clock() + wait
                self._guessed.add(topic)
            log.warning("partitions of %s unknown (%s): partition 0 until the broker answers", topic, exc)
            return None
        with self._lock:
            self._retry_at[topic] = self._clock() + MAX_AGE
            self._guessed.discard(topic)
            self._wait.pop(topic, None)
        return count

    def _maybe_ask_again(self, topic: str) -> None:
        """A batch of ``topic`` left and its count is due: one thread asks the broker again."""
        with self._lock:
            due = self._retry_at.get(topic)
            if due is None or due > self._clock() or topic in self._asking:
                return
            self._asking.add(topic)
        threading.Thread(target=self._ask_again, args=(topic,), name=f"partitions-{topic}", daemon=True).start()

    def _ask_again(self, topic: str) -> None:
        try:
            count = self._ask(topic)
            if count is not None and count != self.counts.get(topic):
                log.info("%s has %d partition(s)", topic, count)
                self._sticky.pop(topic, None)
                self.counts[topic] = count
        except Exception:  # the producer closed its context under the question: nothing to route any more
            log.debug("asking the partitions of %s again failed", topic, exc_info=True)
        finally:
            with self._lock:
                self._asking.discard(topic)

    def route(self, topic: str, key: str | bytes | None, partition: int | None) -> str:
        """The log name (``topic`` or ``topic#k``) this message's batch is for.

        ``partition`` not an int of 0 or more (a str, a bool, -1): ``ConfigError``, before anything is asked.
        """
        if partition is not None:
            check_partition(partition)
        count = self.counts.get(topic) or self.count(topic)
        if partition is not None:
            if not 0 <= partition < count and not (partition >= 0 and self.guessed(topic)):
                raise unknown_partition(topic, partition, count)
            return partition_log(topic, partition)
        if count == 1:
            return topic
        if key is not None:
            return partition_log(topic, partition_for_key(key, count))
        sticky = self._sticky.get(topic)
        if sticky is None:
            sticky = self._sticky[topic] = hash(topic) % count
        return partition_log(topic, sticky)

    def confirmed(self, log_name: str, partitions: object) -> None:
        """A confirm of a batch of ``log_name`` said its topic has ``partitions`` (absent: says nothing).

        More than the producer routes by: partitions were added; the new count is taken at once
        (no waiting for ``MAX_AGE``). Fewer is never taken from a confirm: only a topic made again
        has fewer, and ``UNKNOWN_PARTITION`` asks the broker then. One lookup per batch.
        """
        if type(partitions) is not int or partitions <= self.counts.get(topic := split_log(log_name)[0], 1):
            return
        with self._lock:
            self._retry_at[topic] = self._clock() + MAX_AGE
            self._guessed.discard(topic)
            self._wait.pop(topic, None)
        log.info("%s has %d partition(s) now", topic, partitions)
        self._sticky.pop(topic, None)
        self.counts[topic] = partitions

    def batch_left(self, log_name: str) -> None:
        """A batch went to the broker: if it was the sticky one, the next keyless batch takes the next partition.

        And if the topic's count is due to be asked again (a guess past its back-off, after
        ``UNKNOWN_PARTITION``, or ``MAX_AGE`` old), a thread asks it: once per batch, never per message.
        """
        topic, partition = split_log(log_name)
        if self._retry_at.get(topic, MAX_AGE_NEVER) <= self._clock():
            self._maybe_ask_again(topic)
        sticky = self._sticky.get(topic)
        if sticky == partition:
            self._sticky[topic] = (partition + 1) % self.counts.get(topic, 1)
