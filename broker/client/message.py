"""The message a consumer sees, decoded from a delivered or fetched batch."""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from conveyor.broker.wire.delivery_times import headers_times
from conveyor.broker.wire.entry import entries_from_wire
from conveyor.broker.wire.models import model_kind, to_builtins
from conveyor.broker.wire.record import unpack_records
from conveyor.broker.wire.values import CONTENT_TYPE, decode_value

T = TypeVar("T")  # Message[Order]: what ``value`` holds for a typed handler (consumers/typed.py)

PARTITION_STRIDE = 1 << 52  # Message.ref: partition k's offsets start at k * 2**52 (an offset stays below it)


class _Origin:
    """What the messages of one delivered batch share: topic, partition, broker time, delivery count, first delivery."""

    __slots__ = ("attempt", "first_delivered", "partition", "timestamp", "topic")

    def __init__(
        self,
        topic: str,
        timestamp: float,
        attempt: int,
        first_delivered: float | None = None,
        partition: int = 0,
    ) -> None:
        self.topic = topic
        self.timestamp = timestamp
        self.attempt = attempt
        self.first_delivered = first_delivered
        self.partition = partition


class Message(Generic[T]):
    """One record: where it lives, what it carries, and how often it came.

    ``value`` is decoded from ``body`` by the ``content-type`` header (bytes
    when there is none); a handler annotated ``message: Message[Order]`` gets
    it validated into an ``Order`` (consumers/typed.py); ``attempt`` is the broker's delivery count, so it
    survives a consumer that was killed mid-message; ``first_delivered`` is
    when the broker first delivered it (``stop_after_delay`` measures from it).

    Messages compare by identity. A delivered batch becomes thousands of
    them, so a message holds only its offset, its body, the decoded record
    and what it shares with the rest of its batch; the other fields are
    read from those when asked for (and can be assigned as usual).
    """

    __slots__ = ("_headers", "_origin", "_record", "_value", "body", "offset")

    offset: int
    body: bytes
    _value: Any
    _headers: dict[str, str]
    _origin: _Origin
    _record: tuple[Any, Any, Any]

    def __init__(
        self,
        topic: str,
        offset: int,
        timestamp: float,
        key: str | bytes | None,
        headers: dict[str, str],
        body: bytes,
        attempt: int = 1,
        partition: int = 0,
    ) -> None:
        self._origin = _Origin(topic, timestamp, attempt, partition=partition)
        self._record = (key, None, body)
        self._headers = headers
        self.offset = offset
        self.body = body

    # --- shared with the batch (copied on write) ---------------------------------

    def _set_origin(self, name: str, value: Any) -> None:
        origin = self._origin
        fields = {
            "topic": origin.topic,
            "timestamp": origin.timestamp,
            "attempt": origin.attempt,
            "first_delivered": origin.first_delivered,
            "partition": origin.partition,
            name: value,
        }
        self._origin = _Origin(**fields)

    if TYPE_CHECKING:
        topic: str
        partition: int  # the topic's partition that holds it (0 for a single-partition topic)
        timestamp: float  # broker append time, seconds since the epoch
        attempt: int
        first_delivered: float | None  # when the broker first delivered it, seconds since the epoch
    else:  # C-level getters: these are read per message on hot paths
        topic = property(attrgetter("_origin.topic"), lambda self, v: self._set_origin("topic", v))
        partition = property(attrgetter("_origin.partition"), lambda self, v: self._set_origin("partition", v))
        timestamp = property(attrgetter("_origin.timestamp"), lambda self, v: self._set_origin("timestamp", v))
        attempt = property(attrgetter("_origin.attempt"), lambda self, v: self._set_origin("attempt", v))
        first_delivered = property(
            attrgetter("_origin.first_delivered"), lambda self, v: self._set_origin("first_delivered", v)
        )

    @property
    def ref(self) -> int:
        """One int naming the message within its subscription: the offset on partition 0, else
        ``offset + partition * PARTITION_STRIDE``. ``Subscription.ack`` and the others take it like an
        offset (so code that settles offsets works unchanged on a partitioned topic)."""
        partition = self._origin.partition
        return self.offset + partition * PARTITION_STRIDE if partition else self.offset

    # --- from the record ------------------------------------------------------------

    @property
    def key(self) -> str | bytes | None:
        return self._record[0]

    @key.setter
    def key(self, value: str | bytes | None) -> None:
        self._record = (value, self._record[1], None)

    @property
    def headers(self) -> dict[str, str]:
        try:
            return self._headers
        except AttributeError:
            headers = self._record[1]
            self._headers = headers = {} if headers is None else headers
            return headers

    @headers.setter
    def headers(self, value: dict[str, str]) -> None:
        self._headers = value

    @property
    def value(self) -> T:
        try:
            return self._value
        except AttributeError:
            self._value = value = decode_value(self.body, self.headers.get(CONTENT_TYPE))
            return value

    @value.setter
    def value(self, value: T) -> None:
        """The decoded value, as a typed handler's runner sets it (the body stays as it came)."""
        self._value = value

    @property
    def content_type(self) -> str | None:
        return self.headers.get(CONTENT_TYPE)

    @property
    def not_before(self) -> float | None:
        """When the broker held it back until (``send(delay=...)``), seconds since the epoch; None if not."""
        times = headers_times(self.headers)
        return times[0] / 1000 if times and times[0] else None

    @property
    def expires(self) -> float | None:
        """When it would have expired undelivered (``send(ttl=...)``), seconds since the epoch; None if never."""
        times = headers_times(self.headers)
        return times[1] / 1000 if times and times[1] else None

    def __repr__(self) -> str:
        where = f"partition={self.partition!r}, " if self.partition else ""  # a single-partition repr as it was
        return (
            f"Message(topic={self.topic!r}, {where}offset={self.offset!r}, timestamp={self.timestamp!r}, "
            f"key={self.key!r}, headers={self.headers!r}, body={self.body!r}, attempt={self.attempt!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        args = (
            self.topic,
            self.offset,
            self.timestamp,
            self.key,
            self.headers,
            self.body,
            self.attempt,
            self.partition,
        )
        return (Message, args)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view, as ``conveyor tail --format json`` prints it."""
        value: Any = self.value
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        elif model_kind(type(value)) is not None:  # a typed handler's Message[Order]
            value = to_builtins(value)
        key = self.key.decode("utf-8", errors="replace") if isinstance(self.key, bytes) else self.key
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp": self.timestamp,
            "key": key,
            "headers": self.headers,
            "value": value,
        }


# Building messages column by column: each pass is a C-level loop (``map`` over a slot
# descriptor), so a batch of n messages costs a few C loops instead of n Python calls.
_new = object.__new__
_set_offset = Message.__dict__["offset"].__set__
_set_body = Message.__dict__["body"].__set__
_set_record = Message.__dict__["_record"].__set__
_set_origin = Message.__dict__["_origin"].__set__
_body_of = itemgetter(2)


def _build(records: Any, offsets: Any, origin: _Origin) -> list[Message]:
    n = len(records)
    out = list(map(_new, repeat(Message, n)))
    deque(map(_set_offset, out, offsets), 0)
    deque(map(_set_record, out, records), 0)
    deque(map(_set_origin, out, repeat(origin, n)), 0)
    deque(map(_set_body, out, map(_body_of, records)), 0)
    return out


def messages_from_entries(topic: str, entries: Any, bodies: list[bytes], *, partition: int = 0) -> list[Message]:
    """Expand the ``entries`` of a DELIVER/FETCHED/EVENT header into messages, honouring each slice.

    A damaged entry is ``MalformedFrame`` (see ``DeliveryEntry.from_wire``).
    """
    out: list[Message] = []
    for entry, body in zip(entries_from_wire(entries), bodies, strict=False):
        records = unpack_records(body)
        base = entry.base_offset
        first_ms = entry.first_delivered_ms
        first_at = first_ms / 1000 if first_ms else None
        origin = _Origin(topic, entry.timestamp_ms / 1000, entry.deliveries or 1, first_at, partition)
        picked = entry.offsets
        if picked:
            out += _build([records[offset - base] for offset in picked], picked, origin)
            continue
        first, end = entry.first, entry.end
        if first != base or end - base != len(records):
            records = records[first - base : end - base]
        out += _build(records, range(first, first + len(records)), origin)
    return out
