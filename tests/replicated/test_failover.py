"""Kill -9 of a partition leader under load: nothing confirmed is lost, and clients carry on by themselves."""

from __future__ import annotations

import threading
import time

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.replica_logs import records

MESSAGES = 6000


def leader_of(cluster: ClusterProcess, topic: str, other_than: str | None = None) -> tuple[str, int]:
    """(leader, epoch) as METADATA says, once it names a live leader (other than ``other_than``)."""

    def ask() -> tuple[str, int] | None:
        view = Metadata(cluster.bootstrap).refresh([topic])
        partition = view.topics.get(topic, {}).get(0)
        if partition is None or partition.leader in (None, other_than):
            return None
        return partition.leader, partition.leader_epoch

    return wait_for(ask, timeout=60, message=f"a leader of {topic}")


def test_kill_9_of_the_leader_under_load_loses_no_confirmed_message(cluster: ClusterProcess) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
    leader, epoch = leader_of(cluster, "orders")

    confirmed: dict[int, bytes] = {}  # offset -> value, from the producer's futures
    confirm_times: list[float] = []
    received: list[bytes] = []
    stop = threading.Event()

    def consume() -> None:
        with Subscription("orders", "billing", address=cluster.bootstrap, ack_timeout_ms=5000) as subscription:
            deadline = time.monotonic() + 180
            while not stop.is_set() and time.monotonic() < deadline:
                messages = subscription.receive(timeout=0.5)
                received.extend(bytes(m.value) for m in messages)
                subscription.ack(messages)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    killed_at = 0.0
    # A request timeout far above a failover's: the killed leader is suspect (it hung up, or could not be sent
    # to) and its batches wait for METADATA to name the next one, never for this timeout.
    with Producer(cluster.bootstrap, linger_ms=2, delivery_timeout_ms=120_000, request_timeout_ms=30_000) as producer:
        futures = []
        for i in range(MESSAGES):
            value = f"order-{i}".encode()
            future = producer.send("orders", value)
            future.add_done_callback(lambda f, v=value: f.exception() or confirm_times.append(time.monotonic()))
            futures.append((value, future))
            if i == MESSAGES // 3:
                wait_for(lambda: len(confirm_times) > 100, timeout=60, message="confirms before the kill")
                cluster.node(leader).kill()
                killed_at = time.monotonic()
            if i % 200 == 0:
                time.sleep(0.01)  # bounded pace: about 20k msg/s at most, so the kill lands mid-stream
        producer.flush(120)
        for value, future in futures:
            offset = future.result(120)
            assert offset not in confirmed, f"offset {offset} assigned twice"
            confirmed[offset] = value

    assert len(confirmed) == MESSAGES  # every send confirmed, each at its own offset
    new_leader, new_epoch = leader_of(cluster, "orders", other_than=leader)
    assert new_epoch > epoch
    after = [t for t in confirm_times if t > killed_at]
    assert after, "no confirm after the kill"
    print(f"unavailability: {min(after) - killed_at:.2f} s from kill -9 to the first confirm by {new_leader}")
    assert min(after) - killed_at < 15, "the producer waited out its request timeout on the dead leader"

    wait_for(lambda: set(confirmed.values()) <= set(received), timeout=120, message="the group to get every message")
    stop.set()
    consumer.join(30)

    # The killed node comes back as a follower and catches up; then every replica holds the same records.
    cluster.node(leader).start()
    with Producer(cluster.bootstrap) as producer:
        producer.send("orders", b"after-restart").result(60)

    def back_in_sync() -> bool:
        partition = Metadata(cluster.bootstrap).refresh(["orders"]).topics["orders"][0]
        return leader in partition.isr

    wait_for(back_in_sync, timeout=120, message=f"{leader} to rejoin the in-sync set")
    cluster.stop()
    logs = {node: dict(records(cluster.node(node).data_dir, "orders")) for node in cluster.node_ids}
    for node, held in logs.items():
        for offset, value in confirmed.items():
            assert held.get(offset) == value, f"{node} lost or changed confirmed offset {offset}"
