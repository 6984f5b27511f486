"""What a SUBSCRIBE or CREDIT asks for, checked before anything changes: a refused request sets nothing."""

from __future__ import annotations

from conveyor.broker.log.data_dir import check_name
from conveyor.broker.server.groups import GroupSettings
from conveyor.broker.wire.protocol import Frame
from conveyor.broker.wire.protocol import field as hfield

from conveyor.errors import InvalidRequest


def checked_credit(credit: int, limit: int, *, minimum: int = 1) -> int:
    if not minimum <= credit <= limit:
        raise InvalidRequest(f"credit must be between {minimum} and {limit}", limit=limit)
    return credit


def check_dead_letter_topic(frame: Frame, topic: str) -> None:
    if hfield(frame, "dead_letter_topic", str, "") == topic:
        raise InvalidRequest(
            f"dead_letter_topic {topic} is the subscribed topic itself: a dead letter would be delivered "
            "to the group again, and again (name another topic, or leave it out for <topic>.dlq)",
            field="dead_letter_topic",
        )


def group_settings(frame: Frame, current: GroupSettings) -> GroupSettings:
    """The group settings a SUBSCRIBE asks for; a field it leaves out keeps ``current``."""
    settings = GroupSettings(
        max_deliveries=hfield(frame, "max_deliveries", int, current.max_deliveries),
        ack_timeout_ms=hfield(frame, "ack_timeout_ms", int, current.ack_timeout_ms),
        dead_letter_topic=hfield(frame, "dead_letter_topic", str, current.dead_letter_topic),
        key_affinity=hfield(frame, "key_affinity", bool, current.key_affinity),
    )
    if settings.max_deliveries < 1:
        raise InvalidRequest("max_deliveries must be at least 1", field="max_deliveries")
    if settings.ack_timeout_ms < 1:
        raise InvalidRequest("ack_timeout_ms must be at least 1", field="ack_timeout_ms")
    if settings.dead_letter_topic:
        check_name(settings.dead_letter_topic)
    return settings
