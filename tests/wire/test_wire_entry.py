"""``DeliveryEntry``: the one reader and writer of DELIVER / FETCHED / EVENT entries.

A damaged entry is refused with ``MalformedFrame`` naming the key, never a
``KeyError`` or ``TypeError`` from inside a consumer, the mirror or the
Spark source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from conveyor.broker.client.message import messages_from_entries
from conveyor.broker.wire.entry import DeliveryEntry, entries_from_wire, wire_entry
from conveyor.broker.wire.record import pack_records

from conveyor.errors import MalformedFrame

GOOD = {"b": 10, "n": 3, "t": 1_700_000_000_000, "f": 10, "e": 13, "d": 1}


def test_the_keys_are_read_into_readable_names() -> None:
    entry = DeliveryEntry.from_wire({**GOOD, "o": [10, 12], "fd": 1_699_999_999_000})
    assert entry == DeliveryEntry(
        base_offset=10,
        count=3,
        timestamp_ms=1_700_000_000_000,
        first=10,
        end=13,
        deliveries=1,
        offsets=(10, 12),
        first_delivered_ms=1_699_999_999_000,
    )


def test_the_optional_keys_default_as_the_protocol_says() -> None:
    # FETCHED sends d=0; an older broker may leave d, o and fd out, or send fd as nil
    bare = {k: v for k, v in GOOD.items() if k != "d"}
    assert DeliveryEntry.from_wire(bare) == DeliveryEntry(10, 3, 1_700_000_000_000, 10, 13)
    assert DeliveryEntry.from_wire({**GOOD, "fd": None}).first_delivered_ms == 0
    assert DeliveryEntry.from_wire({**GOOD, "o": None}).offsets is None


def test_to_wire_sends_the_optional_keys_only_when_set() -> None:
    assert DeliveryEntry(1, 2, 3, 1, 3).to_wire() == {"b": 1, "n": 2, "t": 3, "f": 1, "e": 3, "d": 0}
    assert list(DeliveryEntry(1, 2, 3, 1, 3, 4, [1], 9).to_wire()) == ["b", "n", "t", "f", "e", "d", "o", "fd"]
    assert wire_entry(1, 2, 3, 1, 3, 4, [1], 9) == DeliveryEntry(1, 2, 3, 1, 3, 4, [1], 9).to_wire()


def test_fetched_entries_carry_the_producer_id_sequence_and_epoch_only_when_the_batch_has_them() -> None:
    assert wire_entry(1, 2, 3, 1, 3) == {"b": 1, "n": 2, "t": 3, "f": 1, "e": 3, "d": 0}
    assert wire_entry(1, 2, 3, 1, 3, producer_id=-1, sequence=-1, leader_epoch=0) == wire_entry(1, 2, 3, 1, 3)
    full = wire_entry(1, 2, 3, 1, 3, producer_id=77, sequence=5, leader_epoch=4)
    assert {k: full[k] for k in ("p", "s", "le")} == {"p": 77, "s": 5, "le": 4}
    entry = DeliveryEntry.from_wire(full)
    assert (entry.producer_id, entry.sequence, entry.leader_epoch) == (77, 5, 4)
    assert entry.to_wire() == full
    # An older parent sends none of them: not idempotent, epoch 0
    old = DeliveryEntry.from_wire(GOOD)
    assert (old.producer_id, old.sequence, old.leader_epoch) == (-1, -1, 0)


def test_a_delivery_entry_is_frozen_and_slotted() -> None:
    entry = DeliveryEntry.from_wire(GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.count = 4  # type: ignore[misc]
    assert not hasattr(entry, "__dict__")


@pytest.mark.parametrize("key", ["b", "n", "t", "f", "e"])
def test_a_missing_key_is_malformed_and_named(key: str) -> None:
    damaged = {k: v for k, v in GOOD.items() if k != key}
    with pytest.raises(MalformedFrame, match=f"no key '{key}'") as caught:
        DeliveryEntry.from_wire(damaged)
    assert caught.value.fields == {"field": key}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("b", "10"),
        ("n", 3.0),
        ("t", None),
        ("f", True),
        ("e", [13]),
        ("d", "1"),
        ("fd", 1.5),
        ("o", 10),
        ("o", ["x"]),
        ("p", "7"),
        ("s", 1.0),
        ("le", [2]),
    ],
)
def test_a_key_of_the_wrong_type_is_malformed_and_named(key: str, value: Any) -> None:
    with pytest.raises(MalformedFrame) as caught:
        DeliveryEntry.from_wire({**GOOD, key: value})
    assert caught.value.fields == {"field": key}


@pytest.mark.parametrize("entry", [None, 5, "b", [10, 3], b"\x80"])
def test_an_entry_that_is_no_map_is_malformed(entry: Any) -> None:
    with pytest.raises(MalformedFrame, match="must be a map"):
        DeliveryEntry.from_wire(entry)


def test_entries_must_be_a_list() -> None:
    assert entries_from_wire(None) == []
    assert entries_from_wire([GOOD]) == [DeliveryEntry.from_wire(GOOD)]
    with pytest.raises(MalformedFrame):
        entries_from_wire({"b": 1})


def test_a_consumer_given_a_damaged_entry_gets_malformed_frame_not_key_error() -> None:
    body = pack_records([(None, None, b"v")] * 3)
    with pytest.raises(MalformedFrame):
        messages_from_entries("t", [{k: v for k, v in GOOD.items() if k != "e"}], [body])
