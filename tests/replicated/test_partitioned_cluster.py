"""A partitioned topic in a cluster: 8 partitions over three real brokers on a real etcd.

Each partition is a replicated unit of its own (leader, epoch, in-sync set), and
the controller spreads their leaders over the nodes. Producers send each
partition's batches to its leader; a consumer group's members subscribe to each
partition at its leader. What must hold: every partition has a leader and each
node leads some; per-key order for 1,000 keys from four producers; a group of
four gets every message of every partition; with etcd stopped the partitions
keep serving; kill -9 of one node loses no confirmed message and pauses only
the partitions it led, while the others keep confirming.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import InvalidRequest, NotEnoughReplicas
from tests.helpers import wait_for

PARTITIONS = 8
LEASE_MS = 4000  # a dead leader's partitions wait this long for a new one: the window the test looks in


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    nodes = ClusterProcess(tmp_path_factory.mktemp("partitioned") / "cluster", nodes=3, lease_ms=LEASE_MS).start()
    try:
        yield nodes
    finally:
        nodes.kill()


def leaders(cluster: ClusterProcess, topic: str, *, asking: str | None = None) -> dict[int, str]:
    """Each partition's leader, once every partition has one and three in-sync replicas."""

    def known() -> dict[int, str] | None:
        view = Metadata(asking or cluster.bootstrap).refresh([topic])
        parts = view.topics.get(topic, {})
        if len(parts) != PARTITIONS or any(p.leader is None or len(p.isr) < 3 for p in parts.values()):
            return None
        return {number: str(p.leader) for number, p in parts.items()}

    return wait_for(known, timeout=60, message=f"{topic}'s {PARTITIONS} partitions to have leaders")


def create(cluster: ClusterProcess, topic: str) -> dict[int, str]:
    with Admin(cluster.bootstrap) as admin:
        made = admin.create_topic(topic, partitions=PARTITIONS, replication_factor=3, min_insync_replicas=2)
    assert made["partition_count"] == len(made["partitions"]) == PARTITIONS  # a single broker's shape
    return leaders(cluster, topic)


def stored(cluster: ClusterProcess, topic: str) -> dict[int, list[tuple[str, bytes]]]:
    """Every partition's (key, value) pairs in log order, each read from its leader."""
    out: dict[int, list[tuple[str, bytes]]] = {}
    with Admin(cluster.bootstrap) as admin:
        for partition in range(PARTITIONS):
            rows: list[tuple[str, bytes]] = []
            while True:
                got = admin.fetch(topic, len(rows), 10_000, partition=partition)
                if not got:
                    break
                rows += [(str(m.key), bytes(m.value)) for m in got]
            out[partition] = rows
    return out


OPEN: list[Members] = []


@pytest.fixture(autouse=True)
def no_member_outlives_its_test() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()  # also after a failed assert: the next test's group starts alone


class Members:
    """``count`` members of one group, each a Subscription on a thread: every (partition, offset, value) got."""

    def __init__(self, cluster: ClusterProcess, topic: str, count: int = 4) -> None:
        self.got: list[Counter[tuple[int, int, bytes]]] = [Counter() for _ in range(count)]
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(cluster.bootstrap, topic, i), daemon=True) for i in range(count)
        ]
        for thread in self.threads:
            thread.start()
        OPEN.append(self)

    def _run(self, bootstrap: str, topic: str, index: int) -> None:
        with Subscription(topic, "audit", address=bootstrap, credit=200, ack_timeout_ms=10_000) as subscription:
            deadline = time.monotonic() + 240
            while not self.stop.is_set() and time.monotonic() < deadline:
                messages = subscription.receive(timeout=0.5)
                self.got[index].update((m.partition, m.offset, bytes(m.value)) for m in messages)
                subscription.ack(messages)

    def values(self) -> set[bytes]:
        return {value for got in self.got for (_p, _o, value) in list(got)}  # list(): one C call, members add on

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def send_keyed(cluster: ClusterProcess, topic: str, producer_index: int, keys: int, rounds: int) -> list[bytes]:
    """``rounds`` values for each of this producer's ``keys`` keys, in order; the values confirmed."""
    confirmed = []
    with Producer(cluster.bootstrap, delivery_timeout_ms=120_000) as producer:
        futures = []
        for r in range(rounds):
            for k in range(keys):
                key = f"p{producer_index}-k{k}"
                futures.append(producer.send(topic, f"{key}:{r}".encode(), key=key))
        producer.flush(120)
        for future in futures:
            future.result(120)
        confirmed = [f"p{producer_index}-k{k}:{r}".encode() for r in range(rounds) for k in range(keys)]
    return confirmed


