"""etcd away: the cluster keeps serving with the leaders it has, and loses nothing; elections resume after.

While etcd is down nobody can be elected and no ISR can change, so the leader
keeps confirming as long as its in-sync followers keep fetching. When etcd is
back, a kill -9 of the leader must still bring a new leader. ``make test`` runs
a shorter outage (still five leases long); ``make soak`` runs the 30 s the
issue asks for, once with etcd stopped and once with it frozen (SIGSTOP).
"""

from __future__ import annotations

import threading
import time

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.fault_checks import Load, check_replicas, dumped, leader_of, partition, wait_in_sync

FAST_OUTAGE = 5.0  # seconds: two and a half 2 s leases
ISSUE_OUTAGE = 30.0  # seconds: the issue's "etcd stopped for 30 s" (make soak)


class Group:
    """A consumer group reading the topic on a thread; every value it got."""

    def __init__(self, cluster: ClusterProcess, topic: str) -> None:
        self.received: set[bytes] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(cluster.bootstrap, topic), daemon=True)
        self.thread.start()

    def _run(self, bootstrap: str, topic: str) -> None:
        with Subscription(topic, "audit", address=bootstrap, ack_timeout_ms=10_000) as subscription:
            deadline = time.monotonic() + 300
            while not self.stop.is_set() and time.monotonic() < deadline:
                messages = subscription.receive(timeout=0.5)
                self.received.update(bytes(m.value) for m in messages)
                subscription.ack(messages)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def etcd_outage(cluster: ClusterProcess, seconds: float, *, freeze: bool = False) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("events", replication_factor=3, min_insync_replicas=2)
    leader, epoch = leader_of(cluster, "events")
    group = Group(cluster, "events")
    load = Load(cluster, "events").start()
    wait_for(lambda: len(load.confirm_times) > 200, timeout=60, message="confirms before the outage")

    cluster.etcd.pause() if freeze else cluster.etcd.stop()
    down_at = time.monotonic()
    try:
        wait_for(lambda: load.confirmed_since(down_at) > 1000, timeout=60, message="confirms with etcd down")
        during = [value for value, future in load.futures[-200:] if future.done() and not future.exception()]
        wait_for(lambda: set(during) <= group.received, timeout=60, message="the group to get what etcd-less confirms")
        time.sleep(max(0.0, seconds - (time.monotonic() - down_at)))  # the fault's length, not a wait
        during_outage = load.confirmed_since(down_at)
        same = partition(cluster, "events")
        assert same is not None and (same.leader, same.leader_epoch) == (leader, epoch)
    finally:
        cluster.etcd.resume() if freeze else cluster.etcd.start()
    up_at = time.monotonic()
    print(f"\netcd {'frozen' if freeze else 'stopped'} for {up_at - down_at:.1f} s: {during_outage} confirms meanwhile")

    wait_for(lambda: set(cluster.node_ids) <= cluster.registered(), timeout=60, message="every node registered again")
    registered_after = time.monotonic() - up_at
    wait_for(lambda: load.confirmed_since(up_at) > 200, timeout=60, message="confirms after etcd came back")
    after = partition(cluster, "events")  # a frozen etcd expires every lease when it resumes: still no change
    assert after is not None and (after.leader, after.leader_epoch) == (leader, epoch), after
    confirmed = load.finish()
    leader, epoch = leader_of(cluster, "events")

    # Elections work again: kill -9 the leader (the load is settled first: a producer's resends across a
    # failover are the kill-under-load test's subject, test_failover.py).
    cluster.node(leader).kill()
    killed_at = time.monotonic()
    others = [node for node in cluster.node_ids if node != leader]
    new_leader, new_epoch = leader_of(cluster, "events", other_than=leader, asking=others)
    elected_after = time.monotonic() - killed_at
    assert new_epoch > epoch
    with Producer(cluster.bootstrap, delivery_timeout_ms=120_000) as producer:
        for i in range(20):
            value = f"after-kill-{i}".encode()
            offset = producer.send("events", value).result(120)
            assert offset not in confirmed
            confirmed[offset] = value
    first = time.monotonic() - killed_at
    cluster.node(leader).restart(kill=True)
    wait_in_sync(cluster, "events", leader)
    wait_for(lambda: set(confirmed.values()) <= group.received, timeout=120, message="the group to get everything")
    group.close()
    print(
        f"etcd back: every node registered {registered_after:.2f} s after; after kill -9 of {leader}, "
        f"{new_leader} leads (epoch {new_epoch}) {elected_after:.2f} s later, 20 confirmed by {first:.2f} s; "
        f"{len(confirmed)} confirmed"
    )
    cluster.stop()
    print(f"etcd: records per replica {check_replicas(cluster, 'events', confirmed)}")


def test_etcd_stopped_the_cluster_keeps_serving_and_elects_again_after(cluster: ClusterProcess) -> None:
    with dumped(cluster):
        etcd_outage(cluster, FAST_OUTAGE)


@pytest.mark.soak
@pytest.mark.parametrize("freeze", [False, True], ids=["stopped", "frozen"])
def test_soak_etcd_away_for_30_s(cluster: ClusterProcess, freeze: bool) -> None:
    with dumped(cluster):
        etcd_outage(cluster, ISSUE_OUTAGE, freeze=freeze)
