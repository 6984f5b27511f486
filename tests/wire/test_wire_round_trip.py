"""Encode, then decode: the same values come back, for every encoder and for ``DeliveryEntry``.

Each encoder's frames go through ``protocol.decode`` (the broker's reader,
schema checks included, for requests) and its header and payload must be
exactly the fields the encoder was given.
"""

from __future__ import annotations

from typing import Any

import msgpack
from conveyor.broker.client.message import messages_from_entries
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import DeliveryEntry, entries_from_wire
from conveyor.broker.wire.protocol import Command, decode, error_from_header
from conveyor.broker.wire.record import pack_records
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import ConveyorError, error_for_code

U32 = st.integers(0, 2**32 - 1)
I31 = st.integers(1, 2**31 - 1)
OFFSET = st.integers(0, 2**63 - 2)
I64 = st.integers(-(2**63), 2**63 - 1)
RID = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20))
NAME = st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True)
TEXT = st.text(max_size=50)
BODY = st.binary(min_size=1, max_size=64)
RANGES = st.lists(st.tuples(st.integers(0, 2**62), st.integers(1, 1000)).map(lambda p: [p[0], p[0] + p[1]]), max_size=5)
ENTRY = st.builds(
    DeliveryEntry,
    base_offset=OFFSET,
    count=U32,
    timestamp_ms=I64,
    first=OFFSET,
    end=OFFSET,
    deliveries=st.integers(0, 2**31 - 1),
    offsets=st.none() | st.lists(OFFSET, max_size=8).map(tuple),
    first_delivered_ms=st.integers(0, 2**62),
)

EXAMPLES = settings(max_examples=100, deadline=None)


def header_of(frames: list[Any], command: Command) -> dict[str, Any]:
    frame = decode(frames)
    assert frame.command is command
    return frame.header


@EXAMPLES
@given(client=st.none() | TEXT, rid=RID)
def test_hello(client: str | None, rid: Any) -> None:
    assert header_of(commands.hello(client, rid=rid), Command.HELLO) == {"rid": rid, "client": client}


@EXAMPLES
@given(topic=NAME, body=BODY, pid=st.integers(-1, 2**63 - 1), seq=st.integers(-1, 2**31 - 1), rid=RID)
def test_publish(topic: str, body: bytes, pid: int, seq: int, rid: Any) -> None:
    frame = decode(commands.publish(topic, body, pid=pid, seq=seq, rid=rid))
    assert frame.command is Command.PUBLISH
    assert frame.header == {"rid": rid, "topic": topic, "pid": pid, "seq": seq}
    assert frame.payload == (body,)


@EXAMPLES
@given(
    sub=U32,
    topic=NAME,
    group=NAME,
    credit=U32,
    batch_size=I64,
    start=st.sampled_from(["earliest", "latest", None, 0, {"timestamp": 5}]),
    key_affinity=st.booleans(),
    max_deliveries=I31,
    rid=RID,
)
def test_subscribe(
    sub: int,
    topic: str,
    group: str,
    credit: int,
    batch_size: int,
    start: Any,
    key_affinity: bool,
    max_deliveries: int,
    rid: Any,
) -> None:
    settings_ = {"start": start, "key_affinity": key_affinity, "max_deliveries": max_deliveries}
    frames = commands.subscribe(sub, topic, group, credit=credit, batch_size=batch_size, settings=settings_, rid=rid)
    assert header_of(frames, Command.SUBSCRIBE) == {
        "rid": rid,
        "sub": sub,
        "topic": topic,
        "group": group,
        "credit": credit,
        "batch_size": batch_size,
        **settings_,
    }


@EXAMPLES
@given(sub=U32, ranges=RANGES, delay_ms=I64, error=TEXT, release=st.booleans(), reason=TEXT, credit=U32)
def test_settling_and_credit(
    sub: int, ranges: list[list[int]], delay_ms: int, error: str, release: bool, reason: str, credit: int
) -> None:
    assert header_of(commands.unsubscribe(sub), Command.UNSUBSCRIBE) == {"sub": sub}
    assert header_of(commands.ack(sub, ranges), Command.ACK) == {"sub": sub, "ranges": ranges}
    assert header_of(commands.in_progress(sub, ranges), Command.IN_PROGRESS) == {"sub": sub, "ranges": ranges}
    assert header_of(commands.term(sub, ranges, reason=reason), Command.TERM) == {
        "sub": sub,
        "ranges": ranges,
        "reason": reason,
    }
    nacked = header_of(commands.nack(sub, ranges, delay_ms=delay_ms, error=error, release=release), Command.NACK)
    assert nacked == {
        "sub": sub,
        "ranges": ranges,
        "delay_ms": delay_ms,
        "error": error,
        **({"release": True} if release else {}),
    }
    assert header_of(commands.credit(sub, credit, batch_size=delay_ms), Command.CREDIT) == {
        "sub": sub,
        "credit": credit,
        "batch_size": delay_ms,
    }


