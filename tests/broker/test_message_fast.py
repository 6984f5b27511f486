"""Message and offset_ranges after the fast path (proposed for tests/)."""

from __future__ import annotations

import copy
import pickle

from conveyor.broker.client.message import Message, messages_from_entries
from conveyor.broker.client.subscription import offset_ranges
from conveyor.broker.wire.record import pack_records


def _body(n: int, base_value: int = 0) -> bytes:
    records = [
        (None, None, f"v{base_value + i}".encode()) if i % 3 else (f"k{i}", {"content-type": "text/plain"}, b"t")
        for i in range(n)
    ]
    return pack_records(records)


def test_whole_batch_slice_and_picked_offsets():
    body = _body(10)
    whole = messages_from_entries("t", [{"b": 100, "n": 10, "t": 1500, "f": 100, "e": 110, "d": 2}], [body])
    assert [m.offset for m in whole] == list(range(100, 110))
    assert all(m.topic == "t" and m.timestamp == 1.5 and m.attempt == 2 for m in whole)
    assert whole[1].body == b"v1" and whole[1].key is None and whole[1].headers == {} and whole[1].value == b"v1"
    assert whole[0].key == "k0" and whole[0].headers == {"content-type": "text/plain"} and whole[0].value == "t"
    sliced = messages_from_entries("t", [{"b": 100, "n": 10, "t": 0, "f": 104, "e": 107}], [body])
    assert [m.offset for m in sliced] == [104, 105, 106] and sliced[0].attempt == 1
    assert [m.body for m in sliced] == [b"v4", b"v5", b"t"]
    picked = messages_from_entries("t", [{"b": 100, "n": 10, "t": 0, "f": 101, "e": 109, "o": [101, 105, 108]}], [body])
    assert [(m.offset, m.body) for m in picked] == [(101, b"v1"), (105, b"v5"), (108, b"v8")]
    assert messages_from_entries("t", [], []) == []


def test_several_entries_keep_their_own_origin():
    out = messages_from_entries(
        "t",
        [{"b": 0, "n": 2, "t": 1000, "f": 0, "e": 2, "d": 1}, {"b": 2, "n": 2, "t": 2000, "f": 2, "e": 4, "d": 3}],
        [_body(2), _body(2)],
    )
    assert [(m.offset, m.timestamp, m.attempt) for m in out] == [(0, 1, 1), (1, 1, 1), (2, 2, 3), (3, 2, 3)]


def test_constructor_repr_equality_and_assignment():
    m = Message("t", 5, 1.25, b"k", {"a": "b"}, b"body", 3)
    assert (m.topic, m.offset, m.timestamp, m.key, m.headers, m.body, m.attempt) == (
        "t",
        5,
        1.25,
        b"k",
        {"a": "b"},
        b"body",
        3,
    )
    assert (
        repr(m) == "Message(topic='t', offset=5, timestamp=1.25, key=b'k', headers={'a': 'b'}, body=b'body', attempt=3)"
    )
    twin = Message("t", 5, 1.25, b"k", {"a": "b"}, b"body", 3)
    assert m != twin and m == m and len({m, twin}) == 2
    assert Message("t", 0, 0.0, None, {}, b"x").attempt == 1
    body = _body(3)
    a, b, _ = messages_from_entries("t", [{"b": 0, "n": 3, "t": 0, "f": 0, "e": 3, "d": 1}], [body])
    a.attempt = 7
    a.topic = "other"
    a.headers["x"] = "y"
    a.key = "new"
    assert (a.attempt, a.topic, a.key) == (7, "other", "new")
    assert (b.attempt, b.topic, b.headers) == (1, "t", {})  # siblings untouched
    assert a.headers == {"content-type": "text/plain", "x": "y"}


def test_value_decoding_and_to_dict():
    m = Message("t", 1, 2.0, b"k", {"content-type": "application/msgpack"}, b"\x81\xa1a\x01")
    assert m.value == {"a": 1} and m.value is m.value
    assert m.content_type == "application/msgpack"
    assert m.to_dict() == {
        "topic": "t",
        "partition": 0,
        "offset": 1,
        "timestamp": 2.0,
        "key": "k",
        "headers": m.headers,
        "value": {"a": 1},
    }


def test_pickle_and_copy():
    m = Message("t", 1, 2.0, "k", {"h": "1"}, b"v", 2)
    for clone in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
        assert repr(clone) == repr(m)


def test_offset_ranges():
    ms = messages_from_entries("t", [{"b": 0, "n": 6, "t": 0, "f": 0, "e": 6}], [_body(6)])
    assert offset_ranges(ms) == [[0, 6]]
    assert offset_ranges(iter(ms)) == [[0, 6]]
    assert offset_ranges([ms[0], ms[2], ms[3], 5]) == [[0, 1], [2, 4], [5, 6]]
    assert offset_ranges([3, 1, 2, 2]) == [[1, 4]]
    assert offset_ranges([]) == [] and offset_ranges(m.offset for m in ms[:0]) == []
    assert offset_ranges(range(4, 8)) == [[4, 8]]
