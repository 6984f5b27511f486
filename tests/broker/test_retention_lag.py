"""Retention racing a lagging group: the group goes on from the log start, the broker never dies.

Small segments and size retention make the log start move while a group is
offline, slow, holding nacked or delayed messages, or terminating them. Every
test runs a real broker process; skipped messages are counted in
``conveyor_group_skipped_messages_total`` and in ``skipped_by_retention``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Producer
from conveyor.errors import OffsetOutOfRange
from conveyor.testing import BrokerProcess
from tests.helpers import publish, wait_for

# Members idle while a test publishes (seconds on a busy machine) must not be evicted meanwhile.
HEARTBEAT_MS = 5000
SMALL_LOG = ["--segment-bytes", "1024", "--retention-bytes", "2048", "--heartbeat-ms", str(HEARTBEAT_MS)]
SKIPPED = "conveyor_group_skipped_messages_total"


def publish_numbered(address: str, topic: str, start: int, count: int, *, keys: int = 0) -> None:
    """``count`` ~100-byte messages in batches of 5 (many small segments)."""
    numbers = range(start, start + count)
    values = [{"i": i, "pad": "x" * 80} for i in numbers]
    publish(address, topic, values, keys=[f"k{i % keys}" for i in numbers] if keys else None, batch_size=5)


def start_of(admin: Admin, topic: str) -> int:
    return int(admin.describe_topic(topic)["start_offset"])


def push_start_past(address: str, topic: str, offset: int, *, first: int, keys: int = 0) -> int:
    """Publish until retention moved the log start past ``offset``; the next free value index."""
    with Admin(address) as admin:
        i = first
        for _ in range(20):
            publish_numbered(address, topic, i, 100, keys=keys)
            i += 100
            try:
                wait_for(lambda: start_of(admin, topic) > offset, timeout=2)
            except AssertionError:
                continue  # not yet: publish more
            return i
    raise AssertionError(f"retention never moved {topic}'s start past {offset}")


def skipped(broker: BrokerProcess, topic: str, group: str) -> float:
    return broker.metric(SKIPPED, f'group="{group}",reason="retention",topic="{topic}"')


def values(messages) -> list[int]:
    return [m.value["i"] for m in messages]


def receive_until(sub: Subscription, done, *, ack: bool = True, timeout: float = 30.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while not done(got) and time.monotonic() < deadline:
        batch = sub.receive(timeout=0.05)
        got += batch
        if batch and ack:
            sub.ack(batch)
    return got


@pytest.fixture
def broker(conveyor_broker_factory) -> BrokerProcess:
    return conveyor_broker_factory(extra=SMALL_LOG)


def test_an_offline_group_goes_on_from_the_log_start(broker):
    sub = Subscription("off", "g", address=broker.address, credit=10, heartbeat_ms=HEARTBEAT_MS)
    assert wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.subscribed, timeout=30)
    sub.close()
    push_start_past(broker.address, "off", 0, first=0)
    with Admin(broker.address) as admin:
        # Retention alone moves an offline group on: its description says so without a subscriber.
        assert wait_for(lambda: admin.describe_group("off", "g")["committed_offset"] == start_of(admin, "off"), 30)
        info = admin.describe_group("off", "g")
        end = admin.describe_topic("off")["end_offset"]
        assert info["skipped_by_retention"] == info["committed_offset"] > 0
    sub = Subscription("off", "g", address=broker.address, credit=100, heartbeat_ms=HEARTBEAT_MS)
    try:
        got = receive_until(sub, lambda got: len(got) >= end - info["committed_offset"])
        assert [m.offset for m in got] == list(range(info["committed_offset"], end))
        assert broker.proc.poll() is None
        assert skipped(broker, "off", "g") == info["skipped_by_retention"] > 0
    finally:
        sub.close()


@pytest.mark.parametrize("key_affinity", [False, True], ids=["plain", "key_affinity"])
def test_a_slow_member_goes_on_from_the_log_start(broker, key_affinity):
    topic = f"slow-{key_affinity}"
    sub = Subscription(
        topic, "g", address=broker.address, credit=10, key_affinity=key_affinity, heartbeat_ms=HEARTBEAT_MS
    )
    try:
        keys = 3 if key_affinity else 0
        publish_numbered(broker.address, topic, 0, 10, keys=keys)
        held = receive_until(sub, lambda got: len(got) >= 10, ack=False)
        assert [m.offset for m in held] == list(range(10))
        after = push_start_past(broker.address, topic, 20, first=10, keys=keys)
        with Admin(broker.address) as admin:
            sub.ack(held)  # credit comes back: the group's next offset is long gone
            publish_numbered(broker.address, topic, after, 5, keys=keys)
            end = admin.describe_topic(topic)["end_offset"]
            got = receive_until(sub, lambda got: got and got[-1].offset == end - 1)
            assert broker.proc.poll() is None, "".join(broker.output[-20:])
            offsets = [m.offset for m in got]
            assert offsets == sorted(set(offsets)) and offsets[-1] == end - 1
            info = admin.describe_group(topic, "g")
            # Retention may pass the group again while it catches up: every offset is delivered or skipped.
            assert info["skipped_by_retention"] == (end - 10) - len(offsets) > 0
            assert skipped(broker, topic, "g") == info["skipped_by_retention"]
    finally:
        sub.close()


def test_nacked_delayed_and_terminated_messages_below_the_start_are_skipped(broker):
    sub = Subscription("held", "g", address=broker.address, credit=15, ack_timeout_ms=60_000, heartbeat_ms=HEARTBEAT_MS)
    try:
        publish_numbered(broker.address, "held", 0, 15)
        held = receive_until(sub, lambda got: len(got) >= 15, ack=False)
        assert [m.offset for m in held] == list(range(15))
        sub.set_credit(0)  # paused: what it holds stays held while retention runs
        sub.nack(held[:5], delay_ms=1500, error="later")
        push_start_past(broker.address, "held", 40, first=15)
        sub.term(held[5:10], reason="bad")  # gone already: nothing to dead-letter
        sub.ack(held[10:])
        sub.set_credit(100)
        with Admin(broker.address) as admin:
            end = admin.describe_topic("held")["end_offset"]
            got = receive_until(sub, lambda got: got and got[-1].offset == end - 1)
            assert broker.proc.poll() is None, "".join(broker.output[-20:])
            offsets = [m.offset for m in got]
            assert offsets == sorted(set(offsets)) and offsets[-1] == end - 1, "each message at most once, in order"
            assert all(m.attempt == 1 for m in got)
            info = admin.describe_group("held", "g")
            # 0-4 nacked, 5-9 terminated, and from 15 on what was not delivered: all deleted unread
            assert info["skipped_by_retention"] == 10 + (end - 15) - len(offsets)
            assert skipped(broker, "held", "g") == info["skipped_by_retention"]
            assert "held.dlq" not in [t["name"] for t in admin.list_topics()]
    finally:
        sub.close()


def test_a_restarted_broker_moves_a_group_below_the_start_on_at_once(broker):
    sub = Subscription("boot", "g", address=broker.address, credit=10, heartbeat_ms=HEARTBEAT_MS)
    assert wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.subscribed, timeout=30)
    sub.close()
    push_start_past(broker.address, "boot", 0, first=0)
    broker.stop()
    # An offsets file older than the retention that ran (a crash before the commit, an older broker).
    path = broker.data_dir / "topics" / "boot" / "groups.json"
    state = json.loads(path.read_text())
    state["g"] = {key: value for key, value in state["g"].items() if key not in ("next_offset", "unsettled")}
    state["g"]["committed_offset"] = 0
    state["g"].pop("skipped_by_retention", None)
    path.write_text(json.dumps(state))
    broker.start()
    with Admin(broker.address) as admin:
        # (retention may run once more after the start, for what the last pass before the stop appended)
        assert wait_for(lambda: admin.describe_group("boot", "g")["committed_offset"] == start_of(admin, "boot"), 30)
        start = start_of(admin, "boot")
        assert admin.describe_group("boot", "g")["skipped_by_retention"] == start > 0
    assert skipped(broker, "boot", "g") == start
    assert wait_for(lambda: any("skipped" in line and "retention" in line for line in broker.output), 10)


def test_reset_and_fetch_below_the_start(broker):
    push_start_past(broker.address, "rf", 0, first=0)
    with Admin(broker.address) as admin:
        start = start_of(admin, "rf")
        assert admin.reset_offsets("rf", "g", 0)["committed_offset"] >= start
        with pytest.raises(OffsetOutOfRange) as caught:
            admin.fetch("rf", 0, 10)
        assert caught.value.fields["start_offset"] >= start
        assert admin.fetch("rf", caught.value.fields["start_offset"], 1)
    assert broker.proc.poll() is None


def test_retention_passing_the_durable_offset_under_interval_fsync(conveyor_broker_factory):
    """Rolls sync sealed segments and retention may delete them before the interval's sync moves the durable offset."""
    broker = conveyor_broker_factory(fsync="interval:1500", extra=SMALL_LOG)
    sub = Subscription("iv", "g", address=broker.address, credit=1000, heartbeat_ms=HEARTBEAT_MS)
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(receive_until(sub, lambda g: g and g[-1].offset == 299)))
    try:
        assert wait_for(lambda: sub.receive(timeout=0.05) == [] and sub.subscribed, timeout=30)
        consumer.start()
        with Admin(broker.address) as admin:
            parked = Admin(broker.address)
            try:
                # A FETCH parked at the durable end, answered after retention passed it.
                parked._sock.send_multipart(_fetch_frame("iv", 0, wait_ms=4000))
                with Producer(broker.address, linger_ms=1, batch_size=10, max_in_flight=64) as producer:
                    futures = [producer.send("iv", {"i": i, "pad": "x" * 80}) for i in range(300)]
                    producer.flush(timeout=30)
                assert [f.result() for f in futures] == list(range(0, 300, 1))
                assert start_of(admin, "iv") > 0
                assert parked._sock.poll(10_000), "the parked FETCH is answered"
            finally:
                parked.close()
            consumer.join(timeout=40)
            assert broker.proc.poll() is None, "".join(broker.output[-20:])
            offsets = [m.offset for m in got]
            assert offsets and offsets[-1] == 299
            assert offsets == sorted(set(offsets))
            assert admin.describe_group("iv", "g")["skipped_by_retention"] == 300 - len(offsets) > 0
    finally:
        consumer.join(timeout=40)
        sub.close()


