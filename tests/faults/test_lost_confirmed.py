"""Recovery that finds confirmed messages missing: loud, counted, DEGRADED, and their offsets never given again.

Real broker processes: a group commits, the stopped broker's newest segment is damaged, the broker restarts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from conveyor.broker.wire.record import HEADER_SIZE

from conveyor import Admin, Producer
from tests.faults.fault_helpers import fetch_all
from tests.faults.test_files import batches_of, consume_all, publish_batches
from tests.helpers import wait_for

FIRST, LAST = [f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)]


def health(broker) -> dict:
    url = broker.metrics_url.replace("/metrics", "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as answer:
        return json.loads(answer.read())


def committed_topic(brokers, topic: str, **create):
    """A stopped broker whose ``topic`` holds FIRST then LAST (two batches), all committed by group g."""
    broker = brokers.start()
    if create:
        with Admin(broker.address) as admin:
            admin.create_topic(topic, **create)
    publish_batches(broker.address, topic, [FIRST, LAST])
    consume_all(broker, topic, "g", 20)
    groups = broker.data_dir / "topics" / topic / "groups.json"
    assert wait_for(lambda: groups.exists() and json.loads(groups.read_text())["g"]["committed_offset"] == 20)
    broker.stop()
    return broker, broker.data_dir / "topics" / topic


def assert_loss_is_loud_and_offsets_not_reused(broker, topic: str, lost: tuple[int, int], kept: list[str]):
    output = "".join(broker.output)
    assert f"{topic}: CONFIRMED DATA LOST: offsets [{lost[0]}, {lost[1]})" in output
    assert "group g committed offset 20" in output
    assert broker.metric("conveyor_log_lost_offsets_total", f'topic="{topic}"') == lost[1] - lost[0]
    checks = health(broker)["checks"]
    assert checks["lost_data"]["status"] == "DEGRADED"
    assert checks["lost_data"]["topics"][topic][0]["start"] == lost[0]
    with Producer(broker.address) as producer:
        assert producer.send(topic, "new").result(timeout=10) == 20, "a lost offset was given to a new message"
    assert [v for _o, v in fetch_all(broker.address, topic)] == [*kept, "new"]
    # And after another restart the gap is known: no new loss, nothing reused
    broker.restart()
    assert broker.metric("conveyor_log_lost_offsets_total", f'topic="{topic}"') in (0, None)
    with Producer(broker.address) as producer:
        assert producer.send(topic, "newer").result(timeout=10) == 21


def test_a_flipped_byte_in_the_last_committed_batch_is_not_cut_silently_nor_reused(brokers):
    broker, directory = committed_topic(brokers, "flip")
    segment = next(directory.glob("*.log"))
    position, _size = batches_of(segment)[-1]
    with segment.open("r+b") as f:  # one byte of the last batch's body: its CRC fails, nothing valid follows
        f.seek(position + HEADER_SIZE + 3)
        byte = f.read(1)
        f.seek(position + HEADER_SIZE + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    broker.start()
    assert_loss_is_loud_and_offsets_not_reused(broker, "flip", (10, 20), FIRST)
    assert any(p.name.endswith(".log.lost") and p.stat().st_size > 0 for p in (directory / "quarantine").iterdir())


def test_a_deleted_newest_log_with_its_index_left_is_not_reused(brokers):
    broker, directory = committed_topic(brokers, "gone", segment_bytes=1024, index_interval_bytes=64)
    broker.start()
    publish_batches(broker.address, "gone", [[f"c{i}" for i in range(40)]])
    broker.stop()
    logs = sorted(directory.glob("*.log"))
    assert len(logs) >= 2, "the topic rolled a segment"
    newest = logs[-1]
    assert newest.with_suffix(".index").exists()
    newest.unlink()
    broker.start()
    output = "".join(broker.output)
    assert "gone: CONFIRMED DATA LOST" in output and "is left of a segment whose .log is gone" in output
    assert broker.metric("conveyor_log_lost_offsets_total", 'topic="gone"') >= 1
    with Admin(broker.address) as admin:
        end = admin.describe_topic("gone")["end_offset"]
    assert end > int(newest.stem), "the log goes on after the deleted segment's offsets"
    assert health(broker)["checks"]["lost_data"]["status"] == "DEGRADED"


def test_a_torn_tail_no_group_saw_is_cut_as_before(brokers):
    broker = brokers.start()
    publish_batches(broker.address, "torn", [FIRST, LAST])
    consume_all(broker, "torn", "g", 20)
    publish_batches(broker.address, "torn", [["z"]])
    broker.stop()
    segment = next((broker.data_dir / "topics" / "torn").glob("*.log"))
    position, size = batches_of(segment)[-1]
    with segment.open("r+b") as f:
        f.truncate(position + size - 1)
    broker.start()
    assert "CONFIRMED DATA LOST" not in "".join(broker.output)
    assert health(broker)["checks"]["lost_data"]["status"] == "HEALTHY"
    with Producer(broker.address) as producer:
        assert producer.send("torn", "again").result(timeout=10) == 20
