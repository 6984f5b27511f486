"""Key affinity with a real broker: a key's order holds through delayed redeliveries, splits and departures.

Waiting behind an earlier message of the same key is not a delivery: held
messages are delivered once their key's head went, with their count intact.
"""

from __future__ import annotations

import time

from conveyor.broker.client.subscription import Subscription

from conveyor import Message
from tests.helpers import publish


def subscribe(address: str, credit: int = 100) -> Subscription:
    return Subscription("ko", "g", address=address, key_affinity=True, credit=credit)


def receive(sub: Subscription, count: int, timeout: float = 30.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += sub.receive(timeout=0.1)
    return got


def test_a_keys_new_messages_wait_behind_its_delayed_redelivery_while_other_keys_flow(conveyor_broker):
    sub = subscribe(conveyor_broker.address)
    try:
        publish(conveyor_broker.address, "ko", [0, 1], keys=["k", "j"], linger_ms=20)
        first = receive(sub, 2)
        assert [m.offset for m in first] == [0, 1]
        sub.nack([0], delay_ms=5000, error="later")
        sub.ack([1])
        publish(conveyor_broker.address, "ko", [2, 3], keys=["k", "j"], linger_ms=20)
        got = receive(sub, 3)
        sub.ack(got)
        assert [(m.offset, m.attempt) for m in got] == [(3, 1), (0, 2), (2, 1)], "j flows; k's 2 waits for 0, uncounted"
    finally:
        sub.close()


def test_in_progress_on_the_middle_of_a_key_then_the_member_leaves_keeps_its_order(conveyor_broker):
    a = subscribe(conveyor_broker.address)
    publish(conveyor_broker.address, "ko", [0, 1, 2], keys=["k", "k", "k"], linger_ms=20)
    assert [m.offset for m in receive(a, 3)] == [0, 1, 2]
    a.in_progress([1])  # the lease of 1 alone is renewed: the broker splits what a holds
    a.close()
    b = subscribe(conveyor_broker.address)
    try:
        got = receive(b, 3)
        b.ack(got)
        assert [m.offset for m in got] == [0, 1, 2]
    finally:
        b.close()


def test_a_member_leaving_while_its_keys_head_waits_keeps_the_keys_order(conveyor_broker):
    a = subscribe(conveyor_broker.address)
    publish(conveyor_broker.address, "ko", list(range(6)), keys=["k", "k", "j", "k", "j", "k"], linger_ms=20)
    assert [m.offset for m in receive(a, 6)] == list(range(6))
    a.nack([0], delay_ms=3000, error="later")
    a.ack([2, 4])
    a.close()  # holding 1, 3, 5 of k while 0 waits
    b = subscribe(conveyor_broker.address)
    try:
        got = receive(b, 4)
        b.ack(got)
        assert [m.offset for m in got] == [0, 1, 3, 5], "k's head first, then the rest in order"
    finally:
        b.close()
