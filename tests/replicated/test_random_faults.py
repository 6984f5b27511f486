"""A randomized fault schedule against a three-node cluster, checked by an oracle.

Faults: kill -9 of the leader or of a follower, SIGSTOP longer than the lease
(a zombie) then SIGCONT, SIGTERM restarts, and kill -9 restarts of etcd. A
producer publishes throughout and a consumer group reads throughout. After the
schedule the oracle checks, with every broker stopped and its log read from
disk: every confirmed message is present once, at its confirmed offset, on
every replica that is in the in-sync set; no offset holds two different
values on two replicas; every confirmed message reached the group at least
once. Duplicates in the group are counted and printed (redeliveries after a
failover: at-least-once).

``make soak`` runs 50 faults; ``make test`` runs a slice of 3.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.replica_logs import records

TOPIC = "chaos"


def partition(cluster: ClusterProcess):  # type: ignore[no-untyped-def]
    try:
        return Metadata(cluster.bootstrap, timeout=2.0).refresh([TOPIC]).topics.get(TOPIC, {}).get(0)
    except Exception:  # every node busy or down for a moment
        return None


def healthy(cluster: ClusterProcess) -> bool:
    info = partition(cluster)
    return info is not None and info.leader is not None and len(info.isr) == len(cluster.node_ids)


class Traffic:
    """A producer and a consumer group on threads, bounded in time; what each confirmed and received."""

    def __init__(self, cluster: ClusterProcess, seconds: float) -> None:
        self.cluster = cluster
        self.deadline = time.monotonic() + seconds
        self.stop = threading.Event()
        self.confirmed: dict[int, bytes] = {}
        self.duplicate_offsets: list[int] = []
        self.failed: list[BaseException] = []
        self.received: list[bytes] = []  # appended by the consumer thread; read as a copy
        self.threads = [threading.Thread(target=self._produce), threading.Thread(target=self._consume)]
        for thread in self.threads:
            thread.daemon = True
            thread.start()

    def _produce(self) -> None:
        with Producer(self.cluster.bootstrap, linger_ms=2, delivery_timeout_ms=300_000) as producer:
            n = 0
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                value = f"m{n}".encode()
                producer.send(TOPIC, value).add_done_callback(lambda f, v=value: self._done(f, v))
                n += 1
                if n % 50 == 0:
                    self.stop.wait(0.01)  # about 5,000 msg/s at most
            producer.flush(300)

    def _done(self, future, value: bytes) -> None:  # type: ignore[no-untyped-def]
        error = future.exception()
        if error is not None:
            self.failed.append(error)
            return
        offset = future.result()
        if offset in self.confirmed:
            self.duplicate_offsets.append(offset)
        self.confirmed[offset] = value

    def _consume(self) -> None:
        with Subscription(TOPIC, "oracle", address=self.cluster.bootstrap, ack_timeout_ms=5000) as subscription:
            while not self.stop.is_set() and time.monotonic() < self.deadline + 300:
                messages = subscription.receive(timeout=0.5)
                self.received.extend(bytes(m.value) for m in messages)
                subscription.ack(messages)

    def finish(self) -> None:
        self.threads[0].join(400)
        confirmed = set(self.confirmed.values())
        wait_for(lambda: confirmed <= set(list(self.received)), timeout=300, message="the group to get every one")
        self.stop.set()
        self.threads[1].join(60)


def inject(cluster: ClusterProcess, rng: random.Random, lease_s: float) -> str:
    """One fault, then its repair; returns what it was."""
    info = partition(cluster)
    leader = info.leader if info is not None and info.leader else rng.choice(cluster.node_ids)
    followers = [n for n in cluster.node_ids if n != leader]
    kind = rng.choice(["kill_leader", "kill_follower", "zombie_leader", "restart_leader", "etcd_kill", "kill_leader"])
    if kind == "kill_leader":
        cluster.node(leader).kill()
        wait_for(lambda: (p := partition(cluster)) is not None and p.leader not in (None, leader), timeout=60)
        cluster.node(leader).start()
    elif kind == "kill_follower":
        victim = rng.choice(followers)
        cluster.node(victim).kill()
        time.sleep(rng.uniform(0.2, 2.0))  # the fault lasts a while: publishes go on meanwhile
        cluster.node(victim).start()
    elif kind == "zombie_leader":
        cluster.node(leader).signal(signal.SIGSTOP)
        time.sleep(lease_s * 2.5)  # longer than its lease: the others elect a new leader
        cluster.node(leader).signal(signal.SIGCONT)
    elif kind == "restart_leader":
        cluster.node(leader).stop()
        cluster.node(leader).start()
    else:
        cluster.etcd.restart(kill=True, down_for=rng.uniform(0.2, 3.0))
    return f"{kind} ({leader} led)"


def run_schedule(tmp_path: Path, faults: int, seed: int) -> None:
    lease_s = 2.0
    cluster = ClusterProcess(tmp_path / "cluster", nodes=3).start()
    try:
        with Admin(cluster.bootstrap) as admin:
            admin.create_topic(TOPIC, replication_factor=3, min_insync_replicas=2)
        wait_for(lambda: healthy(cluster), timeout=60, message="a full in-sync set")
        rng = random.Random(seed)
        traffic = Traffic(cluster, seconds=faults * 12 + 30)
        done: list[str] = []
        for _ in range(faults):
            done.append(inject(cluster, rng, lease_s))
            wait_for(lambda: healthy(cluster), timeout=120, message=f"recovery after {done[-1]}")
        traffic.deadline = time.monotonic()  # stop publishing now
        traffic.finish()
        wait_for(lambda: healthy(cluster), timeout=120, message="a full in-sync set at the end")
    except BaseException:
        for node, broker in cluster.brokers.items():  # what each node said, for the failure's report
            print(
                f"== {node}\n"
                + "".join(
                    line
                    for line in broker.output[-400:]
                    if " INFO " not in line[:40] or "conveyor.partitions" in line or "conveyor.cluster" in line
                )[-6000:]
            )
        raise
    finally:
        cluster.stop() if all(b.proc and b.proc.poll() is None for b in cluster.brokers.values()) else cluster.kill()

    print(f"seed {seed}: {len(done)} faults: {Counter(d.split()[0] for d in done)}")
    assert not traffic.failed, traffic.failed[:3]
    assert not traffic.duplicate_offsets, f"offsets confirmed twice: {traffic.duplicate_offsets[:10]}"
    logs = {node: records(cluster.node(node).data_dir, TOPIC) for node in cluster.node_ids}
    for node, held in logs.items():
        offsets = [offset for offset, _ in held]
        assert offsets == sorted(set(offsets)), f"{node}: an offset twice or out of order"
        as_map = dict(held)
        lost = [o for o, v in traffic.confirmed.items() if as_map.get(o) != v]
        assert not lost, f"{node} lost or changed {len(lost)} confirmed offsets, first {sorted(lost)[:5]}"
    shortest = min(len(held) for held in logs.values())
    prefixes = {tuple(held[:shortest]) for held in logs.values()}
    assert len(prefixes) == 1, "two replicas hold different records at the same offset"
    values = [v for v in traffic.confirmed.values()]
    assert len(set(values)) == len(values), "a message confirmed at two offsets"
    counts = Counter(traffic.received)
    duplicates = sum(count - 1 for count in counts.values() if count > 1)
    print(
        f"confirmed {len(traffic.confirmed):,}, received {len(traffic.received):,} "
        f"({duplicates:,} redeliveries after failovers)"
    )


def test_a_few_random_faults_lose_no_confirmed_message(tmp_path: Path) -> None:
    run_schedule(tmp_path, faults=3, seed=int(os.environ.get("CONVEYOR_CHAOS_SEED", "17")))


@pytest.mark.soak
def test_fifty_random_faults_lose_no_confirmed_message(tmp_path: Path) -> None:
    run_schedule(tmp_path, faults=50, seed=int(os.environ.get("CONVEYOR_CHAOS_SEED", str(int(time.time())))))
