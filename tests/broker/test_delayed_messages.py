"""Delayed messages and expiry against a real broker process (``send(delay=, not_before=, ttl=)``).

A delayed message is held back from the group until its time while a later message of another key is
delivered first; the hold survives a broker restart (the group finds the batch again, unacked); a
message whose ttl ran out before it was delivered goes to ``<topic>.dlq`` with ``x-last-error:
expired``, counted in ``conveyor_expired_messages_total``, and is never delivered. No timing asserts
tighter than the delay: "not before" is checked against the message's own time, on the same clock.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.server.dead_letters import LAST_ERROR
from conveyor.broker.wire.delivery_times import EXPIRED

from conveyor import Admin, AsyncProducer, Message, Producer
from conveyor.errors import InvalidDeliveryTime
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for

TOPIC = "later"


def receive(sub: Subscription, wanted: int, timeout: float = 30.0) -> list[Message]:
    """At least ``wanted`` messages (acked as they come), or what came in ``timeout``."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < wanted and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.1)
        if batch:
            got += batch
            sub.ack(batch)
    return got


def subscribe(broker: BrokerProcess, **options) -> Subscription:
    return Subscription(TOPIC, "g", address=broker.address, credit=10, **options)


@pytest.mark.parametrize("key_affinity", [False, True], ids=["round_robin", "key_affinity"])
def test_a_delayed_message_waits_while_later_ones_flow(conveyor_broker, key_affinity):
    sub = subscribe(conveyor_broker, key_affinity=key_affinity)
    try:
        with Producer(conveyor_broker.address, eager=False, linger_ms=20) as producer:  # batches stay open a while
            sent = time.time()
            delayed = producer.send(TOPIC, "later", key="a", delay=2.0)
            producer.send_many(TOPIC, ["now"], key="b")[0].result(timeout=30)  # not in the delayed batch
            assert delayed.result(timeout=30) == 0, "stored at once, in the log like any message"
            with pytest.raises(InvalidDeliveryTime):
                producer.send(TOPIC, "never", delay=-1)
        first = receive(sub, 1)
        assert [m.value for m in first] == ["now"], "the later message of another key does not wait"
        (later,) = receive(sub, 1)
        assert later.value == "later" and later.key == "a" and later.attempt == 1
        assert later.not_before is not None and later.not_before >= sent + 2.0
        assert time.time() >= later.not_before, "not delivered before its time (the broker's clock is ours)"
    finally:
        sub.close()


def test_the_hold_survives_a_restart_and_an_expired_message_is_dead_lettered(conveyor_broker):
    broker = conveyor_broker
    with Producer(broker.address) as producer:
        producer.send(TOPIC, "held", delay=timedelta(seconds=3)).result(timeout=30)
        doomed = producer.send(TOPIC, "doomed", delay=1.0, ttl=1.5)
        producer.send(TOPIC, "now").result(timeout=30)
        expires = time.time() + 1.5
        doomed.result(timeout=30)
    sub = subscribe(broker)
    try:
        assert [m.value for m in receive(sub, 1)] == ["now"]
    finally:
        sub.close()
    broker.restart(kill=True)
    wait_for(lambda: time.time() > expires + 0.1, timeout=30, message="the ttl to run out while down")
    sub = subscribe(broker)
    try:
        got = receive(sub, 1)
        if [m.value for m in got] == ["now"]:  # its ack may not have been committed before the kill: again
            got = receive(sub, 1)
        (held,) = got
        assert held.value == "held" and time.time() >= held.not_before, "held back again after the restart"
        assert receive(sub, 1, timeout=0.5) == [], "the expired one is never delivered"
    finally:
        sub.close()
    with Admin(broker.address) as admin:
        (dead,) = wait_for(lambda: admin.fetch(f"{TOPIC}.dlq", 0, 10), timeout=30, message="the dead letter")
    assert dead.value == "doomed" and dead.headers[LAST_ERROR] == EXPIRED
    assert dead.headers["x-origin-offset"] == "1"
    assert broker.metric("conveyor_expired_messages_total", f'topic="{TOPIC}"') == 1


def test_the_async_producer_sends_delayed_messages_too(conveyor_broker):
    async def send() -> float:
        async with AsyncProducer(conveyor_broker.address) as producer:
            due = time.time() + 1.0
            held = await producer.send(TOPIC, "async-later", not_before=datetime.fromtimestamp(due))
            await producer.send_and_wait(TOPIC, "async-now")
            assert await held == 0
            with pytest.raises(InvalidDeliveryTime):
                await producer.send(TOPIC, "never", ttl=timedelta(seconds=-1))
        return due

    due = asyncio.run(send())
    sub = subscribe(conveyor_broker)
    try:
        got = receive(sub, 2)
        assert [m.value for m in got] == ["async-now", "async-later"]
        assert time.time() >= got[1].not_before >= due
    finally:
        sub.close()


def test_delays_and_expiry_on_a_partitioned_topic(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("parted", partitions=4)
    keys = [f"k{i}" for i in range(8)]
    with Producer(address) as producer:
        held = [producer.send("parted", f"held-{k}", key=k, delay=3.0) for k in keys]
        doomed = producer.send("parted", "doomed", key="k5", delay=0.5, ttl=1.0)
        for k in keys:
            producer.send("parted", f"now-{k}", key=k)
        expires = time.time() + 1.0
        producer.flush(timeout=30)
    assert len({f.result().partition for f in held}) > 1, "the held messages are spread over partitions"
    wait_for(lambda: time.time() > expires + 0.1, timeout=30, message="the ttl to run out before anyone reads")
    sub = Subscription("parted", "g", address=address, credit=100)
    try:
        first = receive(sub, len(keys))
        assert sorted(m.value for m in first) == sorted(f"now-{k}" for k in keys)
        rest = receive(sub, len(keys))
        assert sorted(m.value for m in rest) == sorted(f"held-{k}" for k in keys)
        assert all(time.time() >= m.not_before for m in rest)
    finally:
        sub.close()
    partition = doomed.result().partition
    with Admin(address) as admin:
        (dead,) = wait_for(
            lambda: admin.fetch("parted.dlq", 0, 10, partition=partition), timeout=30, message="the dead letter"
        )
    assert dead.value == "doomed" and dead.headers[LAST_ERROR] == EXPIRED
