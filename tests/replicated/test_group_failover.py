"""Consumer groups survive a kill -9 of their topic's leader: offsets, delivery counts, delays, dead letters."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.message import Message
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.test_failover import leader_of

CREDIT = 20


def make_topic(cluster: ClusterProcess, topic: str, messages: int) -> str:
    """A replicated topic holding ``messages`` confirmed messages; its leader."""
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic(topic, replication_factor=3, min_insync_replicas=2)
    leader, _epoch = leader_of(cluster, topic)
    with Producer(cluster.bootstrap, delivery_timeout_ms=60_000) as producer:
        futures = [producer.send(topic, f"m-{i}".encode()) for i in range(messages)]
        producer.flush(60)
        for future in futures:
            future.result(60)
    return leader


def receive_until(subscription: Subscription, done: collections.abc.Callable[[], bool], on: object, timeout: float):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out receiving"
        messages: list[Message] = subscription.receive(timeout=0.5)
        on(messages)  # type: ignore[operator]


def test_a_group_resumes_from_its_committed_offset_after_a_leader_kill(cluster: ClusterProcess) -> None:
    total = 1000
    leader = make_topic(cluster, "jobs", total)
    counts: collections.Counter[bytes] = collections.Counter()
    with Subscription("jobs", "workers", address=cluster.bootstrap, credit=CREDIT) as subscription:

        def take(messages: list[Message]) -> None:
            counts.update(bytes(m.value) for m in messages)
            subscription.ack(messages)

        receive_until(subscription, lambda: len(counts) >= 400, take, 60)
        before = len(counts)
        cluster.node(leader).kill()
        leader_of(cluster, "jobs", other_than=leader)
        receive_until(subscription, lambda: len(counts) >= total, take, 120)
    again = sum(n - 1 for n in counts.values())
    print(f"{before} acked before the kill; {again} delivered again after it (credit {CREDIT})")
    # What was in flight (at most the credit) and the acks not yet recorded (at most the credit): not
    # the 400 messages a group restarting from its start offset would get again.
    assert again <= 2 * CREDIT, f"{again} messages delivered again"


def test_no_message_passes_max_deliveries_across_a_leader_kill(cluster: ClusterProcess) -> None:
    total = 20
    leader = make_topic(cluster, "poison", total)
    counts: collections.Counter[bytes] = collections.Counter()
    attempts: dict[bytes, int] = {}
    with Subscription(
        "poison", "stuck", address=cluster.bootstrap, credit=100, max_deliveries=2, ack_timeout_ms=1500
    ) as subscription:

        def take(messages: list[Message]) -> None:  # never acked: each lease runs out
            for m in messages:
                counts[bytes(m.value)] += 1
                attempts[bytes(m.value)] = max(attempts.get(bytes(m.value), 0), m.attempt)

        receive_until(subscription, lambda: len(counts) == total and min(counts.values()) >= 2, take, 60)
        cluster.node(leader).kill()  # each message delivered twice: the next lease expiry dead-letters it
        leader_of(cluster, "poison", other_than=leader)
        dead: set[bytes] = set()
        with Subscription("poison.dlq", "audit", address=cluster.bootstrap) as dlq:

            def audit(messages: list[Message]) -> None:
                dead.update(bytes(m.value) for m in messages)
                dlq.ack(messages)

            def also_poison() -> None:
                take(subscription.receive(timeout=0.1))

            receive_until(dlq, lambda: len(dead) == total, lambda ms: (audit(ms), also_poison()), 120)
    assert max(counts.values()) <= 2, f"delivered more than max_deliveries: {counts.most_common(3)}"
    assert max(attempts.values()) <= 2
    assert dead == set(counts)


def test_a_delayed_nack_survives_a_leader_kill(cluster: ClusterProcess) -> None:
    leader = make_topic(cluster, "later", 1)
    got: list[tuple[bytes, int, float]] = []  # (value, attempt, when)
    with Subscription("later", "slow", address=cluster.bootstrap, credit=10) as subscription:

        def take(messages: list[Message]) -> None:
            got.extend((bytes(m.value), m.attempt, time.monotonic()) for m in messages)
            subscription.ack([m for m in messages if m.value == b"after-nack"])

        receive_until(subscription, lambda: bool(got), take, 60)
        subscription.nack([0], delay_ms=8000)
        nacked_at = time.monotonic()
        with Producer(cluster.bootstrap) as producer:  # its delivery comes after the nack's record is replicated
            producer.send("later", b"after-nack").result(30)
        receive_until(subscription, lambda: any(v == b"after-nack" for v, _a, _t in got), take, 60)
        cluster.node(leader).kill()
        leader_of(cluster, "later", other_than=leader)
        receive_until(subscription, lambda: any(v == b"m-0" for v, _a, _t in got[1:]), take, 120)
    again = [(a, t) for v, a, t in got[1:] if v == b"m-0"]
    assert [a for a, _t in again] == [2], again
    # Redelivered after its delay, counted once more: not at once, as an in-flight message would be.
    assert again[0][1] - nacked_at >= 7.0, f"redelivered {again[0][1] - nacked_at:.1f} s after an 8 s nack"


def test_a_deleted_group_stays_deleted_after_a_leader_kill(cluster: ClusterProcess) -> None:
    leader = make_topic(cluster, "gone", 10)
    with Subscription("gone", "old", address=cluster.bootstrap, credit=10) as subscription:
        seen: list[Message] = []
        receive_until(subscription, lambda: len(seen) >= 10, lambda ms: (seen.extend(ms), subscription.ack(ms)), 60)
    with Admin(cluster.address(leader)) as admin:
        admin.delete_group("gone", "old")
        assert "old" not in admin.describe_topic("gone").get("groups", [])
    with Subscription("gone", "keep", address=cluster.bootstrap, credit=10) as subscription:  # proves the record
        kept: list[Message] = []
        receive_until(subscription, lambda: len(kept) >= 10, lambda ms: kept.extend(ms), 60)
    cluster.node(leader).kill()
    new_leader, _epoch = leader_of(cluster, "gone", other_than=leader)
    with Admin(cluster.address(new_leader)) as admin:
        groups = admin.describe_topic("gone").get("groups", [])
    assert "keep" in groups and "old" not in groups


def test_dead_letters_reach_their_topic_with_auto_create_off(tmp_path: Path) -> None:
    """A dead-letter topic is made through the controller whatever --auto-create-topics says, as on one node."""
    with ClusterProcess(tmp_path / "cluster", nodes=3, extra=["--no-auto-create-topics"]) as cluster:
        make_topic(cluster, "strict", 5)
        with Subscription(
            "strict", "once", address=cluster.bootstrap, max_deliveries=1, ack_timeout_ms=1000
        ) as subscription:
            seen: list[Message] = []
            receive_until(subscription, lambda: len(seen) >= 5, seen.extend, 60)  # never acked
            dead: list[Message] = []
            with Subscription("strict.dlq", "audit", address=cluster.bootstrap) as dlq:
                receive_until(dlq, lambda: len(dead) >= 5, dead.extend, 60)
        assert sorted(bytes(m.value) for m in dead) == sorted(bytes(m.value) for m in seen)


def test_a_followers_groups_file_follows_the_leaders_group_log(cluster: ClusterProcess) -> None:
    leader = make_topic(cluster, "mirrored", 50)
    with Subscription("mirrored", "readers", address=cluster.bootstrap, credit=10) as subscription:
        seen: list[Message] = []
        receive_until(subscription, lambda: len(seen) >= 50, lambda ms: (seen.extend(ms), subscription.ack(ms)), 60)
        follower = next(node for node in cluster.node_ids if node != leader)
        path = cluster.node(follower).data_dir / "topics" / "mirrored" / "groups.json"

        def committed() -> int:
            try:
                return int(json.loads(path.read_text())["readers"]["committed_offset"])
            except (OSError, ValueError, KeyError):
                return -1

        wait_for(lambda: committed() == 50, timeout=60, message=f"{follower}'s groups.json at offset 50")


def test_a_delayed_message_is_held_back_by_the_new_leader_too(cluster: ClusterProcess) -> None:
    leader = make_topic(cluster, "held", 0)
    with Subscription("held", "g", address=cluster.bootstrap, credit=10) as subscription:
        got: list[Message] = []

        def take(messages: list[Message]) -> None:
            got.extend(messages)
            subscription.ack(messages)

        with Producer(cluster.bootstrap) as producer:
            producer.send("held", b"later", delay=6.0).result(30)
            producer.send("held", b"now").result(30)
        receive_until(subscription, lambda: bool(got), take, 60)
        assert [m.value for m in got] == [b"now"], "the delayed one waits; the later one does not"
        cluster.node(leader).kill()
        leader_of(cluster, "held", other_than=leader)
        receive_until(subscription, lambda: any(m.value == b"later" for m in got), take, 120)
    later = next(m for m in got if m.value == b"later")
    assert later.not_before is not None and time.time() >= later.not_before
    assert later.offset == 0 and later.attempt == 1, "held, never delivered: its first delivery"