@EXAMPLES
@given(topic=NAME, offset=OFFSET, max_messages=I64, max_bytes=I64, wait_ms=I64, rid=RID)
def test_fetch(topic: str, offset: int, max_messages: int, max_bytes: int, wait_ms: int, rid: Any) -> None:
    frames = commands.fetch(topic, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms, rid=rid)
    assert header_of(frames, Command.FETCH) == {
        "rid": rid,
        "topic": topic,
        "offset": offset,
        "max_messages": max_messages,
        "max_bytes": max_bytes,
        "wait_ms": wait_ms,
    }


@EXAMPLES
@given(topic=NAME, group=NAME, rid=RID)
def test_admin(topic: str, group: str, rid: Any) -> None:
    args = {"topic": topic, "group": group}
    assert header_of(commands.admin("describe_group", args, rid=rid), Command.ADMIN) == {
        "rid": rid,
        "op": "describe_group",
        **args,
    }


@EXAMPLES
@given(reason=st.none() | TEXT)
def test_heartbeat_and_bye(reason: str | None) -> None:
    assert header_of(commands.heartbeat(), Command.HEARTBEAT) == {}
    assert header_of(commands.bye(reason), Command.BYE) == ({} if reason is None else {"reason": reason})


@EXAMPLES
@given(rid=RID, numbers=st.lists(U32, min_size=5, max_size=5))
def test_welcome(rid: Any, numbers: list[int]) -> None:
    names = ["heartbeat_ms", "liveness", "max_message_bytes", "max_batch_bytes", "max_credit"]
    values = dict(zip(names, numbers, strict=True))
    assert header_of(commands.welcome(rid, **values), Command.WELCOME) == {"rid": rid, "version": 1, **values}


@EXAMPLES
@given(rid=RID, topic=NAME, base=OFFSET, count=U32, duplicate=st.booleans())
def test_published(rid: Any, topic: str, base: int, count: int, duplicate: bool) -> None:
    frames = commands.published(rid, topic, base_offset=base, count=count, duplicate=duplicate)
    assert header_of(frames, Command.PUBLISHED) == {
        "rid": rid,
        "topic": topic,
        "base_offset": base,
        "count": count,
        "duplicate": duplicate,
    }


@EXAMPLES
@given(rid=RID, sub=U32, topic=NAME, group=NAME, committed=OFFSET, end=OFFSET, heartbeat_ms=U32)
def test_subscribed(rid: Any, sub: int, topic: str, group: str, committed: int, end: int, heartbeat_ms: int) -> None:
    frames = commands.subscribed(
        rid, sub, topic, group, committed_offset=committed, end_offset=end, heartbeat_ms=heartbeat_ms
    )
    assert header_of(frames, Command.SUBSCRIBED) == {
        "rid": rid,
        "sub": sub,
        "topic": topic,
        "group": group,
        "committed_offset": committed,
        "end_offset": end,
        "heartbeat_ms": heartbeat_ms,
    }


@EXAMPLES
@given(sub=U32, topic=NAME, entries=st.lists(st.tuples(ENTRY, BODY), max_size=6))
def test_deliver_entries_come_back_as_the_same_delivery_entries(
    sub: int, topic: str, entries: list[tuple[DeliveryEntry, bytes]]
) -> None:
    sent = [e for e, _ in entries]
    frame = decode(commands.deliver(sub, topic, [e.to_wire() for e in sent], [b for _, b in entries]))
    assert frame.command is Command.DELIVER
    assert (frame.get("sub"), frame.get("topic")) == (sub, topic)
    assert entries_from_wire(frame.get("entries")) == sent
    assert list(frame.payload) == [b for _, b in entries]


