"""``--fsync interval:MS``: a sync in a pass of its own wakes the groups and parked FETCHes of its logs.

Under the interval policy an append is confirmed, delivered and served only
once a sync made it durable, and that sync often comes in a later loop pass
than the append (the interval had not elapsed yet). The unit test of the
interval itself (monotonic, not wall clock) is in
``tests/storage/test_fsync_policy.py``.
"""

from __future__ import annotations

from conveyor.broker.client.message import messages_from_entries
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.wire.protocol import Command, decode, encode

from conveyor import Admin, Producer
from tests.helpers import publish, wait_for

INTERVAL = "interval:400"


def test_messages_synced_in_a_later_pass_are_pushed_to_the_group(conveyor_broker_factory):
    broker = conveyor_broker_factory(fsync=INTERVAL)
    sub = Subscription("later", "g", address=broker.address, credit=100)
    try:
        assert wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.subscribed, timeout=30)
        # The first append after a quiet interval syncs at once; the next ones wait for the interval.
        assert publish(broker.address, "later", ["m0"], linger_ms=5) == [0]
        assert publish(broker.address, "later", ["m1", "m2", "m3"], linger_ms=5) == [1, 2, 3]
        got: list = []

        def received_all() -> bool:
            batch = sub.receive(timeout=0.05)
            sub.ack(batch)
            got.extend(batch)
            return len(got) >= 4

        wait_for(received_all, timeout=20)  # well inside the 30 s lease: no redelivery brings them
        assert [m.offset for m in got] == [0, 1, 2, 3]
    finally:
        sub.close()


class ParkedFetch:
    """A FETCH the broker holds: sent, then a HELLO on the same socket whose answer proves it was parked."""

    def __init__(self, address: str, topic: str, offset: int, wait_ms: int = 20_000) -> None:
        self.admin = Admin(address)
        self.topic = topic
        self.admin._sock.send_multipart(
            encode(Command.FETCH, {"rid": 1, "topic": topic, "offset": offset, "wait_ms": wait_ms})
        )
        self.admin._sock.send_multipart(encode(Command.HELLO, {"rid": 2}))
        assert self.admin._sock.poll(30_000)
        assert decode(self.admin._sock.recv_multipart()).command is Command.WELCOME, "not answered before the HELLO"

    def answer(self, timeout_ms: int) -> list[int] | None:
        """The offsets the FETCH was answered with, or None if no answer came in time."""
        if not self.admin._sock.poll(timeout_ms):
            return None
        reply = decode(self.admin._sock.recv_multipart())
        assert reply.command is Command.FETCHED, reply.header
        messages = messages_from_entries(self.topic, reply.get("entries", []), [bytes(b) for b in reply.payload])
        return [m.offset for m in messages]

    def close(self) -> None:
        self.admin.close()


def test_a_parked_fetch_gets_what_a_later_sync_makes_durable(conveyor_broker_factory):
    broker = conveyor_broker_factory(fsync=INTERVAL)
    assert publish(broker.address, "parked", ["m0"], linger_ms=5) == [0]
    fetch = ParkedFetch(broker.address, "parked", 1)
    try:
        assert publish(broker.address, "parked", ["m1", "m2", "m3"], linger_ms=5) == [1, 2, 3]
        assert fetch.answer(30_000) == [1, 2, 3]
    finally:
        fetch.close()


def test_a_parked_fetch_is_not_answered_before_its_offset_is_durable(conveyor_broker_factory):
    """An append the interval has not synced yet is no reason to answer a FETCH (with nothing)."""
    broker = conveyor_broker_factory(fsync="interval:3000")
    assert publish(broker.address, "early", ["m0"], linger_ms=5) == [0]
    fetch = ParkedFetch(broker.address, "early", 1)
    try:
        with Producer(broker.address, linger_ms=1) as producer:
            futures = [producer.send("early", f"m{i}") for i in range(1, 4)]
            answer = fetch.answer(30_000)  # comes with the sync, some 3 s after the append
            producer.flush(timeout=30)
        assert [f.result() for f in futures] == [1, 2, 3]
        assert answer == [1, 2, 3]
    finally:
        fetch.close()
