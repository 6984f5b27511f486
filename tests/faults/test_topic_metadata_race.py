"""An alter sent right after a PUBLISH auto-created the topic: the creator thread and the alter both write topic.json.

Real broker process: a raw client publishes to many new topics and alters each at once, then the broker restarts.
"""

from __future__ import annotations

import json
import time

import msgpack
import zmq
from conveyor.broker.wire.protocol import SIGNATURE, Command

from conveyor import Admin

TOPICS = 16
RETENTION_MS = 12345


def publish_then_alter(address: str, topics: list[str]) -> dict[int, tuple[int, dict]]:
    """Each topic: a PUBLISH (auto-creates it) and at once an alter_topic; the answers by request id."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    body = msgpack.packb([[None, None, b"v"]])
    try:
        for i, topic in enumerate(topics):
            sock.send_multipart(
                [SIGNATURE, bytes([Command.PUBLISH]), msgpack.packb({"rid": 2 * i, "topic": topic}), body]
            )
            alter = {"rid": 2 * i + 1, "op": "alter_topic", "topic": topic, "config": {"retention_ms": RETENTION_MS}}
            sock.send_multipart([SIGNATURE, bytes([Command.ADMIN]), msgpack.packb(alter)])
        answers: dict[int, tuple[int, dict]] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(answers) < 2 * len(topics):
            if sock.poll(200):
                frames = sock.recv_multipart()
                header = msgpack.unpackb(frames[2], strict_map_key=False)
                if "rid" in header:
                    answers[header["rid"]] = (frames[1][0], header)
        return answers
    finally:
        sock.close()
        ctx.term()


def test_an_alter_racing_the_topic_creator_is_kept_and_nothing_is_torn(brokers):
    broker = brokers.start()
    topics = [f"race{i}" for i in range(TOPICS)]
    answers = publish_then_alter(broker.address, topics)
    # Every alter is answered OK (never an internal error)
    refused = {
        t: answers.get(2 * i + 1) for i, t in enumerate(topics) if answers.get(2 * i + 1, (0,))[0] != Command.RESULT
    }
    assert not refused, f"alters not answered OK: {refused}"
    with Admin(broker.address) as admin:
        assert all(admin.describe_topic(t)["config"]["retention_ms"] == RETENTION_MS for t in topics)
    broker.stop()
    # On disk each topic.json is whole and holds the alter, and no temp file is left
    for topic in topics:
        directory = broker.data_dir / "topics" / topic
        stored = json.loads((directory / "topic.json").read_text())
        assert stored["retention_ms"] == RETENTION_MS, f"{topic}: the alter was overwritten on disk: {stored}"
        assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    # And after a restart every alter survived
    broker.start()
    with Admin(broker.address) as admin:
        lost = [t for t in topics if admin.describe_topic(t)["config"]["retention_ms"] != RETENTION_MS]
    assert not lost, f"alters lost after restart: {lost}"


def test_temp_files_an_interrupted_write_left_are_removed_at_start(brokers):
    broker = brokers.start()
    with Admin(broker.address) as admin:
        admin.create_topic("left")
    broker.stop()
    directory = broker.data_dir / "topics" / "left"
    (directory / ".topic.json.123.456.0.tmp").write_bytes(b'{"retention_ms": 1')
    (directory / ".groups.json.tmp").write_bytes(b"")
    broker.start()
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    with Admin(broker.address) as admin:
        assert admin.describe_topic("left")["name"] == "left"
