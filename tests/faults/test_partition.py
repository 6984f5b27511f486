"""A network partition between one consumer and the broker, through a TCP proxy.

While the proxy stalls, the consumer's heartbeats stop reaching the broker:
it is evicted, the credit it held is reclaimed and its messages go to the
other member. When the proxy heals, it re-subscribes and gets work again. A
cut (every connection reset) is survived the same way.
"""

from __future__ import annotations

import threading
import time

from conveyor import Admin, Producer
from tests.faults.fault_helpers import ConsumerThread, Proxy, drain_group, fetch_all, judge_group, report
from tests.helpers import wait_for

AFTER_HEAL = 600


def publish_steadily(address: str, topic: str, count: int, seconds: float, stop: threading.Event) -> None:
    with Producer(address, linger_ms=2) as producer:
        for i in range(count):
            if stop.is_set():
                break
            producer.send(topic, f"m{i}")
            if i % 50 == 0:
                time.sleep(seconds * 50 / count)
        producer.flush(timeout=30)


def test_a_partitioned_consumer_is_evicted_its_messages_move_on_and_it_recovers(brokers):
    broker = brokers.start(extra=["--heartbeat-ms", "300"])  # a peer silent for 0.9 s is dead
    topic, total = "parted", 4000
    with Admin(broker.address) as admin:
        admin.create_topic(topic)
    proxy = Proxy(broker.address)
    proxy.start()
    far = ConsumerThread(proxy.address, topic, "g", credit=100, ack_delay=0.02)
    near = ConsumerThread(broker.address, topic, "g", credit=100, ack_delay=0.02)
    stop = threading.Event()
    publisher = threading.Thread(target=publish_steadily, args=(broker.address, topic, total, 4.0, stop))
    try:
        far.start()
        near.start()
        publisher.start()
        assert wait_for(lambda: len(far.deliveries) > 50 and len(near.deliveries) > 50, timeout=15)
        # When the link to the far consumer stalls
        proxy.stall()
        stalled_at = len(far.deliveries)
        with Admin(broker.address) as admin:
            assert wait_for(lambda: len(admin.describe_group(topic, "g")["members"]) == 1, timeout=5), "not evicted"
            evicted = admin.describe_group(topic, "g")
        time.sleep(1.0)
        assert len(far.deliveries) == stalled_at, "deliveries through a stalled link"
        # Then its messages went to the near member (redelivered, attempt 2)
        moved = [d for d in near.deliveries if d[2] > 1]
        assert moved, "nothing the partitioned consumer held was redelivered"
        # When the link heals, the far consumer re-subscribes and gets work again: new messages keep
        # coming while it does (the first publisher may have sent its last before the heal)
        proxy.heal()
        more = threading.Thread(target=publish_steadily, args=(broker.address, topic, AFTER_HEAL, 3.0, stop))
        more.start()
        assert wait_for(lambda: len(far.deliveries) > stalled_at, timeout=15), "no recovery after healing"
        # When every connection is cut, it reconnects and keeps going
        healed_at = len(far.deliveries)
        publisher.join(60)
        more.join(60)
        proxy.cut()
        time.sleep(0.3)
        proxy.heal()
        publish_steadily(broker.address, topic, 1000, 3.0, stop)
        assert wait_for(lambda: len(far.deliveries) > healed_at, timeout=15), "no recovery after the cut"
        assert drain_group(broker.address, topic, "g", [far, near], timeout=30)
    finally:
        stop.set()
        publisher.join(30)
        far.stop()
        near.stop()
        proxy.close()
    stored = fetch_all(broker.address, topic)
    assert len(stored) == total + AFTER_HEAL + 1000
    members = judge_group([far, near], stored)
    assert not members.missing, f"never delivered: {members.missing[:10]}"
    report(
        "partition",
        messages=len(stored),
        far_deliveries=len(far.deliveries),
        near_deliveries=len(near.deliveries),
        redelivered=members.duplicates,
        members_while_stalled=len(evicted["members"]),
        redelivered_member_gone=broker.metric("conveyor_redelivered_messages_total", "member_gone"),
        proxy_connections=proxy.connections,
    )
