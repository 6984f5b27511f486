"""Thousands of one-message batches: every DELIVER, FETCHED and ACK header must fit the 64 KiB limit.

A member with a large credit catching up on a log of tiny batches used to be
planned one DELIVER listing every batch; past about 1,000 entries its header
exceeded ``MAX_HEADER_BYTES``, the consumer could not decode it, and the
same frame came back after each ack timeout: the group was stuck for good.
"""

from __future__ import annotations

import collections
import logging
import time

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.server.groups import MAX_ENTRIES

from conveyor import Admin, Producer
from conveyor.testing import BrokerProcess
from tests.broker.broker_helpers import drain, quiet
from tests.helpers import wait_for

BATCHES = 3 * MAX_ENTRIES + 17  # several DELIVERs' worth of entries


def publish_one_per_batch(address: str, topic: str, count: int, *, keys: int = 0) -> None:
    with Producer(address, batch_size=1, max_in_flight=64) as producer:
        for i in range(count):
            producer.send(topic, f"m{i}", key=f"k{i % keys}" if keys else None)
        producer.flush(timeout=60)


@pytest.fixture
def undecodable(caplog):
    """Records of a consumer dropping a frame it could not decode."""
    caplog.set_level(logging.WARNING)
    return lambda: [r for r in caplog.records if "undecodable" in r.getMessage()]


def test_a_lagging_member_with_a_large_credit_gets_every_tiny_batch(conveyor_broker, undecodable):
    # Given a log of one-message batches, written before anyone subscribes
    publish_one_per_batch(conveyor_broker.address, "tiny", BATCHES)
    sub = Subscription("tiny", "g", address=conveyor_broker.address, credit=10_000)
    try:
        # When the member catches up with a credit larger than one DELIVER can list
        got = drain([sub], BATCHES, timeout=30)[0]
        # Then it receives each message once, in order, in several DELIVERs
        assert [m.offset for m in got] == list(range(BATCHES))
        assert [m.value for m in got] == [f"m{i}" for i in range(BATCHES)]
        assert quiet([sub], 0.3) == []
        assert undecodable() == []
        with Admin(conveyor_broker.address) as admin:
            assert admin.describe_group("tiny", "g")["committed_offset"] == BATCHES
    finally:
        sub.close()


def test_redelivery_of_many_tiny_batches_is_split_too(conveyor_broker, undecodable):
    # Given a member that took thousands of tiny batches and left without acking
    publish_one_per_batch(conveyor_broker.address, "again", BATCHES)
    first = Subscription("again", "g", address=conveyor_broker.address, credit=10_000)
    taken = drain([first], BATCHES, timeout=30, ack=False)[0]
    assert len(taken) == BATCHES
    first.close()  # BYE: everything it held is redelivered at once
    # When another member takes over
    second = Subscription("again", "g", address=conveyor_broker.address, credit=10_000)
    try:
        got = drain([second], BATCHES, timeout=30)[0]
        # Then the redelivery arrives whole, each message once, marked as a second delivery
        assert sorted(m.offset for m in got) == list(range(BATCHES))
        assert {m.attempt for m in got} == {2}
        assert undecodable() == []
    finally:
        second.close()