def check_key_order(partitions: dict[int, list[tuple[str, bytes]]]) -> int:
    """Each key's values are in one partition, in the order they were sent, none missing; the key count."""
    seen: dict[str, int] = {}
    home: dict[str, int] = {}
    for partition, rows in partitions.items():
        for key, value in rows:
            assert home.setdefault(key, partition) == partition, f"{key} in partitions {home[key]} and {partition}"
            number = int(value.decode().rsplit(":", 1)[1])
            assert number == seen.get(key, -1) + 1, f"{key}: {number} after {seen.get(key)}"
            seen[key] = number
    return len(seen)


def test_leaders_spread_key_order_and_a_group_of_four_over_8_partitions(cluster: ClusterProcess) -> None:
    led = create(cluster, "orders")
    per_node = Counter(led.values())
    assert set(per_node) == set(cluster.node_ids) and max(per_node.values()) - min(per_node.values()) <= 1, led

    members = Members(cluster, "orders")
    results: list[list[bytes]] = [[] for _ in range(4)]

    def produce(index: int) -> None:
        results[index] = send_keyed(cluster, "orders", index, keys=250, rounds=5)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    confirmed = {value for values in results for value in values}
    assert len(confirmed) == 4 * 250 * 5

    partitions = stored(cluster, "orders")
    assert all(partitions.values()), "a partition got nothing"
    assert check_key_order(partitions) == 1000
    wait_for(lambda: confirmed <= members.values(), timeout=60, message="the group to get every message")
    members.close()
    assert all(members.got), "a member of four got nothing"
    with Admin(cluster.bootstrap) as admin:
        described = admin.describe_topic("orders")
        assert [row["partition"] for row in described["partitions"]] == list(range(PARTITIONS))
        assert described["end_offset"] == len(confirmed)
        group = admin.describe_group("orders", "audit")
        assert len(group["partitions"]) == PARTITIONS
    for partition, leader in led.items():  # each partition's own series name it by topic and partition
        labels = f'partition="{partition}",topic="orders"'
        assert [cluster.node(n).metric("conveyor_partition_leader", labels) for n in cluster.node_ids] == [
            float(n == leader) for n in cluster.node_ids
        ]
    moved_to = next(node for node in cluster.node_ids if node != led[3])
    with Admin(cluster.bootstrap) as admin:  # the same replicas, another first: the leadership moves to it
        admin.reassign_topic("orders", [moved_to, *(n for n in cluster.node_ids if n != moved_to)], partition=3)
    wait_for(lambda: leaders(cluster, "orders")[3] == moved_to, timeout=60, message="partition 3's leader to move")
    led = leaders(cluster, "orders")
    with Admin(cluster.address(led[3])) as admin:
        rows = admin.describe_partitions("orders")["partitions"]
    assert {(row["topic"], row["partition"]) for row in rows if row["role"] == "leader"} == {
        ("orders", p) for p, node in led.items() if node == led[3]
    }


def test_with_etcd_stopped_every_partition_keeps_serving(cluster: ClusterProcess) -> None:
    led = create(cluster, "offline-etcd")
    members = Members(cluster, "offline-etcd", count=2)
    cluster.etcd.stop()
    try:
        values = send_keyed(cluster, "offline-etcd", 0, keys=100, rounds=3)
        wait_for(lambda: set(values) <= members.values(), timeout=60, message="the group to get it with etcd down")
        partitions = stored(cluster, "offline-etcd")
        assert all(partitions.values()) and check_key_order(partitions) == 100
    finally:
        cluster.etcd.start()
    members.close()
    wait_for(lambda: set(cluster.node_ids) <= cluster.registered(), timeout=60, message="every node registered again")
    assert leaders(cluster, "offline-etcd") == led  # nothing moved


