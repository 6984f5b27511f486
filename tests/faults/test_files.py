"""Damaged files under a real broker: torn tails, flipped bytes, offsets files caught mid-write.

``tests/storage`` covers these on a ``FileLog`` alone; here the broker process
opens the damaged data directory, and clients check what it serves.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from conveyor.broker.log.syscalls import ENV_CONTROL
from conveyor.broker.wire.record import HEADER_SIZE, decode_header

from conveyor import Admin, Producer
from conveyor.errors import OffsetOutOfRange, SegmentCorrupt
from tests.faults.fault_helpers import consumers, drain_group, fetch_all, report
from tests.helpers import wait_for


def batches_of(path) -> list[tuple[int, int]]:
    """(position, size) of every batch in a segment file."""
    data = path.read_bytes()
    out, position = [], 0
    while position < len(data):
        header = decode_header(data, position)
        out.append((position, header.size))
        position += header.size
    return out


def publish_batches(address: str, topic: str, groups: list[list[str]]) -> None:
    with Producer(address, linger_ms=50) as producer:
        for values in groups:
            # send_many queues the group at once, so a linger firing on a loaded machine cannot split it
            futures = producer.send_many(topic, values)
            producer.flush(timeout=10)  # one batch per group
            assert all(f.done() and f.exception() is None for f in futures)


def test_a_torn_tail_at_every_byte_of_the_last_batch_is_cut_and_nothing_before_it(brokers):
    # Given one topic per cut point, each ending with the same one-message batch
    broker = brokers.start()
    probe = "torn-probe"
    publish_batches(broker.address, probe, [[f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)], ["z"]])
    broker.stop()
    segment = next((broker.data_dir / "topics" / probe).glob("*.log"))
    last_position, last_size = batches_of(segment)[-1]
    cuts = list(range(1, last_size))  # every byte of the last batch: header and body
    broker.start()
    for cut in cuts:
        publish_batches(
            broker.address, f"torn-{cut}", [[f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)], ["z"]]
        )
    broker.stop()
    # When each topic's newest segment loses the end of its last batch (cut bytes into it)
    for cut in cuts:
        path = next((broker.data_dir / "topics" / f"torn-{cut}").glob("*.log"))
        assert batches_of(path)[-1] == (last_position, last_size)
        with path.open("r+b") as f:
            f.truncate(last_position + cut)
    broker.start()
    # Then every topic serves its two whole batches, the torn one is gone and counted, and appends go on
    with Producer(broker.address) as producer:
        for cut in cuts:
            topic = f"torn-{cut}"
            assert [v for _o, v in fetch_all(broker.address, topic)] == [f"a{i}" for i in range(10)] + [
                f"b{i}" for i in range(10)
            ]
            assert broker.metric("conveyor_log_truncated_bytes_total", f'topic="{topic}"') == cut
            assert producer.send(topic, "again").result(timeout=10) == 20
    report("torn-tails", cut_points=len(cuts), header_bytes=HEADER_SIZE, last_batch_bytes=last_size)


def test_a_flipped_byte_in_a_sealed_segment_stops_the_broker_or_is_quarantined(brokers):
    # Given topics whose first (sealed) segment gets one byte flipped: in the header, in the CRC, in the body
    broker = brokers.start()
    places = {"length": 9, "crc": 17, "count": 21, "body": HEADER_SIZE + 5}
    with Admin(broker.address) as admin:
        for name in places:
            admin.create_topic(f"flip-{name}", segment_bytes=1024)
    for name in places:
        publish_batches(broker.address, f"flip-{name}", [[f"{name}-{b}-{i}" for i in range(20)] for b in range(8)])
    broker.stop()
    sealed = {}
    for name, at in places.items():
        segments = sorted((broker.data_dir / "topics" / f"flip-{name}").glob("*.log"))
        assert len(segments) >= 3
        sealed[name] = segments[0]
        data = bytearray(segments[0].read_bytes())
        position = batches_of(segments[0])[-1][0]  # the last batch of the sealed segment
        data[position + at] ^= 0x40
        segments[0].write_bytes(bytes(data))
    # When the broker starts, it refuses, naming the corrupt file
    with pytest.raises(RuntimeError, match="SEGMENT_CORRUPT") as refused:
        broker.start()
    assert any(str(path) in str(refused.value) for path in sealed.values())
    # Then with --quarantine it starts, moves the bad segments aside and serves the rest intact
    broker.extra.append("--quarantine")
    broker.start()
    for name, path in sealed.items():
        topic = f"flip-{name}"
        assert (path.parent / "quarantine" / path.name).exists()
        stored = fetch_all(broker.address, topic)
        assert stored, topic
        start = stored[0][0]
        assert start > 0
        assert [v for _o, v in stored] == [f"{name}-{o // 20}-{o % 20}" for o in range(start, start + len(stored))]
        with Admin(broker.address) as admin, pytest.raises(OffsetOutOfRange):
            admin.fetch(topic, 0, 10)
    report("flipped-bytes", topics=len(places), quarantined=len(sealed))


def test_a_flipped_byte_mid_newest_segment_stops_the_broker_or_is_quarantined(brokers):
    # Given a topic whose only (newest) segment has a byte flipped in its second batch, valid batches after it
    broker = brokers.start()
    publish_batches(broker.address, "mid", [[f"b{b}-{i}" for i in range(10)] for b in range(6)])
    broker.stop()
    segment = next((broker.data_dir / "topics" / "mid").glob("*.log"))
    position = batches_of(segment)[1][0]
    data = bytearray(segment.read_bytes())
    data[position + HEADER_SIZE + 3] ^= 0x01
    segment.write_bytes(bytes(data))
    # When the broker starts, it refuses, naming the file and the position, and cuts nothing
    with pytest.raises(RuntimeError, match="SEGMENT_CORRUPT") as refused:
        broker.start()
    assert f"{segment}: CRC mismatch at position {position}" in str(refused.value)
    assert "--quarantine" in str(refused.value)
    assert segment.read_bytes() == bytes(data)
    # Then with --quarantine it starts, moves the segment aside, counts it, and never reuses its offsets
    broker.extra.append("--quarantine")
    broker.start()
    assert (segment.parent / "quarantine" / segment.name).exists()
    assert broker.metric("conveyor_log_quarantined_segments_total", 'topic="mid"') == 1
    with Producer(broker.address) as producer:
        assert producer.send("mid", "after").result(timeout=10) == 60
    assert fetch_all(broker.address, "mid") == [(60, "after")]


def test_a_batch_corrupted_under_a_running_broker_never_ends_it(brokers):
    # Given a topic read from disk (no tail cache) and a byte flipped in its third batch while the broker runs
    broker = brokers.start()
    with Admin(broker.address) as admin:
        admin.create_topic("rot", cache_bytes=0)
    publish_batches(broker.address, "rot", [[f"b{b}-{i}" for i in range(10)] for b in range(5)])
    segment = next((broker.data_dir / "topics" / "rot").glob("*.log"))
    position = batches_of(segment)[2][0]
    with segment.open("r+b") as f:
        f.seek(position + HEADER_SIZE + 3)
        good = f.read(1)
        f.seek(position + HEADER_SIZE + 3)
        f.write(bytes([good[0] ^ 0x01]))
    # When a group reaches it
    with consumers(broker.address, "rot", "g", n=1) as group:
        assert wait_for(lambda: broker.metric("conveyor_dispatch_errors_total", 'error="SEGMENT_CORRUPT"') >= 1, 30)
        # Then the broker lives: the batches before it were delivered, the group is paused and shown as DEGRADED
        assert broker.proc.poll() is None
        assert wait_for(lambda: len(group[0].deliveries) >= 20, 30)
        health_url = broker.metrics_url.replace("/metrics", "/healthz")
        health = json.loads(urllib.request.urlopen(health_url, timeout=5).read())  # DEGRADED is a 200
        assert health["status"] == "DEGRADED"
        recent = health["checks"]["internal_errors"]["recent"]["dispatch"]
        assert "SEGMENT_CORRUPT" in recent["error"] and recent["context"] == "topic=rot group=g offset=20"
        # (the output is read by another thread: the line may land a moment after the health check saw it)
        assert wait_for(lambda: "internal error in dispatch topic=rot group=g offset=20" in "".join(broker.output), 10)
        # And a FETCH of it is answered SEGMENT_CORRUPT, never with its bytes
        with Admin(broker.address) as admin, pytest.raises(SegmentCorrupt):
            admin.fetch("rot", 25, 10)
        # And other topics and groups are served meanwhile
        with Producer(broker.address) as producer:
            assert producer.send("other", "x").result(timeout=10) == 0
        with consumers(broker.address, "other", "g", n=1) as other:
            assert wait_for(lambda: len(other[0].deliveries) == 1, 30)
        # And once the byte is good again, a retry (with backoff) delivers the rest
        with segment.open("r+b") as f:
            f.seek(position + HEADER_SIZE + 3)
            f.write(good)
        assert wait_for(lambda: len(group[0].deliveries) >= 50, 60)
    assert sorted(o for o, _v, _a in group[0].deliveries) == list(range(50))
    assert broker.metric("conveyor_dispatch_errors_total", 'group="g",topic="rot"') >= 1


def consume_all(broker, topic: str, group: str, expected_committed: int) -> None:
    with consumers(broker.address, topic, group, n=1) as members:
        assert drain_group(broker.address, topic, group, members, timeout=20)
    with Admin(broker.address) as admin:
        assert admin.describe_group(topic, group)["committed_offset"] == expected_committed


@pytest.mark.parametrize(
    "leftover",
    [b'{"g": {"committed_off', b"\x00" * 37, b'{"g": {"committed_offset": 3, "max_deliveries": 10}}', b""],
    ids=["half-written", "zeros", "whole-but-never-renamed", "empty"],
)
def test_a_leftover_offsets_temp_file_is_ignored(brokers, leftover):
    # Given a group that committed 100, and a crash that left the offsets temp file behind
    broker = brokers.start()
    publish_batches(broker.address, "offsets", [[f"m{i}" for i in range(100)]])
    consume_all(broker, "offsets", "g", 100)
    broker.stop()
    (broker.data_dir / "topics" / "offsets" / ".groups.json.tmp").write_bytes(leftover)
    # When the broker restarts, the offsets are the ones last renamed into place, never the temp file's
    broker.start()
    with Admin(broker.address) as admin:
        assert admin.describe_group("offsets", "g")["committed_offset"] == 100
    # And the next commit replaces the temp file
    publish_batches(broker.address, "offsets", [["m100"]])
    consume_all(broker, "offsets", "g", 101)
    time.sleep(0.5)
    groups = json.loads((broker.data_dir / "topics" / "offsets" / "groups.json").read_text())
    assert groups["g"]["committed_offset"] == 101


def test_a_crash_between_writing_and_renaming_the_offsets_file_keeps_the_old_offsets(brokers, tmp_path):
    # Given a group whose committed offset 100 is on disk
    control = tmp_path / "faults"
    broker = brokers.start(env={ENV_CONTROL: str(control)})
    publish_batches(broker.address, "offsets", [[f"m{i}" for i in range(100)]])
    consume_all(broker, "offsets", "g", 100)
    groups = broker.data_dir / "topics" / "offsets" / "groups.json"
    assert wait_for(lambda: groups.exists() and json.loads(groups.read_text())["g"]["committed_offset"] == 100)
    # When every later offsets write fails at the rename, the group moves on, and the broker is killed
    control.write_text("rename_eio,match=groups.json")
    publish_batches(broker.address, "offsets", [[f"n{i}" for i in range(50)]])
    consume_all(broker, "offsets", "g", 150)
    time.sleep(0.5)
    broker.kill()
    assert json.loads(groups.read_text())["g"]["committed_offset"] == 100, "the rename did not happen"
    assert not list(groups.parent.glob(".groups.json.*tmp")), "a failed write removes its temp file"
    injected = sum("injected rename_eio" in line for line in broker.output)
    control.write_text("")
    # Then the restarted broker has the old offset, and redelivers from it (at-least-once)
    broker.restart(kill=True)
    with Admin(broker.address) as admin:
        assert admin.describe_group("offsets", "g")["committed_offset"] == 100
    with consumers(broker.address, "offsets", "g", n=1) as members:
        assert drain_group(broker.address, "offsets", "g", members)
    assert sorted(o for o, _v, _a in members[0].deliveries) == list(range(100, 150))
    report("offsets-rename-crash", faults_injected=injected, redelivered=len(members[0].deliveries))


def test_committed_offsets_reach_the_disk_within_offsets_commit_ms(brokers):
    """After a kill -9 a group resumes at most --offsets-commit-ms behind what it had committed."""
    commit_ms = 50
    broker = brokers.start(extra=["--offsets-commit-ms", str(commit_ms)])
    with Admin(broker.address) as admin:
        admin.create_topic("steady")
    rng = random.Random(11)
    worst = 0.0
    stale = []
    for round_ in range(6):
        samples: list[tuple[float, int]] = []
        producer = Producer(broker.address, linger_ms=1, request_timeout_ms=500)
        with Admin(broker.address) as admin, consumers(broker.address, "steady", "g", n=1, credit=10):
            assert wait_for(lambda a=admin: any(g["group"] == "g" for g in a.list_groups("steady")))
            deadline = time.monotonic() + 0.6 + rng.uniform(0, 0.3)
            n = 0
            while time.monotonic() < deadline:
                producer.send("steady", f"{round_}-{n}")
                n += 1
                if n % 20 == 0:
                    samples.append((time.monotonic(), admin.describe_group("steady", "g")["committed_offset"]))
            killed_at = time.monotonic()
            broker.kill()
        broker.restart(kill=True)
        producer.close(timeout=30)  # what was unconfirmed is resent to the restarted broker
        with Admin(broker.address) as admin:
            resumed = admin.describe_group("steady", "g")["committed_offset"]
        # The first moment the broker had committed more than it resumed at: what came after was not on disk.
        newer = [t for t, committed in samples if committed > resumed]
        staleness = killed_at - newer[0] if newer else 0.0
        stale.append(round(staleness * 1000))
        worst = max(worst, staleness)
        with consumers(broker.address, "steady", "g", n=1) as members:
            drain_group(broker.address, "steady", "g", members)
    report("offsets-commit-window", offsets_commit_ms=commit_ms, staleness_ms=stale, worst_ms=round(worst * 1000))
    # A pass of the loop and a describe_group round trip come on top of the interval.
    assert worst * 1000 < commit_ms + 120, f"offsets reached the disk up to {worst * 1000:.0f} ms late: {stale}"