@EXAMPLES
@given(rid=RID, topic=NAME, start=OFFSET, end=OFFSET, entries=st.lists(st.tuples(ENTRY, BODY), max_size=6))
def test_fetched(rid: Any, topic: str, start: int, end: int, entries: list[tuple[DeliveryEntry, bytes]]) -> None:
    sent = [e for e, _ in entries]
    frames = commands.fetched(
        rid,
        topic,
        start_offset=start,
        end_offset=end,
        entries=[e.to_wire() for e in sent],
        bodies=[b for _, b in entries],
    )
    frame = decode(frames)
    assert frame.command is Command.FETCHED
    assert (frame.get("rid"), frame.get("topic"), frame.get("start_offset"), frame.get("end_offset")) == (
        rid,
        topic,
        start,
        end,
    )
    assert entries_from_wire(frame.get("entries")) == sent
    assert list(frame.payload) == [b for _, b in entries]


@EXAMPLES
@given(sub=U32, topic=NAME, event=st.sampled_from(["RESET", "READY"]), offset=OFFSET, entry=ENTRY, reason=TEXT)
def test_events(sub: int, topic: str, event: str, offset: int, entry: DeliveryEntry, reason: str) -> None:
    assert header_of(commands.event(sub, topic, event, offset), Command.EVENT) == {
        "sub": sub,
        "topic": topic,
        "event": event,
        "offset": offset,
    }
    frames = commands.dead_lettered(
        sub,
        topic,
        offset=entry.first,
        reason=reason,
        deliveries=3,
        dead_letter_topic=topic + ".dlq",
        entries=[entry.to_wire()],
        bodies=[b"x"],
    )
    header = header_of(frames, Command.EVENT)
    assert entries_from_wire(header.pop("entries")) == [entry]
    assert header == {
        "sub": sub,
        "topic": topic,
        "event": "DEAD_LETTERED",
        "offset": entry.first,
        "reason": reason,
        "deliveries": 3,
        "dead_letter_topic": topic + ".dlq",
    }


@EXAMPLES
@given(
    rid=RID, result=st.recursive(st.none() | st.integers(0, 10**6) | TEXT, lambda inner: st.lists(inner, max_size=3))
)
def test_result(rid: Any, result: Any) -> None:
    assert header_of(commands.result(rid, result), Command.RESULT) == {"rid": rid, "result": result}


ERROR_CODES = [100, 101, 102, 103, 104, 105, 109, 201, 205, 207, 300, 303, 305, 402, 405, 500]


@EXAMPLES
@given(
    code=st.sampled_from(ERROR_CODES),
    message=st.text(min_size=1, max_size=40),
    rid=st.none() | RID,
    fields=st.dictionaries(
        st.sampled_from(["topic", "offset", "limit", "field"]), st.integers(0, 99) | NAME, max_size=3
    ),
)
def test_error(code: int, message: str, rid: Any, fields: dict[str, Any]) -> None:
    sent = error_for_code(code)(message, **fields)
    frame = decode(commands.error(sent, rid))
    assert frame.command is Command.ERROR
    assert frame.get("rid") == rid
    got = error_from_header(frame.header)
    assert isinstance(got, ConveyorError)
    assert (type(got), got.message, got.fields) == (type(sent), sent.message, sent.fields)


@settings(max_examples=300, deadline=None)
@given(entry=ENTRY)
def test_a_delivery_entry_survives_msgpack(entry: DeliveryEntry) -> None:
    packed = msgpack.packb(entry.to_wire(), use_bin_type=True)
    assert DeliveryEntry.from_wire(msgpack.unpackb(packed, raw=False)) == entry


@EXAMPLES
@given(
    values=st.lists(st.binary(max_size=8), min_size=1, max_size=30),
    data=st.data(),
    deliveries=st.integers(0, 5),
)
def test_a_consumer_reads_exactly_the_offsets_an_entry_names(values: list[bytes], data: Any, deliveries: int) -> None:
    # Given a body of n records at base 100, and a slice or a picked set of its offsets
    base, n = 100, len(values)
    body = pack_records([(None, None, v) for v in values])
    first = data.draw(st.integers(base, base + n - 1))
    end = data.draw(st.integers(first + 1, base + n))
    picked = data.draw(st.none() | st.lists(st.integers(base, base + n - 1), min_size=1, unique=True).map(sorted))
    entry = DeliveryEntry(base, n, 1_000, first, end, deliveries, None if picked is None else tuple(picked))
    # When the client expands it
    messages = messages_from_entries("t", [entry.to_wire()], [body])
    # Then
    offsets = list(range(first, end)) if picked is None else picked
    assert [m.offset for m in messages] == offsets
    assert [m.body for m in messages] == [values[o - base] for o in offsets]
    assert all(m.attempt == (deliveries or 1) for m in messages)
