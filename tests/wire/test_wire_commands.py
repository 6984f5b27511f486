"""Frame by frame: each encoder of broker/wire/commands.py gives exactly these frames.

The expected frames are written out: the signature, the command byte as a
literal (not through ``Command``), the header as an ordered map (msgpack
keeps the order, so the bytes are fixed) and the payload frames. Every
request must also pass the broker's own ``decode``, schema included.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import DeliveryEntry, wire_entry
from conveyor.broker.wire.protocol import Command, decode
from conveyor.broker.wire.schema import check_metadata_result

from conveyor.errors import InvalidRequest, UnknownTopic

SIG = b"CVY1"
BODY = msgpack.packb([[None, None, b"hi"]], use_bin_type=True)


def frames(code: int, header: dict[str, Any], *payload: bytes) -> list[Any]:
    return [SIG, bytes([code]), msgpack.packb(header, use_bin_type=True), *payload]


# --- client -> broker -----------------------------------------------------------------

REQUESTS = {
    "hello": (
        commands.hello("conveyor-consumer/7", rid=1),
        frames(0x01, {"rid": 1, "client": "conveyor-consumer/7"}),
    ),
    "hello without rid": (commands.hello("me"), frames(0x01, {"client": "me"})),
    "publish": (
        commands.publish("orders", BODY, pid=77, seq=0, rid=1),
        frames(0x02, {"rid": 1, "topic": "orders", "pid": 77, "seq": 0}, BODY),
    ),
    "publish, not idempotent": (
        commands.publish("orders", BODY, rid="r"),
        frames(0x02, {"rid": "r", "topic": "orders"}, BODY),
    ),
    "subscribe": (
        commands.subscribe(
            1, "orders", "billing", credit=100, batch_size=10, settings={"start": None, "key_affinity": False}, rid=2
        ),
        frames(
            0x03,
            {
                "rid": 2,
                "sub": 1,
                "topic": "orders",
                "group": "billing",
                "credit": 100,
                "batch_size": 10,
                "start": None,
                "key_affinity": False,
            },
        ),
    ),
    "subscribe, bare": (
        commands.subscribe(5, "t", "g"),
        frames(0x03, {"sub": 5, "topic": "t", "group": "g"}),
    ),
    "unsubscribe": (commands.unsubscribe(3), frames(0x04, {"sub": 3})),
    "ack": (commands.ack(1, [[0, 5], [9, 10]]), frames(0x05, {"sub": 1, "ranges": [[0, 5], [9, 10]]})),
    "nack": (
        commands.nack(1, [[0, 1]], delay_ms=250, error="boom"),
        frames(0x06, {"sub": 1, "ranges": [[0, 1]], "delay_ms": 250, "error": "boom"}),
    ),
    "nack, release": (
        commands.nack(1, [[0, 1]], delay_ms=0, error="", release=True),
        frames(0x06, {"sub": 1, "ranges": [[0, 1]], "delay_ms": 0, "error": "", "release": True}),
    ),
    "in progress": (commands.in_progress(1, [[4, 8]]), frames(0x07, {"sub": 1, "ranges": [[4, 8]]})),
    "term": (
        commands.term(1, [[4, 8]], reason="poison"),
        frames(0x08, {"sub": 1, "ranges": [[4, 8]], "reason": "poison"}),
    ),
    "credit": (
        commands.credit(1, 50, batch_size=25),
        frames(0x09, {"sub": 1, "credit": 50, "batch_size": 25}),
    ),
    "fetch": (
        commands.fetch("orders", 10, max_messages=100, max_bytes=4096, wait_ms=500, rid=9),
        frames(
            0x0A,
            {"rid": 9, "topic": "orders", "offset": 10, "max_messages": 100, "max_bytes": 4096, "wait_ms": 500},
        ),
    ),
    "replica_fetch": (
        commands.fetch(
            "orders", 10, max_messages=100, wait_ms=500, replica="b", leader_epoch=3, last_epoch=2, durable=8, rid=9
        ),
        frames(
            0x0A,
            {
                "rid": 9,
                "topic": "orders",
                "offset": 10,
                "max_messages": 100,
                "max_bytes": 1 << 20,
                "wait_ms": 500,
                "replica": "b",
                "leader_epoch": 3,
                "last_epoch": 2,
                "durable": 8,
            },
        ),
    ),
    "admin": (
        commands.admin("describe_group", {"topic": "orders", "group": "billing"}, rid=4),
        frames(0x0B, {"rid": 4, "op": "describe_group", "topic": "orders", "group": "billing"}),
    ),
    "admin without arguments": (commands.admin("list_topics", rid=5), frames(0x0B, {"rid": 5, "op": "list_topics"})),
    "metadata of every topic": (commands.metadata(rid=6), frames(0x0C, {"rid": 6})),
    "metadata of some topics": (
        commands.metadata(["orders", "audit"], rid=7),
        frames(0x0C, {"rid": 7, "topics": ["orders", "audit"]}),
    ),
    "heartbeat": (commands.heartbeat(), [SIG, b"\x10", b"\x80"]),
    "bye": (commands.bye(), [SIG, b"\x11", b"\x80"]),
    "bye with a reason": (commands.bye("broker shutting down"), frames(0x11, {"reason": "broker shutting down"})),
}


@pytest.mark.parametrize("name", REQUESTS)
def test_each_request_encodes_to_exactly_these_frames(name: str) -> None:
    # Given / When
    got, expected = REQUESTS[name]
    # Then
    assert got == expected


@pytest.mark.parametrize("name", REQUESTS)
def test_each_request_passes_the_brokers_decode_and_schema(name: str) -> None:
    got, expected = REQUESTS[name]
    frame = decode(got)
    assert frame.header == msgpack.unpackb(expected[2])
    assert list(frame.payload) == expected[3:]


# --- broker -> client -----------------------------------------------------------------

ENTRY = wire_entry(0, 1, 1_700_000_000_000, 0, 1, 1)
KEYED = DeliveryEntry(10, 20, 5, 11, 19, 2, (11, 15), 1_699_999_999_000).to_wire()


def test_welcome() -> None:
    got = commands.welcome(
        1, heartbeat_ms=1000, liveness=3, max_message_bytes=1 << 20, max_batch_bytes=16 << 20, max_credit=10_000
    )
    assert got == frames(
        0x20,
        {
            "rid": 1,
            "version": 1,
            "heartbeat_ms": 1000,
            "liveness": 3,
            "max_message_bytes": 1 << 20,
            "max_batch_bytes": 16 << 20,
            "max_credit": 10_000,
        },
    )


def test_published() -> None:
    got = commands.published(1, "orders", base_offset=0, count=1, duplicate=False)
    assert got == frames(0x21, {"rid": 1, "topic": "orders", "base_offset": 0, "count": 1, "duplicate": False})


def test_subscribed() -> None:
    got = commands.subscribed(2, 1, "orders", "billing", committed_offset=0, end_offset=7, heartbeat_ms=1000)
    assert got == frames(
        0x22,
        {
            "rid": 2,
            "sub": 1,
            "topic": "orders",
            "group": "billing",
            "committed_offset": 0,
            "end_offset": 7,
            "heartbeat_ms": 1000,
        },
    )


def test_deliver_carries_one_body_per_entry() -> None:
    got = commands.deliver(1, "orders", [ENTRY, KEYED], [BODY, b"other"])
    assert got == frames(
        0x23,
        {
            "sub": 1,
            "topic": "orders",
            "entries": [
                {"b": 0, "n": 1, "t": 1_700_000_000_000, "f": 0, "e": 1, "d": 1},
                {"b": 10, "n": 20, "t": 5, "f": 11, "e": 19, "d": 2, "o": [11, 15], "fd": 1_699_999_999_000},
            ],
        },
        BODY,
        b"other",
    )


def test_fetched() -> None:
    entry = wire_entry(3, 4, 9, 5, 7)
    got = commands.fetched(8, "orders", start_offset=3, end_offset=7, entries=[entry], bodies=[BODY])
    assert got == frames(
        0x24,
        {
            "rid": 8,
            "topic": "orders",
            "start_offset": 3,
            "end_offset": 7,
            "entries": [{"b": 3, "n": 4, "t": 9, "f": 5, "e": 7, "d": 0}],
        },
        BODY,
    )


def test_fetched_with_nothing_to_read() -> None:
    got = commands.fetched(8, "orders", start_offset=0, end_offset=0, entries=[], bodies=[])
    assert got == frames(0x24, {"rid": 8, "topic": "orders", "start_offset": 0, "end_offset": 0, "entries": []})


def test_fetched_for_a_replica_carries_the_high_watermark_and_where_the_logs_diverge() -> None:
    got = commands.fetched(
        8, "orders", start_offset=0, end_offset=9, entries=[], bodies=[], hw=7, diverging={"epoch": 2, "end_offset": 5}
    )
    assert got == frames(
        0x24,
        {
            "rid": 8,
            "topic": "orders",
            "start_offset": 0,
            "end_offset": 9,
            "entries": [],
            "hw": 7,
            "diverging": {"epoch": 2, "end_offset": 5},
        },
    )


def test_result() -> None:
    assert commands.result(4, {"deleted": "orders"}) == frames(0x25, {"rid": 4, "result": {"deleted": "orders"}})
    assert commands.result(5, None) == frames(0x25, {"rid": 5, "result": None})


def test_error_with_fields_and_rid() -> None:
    got = commands.error(UnknownTopic("no topic orders", topic="orders"), rid=3)
    assert got == frames(
        0x26,
        {"code": 300, "name": "UNKNOWN_TOPIC", "message": "no topic orders", "rid": 3, "fields": {"topic": "orders"}},
    )


def test_error_without_rid_sends_none() -> None:
    got = commands.error(InvalidRequest("bad"))
    assert got == frames(0x26, {"code": 207, "name": "INVALID_REQUEST", "message": "bad"})


def test_event_reset() -> None:
    got = commands.event(1, "orders", "RESET", 0)
    assert got == frames(0x27, {"sub": 1, "topic": "orders", "event": "RESET", "offset": 0})


def test_an_event_of_a_partition_log_names_the_topic_and_p_never_the_log() -> None:
    """A mirror's RESET of partition 2 went out as topic 'orders#2' (the broker's log name) with no ``p``."""
    got = commands.event(3, "orders#2", "RESET", 5)
    assert got == frames(0x27, {"sub": 3, "topic": "orders", "p": 2, "event": "RESET", "offset": 5})
    dead = commands.dead_lettered(
        3, "orders#2", offset=0, reason="r", deliveries=1, dead_letter_topic="orders.dlq", entries=[], bodies=[]
    )
    header = msgpack.unpackb(dead[2])
    assert (header["topic"], header["p"], header["dead_letter_topic"]) == ("orders", 2, "orders.dlq")


