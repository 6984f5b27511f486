"""Small stand-ins for the broker's loop: a recorder of what would be sent, a settable clock, a log's offsets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.broker.wire.protocol import Frame, decode

from conveyor.errors import ConveyorError


@dataclass
class Sent:
    """What the loop's ``send`` and ``reply_error`` were asked to send, decoded, in order."""

    frames: list[tuple[bytes, Frame]] = field(default_factory=list)
    errors: list[tuple[bytes, str, Any]] = field(default_factory=list)
    accept: bool = True  # False: every send bounces (the peer's queue is full)

    def send(self, peer: bytes, frames: list[Any]) -> bool:
        if self.accept:
            self.frames.append((peer, decode(frames)))
        return self.accept

    def reply_error(self, peer: bytes, exc: ConveyorError, rid: Any = None) -> None:
        self.errors.append((peer, exc.name, rid))


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeLog:
    name: str
    end_offset: int = 0
    durable_offset: int = 0
    high_watermark: int | None = None

    @property
    def visible_offset(self) -> int:  # as TopicLog's
        return self.durable_offset if self.high_watermark is None else min(self.durable_offset, self.high_watermark)


class Histogram:
    def __init__(self) -> None:
        self.observed: list[float] = []

    def observe(self, value: float) -> None:
        self.observed.append(value)