def test_kill_9_of_one_leader_pauses_only_its_partitions_and_loses_nothing(cluster: ClusterProcess) -> None:
    led = create(cluster, "payments")
    victim = led[0]
    theirs = sorted(p for p, node in led.items() if node == victim)
    others = sorted(p for p, node in led.items() if node != victim)
    survivors = [node for node in cluster.node_ids if node != victim]
    members = Members(cluster, "payments")
    keyed = KeyedLoad(cluster, "payments")  # 1,000 keys across the kill: retries and resends keep each key's order
    wait_for(lambda: keyed.rounds_done() >= 2, timeout=60, message="keyed rounds before the kill")
    confirmed: set[bytes] = set()
    with Producer(cluster.bootstrap, delivery_timeout_ms=120_000, request_timeout_ms=1000) as producer:
        for p in range(PARTITIONS):
            producer.send("payments", f"before-{p}".encode(), partition=p).result(60)
            confirmed.add(f"before-{p}".encode())

        cluster.node(victim).kill()
        paused = [producer.send("payments", f"paused-{p}".encode(), partition=p) for p in theirs]
        served = [producer.send("payments", f"served-{p}".encode(), partition=p) for p in others]
        for future in served:
            future.result(60)  # the other nodes' partitions confirm, as a rule while the victim's lease lasts
        still = Metadata(",".join(cluster.address(n) for n in survivors)).refresh(["payments"]).topics["payments"]
        moved = [p for p in theirs if still[p].leader != victim]
        if not moved:  # the victim's partitions had no leader meanwhile: they, and only they, paused
            assert not any(future.done() for future in paused)
        for future in paused:
            future.result(120)  # then a follower leads them, and what was sent there is confirmed
        confirmed |= {f"{kind}-{p}".encode() for kind, ps in (("paused", theirs), ("served", others)) for p in ps}
    confirmed |= keyed.finish()

    after = leaders_without(cluster, "payments", victim, survivors)
    assert all(after[p] != victim for p in theirs)
    assert all(after[p] == led[p] for p in others), "a partition the victim did not lead changed leader"
    with Admin(",".join(cluster.address(n) for n in survivors)) as admin:  # 3 replicas each, 2 nodes live
        with pytest.raises(NotEnoughReplicas):
            admin.add_partitions("payments", PARTITIONS + 4)
        assert admin.describe_topic("payments")["partition_count"] == PARTITIONS
    cluster.node(victim).restart(kill=True)
    wait_for(lambda: confirmed <= members.values(), timeout=120, message="the group to get every confirmed message")
    members.close()
    partitions = stored(cluster, "payments")
    values = {value for rows in partitions.values() for _key, value in rows}
    assert confirmed <= values
    assert (
        check_key_order({p: [row for row in rows if row[0].startswith("p")] for p, rows in partitions.items()}) == 1000
    )


class KeyedLoad:
    """Four producers, 250 keys each, sending round after round (bounded) until ``finish``."""

    def __init__(self, cluster: ClusterProcess, topic: str) -> None:
        self.stop = threading.Event()
        self.done = [0] * 4
        self.confirmed: list[set[bytes]] = [set() for _ in range(4)]
        self.threads = [threading.Thread(target=self._run, args=(cluster, topic, i)) for i in range(4)]
        for thread in self.threads:
            thread.start()

    def _run(self, cluster: ClusterProcess, topic: str, index: int) -> None:
        with Producer(cluster.bootstrap, delivery_timeout_ms=120_000, request_timeout_ms=1000) as producer:
            deadline = time.monotonic() + 120
            for r in range(40):
                if self.stop.is_set() or time.monotonic() > deadline:
                    break
                values = [f"p{index}-k{k}:{r}".encode() for k in range(250)]
                futures = [producer.send(topic, v, key=v.decode().split(":")[0]) for v in values]
                producer.flush(120)
                for value, future in zip(values, futures, strict=True):
                    future.result(120)
                    self.confirmed[index].add(value)
                self.done[index] = r + 1

    def rounds_done(self) -> int:
        return min(self.done)

    def finish(self) -> set[bytes]:
        self.stop.set()
        for thread in self.threads:
            thread.join(150)
        return set().union(*self.confirmed)


