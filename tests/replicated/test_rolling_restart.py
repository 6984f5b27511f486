"""A rolling restart (SIGTERM, one node at a time) under load: a controlled shutdown hands leadership off first."""

from __future__ import annotations

import itertools
import threading
import time

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer
from conveyor.broker.client.subscription import Subscription

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for

TOPIC = "rolling"


def in_sync(cluster: ClusterProcess) -> bool:
    try:
        info = Metadata(cluster.bootstrap, timeout=2.0).refresh([TOPIC]).topics[TOPIC][0]
    except Exception:  # a node is restarting: ask again
        return False
    return info.leader is not None and len(info.isr) == len(cluster.node_ids)


def more_than(items: list[float], count: int):  # type: ignore[no-untyped-def]
    return lambda: len(items) > count


def test_a_rolling_restart_under_load_loses_nothing_and_hands_off_quickly(cluster: ClusterProcess) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic(TOPIC, replication_factor=3, min_insync_replicas=2)
    wait_for(lambda: in_sync(cluster), timeout=60, message="a full in-sync set")
    confirms: list[float] = []
    confirmed: dict[int, bytes] = {}
    failed: list[BaseException] = []
    received: list[bytes] = []  # appended by the consumer thread; read as a copy
    stop = threading.Event()
    consumed = threading.Event()

    def done(future, value: bytes) -> None:  # type: ignore[no-untyped-def]
        if future.exception() is not None:
            failed.append(future.exception())
        else:
            confirmed[future.result()] = value
            confirms.append(time.monotonic())

    def produce() -> None:
        with Producer(cluster.bootstrap, linger_ms=1, delivery_timeout_ms=120_000) as producer:
            n = 0
            while not stop.is_set():
                value = f"r{n}".encode()
                producer.send(TOPIC, value).add_done_callback(lambda f, v=value: done(f, v))
                n += 1
                if n % 20 == 0:
                    stop.wait(0.01)  # about 2,000 msg/s
            producer.flush(120)

    def consume() -> None:
        with Subscription(TOPIC, "rolling", address=cluster.bootstrap, ack_timeout_ms=5000) as subscription:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not consumed.is_set():
                messages = subscription.receive(timeout=0.5)
                received.extend(bytes(m.value) for m in messages)
                subscription.ack(messages)

    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    for thread in threads:
        thread.start()
    gaps = []
    for node in cluster.node_ids:
        wait_for(more_than(confirms, len(confirms) + 200), timeout=60, message=f"confirms before {node} stops")
        stopped = time.monotonic()
        assert cluster.node(node).stop(timeout=30) == 0  # a controlled shutdown exits cleanly
        took = time.monotonic() - stopped
        cluster.node(node).start()
        wait_for(lambda: in_sync(cluster), timeout=120, message=f"{node} back in sync")
        window = [t for t in confirms if t >= stopped - 1.0]
        gaps.append(max(b - a for a, b in itertools.pairwise(window)))
        print(f"{node}: SIGTERM to exit {took:.2f} s, longest pause between confirms {gaps[-1]:.2f} s")
    stop.set()
    threads[0].join(150)
    assert not failed, failed[:3]
    values = list(confirmed.values())
    assert len(set(values)) == len(values)
    wait_for(lambda: set(values) <= set(list(received)), timeout=120, message="the group to get every confirmed one")
    consumed.set()
    threads[1].join(30)
    # A controlled shutdown costs clients well under a failover (a lease of 2 s plus the reaction).
    assert max(gaps) < 2.0, gaps