def test_key_affinity_splits_a_long_list_of_offsets(conveyor_broker, undecodable):
    # Given one large batch whose keys alternate between members: each DELIVER lists its offsets
    # (about 30,000 per member here, some 90 KB if listed in one header)
    count = 60_000
    with Producer(conveyor_broker.address, batch_size=count, linger_ms=50) as producer:
        for i in range(count):
            producer.send("keyed", i, key=f"k{i % 7}")
        producer.flush(timeout=30)
    subs = [
        Subscription("keyed", "g", address=conveyor_broker.address, credit=count, key_affinity=True) for _ in range(2)
    ]
    try:
        # When both catch up
        got = drain(subs, count, timeout=30)
        # Then every message arrives once, each key with one member, in order
        offsets = [m.offset for batch in got for m in batch]
        assert sorted(offsets) == list(range(count))
        owners = collections.defaultdict(set)
        for i, batch in enumerate(got):
            for m in batch:
                owners[m.key].add(i)
            assert [m.offset for m in batch] == sorted(m.offset for m in batch)
        assert all(len(members) == 1 for members in owners.values()), owners
        assert undecodable() == []
        # Each DELIVER carries a slice of the batch around its offsets, not the whole body again
        published = conveyor_broker.metric("conveyor_published_bytes_total", 'topic="keyed"')
        delivered = conveyor_broker.metric("conveyor_delivered_bytes_total", 'topic="keyed"')
        assert delivered < 3 * published, (delivered, published)
    finally:
        for sub in subs:
            sub.close()


def test_acking_scattered_offsets_is_split_into_frames_that_fit(conveyor_broker):
    # Given 30,000 delivered messages
    count = 30_000
    with Producer(conveyor_broker.address, batch_size=count, linger_ms=50) as producer:
        producer.send_many("scattered", [b"x"] * count)
        producer.flush(timeout=30)
    sub = Subscription("scattered", "g", address=conveyor_broker.address, credit=count)
    try:
        got = drain([sub], count, timeout=30, ack=False)[0]
        assert len(got) == count
        # When every other message is acked (15,000 separate ranges, some 100 KB), then the rest
        sub.ack(got[::2])
        sub.ack(got[1::2])
        # Then the broker took every ack: the group is settled, nothing comes back
        with Admin(conveyor_broker.address) as admin:
            assert wait_for(lambda: admin.describe_group("scattered", "g")["committed_offset"] == count, timeout=10)
            described = admin.describe_group("scattered", "g")
        assert described["in_flight"] == 0
        assert quiet([sub], 0.3) == []
    finally:
        sub.close()


def test_fetch_answers_fit_and_page_through_tiny_batches(conveyor_broker):
    publish_one_per_batch(conveyor_broker.address, "paged", BATCHES)
    with Admin(conveyor_broker.address) as admin:
        # One FETCH asking for more messages than one answer may list
        first = admin.fetch("paged", 0, 10_000)
        assert 0 < len(first) <= MAX_ENTRIES
        # Paging on from each answer's end reads everything once
        values = [m.value for m in first]
        offset = len(first)
        deadline = time.monotonic() + 20
        while offset < BATCHES and time.monotonic() < deadline:
            batch = admin.fetch("paged", offset, 10_000)
            values += [m.value for m in batch]
            offset += len(batch)
    assert values == [f"m{i}" for i in range(BATCHES)]


def test_a_child_mirrors_a_parent_log_of_tiny_batches(tmp_path):
    root = BrokerProcess(tmp_path / "root").start()
    try:
        publish_one_per_batch(root.address, "orders", BATCHES)
        child = BrokerProcess(tmp_path / "child", extra=["--upstream", root.address, "--mirror", "orders"]).start()
        try:
            with Admin(child.address) as admin:
                assert wait_for(lambda: _end(admin, "orders") == BATCHES, timeout=30), _end(admin, "orders")
            with Admin(root.address) as parent, Admin(child.address) as mirror:
                assert _read(mirror) == _read(parent), "same offsets, timestamps and values"
        finally:
            child.stop()
    finally:
        root.stop()


def _read(admin: Admin) -> list[tuple[int, float, object]]:
    out: list[tuple[int, float, object]] = []
    while len(out) < BATCHES:
        batch = admin.fetch("orders", len(out), 10_000)
        assert batch, f"nothing from offset {len(out)}"
        out += [(m.offset, m.timestamp, m.value) for m in batch]
    return out


def _end(admin: Admin, topic: str) -> int:
    try:
        return int(admin.describe_topic(topic)["end_offset"])
    except Exception:
        return -1