def leaders_without(cluster: ClusterProcess, topic: str, gone: str, asking: list[str]) -> dict[int, str]:
    def known() -> dict[int, str] | None:
        parts = Metadata(",".join(cluster.address(n) for n in asking)).refresh([topic]).topics.get(topic, {})
        if len(parts) != PARTITIONS or any(p.leader in (None, gone) for p in parts.values()):
            return None
        return {number: str(p.leader) for number, p in parts.items()}

    return wait_for(known, timeout=60, message=f"{topic}'s partitions to have leaders other than {gone}")


def settings_of(cluster: ClusterProcess, topic: str) -> list[object]:
    """``retention_ms`` in the topic.json of every partition log on every node."""
    found = []
    for node in cluster.node_ids:
        for path in (cluster.node(node).data_dir / "topics").glob(f"{topic}*/topic.json"):
            if not path.parent.name.startswith(f"{topic}.dlq"):
                found.append(json.loads(path.read_text()).get("retention_ms"))
    return found


def test_alter_reaches_and_delete_drops_every_partition_on_every_node(cluster: ClusterProcess) -> None:
    create(cluster, "scratch")
    send_keyed(cluster, "scratch", 0, keys=20, rounds=1)
    with Admin(cluster.bootstrap) as admin:
        admin.alter_topic("scratch", retention_ms=3_600_000)
        wait_for(
            lambda: settings_of(cluster, "scratch") == [3_600_000] * (3 * PARTITIONS),
            timeout=60,
            message="every replica of every partition to have the new setting",
        )
        admin.delete_topic("scratch")

    def dirs_left() -> list[Path]:
        return [
            path
            for node in cluster.node_ids
            for path in (cluster.node(node).data_dir / "topics").glob("scratch*")
            if not path.name.startswith("scratch.dlq")
        ]

    wait_for(lambda: not dirs_left(), timeout=60, message="every node to drop every partition of the topic")


def test_partitions_added_in_a_cluster_get_leaders_and_the_group_reads_them(cluster: ClusterProcess) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("growing", partitions=2, replication_factor=3, min_insync_replicas=2)
    members = Members(cluster, "growing", count=2)
    running = Producer(cluster.bootstrap, delivery_timeout_ms=60_000)  # made before the growth, used after
    first = [f"early-{i}".encode() for i in range(50)]
    for value in first:
        running.send("growing", value, key=value.decode())
    running.flush(60)
    wait_for(lambda: set(first) <= members.values(), timeout=60, message="the group to read the first two partitions")
    with Admin(cluster.bootstrap) as admin:
        admin.add_partitions("growing", PARTITIONS)
        with pytest.raises(InvalidRequest):
            admin.add_partitions("growing", 4)  # partitions are only added
    led = leaders(cluster, "growing")
    assert len(set(led.values())) == 3  # the new partitions' leaders are spread too
    later = []
    for round_ in range(2):  # the first round's confirms tell the running producer the new count
        values = [f"late-{round_}-{i}".encode() for i in range(200)]
        futures = [running.send("growing", value, key=f"k{i}") for i, value in enumerate(values)]
        running.flush(60)
        assert all(future.result(60) is not None for future in futures)
        later += values
    assert {int(running.send("growing", b"x", key=f"k{i}").result(60).partition) for i in range(200)} == set(
        range(PARTITIONS)
    )
    running.close()
    partitions = stored(cluster, "growing")
    assert all(partitions[k] for k in range(2, PARTITIONS)), "keys sent after the growth reach the new partitions"
    wait_for(lambda: set(later) <= members.values(), timeout=60, message="the group to read the added partitions")
    with Admin(cluster.bootstrap) as admin:
        assert admin.describe_topic("growing")["partition_count"] == PARTITIONS


