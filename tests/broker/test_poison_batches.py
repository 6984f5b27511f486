"""Batches that used to be confirmed and then kill the broker whenever it re-encoded them.

The broker re-encodes stored records when it slices a batch for a member
with little credit, routes a batch by key, and dead-letters. A body that
unpacks but cannot be packed again (a map key that is not UTF-8) was
accepted, confirmed, and then ended the broker at the next slice, and again
after every restart since the batch is in the log. Now every record is
checked completely at publish time, and records an older version stored
without that check re-encode byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.log.data_dir import Store
from conveyor.broker.wire.protocol import SIGNATURE, Command, decode
from conveyor.broker.wire.record import unpack_records

from conveyor import Admin, Message
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for

INVALID_REQUEST = 207
COUNT = 40  # over 16 records, so a member with a credit of 5 gets slices re-encoded from it


def record(key: bytes, headers: bytes, value: bytes = b"\xc4\x01v") -> bytes:
    """One record from raw msgpack pieces: what a client in another language could send."""
    return b"\x93" + key + headers + value


# Each is one bad record among good ones, as raw msgpack: a str is 0xa0|len followed by its bytes.
GOOD = record(b"\xc0", b"\xc0")
POISON = {
    "map key not UTF-8": record(b"\xc0", b"\x81\xa2\xc3\x28\xa1x"),
    "header value not UTF-8": record(b"\xc0", b"\x81\xa1x\xa2\xff\xfe"),
    "str key not UTF-8": record(b"\xa2\xff\xfe", b"\xc0"),
    "str value not UTF-8": record(b"\xc0", b"\xc0", b"\xa1\xff"),
    "header value an int": record(b"\xc0", b"\x81\xa1n\x01"),
    "header name an int": record(b"\xc0", b"\x81\x01\xa1x"),
    "header value nil": record(b"\xc0", b"\x81\xa1n\xc0"),
    "map as a header name": record(b"\xc0", b"\x81\x81\xa1a\xa1b\xa1x"),
    "key an int": record(b"\x07", b"\xc0"),
}


def body_of(records: list[bytes]) -> bytes:
    return b"\xdc" + len(records).to_bytes(2, "big") + b"".join(records)


@pytest.fixture
def dealer():
    sockets: list[Any] = []

    def connect(address: str) -> Any:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()


def publish_raw(sock: Any, rid: int, topic: str, body: bytes) -> Any:
    sock.send_multipart([SIGNATURE, bytes([Command.PUBLISH]), msgpack.packb({"rid": rid, "topic": topic}), body])
    assert sock.poll(30_000), "no answer to the PUBLISH"
    return decode(sock.recv_multipart())


def receive(sub: Subscription, count: int, *, ack: bool = True) -> list[Message]:
    got: list[Message] = []

    def more() -> bool:
        batch = sub.receive(timeout=0.05)
        if ack:
            sub.ack(batch)
        got.extend(batch)
        return len(got) >= count

    assert wait_for(more, timeout=30), f"got {len(got)} of {count}"
    return got


def test_records_the_broker_could_not_re_encode_are_refused_and_nothing_dies_across_a_restart(tmp_path, dealer):
    broker = BrokerProcess(tmp_path / "data").start()
    try:
        sock = dealer(broker.address)
        # When each poison record arrives in the middle of a batch of good ones
        for rid, (what, bad) in enumerate(POISON.items(), start=1):
            reply = publish_raw(sock, rid, "poison", body_of([GOOD] * 20 + [bad] + [GOOD] * 19))
            # Then the whole batch is refused with the request's rid, and nothing is stored
            assert reply.command is Command.ERROR, f"{what}: {reply.command.name} {reply.header}"
            assert (reply.get("code"), reply.get("rid")) == (INVALID_REQUEST, rid), f"{what}: {reply.header}"
        assert publish_raw(sock, 99, "poison", body_of([GOOD] * COUNT)).get("base_offset") == 0
        # And slicing, key routing and dead-lettering go on, before and after a restart
        for round_ in range(2):
            with Subscription("poison", f"small-{round_}", address=broker.address, credit=5) as sub:
                assert [m.offset for m in receive(sub, COUNT)] == list(range(COUNT))
            if round_ == 0:
                broker.restart()
        with Admin(broker.address) as admin:
            assert admin.describe_topic("poison")["end_offset"] == COUNT
        assert broker.metric("conveyor_internal_errors_total") == 0
    finally:
        assert broker.stop() == 0, "".join(broker.output[-30:])


# --- records an older version stored without the full check --------------------------------------------

LEGACY_RECORDS = [
    record(b"\xa2\xff\xfe", b"\x81\xa2\xc3\x28\xa1x"),  # str key and header name, neither UTF-8
    record(b"\xa1k", b"\x81\xa1x\xa2\xff\xfe"),  # header value not UTF-8
    record(b"\xc4\x01k", b"\x81\xa1n\x01"),  # an int header value (accepted before)
    record(b"\xc0", b"\xc0", b"\xa2\xed\xa0"),  # a str value that is not UTF-8 (a lone surrogate's bytes)
]
LEGACY_BODY = body_of([LEGACY_RECORDS[i % len(LEGACY_RECORDS)] for i in range(COUNT)])


def expected(offset: int) -> tuple[Any, Any, Any]:
    return unpack_records(body_of([LEGACY_RECORDS[offset % len(LEGACY_RECORDS)]]))[0]


def write_as_an_older_version(data_dir: Path) -> None:
    """Append LEGACY_BODY straight to the log, as a broker without the full check stored it."""
    store = Store(data_dir)
    try:
        store.create_topic("legacy").append(LEGACY_BODY, COUNT)
        store.sync(force=True)
    finally:
        store.close()


def same_bytes(messages: list[Message]) -> None:
    for m in messages:
        key, headers, value = expected(m.offset)
        assert (m.key, m.body) == (key, value)
        assert {k: v for k, v in (m.headers or {}).items() if not k.startswith("x-")} == (headers or {})


def test_records_an_older_version_stored_are_sliced_routed_and_dead_lettered_byte_for_byte(tmp_path):
    write_as_an_older_version(tmp_path / "data")
    broker = BrokerProcess(tmp_path / "data").start()
    try:
        # Sliced for a member with little credit
        with Subscription("legacy", "small", address=broker.address, credit=5) as sub:
            got = receive(sub, COUNT)
        assert sorted(m.offset for m in got) == list(range(COUNT))
        same_bytes(got)
        # Routed by key, to two members
        subs = [Subscription("legacy", "keyed", address=broker.address, credit=3, key_affinity=True) for _ in range(2)]
        try:
            keyed: list[Message] = []
            assert wait_for(lambda: [keyed.extend(_take(s)) for s in subs] and len(keyed) >= COUNT, timeout=30)
            assert sorted(m.offset for m in keyed) == list(range(COUNT))
            same_bytes(keyed)
        finally:
            for s in subs:
                s.close()
        # Dead-lettered: the dead-letter topic holds the same bytes, plus the origin headers
        with Subscription("legacy", "doomed", address=broker.address, credit=7) as sub:
            terminate_all(sub, COUNT)
        with Admin(broker.address) as admin:
            assert wait_for(lambda: _end(admin, "legacy.dlq") == COUNT, timeout=30)
            dead = admin.fetch("legacy.dlq", 0, COUNT)
        assert sorted(int(m.headers["x-origin-offset"]) for m in dead) == list(range(COUNT))
        assert all(m.headers["x-last-error"] == "poison" for m in dead)
        same_bytes([_as_origin(m) for m in dead])
        assert broker.metric("conveyor_internal_errors_total") == 0
        # And a restart changes nothing
        broker.restart()
        with Subscription("legacy", "after-restart", address=broker.address, credit=5) as sub:
            same_bytes(receive(sub, COUNT))
    finally:
        assert broker.stop() == 0, "".join(broker.output[-30:])


def _take(sub: Subscription) -> list[Message]:
    batch = sub.receive(timeout=0.05)
    sub.ack(batch)
    return batch


def terminate_all(sub: Subscription, count: int) -> None:
    """Terminate every message as it comes (a few per DELIVER: credit 7), until ``count``."""
    done: list[Message] = []

    def more() -> bool:
        batch = sub.receive(timeout=0.05)
        sub.term(batch, reason="poison")
        done.extend(batch)
        return len(done) >= count

    assert wait_for(more, timeout=30)


def _as_origin(m: Message) -> Message:
    """A dead letter seen with its origin offset, to compare with what was stored there."""
    m.offset = int(m.headers["x-origin-offset"])
    return m


def _end(admin: Admin, topic: str) -> int:
    try:
        return admin.describe_topic(topic)["end_offset"]
    except Exception:
        return -1
