"""Delivery counts survive a broker restart: ``groups.json`` keeps them with the offsets.

A poison message must not get a fresh set of attempts each time the broker
restarts (kill -9 or SIGTERM), and a delayed retry keeps its due time. Every
test runs a real broker process.
"""

from __future__ import annotations

import json
import time

import pytest
from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Message
from conveyor.testing import BrokerProcess
from tests.helpers import publish, wait_for

TOPIC = "counts"


def next_message(sub: Subscription, timeout: float = 30.0) -> Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = sub.receive(timeout=0.1)
        if batch:
            assert len(batch) == 1, [m.offset for m in batch]
            return batch[0]
    raise AssertionError(f"no message in {timeout} s")


def saved(broker: BrokerProcess, offset: int, group: str = "g") -> list[int] | None:
    """The unsettled row of ``groups.json`` holding ``offset``: [start, end, deliveries, first_ms, due_ms, dead]."""
    try:
        state = json.loads((broker.data_dir / "topics" / TOPIC / "groups.json").read_text()).get(group, {})
    except (FileNotFoundError, ValueError):
        return None
    return next((row for row in state.get("unsettled", []) if row[0] <= offset < row[1]), None)


def subscribe(broker: BrokerProcess, credit: int = 10, **options) -> Subscription:
    return Subscription(TOPIC, "g", address=broker.address, credit=credit, **options)


@pytest.mark.parametrize("kill", [True, False], ids=["kill9", "sigterm"])
def test_delivery_counts_continue_after_a_restart(conveyor_broker_factory, kill):
    broker = conveyor_broker_factory()
    publish(broker.address, TOPIC, ["poison"])
    sub = subscribe(broker, max_deliveries=10)
    attempts = []
    try:
        for _ in range(3):
            message = next_message(sub)
            attempts.append(message.attempt)
            if len(attempts) < 3:
                sub.nack([message], error="boom")
        # The third delivery is in flight when the broker goes down.
        assert wait_for(lambda: (saved(broker, 0) or [0, 0, 0])[2] == 3, timeout=30), saved(broker, 0)
        first_ms = saved(broker, 0)[3]
        broker.restart(kill=kill)
    finally:
        sub.close()
    sub = subscribe(broker, max_deliveries=10)
    try:
        message = next_message(sub)
        attempts.append(message.attempt)
        assert attempts == [1, 2, 3, 4], "the count goes on: the delivery in flight at the restart counted"
        assert saved(broker, 0) is None or saved(broker, 0)[3] == first_ms
        sub.ack([message])
        assert wait_for(lambda: saved(broker, 0) is None, timeout=30)
    finally:
        sub.close()


def test_a_retry_delay_survives_a_kill(conveyor_broker_factory):
    broker = conveyor_broker_factory()
    publish(broker.address, TOPIC, ["later"])
    sub = subscribe(broker)
    try:
        first = next_message(sub)
        assert first.attempt == 1
        sub.nack([first], delay_ms=6000, error="not yet")
        nacked = time.monotonic()
        assert wait_for(lambda: (saved(broker, 0) or [0, 0, 0, 0, 0])[4] > 0, timeout=30), saved(broker, 0)
        broker.restart(kill=True)
    finally:
        sub.close()
    sub = subscribe(broker)
    try:
        again = next_message(sub, timeout=40)
        waited = time.monotonic() - nacked
        assert again.attempt == 2
        assert waited >= 5.5, f"redelivered {waited:.1f} s after a nack delayed by 6 s"
        sub.ack([again])
    finally:
        sub.close()


def test_a_poison_message_gets_no_fresh_attempts_when_the_broker_is_killed(conveyor_broker_factory):
    """Each delivery kills the broker (as a poison message that crashes what handles it might)."""
    broker = conveyor_broker_factory()
    publish(broker.address, TOPIC, ["poison", "fine"])
    attempts = []
    for _ in range(3):
        sub = subscribe(broker, credit=1, max_deliveries=3)
        try:
            message = next_message(sub)
            assert message.offset == 0
            attempts.append(message.attempt)
            count = len(attempts)
            assert wait_for(lambda: (saved(broker, 0) or [0, 0, 0])[2] == count, timeout=30)  # noqa: B023
            broker.restart(kill=True)
        finally:
            sub.close()
    assert attempts == [1, 2, 3]
    with Admin(broker.address) as admin:
        assert wait_for(lambda: TOPIC + ".dlq" in [t["name"] for t in admin.list_topics()], timeout=30)
        dead = admin.fetch(TOPIC + ".dlq", 0, 10, wait_ms=5000)
    assert [m.value for m in dead] == ["poison"]
    assert dead[0].headers["x-delivery-count"] == "3"
    sub = subscribe(broker, credit=1, max_deliveries=3)
    try:
        rest = next_message(sub)
        assert (rest.offset, rest.value, rest.attempt) == (1, "fine", 1)
        sub.ack([rest])
    finally:
        sub.close()


def test_saved_ranges_are_bounded_and_what_is_left_out_comes_again():
    """In-process: at most MAX_SAVED_RANGES rows; the saved next offset stops before the first one left out."""
    from conveyor.broker.server.groups import MAX_SAVED_RANGES, Group, GroupSettings, Pending

    clock = [100.0]
    group = Group(TOPIC, "g", GroupSettings(max_deliveries=5), next_offset=50_000, clock=lambda: clock[0])
    # Every other offset waits for a redelivery, after 2 deliveries; one of them due in 3 s.
    group.pending = [Pending([(2 * i, 2 * i + 1)], 2, 100.0, "boom", first_ms=7) for i in range(MAX_SAVED_RANGES + 5)]
    group.pending[0].not_before = 103.0
    state = group.saved_state(100.0, 1_000_000)
    rows = state["unsettled"]
    assert len(rows) == MAX_SAVED_RANGES
    assert rows[0] == [0, 1, 2, 7, 1_003_000, 0] and rows[1] == [2, 3, 2, 7, 0, 0]
    assert state["next_offset"] == 2 * MAX_SAVED_RANGES  # the first range left out: delivered again, as new
    assert state["committed_offset"] == 0
    restored = Group(TOPIC, "g", GroupSettings(max_deliveries=5), next_offset=state["next_offset"], clock=lambda: 500.0)
    restored.restore(rows, 500.0, 1_001_000)  # one second of wall clock later
    assert [(p.ranges, p.deliveries, p.first_ms) for p in restored.pending[:2]] == [([(0, 1)], 2, 7), ([(2, 3)], 2, 7)]
    assert restored.pending[0].not_before == 502.0  # still due 2 s later
    assert restored.committed_offset == 0 and restored.next_offset == 2 * MAX_SAVED_RANGES