def test_right_after_a_create_keys_route_by_the_count_and_one_node_s_address_reads_every_partition(
    cluster: ClusterProcess,
) -> None:
    with Admin(cluster.bootstrap) as admin:  # no wait for leaders: a producer may start at once
        admin.create_topic("at-once", partitions=3, replication_factor=1)
    with Producer(cluster.bootstrap) as producer:  # asks the count of whichever node answers first
        offsets = {f"key-{i}": producer.send("at-once", f"v{i}", key=f"key-{i}") for i in range(300)}
        producer.flush(60)
        placed = {key: future.result(60).partition for key, future in offsets.items()}
    assert placed == {key: zlib.crc32(key.encode()) % 3 for key in placed}
    led = {p.leader for p in Metadata(cluster.bootstrap).refresh(["at-once"]).topics["at-once"].values()}
    assert len(led) == 3  # replication factor 1: each node holds one partition only
    for node in cluster.node_ids:  # one address: a partition held elsewhere answers NOT_LEADER naming its leader
        with Admin(cluster.address(node)) as admin:
            got = [m.value for k in range(3) for m in admin.fetch("at-once", 0, 1000, partition=k)]
        assert sorted(got) == sorted(f"v{i}" for i in range(300))
    # A consumer given one node's address too: each partition is subscribed at its own leader
    received: set[str] = set()
    with Subscription("at-once", "one-address", address=cluster.address(led_by_first := "n1"), credit=300) as sub:
        deadline = time.monotonic() + 60
        while len(received) < 300 and time.monotonic() < deadline:
            messages = sub.receive(timeout=0.5)
            received.update(str(m.value) for m in messages)
            sub.ack(messages)
    assert len(received) == 300, f"{len(received)} of 300 through {led_by_first}'s address"


def test_describe_sums_every_leader_s_rows_and_one_partition_resets_at_its_leader(cluster: ClusterProcess) -> None:
    """The merge summed end_offset and lag only (durable, visible, size, committed: the first leader's share);
    a reset could not name one partition; a negative offset reset every partition to earliest."""
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("summed", partitions=3, replication_factor=1)
    led = wait_for(
        lambda: (lambda parts: parts if len(parts) == 3 and all(p.leader for p in parts.values()) else None)(
            Metadata(cluster.bootstrap).refresh(["summed"]).topics.get("summed", {})
        ),
        timeout=60,
        message="3 leaders",
    )
    assert len({p.leader for p in led.values()}) == 3  # one partition per node: three answers to merge
    with Producer(cluster.bootstrap) as producer:
        for partition, count in enumerate((2, 3, 4)):
            for i in range(count):
                producer.send("summed", f"{partition}-{i}", partition=partition).result(60)
    with Admin(cluster.bootstrap) as admin:
        info = wait_for(
            lambda: (lambda i: i if i["visible_offset"] == 9 else None)(admin.describe_topic("summed")),
            timeout=60,
            message="every partition visible",
        )
        rows = info["partitions"]
        assert [r["end_offset"] for r in rows] == [2, 3, 4] and (info["end_offset"], info["durable_offset"]) == (9, 9)
        assert info["size_bytes"] == sum(r["size_bytes"] for r in rows) and info["segments"] == 3
        admin.reset_offsets("summed", "g", "earliest")
        with pytest.raises(InvalidRequest):
            admin.reset_offsets("summed", "g", -5)
        group = admin.reset_offsets("summed", "g", "latest", partition=2)  # at partition 2's leader only
        assert [r["committed_offset"] for r in group["partitions"]] == [0, 0, 4]
        assert (group["committed_offset"], group["end_offset"], group["lag"]) == (4, 9, 5)
        again = admin.describe_group("summed", "g")
        assert (again["committed_offset"], again["next_offset"], again["end_offset"], again["lag"]) == (4, 4, 9, 5)
        (listed,) = [row for row in admin.list_groups() if row["topic"] == "summed"]
        assert (listed["committed_offset"], listed["end_offset"], listed["lag"]) == (4, 9, 5)
        assert [(t["end_offset"], t["size_bytes"]) for t in admin.list_topics() if t["name"] == "summed"] == [
            (9, info["size_bytes"])
        ]
        admin.delete_topic("summed")
