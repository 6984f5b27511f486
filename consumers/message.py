"""The message a consumer sees, decoded from a delivered or fetched batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.codec import CONTENT_TYPE, decode_value
from broker.record import unpack_records


@dataclass(slots=True, eq=False)
class Message:
    """One record: where it lives, what it carries, and how often it came.

    ``value`` is decoded from ``body`` by the ``content-type`` header (bytes
    when there is none); ``attempt`` is the broker's delivery count, so it
    survives a consumer that was killed mid-message.
    """

    topic: str
    offset: int
    timestamp: float  # broker append time, seconds since the epoch
    key: str | bytes | None
    headers: dict[str, str]
    body: bytes
    attempt: int = 1
    _value: Any = field(default=None, repr=False)
    _decoded: bool = field(default=False, repr=False)

    @property
    def value(self) -> Any:
        if not self._decoded:
            self._value = decode_value(self.body, self.headers.get(CONTENT_TYPE))
            self._decoded = True
        return self._value

    @property
    def content_type(self) -> str | None:
        return self.headers.get(CONTENT_TYPE)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view, as ``conveyor tail --format json`` prints it."""
        value = self.value
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        key = self.key.decode("utf-8", errors="replace") if isinstance(self.key, bytes) else self.key
        return {
            "topic": self.topic,
            "offset": self.offset,
            "timestamp": self.timestamp,
            "key": key,
            "headers": self.headers,
            "value": value,
        }


def messages_from_entries(topic: str, entries: list[dict[str, Any]], bodies: list[bytes]) -> list[Message]:
    """Expand DELIVER/FETCHED entries into messages, honouring each slice."""
    out: list[Message] = []
    for entry, body in zip(entries, bodies, strict=False):
        records = unpack_records(body)
        base, ts = entry["b"], entry["t"] / 1000
        deliveries = entry.get("d", 0) or 1
        offsets = entry.get("o") or range(entry["f"], entry["e"])
        for offset in offsets:
            key, headers, value = records[offset - base]
            out.append(Message(topic, offset, ts, key, headers or {}, value, deliveries))
    return out
