"""Three real brokers in this process replicate a partition; their roles are set directly (no etcd yet).

The oracle: every confirmed message is at the same offset on every replica, the
segments are byte-identical, and a confirm comes only once every in-sync replica
reported the batch durable (and only with ``min_insync_replicas`` of them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import zmq
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.cluster.keys import PartitionState
from conveyor.broker.server.group_log import group_log_name, replay
from conveyor.broker.server.partition_status import describe_partition
from conveyor.broker.server.partitions import Role
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode, error_from_header

from conveyor.errors import NotLeader
from tests.helpers import stays_false, wait_for
from tests.replication.cluster_helpers import Node, batch, follow, lead, request

TOPIC = "orders"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    made = {name: Node(name, tmp_path / name, lag_max_ms=1000) for name in "abc"}
    for node in made.values():
        node.start()
    yield made
    for node in made.values():
        node.stop()


def replicate_from_a(nodes: dict[str, Node], *, min_insync: int = 2, followers: str = "bc") -> None:
    a = nodes["a"]
    lead(a, TOPIC, epoch=1, replicas=["a", "b", "c"], isr=["a", "b", "c"], min_insync=min_insync)
    for name in followers:
        follow(nodes[name], TOPIC, a, epoch=1)


def send(address: str, count: int, start: int = 0) -> list[Future[int]]:
    with Producer(address, linger_ms=1, batch_size=500, delivery_timeout_ms=120_000) as producer:
        futures = [producer.send(TOPIC, f"message {i}".encode()) for i in range(start, start + count)]
        producer.flush(timeout=60)
    return futures


def caught_up(node: Node, end: int) -> bool:
    return node.log_offsets(TOPIC) == (end, end)


def test_three_replicas_hold_byte_identical_segments_of_10000_messages(nodes: dict[str, Node]) -> None:
    replicate_from_a(nodes)
    futures = send(nodes["a"].address, 10_000)
    assert [f.result(timeout=60) for f in futures] == list(range(10_000))
    for name in "bc":
        wait_for(lambda name=name: caught_up(nodes[name], 10_000), message=f"{name} holds all 10,000 durably")
    assert nodes["a"].on_loop(lambda: nodes["a"].partitions.hw(TOPIC)) == 10_000
    described = nodes["a"].on_loop(lambda: describe_partition(nodes["a"].partitions, nodes["a"].broker.store, TOPIC))
    assert described["high_watermark"] == 10_000 and described["isr"] == ["a", "b", "c"]
    assert nodes["a"].on_loop(lambda: nodes["a"].partitions.successors()) == {(TOPIC, 0): "b"}
    followed = nodes["b"].on_loop(lambda: describe_partition(nodes["b"].partitions, nodes["b"].broker.store, TOPIC))
    assert followed["role"] == "follower" and followed["leader"] == "a" and followed["truncations"] == 0
    first = nodes["b"].on_loop(lambda: nodes["b"].broker.store.topic(TOPIC).read(0)[0])
    assert first.leader_epoch == 1 and first.producer_id >= 0 and first.sequence == 0  # the leader's header, kept
    for node in nodes.values():
        node.stop()
    leader = nodes["a"].segments(TOPIC)
    assert leader and sum(len(b) for b in leader.values()) > 10_000 * 10
    assert nodes["b"].segments(TOPIC) == leader
    assert nodes["c"].segments(TOPIC) == leader


def test_a_confirm_waits_for_every_in_sync_replica_and_for_min_insync(nodes: dict[str, Node]) -> None:
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    for node in (a, b, c):
        node.write_isr = False  # the "agent" writes nothing: c stays in the ISR although it never fetches
    replicate_from_a(nodes, min_insync=3, followers="b")
    with Producer(a.address, linger_ms=1, delivery_timeout_ms=120_000) as producer:
        future = producer.send(TOPIC, b"held")
        wait_for(lambda: caught_up(b, 1), message="b holds the message durably")
        stays_false(future.done, 2.0, message="a confirm while c (in the ISR) has not got the message")
        # The agent writes the shrink c's lag asked for: with min_insync 3, still no confirm.
        wait_for(lambda: a.proposed, message="a proposes dropping c")
        assert a.proposed[0].isr == ("a", "b") and a.proposed[0].shrink
        a.on_loop(lambda: a.partitions.isr_written(TOPIC, 0, ("a", "b")))
        stays_false(future.done, 1.0, message="a confirm with 2 in-sync replicas and min_insync 3")
        # min_insync 2 (the same epoch, a new config): the confirm comes.
        lead(a, TOPIC, epoch=1, replicas=["a", "b", "c"], isr=["a", "b"], min_insync=2)
        assert future.result(timeout=30) == 0
        producer.flush(timeout=30)


def test_a_follower_restarted_behind_catches_up_and_rejoins_the_isr(nodes: dict[str, Node]) -> None:
    a, c = nodes["a"], nodes["c"]
    replicate_from_a(nodes)
    assert [f.result(timeout=60) for f in send(a.address, 1000)] == list(range(1000))
    wait_for(lambda: caught_up(c, 1000), message="c holds the first 1000")
    c.stop()
    # c lags: once it is out of the ISR (1 s), a and b confirm without it.
    assert [f.result(timeout=60) for f in send(a.address, 2000, 1000)] == list(range(1000, 3000))
    assert "c" not in a.on_loop(lambda: set(a.partitions.check_leader(TOPIC).isr))
    c.start()
    follow(c, TOPIC, a, epoch=1)
    wait_for(lambda: caught_up(c, 3000), message="c caught up after its restart")
    wait_for(lambda: "c" in a.on_loop(lambda: set(a.partitions.check_leader(TOPIC).isr)), message="c back in the ISR")
    for node in nodes.values():
        node.stop()
    assert c.segments(TOPIC) == a.segments(TOPIC) == nodes["b"].segments(TOPIC)


def test_a_follower_answers_publish_and_subscribe_with_not_leader_naming_the_leader(nodes: dict[str, Node]) -> None:
    replicate_from_a(nodes)
    b = nodes["b"]
    assert b.on_loop(lambda: b.partitions.role(TOPIC)) is Role.FOLLOWER
    for frames in (commands.publish(TOPIC, batch(b"x"), rid=1), commands.subscribe(1, TOPIC, "g", rid=2)):
        answer = request(b.address, frames)
        assert answer.command is Command.ERROR
        error = error_from_header(answer.header)
        assert isinstance(error, NotLeader)
        assert error.fields["leader"] == "a" and error.fields["leader_addr"] == nodes["a"].address
        assert error.fields["leader_epoch"] == 1
    assert b.log_offsets(TOPIC) == (0, 0)


def test_a_publish_below_min_insync_is_refused_and_appends_nothing(nodes: dict[str, Node]) -> None:
    a = nodes["a"]
    lead(a, TOPIC, epoch=1, replicas=["a", "b", "c"], isr=["a", "b"], min_insync=3)
    answer = request(a.address, commands.publish(TOPIC, batch(b"x"), rid=1))
    assert error_from_header(answer.header).name == "NOT_ENOUGH_REPLICAS"
    assert a.log_offsets(TOPIC) == (0, 0)


def test_an_old_leaders_unreplicated_tail_is_truncated_when_it_follows_the_new_leader(
    nodes: dict[str, Node],
) -> None:
    a, b = nodes["a"], nodes["b"]
    for node in (a, b):
        node.write_isr = False
    lead(a, TOPIC, epoch=1, replicas=["a", "b"], isr=["a", "b"], min_insync=1)
    follow(b, TOPIC, a, epoch=1)
    for i in range(3):
        answer = request(a.address, commands.publish(TOPIC, batch(b"kept %d" % i, b"kept"), rid=i))
        assert answer.command is Command.PUBLISHED
    wait_for(lambda: caught_up(b, 6), message="b holds the first 6 durably")
    b.on_loop(lambda: b.partitions.stop(TOPIC))  # b stops fetching: what a appends now only a holds
    with contextlib.closing(zmq.Context.instance().socket(zmq.DEALER)) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(a.address)
        sock.send_multipart(commands.publish(TOPIC, batch(b"lost 1", b"lost 2", b"lost 3"), rid=9))
        wait_for(lambda: a.log_offsets(TOPIC) == (9, 9), message="a appended a tail b never saw")
        # b becomes the leader of epoch 2 (a was cut off), a its follower: a's confirm is NOT_LEADER.
        lead(b, TOPIC, epoch=2, replicas=["a", "b"], isr=["b"], min_insync=1)
        follow(a, TOPIC, b, epoch=2)
        assert sock.poll(30_000)
        assert error_from_header(decode(sock.recv_multipart()).header).name == "NOT_LEADER"
    answer = request(b.address, commands.publish(TOPIC, batch(b"new"), rid=10))
    assert answer.command is Command.PUBLISHED and answer.get("base_offset") == 6
    wait_for(lambda: caught_up(a, 7), message="a truncated its tail and copied b's")
    assert a.on_loop(lambda: a.partitions.replicas.followed(TOPIC, 0)).truncations == 1
    for node in nodes.values():
        node.stop()
    assert a.segments(TOPIC) == b.segments(TOPIC)


def test_followers_that_sync_on_an_interval_report_their_durable_end_after_the_sync(tmp_path: Path) -> None:
    made = {name: Node(name, tmp_path / name, fsync="batch" if name == "a" else "interval:200") for name in "abc"}
    for node in made.values():
        node.start()
    try:
        replicate_from_a(made)
        assert [f.result(timeout=60) for f in send(made["a"].address, 2000)] == list(range(2000))
        for name in "bc":
            wait_for(lambda name=name: caught_up(made[name], 2000), message=f"{name} holds all 2000 durably")
    finally:
        for node in made.values():
            node.stop()
    assert made["b"].segments(TOPIC) == made["c"].segments(TOPIC) == made["a"].segments(TOPIC)


def test_a_failover_driven_by_partition_records_keeps_every_confirmed_message(nodes: dict[str, Node]) -> None:
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    addresses = {name: node.address for name, node in nodes.items()}

    def apply(node: Node, state: PartitionState) -> Role:
        return node.on_loop(lambda: node.partitions.apply_state(TOPIC, 0, state, min_insync=2, addresses=addresses))

    first = PartitionState(("a", "b", "c"), "a", 1, ("a", "b", "c"))
    assert [apply(node, first) for node in (a, b, c)] == [Role.LEADER, Role.FOLLOWER, Role.FOLLOWER]
    assert [f.result(timeout=60) for f in send(a.address, 1000)] == list(range(1000))
    a.stop()  # the leader dies; the controller elects b from the ISR
    second = PartitionState(("a", "b", "c"), "b", 2, ("b", "c"))
    assert [apply(node, second) for node in (b, c)] == [Role.LEADER, Role.FOLLOWER]
    assert [f.result(timeout=60) for f in send(b.address, 1000, 1000)] == list(range(1000, 2000))
    a.start()  # back, behind: it follows the new leader and catches up
    addresses["a"] = a.address
    assert apply(a, second) is Role.FOLLOWER
    wait_for(lambda: caught_up(a, 2000), message="the old leader caught up with the new one")
    wait_for(lambda: "a" in b.on_loop(lambda: set(b.partitions.check_leader(TOPIC).isr)), message="a back in the ISR")
    for node in nodes.values():
        node.stop()
    assert a.segments(TOPIC) == b.segments(TOPIC) == c.segments(TOPIC)


def test_a_resend_to_the_new_leader_is_answered_with_the_offsets_the_old_leader_gave(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    lead(a, TOPIC, epoch=1, replicas=["a", "b"], isr=["a", "b"], min_insync=2)
    follow(b, TOPIC, a, epoch=1)
    body = batch(b"one", b"two", b"three")
    first = request(a.address, commands.publish(TOPIC, body, pid=77, seq=0, rid=1))
    assert first.command is Command.PUBLISHED and first.get("base_offset") == 0
    request(a.address, commands.publish(TOPIC, batch(b"four"), pid=77, seq=1, rid=2))
    a.stop()
    lead(b, TOPIC, epoch=2, replicas=["a", "b"], isr=["b"], min_insync=1)
    again = request(b.address, commands.publish(TOPIC, body, pid=77, seq=0, rid=3))
    assert again.command is Command.PUBLISHED
    assert (again.get("base_offset"), again.get("duplicate")) == (0, True)
    assert b.log_offsets(TOPIC) == (4, 4)


def test_a_delivery_is_counted_with_its_messages_and_leaves_once_both_logs_pass_hw(nodes: dict[str, Node]) -> None:
    """The group-log record counting a DELIVER replicates in the same round as the messages it delivers."""
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    for node in (a, b, c):
        node.write_isr = False  # c stays in the ISR although it never fetches: neither HW passes what b holds
    replicate_from_a(nodes, followers="b")
    groups = group_log_name(TOPIC)

    def counted_on_b() -> bool:
        log_ = b.broker.store.logs.get(groups)
        states = replay(log_) if log_ is not None and log_.durable_offset == log_.end_offset else None
        return bool(states) and states.get("billing", {}).get("next_offset") == 1

    with Subscription(TOPIC, "billing", address=a.address, credit=10) as subscription:
        wait_for(lambda: a.on_loop(lambda: (TOPIC, "billing") in a.broker.groups), message="the group on a")
        with Producer(a.address, linger_ms=1, delivery_timeout_ms=120_000) as producer:
            future = producer.send(TOPIC, b"early")
            # Planned while the message is above HW: b holds the record counting it, durably.
            wait_for(lambda: b.on_loop(counted_on_b), message="b holds the record counting the delivery")
            # The record passes its log's HW (its ISR without c), the message not: no DELIVER yet.
            a.on_loop(lambda: a.partitions.isr_written(groups, 0, ("a", "b")))
            wait_for(
                lambda: a.on_loop(lambda: a.partitions.hw(groups) == a.broker.store.topic(groups).end_offset),
                message="the group log's HW passes the record",
            )
            assert subscription.receive(timeout=1.0) == []
            assert not future.done()
            a.on_loop(lambda: a.partitions.isr_written(TOPIC, 0, ("a", "b")))
            assert future.result(timeout=30) == 0
            got = []
            wait_for(lambda: got.extend(subscription.receive(timeout=0.2)) or bool(got), message="the delivery")
            assert [bytes(m.value) for m in got] == [b"early"]


def test_a_confirm_hw_allows_leaves_before_the_fsync_of_new_appends_in_the_same_pass(nodes: dict[str, Node]) -> None:
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    for node in (a, b, c):
        node.write_isr = False  # c stays in the ISR although it never fetches: HW stays at 0
    replicate_from_a(nodes, followers="b")
    with contextlib.closing(zmq.Context.instance().socket(zmq.DEALER)) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(a.address)
        sock.send_multipart(commands.publish(TOPIC, batch(b"first"), rid=1))
        wait_for(lambda: caught_up(b, 1), message="b holds the first message durably")
        owed_at_sync: list[int] = []

        def one_pass() -> None:
            # In one pass: a new publish is appended, and the ISR loses c, so HW passes the first message.
            a.broker.store.topic(TOPIC).append(batch(b"second"), 1, leader_epoch=1)
            a.broker.appended.add(TOPIC)
            store, sync = a.broker.store, a.broker.store.sync
            store.sync = lambda **kw: (owed_at_sync.append(len(a.broker.confirms)), sync(**kw))[1]  # type: ignore[method-assign]
            try:
                a.partitions.isr_written(TOPIC, 0, ("a", "b"))
                a.broker._group_commit()
            finally:
                del store.sync

        a.on_loop(one_pass)
        assert owed_at_sync and owed_at_sync[0] == 0, "the first message's confirm waited for the second's fsync"
        assert sock.poll(30_000)
        answer = decode(sock.recv_multipart())
        assert answer.command is Command.PUBLISHED and answer.get("rid") == 1


def test_a_leader_not_in_place_yet_is_quiet_for_a_moment_then_warned_about(
    nodes: dict[str, Node], caplog: pytest.LogCaptureFixture
) -> None:
    # Given b following a, which holds the topic but does not lead it (yet): replica FETCHes get NOT_LEADER
    a, b = nodes["a"], nodes["b"]
    a.on_loop(lambda: a.broker.store.create_topic(TOPIC))
    b.on_loop(lambda: setattr(b.partitions.replicas, "quiet_seconds", 1.0))

    def answers(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and f"FETCH {TOPIC}/0" in r.getMessage()]

    caplog.set_level(logging.WARNING, logger="conveyor.fetcher")
    with caplog.at_level(logging.DEBUG, logger="conveyor.replica"):
        follow(b, TOPIC, a, epoch=1)

        # Then the first answer is logged at debug only (a leadership moving is normal for a moment)
        first = wait_for(lambda: answers(logging.DEBUG), message="a NOT_LEADER answer at debug")
        assert "NOT_LEADER" in first[0] and not answers(logging.WARNING)

        # And once the answers go on past the quiet time, at warning
        warned = wait_for(lambda: answers(logging.WARNING), message="the NOT_LEADER answers at warning")
        assert "NOT_LEADER" in warned[0]

        # And b asks again after each answer (RETRY_AFTER), not only when its link has been silent long enough
        # to be reconnected (a follower waiting that long would hold its leader's HW back)
        wait_for(lambda: len(answers(logging.DEBUG) + answers(logging.WARNING)) >= 5, message="five answers")
    reconnects = [r.getMessage() for r in caplog.records if "no answer for" in r.getMessage()]
    assert not reconnects


def test_a_caught_up_follower_has_its_next_fetch_parked_at_the_leader_while_it_syncs(nodes: dict[str, Node]) -> None:
    """What the leader appends during a follower's sync goes at once; the sync's report moves HW."""
    a, b = nodes["a"], nodes["b"]
    replicate_from_a(nodes)
    assert request(a.address, commands.publish(TOPIC, batch(b"first"), rid=1)).command is Command.PUBLISHED
    wait_for(lambda: caught_up(b, 1), message="b holds the first message durably")
    syncing = threading.Event()
    go_on = threading.Event()
    store, sync = b.broker.store, b.broker.store.sync

    def slow_sync(**kw: Any) -> None:  # b's loop waits here once it holds the second message
        if store.topic(TOPIC).end_offset >= 2 and not go_on.is_set():
            syncing.set()
            go_on.wait(30)
        sync(**kw)

    b.on_loop(lambda: setattr(store, "sync", slow_sync))
    with contextlib.closing(zmq.Context.instance().socket(zmq.DEALER)) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(a.address)
        sock.send_multipart(commands.publish(TOPIC, batch(b"second"), rid=2))
        try:
            assert syncing.wait(30), "b syncs the second message"

            def parked_from_b() -> bool:
                waits = a.broker.fetches.by_topic.get(TOPIC, [])
                return any(w.replica and w.frame.get("replica") == "b" and w.offset == 2 for w in waits)

            wait_for(lambda: a.on_loop(parked_from_b), message="b's next FETCH parked at a during b's sync")
            assert a.on_loop(lambda: a.partitions.hw(TOPIC)) == 1  # b has not reported the second durable
        finally:
            go_on.set()
        assert sock.poll(30_000)
        answer = decode(sock.recv_multipart())
        assert answer.command is Command.PUBLISHED and answer.get("rid") == 2
    b.on_loop(lambda: store.__dict__.pop("sync", None))
    wait_for(lambda: a.on_loop(lambda: a.partitions.hw(TOPIC)) == 2, message="HW passes the second message")
