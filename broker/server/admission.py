"""What a PUBLISH (or a SUBSCRIBE to a new topic) may write: a valid body, to a topic that exists or may be made.

Auto-creation is bounded three ways before a topic is made: the topic limit
(``--max-topics`` and the descriptors), the broker's creation rate and each
connection's (``RATE_LIMITED`` with ``retry_after_ms``). Topics made in a
pass are counted, so the loop can end its reads after a burst of creations.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.limits import TokenBucket, TopicLimits
from conveyor.broker.server.peers import Peers
from conveyor.broker.wire.record import validate_body

from conveyor.errors import ConveyorError, MessageTooLarge, ReadOnlyTopic, UnknownTopic
from conveyor.names import log_fields, log_label


class Admission:
    """Checks writes against ``store``; ``creations`` counts the topics made since the loop last reset it."""

    def __init__(
        self,
        store: Store,
        peers: Peers,
        limits: TopicLimits,
        *,
        auto_create: bool,
        client_rate: float,
        max_message_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.peers = peers
        self.limits = limits
        self.auto_create = auto_create
        self.client_rate = client_rate
        self.max_message_bytes = max_message_bytes
        self.clock = clock
        self.creations = 0

    def validate(self, body: bytes) -> int:
        """The number of records in a batch body; MESSAGE_TOO_LARGE naming the limit for an oversized one."""
        try:
            return validate_body(body, max_message_bytes=self.max_message_bytes)
        except ConveyorError as exc:
            if "exceeds max" in exc.message:
                limit = self.max_message_bytes
                raise MessageTooLarge(f"a message exceeds the limit of {limit} bytes", limit=limit) from None
            raise

    def topic_for_write(self, topic: str, identity: bytes | None = None) -> TopicLog:
        """The log of ``topic``, made now if auto-create allows (durable later: see log/topic_creator.py)."""
        if topic not in self.store.logs:
            if not self.auto_create:
                raise UnknownTopic(f"no topic {topic} (auto-create is off)", topic=topic)
            self._admit_auto_create(topic, identity)
            self.creations += 1
            self.store.create_topic(topic, background=True)  # no fsync here: see log/topic_creator.py
        log_ = self.store.topic(topic)
        if log_.config.read_only:
            raise ReadOnlyTopic(f"topic {log_label(topic)} is read-only", **log_fields(topic))
        return log_

    def _admit_auto_create(self, topic: str, identity: bytes | None) -> None:
        """TOPIC_LIMIT past the topic limit; RATE_LIMITED past the broker's or this connection's auto-create rate."""
        check_name(topic)
        self.limits.check_room(len(self.store.logs), topic)
        peer = self.peers.get(identity) if identity is not None else None
        if peer is not None and peer.creations is None:
            peer.creations = TokenBucket(self.client_rate, self.clock)
        client = peer.creations if peer is not None and peer.creations is not None else TokenBucket(1e9)
        self.limits.check_rate(topic, client)

    def check_room(self, topic: str, logs: int = 1) -> None:
        """For ADMIN create_topic and add_partitions: the topic limit holds there too, for every log the op
        makes (a partition is a log); its rate does not: an operator asks."""
        self.limits.check_room(len(self.store.logs) + max(0, logs - 1), topic)
