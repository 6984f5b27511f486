"""A dispatch that fails changes nothing, and what lies before the failure still goes.

A batch a group must deliver can be unreadable (a flipped byte found by its
CRC, an EIO from the disk). ``dispatch_contained`` rolls the failed dispatch
back, delivers what lies before the unreadable offset, and returns the error;
the broker then counts it (``conveyor_dispatch_errors_total{topic,group,error}``),
records it in its containment (logged with topic, group and offset, DEGRADED
``internal_errors`` in ``/healthz``) and pauses the group: retried after 1 s,
doubling to 30 s, while every other group goes on.
"""

from __future__ import annotations

from typing import Any, cast

from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.groups import Delivery, Group
from conveyor.broker.wire.record import Batch

from conveyor.errors import ConveyorError


def dispatch_contained(group: Group, log_: TopicLog) -> tuple[list[Delivery], Exception | None]:
    """The group's deliveries, and the error that stopped them early (None if none did).

    A failed dispatch changes nothing (``Group.dispatch_or_nothing``); if the
    error names the offset it could not read, the group is dispatched again
    with that offset as the end of what it may read, so what lies before it is
    still delivered.
    """
    try:
        return group.dispatch_or_nothing(log_), None
    except Exception as exc:
        offset = exc.fields.get("offset") if isinstance(exc, ConveyorError) else None
        if not isinstance(offset, int) or offset <= log_.start_offset:
            return [], exc
        try:
            return group.dispatch_or_nothing(cast(TopicLog, _ReadsBefore(log_, offset))), exc
        except Exception:
            return [], exc


class _ReadsBefore:
    """A view of a log that ends at ``end``: the group neither plans nor reads past it."""

    def __init__(self, log_: TopicLog, end: int) -> None:
        self._log = log_
        self.start_offset = log_.start_offset
        self.visible_offset = min(end, log_.visible_offset)

    def read(self, offset: int, **kwargs: Any) -> list[Batch]:
        return self._log.read(offset, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)
