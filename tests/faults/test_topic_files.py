"""A topic's directory whose topic.json is lost or damaged: its data is kept, never skipped or replaced.

Real broker processes: the broker opens the damaged data directory and clients check what it serves.
"""

from __future__ import annotations

import pytest

from conveyor import Admin, Producer
from tests.faults.fault_helpers import consumers, drain_group, fetch_all
from tests.faults.test_files import publish_batches

VALUES = [f"m{i}" for i in range(10)]


def stored_topic(brokers, topic: str):
    """A stopped broker whose ``topic`` holds VALUES, all acked by group g."""
    broker = brokers.start()
    publish_batches(broker.address, topic, [VALUES[:5], VALUES[5:]])
    with consumers(broker.address, topic, "g", n=1) as members:
        assert drain_group(broker.address, topic, "g", members)
    broker.stop()
    return broker, broker.data_dir / "topics" / topic


def test_a_topic_without_its_topic_json_is_adopted_with_its_data_and_offsets(brokers):
    # Given a stored topic whose topic.json is lost
    broker, directory = stored_topic(brokers, "j5")
    (directory / "topic.json").unlink()
    # When the broker starts
    broker.start()
    # Then the topic is there with its data and its group's offset, reported, counted and written down again
    assert fetch_all(broker.address, "j5") == list(enumerate(VALUES))
    with Admin(broker.address) as admin:
        assert admin.describe_group("j5", "g")["committed_offset"] == 10
        assert [e["setting"] for e in admin.describe_topic("j5")["config_errors"]] == ["topic.json"]
    assert broker.metric("conveyor_topic_config_errors_total", 'setting="topic.json",topic="j5"') == 1
    assert "j5: topic.json is missing but the segments hold data; adopted" in "".join(broker.output)
    assert (directory / "topic.json").exists()
    # And publishing to it (no auto-create) appends after its data, also after a restart
    with Producer(broker.address) as producer:
        assert producer.send("j5", "again").result(timeout=10) == 10
    broker.restart()
    assert fetch_all(broker.address, "j5") == [*enumerate(VALUES), (10, "again")]


def test_an_unreadable_topic_json_stops_the_broker_or_is_quarantined(brokers):
    broker, directory = stored_topic(brokers, "bad")
    (directory / "topic.json").write_bytes(b'{"segment_bytes": 10')
    # When the broker starts, it refuses, naming the file and the way out
    with pytest.raises(RuntimeError, match="METADATA_CORRUPT") as refused:
        broker.start()
    assert str(directory / "topic.json") in str(refused.value) and "--quarantine" in str(refused.value)
    # Then with --quarantine the file is moved aside and the topic adopted with all its data
    broker.extra.append("--quarantine")
    broker.start()
    assert (directory / "quarantine" / "topic.json").read_bytes() == b'{"segment_bytes": 10'
    assert fetch_all(broker.address, "bad") == list(enumerate(VALUES))
    with Admin(broker.address) as admin:
        assert admin.describe_group("bad", "g")["committed_offset"] == 10


def test_only_an_unfinished_creation_is_replaced(brokers):
    # Given a directory a crash left mid-creation: an empty segment, no topic.json
    broker = brokers.start()
    broker.stop()
    unfinished = broker.data_dir / "topics" / "fresh"
    unfinished.mkdir(parents=True)
    (unfinished / f"{0:020d}.log").write_bytes(b"")
    # When the broker starts, it is no topic; creating it takes the directory
    broker.start()
    with Admin(broker.address) as admin:
        assert "fresh" not in [t["name"] for t in admin.list_topics()]
        admin.create_topic("fresh", segment_bytes=4096)
        assert admin.describe_topic("fresh")["config"]["segment_bytes"] == 4096
    with Producer(broker.address) as producer:
        assert producer.send("fresh", "first").result(timeout=10) == 0
