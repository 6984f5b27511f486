"""End-to-end delivery semantics against the real broker process."""

from __future__ import annotations

import collections
import time

from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Producer
from conveyor.errors import UnknownTopic
from tests.broker.broker_helpers import drain, quiet
from tests.helpers import publish, wait_for


def end_offset(admin: Admin, topic: str) -> int:
    """The topic's durable end (what FETCH serves), or -1 while it does not exist yet."""
    try:
        return admin.describe_topic(topic)["durable_offset"]
    except UnknownTopic:
        return -1


def test_confirms_return_consecutive_offsets_per_topic(conveyor_broker):
    # When
    a = publish(conveyor_broker.address, "alpha", [f"a{i}" for i in range(250)])
    b = publish(conveyor_broker.address, "beta", [b"x"] * 10)
    more = publish(conveyor_broker.address, "alpha", ["late"])
    # Then
    assert a == list(range(250))
    assert b == list(range(10))
    assert more == [250]
    with Admin(conveyor_broker.address) as admin:
        assert admin.describe_topic("alpha")["end_offset"] == 251


def test_three_members_share_round_robin_each_message_once(conveyor_broker):
    subs = [Subscription("rr", "g", address=conveyor_broker.address, credit=50) for _ in range(3)]
    try:
        wait_for(lambda: all(s.receive(timeout=0.05) == [] for s in subs), timeout=1)
        publish(conveyor_broker.address, "rr", [f"m{i}" for i in range(3000)])
        got = drain(subs, 3000)
        offsets = [m.offset for batch in got for m in batch]
        assert sorted(offsets) == list(range(3000)), "every message exactly once"
        assert all(len(batch) >= 500 for batch in got), [len(b) for b in got]
        assert quiet(subs, 0.5) == []
    finally:
        for s in subs:
            s.close()


def test_two_groups_each_get_everything(conveyor_broker):
    g1 = Subscription("fan", "one", address=conveyor_broker.address)
    g2 = Subscription("fan", "two", address=conveyor_broker.address)
    try:
        publish(conveyor_broker.address, "fan", list(range(500)))
        (one,) = drain([g1], 500)
        (two,) = drain([g2], 500)
        assert [m.value for m in one] == list(range(500))
        assert [m.value for m in two] == list(range(500))
    finally:
        g1.close()
        g2.close()


def test_nack_with_delay_redelivers_after_the_delay(conveyor_broker):
    sub = Subscription("nacks", "g", address=conveyor_broker.address, credit=10)
    try:
        publish(conveyor_broker.address, "nacks", ["only"])
        (first,) = drain([sub], 1, ack=False)
        assert first[0].attempt == 1
        nacked_at = time.monotonic()
        sub.nack(first, delay_ms=600, error="try later")
        (again,) = drain([sub], 1)
        waited = time.monotonic() - nacked_at
        assert again[0].offset == first[0].offset
        assert again[0].attempt == 2
        assert waited >= 0.55
    finally:
        sub.close()


def test_lease_expiry_redelivers_and_in_progress_renews(conveyor_broker):
    sub = Subscription("leases", "g", address=conveyor_broker.address, ack_timeout_ms=700)
    try:
        publish(conveyor_broker.address, "leases", ["slow", "forgotten"])
        (batch,) = drain([sub], 2, ack=False)
        slow, forgotten = batch
        sub.ack([])
        # Keep renewing "slow" for longer than its lease; let "forgotten" expire.
        redelivered = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            sub.in_progress([slow])
            batch = sub.receive(timeout=0.2)
            sub.ack(batch)
            redelivered += batch
        assert [m.offset for m in redelivered] == [forgotten.offset]
        assert redelivered[0].attempt == 2
        sub.ack([slow])
        assert quiet([sub], 1.2) == []
    finally:
        sub.close()


def test_max_deliveries_moves_messages_to_the_dead_letter_topic(conveyor_broker):
    sub = Subscription("fragile", "g", address=conveyor_broker.address, max_deliveries=3)
    try:
        publish(conveyor_broker.address, "fragile", ["poison", "fine"], headers={"origin": "test"})
        attempts = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(attempts) < 4:
            for m in sub.receive(timeout=0.1):
                if m.value == "poison":
                    attempts.append(m.attempt)
                    sub.nack([m], error="ValueError: bad poison")
                else:
                    sub.ack([m])
                    attempts.append(0)
        assert sorted(attempts) == [0, 1, 2, 3]
        with Admin(conveyor_broker.address) as admin:
            assert wait_for(lambda: end_offset(admin, "fragile.dlq") == 1)
            (dead,) = admin.fetch("fragile.dlq", 0, 10)
        assert dead.value == "poison"
        assert dead.headers["x-origin-topic"] == "fragile"
        assert "x-origin-partition" not in dead.headers  # only a partition k > 0 names its partition
        assert dead.headers["x-origin-offset"] == "0"
        assert dead.headers["x-delivery-count"] == "3"
        assert dead.headers["x-last-error"] == "ValueError: bad poison"
        assert dead.headers["origin"] == "test"
        assert quiet([sub], 0.5) == []
    finally:
        sub.close()


def test_key_affinity_sends_each_key_to_one_member_in_order(conveyor_broker):
    subs = [Subscription("keyed", "g", address=conveyor_broker.address, key_affinity=True, credit=40) for _ in range(3)]
    try:
        quiet(subs, 0.3)
        with Producer(conveyor_broker.address, linger_ms=1) as producer:
            for i in range(1200):
                producer.send("keyed", i, key=f"k{i % 12}")
        got = drain(subs, 1200)
        owners: dict[str, set[int]] = collections.defaultdict(set)
        for member, batch in enumerate(got):
            by_key: dict[str, list[int]] = collections.defaultdict(list)
            for m in batch:
                owners[m.key].add(member)
                by_key[m.key].append(m.value)
            for values in by_key.values():
                assert values == sorted(values), "per-key order"
        assert all(len(members) == 1 for members in owners.values()), owners
        assert sum(map(len, got)) == 1200
        assert len({next(iter(m)) for m in owners.values()}) > 1, "keys spread over members"
    finally:
        for s in subs:
            s.close()


def test_reset_offsets_replays_the_topic(conveyor_broker):
    address = conveyor_broker.address
    sub = Subscription("replay", "g", address=address)
    try:
        publish(address, "replay", list(range(100)))
        drain([sub], 100)
        with Admin(address) as admin:
            assert wait_for(lambda: admin.describe_group("replay", "g")["committed_offset"] == 100)
            sub.close()
            described = admin.reset_offsets("replay", "g", 40)
            assert described["committed_offset"] == 40
        sub = Subscription("replay", "g", address=address)
        (again,) = drain([sub], 60)
        assert [m.value for m in again] == list(range(40, 100))
    finally:
        sub.close()


def test_fetch_waits_for_new_data(conveyor_broker):
    address = conveyor_broker.address
    publish(address, "waiting", ["before"])
    with Admin(address) as admin:
        assert [m.value for m in admin.fetch("waiting", 0, 10)] == ["before"]
        start = time.monotonic()
        assert admin.fetch("waiting", 1, 10, wait_ms=300) == []
        assert time.monotonic() - start >= 0.25

        import threading

        timer = threading.Timer(0.3, lambda: publish(address, "waiting", ["after"]))
        timer.start()
        start = time.monotonic()
        got = admin.fetch("waiting", 1, 10, wait_ms=5000)
        elapsed = time.monotonic() - start
        timer.join()
        assert [m.value for m in got] == ["after"]
        assert 0.2 <= elapsed < 3.0