def test_event_dead_lettered_carries_the_messages_as_deliver_does() -> None:
    got = commands.dead_lettered(
        1,
        "orders",
        offset=0,
        reason="boom",
        deliveries=10,
        dead_letter_topic="orders.dlq",
        entries=[ENTRY],
        bodies=[BODY],
    )
    assert got == frames(
        0x27,
        {
            "sub": 1,
            "topic": "orders",
            "event": "DEAD_LETTERED",
            "offset": 0,
            "reason": "boom",
            "deliveries": 10,
            "dead_letter_topic": "orders.dlq",
            "entries": [ENTRY],
        },
        BODY,
    )


PARTITION = {
    "leader": "a",
    "leader_addr": "tcp://h1:5555",
    "leader_epoch": 7,
    "replicas": ["a", "b", "c"],
    "isr": ["a", "b"],
    "offline": False,
}


def test_metadata_result() -> None:
    got = commands.metadata_result(
        9,
        node="b",
        controller="a",
        nodes={"a": "tcp://h1:5555", "b": "tcp://h2:5555"},
        topics={"orders": {"partitions": {"0": PARTITION}}},
    )
    header = {
        "rid": 9,
        "node": "b",
        "controller": "a",
        "nodes": {"a": "tcp://h1:5555", "b": "tcp://h2:5555"},
        "topics": {"orders": {"partitions": {"0": PARTITION}}},
    }
    assert got == frames(0x28, header)
    assert check_metadata_result(decode(got).header) is None


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"node": None}, "'node'"),
        ({"nodes": {"a": 5}}, "'nodes'"),
        ({"topics": {"orders": {}}}, "'partitions'"),
        ({"topics": {"orders": {"partitions": {0: PARTITION}}}}, "decimal strings"),
        ({"topics": {"orders": {"partitions": {"0": {**PARTITION, "leader_epoch": -1}}}}}, "'leader_epoch'"),
        ({"topics": {"orders": {"partitions": {"0": {**PARTITION, "isr": "a"}}}}}, "'isr'"),
    ],
)
def test_a_metadata_result_of_another_shape_is_named(change: dict[str, Any], complaint: str) -> None:
    header = {"node": "b", "controller": None, "nodes": {}, "topics": {}, **change}
    problem = check_metadata_result(header)
    assert problem is not None and complaint in problem


def test_metadata_topics_must_be_a_list_of_names() -> None:
    with pytest.raises(InvalidRequest, match="topics"):
        decode(frames(0x0C, {"rid": 1, "topics": "orders"}))


def test_every_command_has_an_encoder() -> None:
    encoders = {
        "hello", "publish", "subscribe", "unsubscribe", "ack", "nack", "in_progress", "term", "credit", "fetch",
        "admin", "heartbeat", "bye", "welcome", "published", "subscribed", "deliver", "fetched", "result", "error",
        "event", "metadata", "metadata_result",
    }  # fmt: skip
    assert {c.name.lower() for c in Command} == encoders
    assert all(callable(getattr(commands, name)) for name in encoders)
