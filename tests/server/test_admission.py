"""Admission: what a write may carry, and which topic it may make."""

from __future__ import annotations

import pytest
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.admission import Admission
from conveyor.broker.server.limits import TopicLimits
from conveyor.broker.server.peers import Peers
from conveyor.broker.wire.record import pack_records
from conveyor.monitoring.metrics import NullMetrics

from conveyor.errors import MessageTooLarge, RateLimited, ReadOnlyTopic, TopicLimit, UnknownTopic
from tests.server.server_fakes import Clock


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "data", fsync="none", create_in_background=True)
    yield store
    store.close()


def admission(store: Store, *, auto_create: bool = True, max_topics: int = 100, client_rate: float = 100.0):
    clock = Clock()
    peers = Peers(clock, set(), NullMetrics().redelivered_messages)
    peers.touch(b"p")
    limits = TopicLimits(max_topics, 1000.0, clock=clock)
    return Admission(
        store, peers, limits, auto_create=auto_create, client_rate=client_rate, max_message_bytes=10, clock=clock
    )


def test_a_write_to_a_new_topic_makes_it_and_counts_the_creation(store):
    checks = admission(store)
    log = checks.topic_for_write("fresh", b"p")
    assert log is store.topic("fresh") and checks.creations == 1
    assert checks.topic_for_write("fresh", b"p") is log and checks.creations == 1


def test_no_topic_is_made_with_auto_create_off_past_the_limit_or_past_a_connections_rate(store):
    with pytest.raises(UnknownTopic):
        admission(store, auto_create=False).topic_for_write("t", b"p")
    store.create_topic("one")
    with pytest.raises(TopicLimit):
        admission(store, max_topics=1).topic_for_write("two", b"p")
    slow = admission(store, client_rate=1.0)
    slow.topic_for_write("a", b"p")
    with pytest.raises(RateLimited):
        slow.topic_for_write("b", b"p")  # the clock stands still: no token came back
    assert slow.creations == 1


def test_a_read_only_topic_and_an_oversized_message_are_refused(store):
    store.create_topic("mirrored", read_only=True)
    checks = admission(store)
    with pytest.raises(ReadOnlyTopic):
        checks.topic_for_write("mirrored")
    store.create_topic("mirrored#2", read_only=True)  # partition 2 of it: the error names the topic and partition
    with pytest.raises(ReadOnlyTopic) as partition:
        checks.topic_for_write("mirrored#2")
    assert "#" not in partition.value.message and "mirrored partition 2" in partition.value.message
    assert partition.value.fields == {"topic": "mirrored", "partition": 2}
    assert checks.validate(pack_records([(None, None, b"small")])) == 1
    with pytest.raises(MessageTooLarge) as refused:
        checks.validate(pack_records([(None, None, b"x" * 11)]))
    assert refused.value.fields["limit"] == 10
