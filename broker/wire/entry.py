"""One DELIVER / FETCHED / EVENT entry: which records of one stored batch body a frame carries.

The broker writes an entry per batch (never per message) as a short-keyed
msgpack map, ``{b, n, t, f, e, d}`` plus the optional ``o`` and ``fd``, and
in FETCHED the stored batch's ``p``, ``s`` and ``le`` (producer id, sequence,
leader epoch) when it has them (docs/protocol.md, "DELIVER entries"). Every reader of entries goes
through ``DeliveryEntry.from_wire`` and every writer through ``wire_entry``
(which ``DeliveryEntry.to_wire`` calls), so the keys are spelled in one
place, and a reader handed a damaged entry gets ``MalformedFrame`` naming
the key instead of a ``KeyError`` from deep inside a consumer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from conveyor.errors import MalformedFrame


@dataclass(frozen=True, slots=True)
class DeliveryEntry:
    """One stored batch body in a frame, and the offsets of it that are delivered.

    Record ``i`` of the body has offset ``base_offset + i``; the delivered
    ones are ``offsets`` when given (key affinity), else ``[first, end)``.
    """

    base_offset: int  # b
    count: int  # n: records in the body
    timestamp_ms: int  # t: broker append time of the batch
    first: int  # f
    end: int  # e
    deliveries: int = 0  # d: this delivery included; 0 in FETCHED
    offsets: Sequence[int] | None = None  # o: the exact delivered offsets, instead of all of [first, end)
    first_delivered_ms: int = 0  # fd: wall clock ms of the first delivery; 0 when not sent
    # FETCHED only, where the stored batch has them: what a mirror or a follower stores with the copy
    producer_id: int = -1  # p: -1 when the producer is not idempotent
    sequence: int = -1  # s
    leader_epoch: int = 0  # le: 0 for a batch written outside a cluster

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map the broker sends (optional keys only when set)."""
        return wire_entry(
            self.base_offset,
            self.count,
            self.timestamp_ms,
            self.first,
            self.end,
            self.deliveries,
            self.offsets,
            self.first_delivered_ms,
            producer_id=self.producer_id,
            sequence=self.sequence,
            leader_epoch=self.leader_epoch,
        )

    @classmethod
    def from_wire(cls, entry: Any) -> DeliveryEntry:
        """Read an entry a broker sent; ``MalformedFrame`` for a missing or ill-typed key."""
        if not isinstance(entry, Mapping):
            raise MalformedFrame(f"an entry must be a map, not {type(entry).__name__}")
        offsets = entry.get("o")
        if offsets is not None:
            if not isinstance(offsets, list | tuple) or not all(type(o) is int for o in offsets):
                raise MalformedFrame("entry key 'o' must be a list of offsets", field="o")
            offsets = tuple(offsets)
        made = _new(cls)  # a frozen dataclass's __init__ costs ~3 us more; paid per batch a client reads
        _set_base(made, _int(entry, "b"))
        _set_count(made, _int(entry, "n"))
        _set_timestamp(made, _int(entry, "t"))
        _set_first(made, _int(entry, "f"))
        _set_end(made, _int(entry, "e"))
        _set_deliveries(made, _int(entry, "d", 0))
        _set_offsets(made, offsets)
        _set_first_delivered(made, _int(entry, "fd", 0))
        _set_producer(made, _int(entry, "p", -1))
        _set_sequence(made, _int(entry, "s", -1))
        _set_epoch(made, _int(entry, "le", 0))
        return made


# Filling the slots directly: what the frozen __init__ does, without its per-field object.__setattr__.
_new = object.__new__
(
    _set_base,
    _set_count,
    _set_timestamp,
    _set_first,
    _set_end,
    _set_deliveries,
    _set_offsets,
    _set_first_delivered,
    _set_producer,
    _set_sequence,
    _set_epoch,
) = (DeliveryEntry.__dict__[f.name].__set__ for f in fields(DeliveryEntry))


def wire_entry(
    base_offset: int,
    count: int,
    timestamp_ms: int,
    first: int,
    end: int,
    deliveries: int = 0,
    offsets: Sequence[int] | None = None,
    first_delivered_ms: int = 0,
    *,
    producer_id: int = -1,
    sequence: int = -1,
    leader_epoch: int = 0,
) -> dict[str, Any]:
    """The map of one entry, as ``DeliveryEntry.to_wire`` gives it.

    The broker calls it directly with the numbers its own objects hold: it
    builds no ``DeliveryEntry`` per batch it sends (an allocation and eight
    slot writes each, on the hot path). ``p``, ``s`` and ``le`` are written
    only when set: DELIVER never passes them, FETCHED passes the stored ones.
    """
    head: dict[str, Any] = {"b": base_offset, "n": count, "t": timestamp_ms, "f": first, "e": end, "d": deliveries}
    if offsets is not None:
        head["o"] = offsets
    if first_delivered_ms:
        head["fd"] = first_delivered_ms
    if producer_id != -1:
        head["p"] = producer_id
        head["s"] = sequence
    if leader_epoch:
        head["le"] = leader_epoch
    return head


def _int(entry: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    if value is None and default is not None:
        return default
    if type(value) is not int:
        if key not in entry:
            raise MalformedFrame(f"entry has no key {key!r}", field=key)
        raise MalformedFrame(f"entry key {key!r} must be an integer, not {type(value).__name__}", field=key)
    return value


def entries_from_wire(entries: Any) -> list[DeliveryEntry]:
    """The entries of a DELIVER, FETCHED or EVENT header (``entries`` may be absent: none)."""
    if entries is None:
        return []
    if not isinstance(entries, list | tuple):
        raise MalformedFrame(f"'entries' must be a list, not {type(entries).__name__}", field="entries")
    return [DeliveryEntry.from_wire(entry) for entry in entries]