def _fetch_frame(topic: str, offset: int, *, wait_ms: int) -> list[bytes]:
    from conveyor.broker.wire.protocol import Command, encode

    return encode(Command.FETCH, {"rid": 1, "topic": topic, "offset": offset, "wait_ms": wait_ms})


def test_tail_overtaken_by_retention_goes_on_from_the_start(broker):
    publish_numbered(broker.address, "tl", 0, 10)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    options = ["--broker", broker.address, "--from", "earliest", "--format", "json", "--idle-timeout", "3"]
    tail = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "tail", "tl", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(tail.stdout), daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: len(lines) >= 10, timeout=30), lines
        os.kill(tail.pid, signal.SIGSTOP)  # a slow reader: retention overtakes it
        after = push_start_past(broker.address, "tl", 60, first=10)
        os.kill(tail.pid, signal.SIGCONT)
        tail.wait(timeout=60)
        reader.join(timeout=10)
        err = tail.stderr.read()
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert tail.returncode == 0, err
    printed = [json.loads(line)["offset"] for line in lines if line.strip()]
    assert printed[:10] == list(range(10))
    assert printed[-1] == after - 1
    assert printed == sorted(set(printed))
    assert "retention" in err
    assert broker.proc.poll() is None


def test_a_child_broker_resyncs_past_the_parents_retention(tmp_path, conveyor_broker_factory):
    """A child stopped while its parent's retention moves on resyncs; its groups, parked FETCHes and tails go on."""
    root = conveyor_broker_factory(extra=SMALL_LOG, name="root")
    child_options = ["--upstream", root.address, "--mirror", "mt", "--heartbeat-ms", str(HEARTBEAT_MS)]
    child = conveyor_broker_factory(extra=child_options, name="child")
    publish_numbered(root.address, "mt", 0, 10)
    with Admin(child.address) as admin:
        assert wait_for(lambda: "mt" in [t["name"] for t in admin.list_topics()], timeout=30)
        assert wait_for(lambda: admin.describe_topic("mt")["end_offset"] == 10, timeout=30)
    sub = Subscription("mt", "g", address=child.address, credit=100, heartbeat_ms=HEARTBEAT_MS)
    parked = Admin(child.address)
    try:
        got = receive_until(sub, lambda got: len(got) >= 10)
        assert [m.offset for m in got] == list(range(10))
        parked._sock.send_multipart(_fetch_frame("mt", 200, wait_ms=30_000))  # far ahead: waits
        os.kill(child.pid, signal.SIGSTOP)
        try:
            after = push_start_past(root.address, "mt", 300, first=10)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        assert wait_for(lambda: child.metric("conveyor_mirror_gaps_total", 'topic="mt"') >= 1, timeout=30)
        publish_numbered(root.address, "mt", after, 5)
        with Admin(root.address) as admin:
            end = admin.describe_topic("mt")["end_offset"]
        rest = receive_until(sub, lambda got: got and got[-1].offset == end - 1)
        assert child.proc.poll() is None, "".join(child.output[-20:])
        offsets = [m.offset for m in rest]
        assert offsets and offsets[-1] == end - 1 and offsets == sorted(set(offsets)), offsets[:20]
        assert parked._sock.poll(30_000), "the parked FETCH is answered (data or OFFSET_OUT_OF_RANGE)"
        with Admin(child.address) as admin:
            info = admin.describe_group("mt", "g")
            assert info["skipped_by_retention"] == (end - 10) - len(offsets) > 0, "each message delivered or skipped"
            assert admin.describe_topic("mt")["start_offset"] > 300
    finally:
        parked.close()
        sub.close()
