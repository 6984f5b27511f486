"""Slow consumers: broker memory is bounded by credit and the tail cache, not by the backlog."""

from __future__ import annotations

import threading
import time

from conveyor import Admin, Producer
from tests.faults.fault_helpers import ConsumerThread, report, rss_bytes

MiB = 1 << 20


def test_broker_memory_stays_bounded_whatever_the_backlog(brokers):
    # Given a broker, and a consumer that acks slowly with a credit of 100
    broker = brokers.start()
    topic, total, credit = "backlog", 200_000, 100
    with Admin(broker.address) as admin:
        admin.create_topic(topic)
    slow = ConsumerThread(broker.address, topic, "g", credit=credit, ack_delay=0.05)
    slow.start()
    # (messages the broker has stored, its RSS): what the producer has handed over runs ahead of the
    # broker when the machine is busy, and would date a sample too early.
    samples: list[tuple[int, int]] = []
    in_flight: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        with Admin(broker.address) as admin:
            while not stop.is_set():
                stored = admin.describe_topic(topic)["end_offset"]
                samples.append((stored, rss_bytes(broker.pid)))
                in_flight.append(admin.describe_group(topic, "g")["in_flight"])
                time.sleep(0.1)

    try:
        with Producer(broker.address) as producer:
            producer.send_many(topic, [b"w" * 100] * 1000)
            producer.flush(timeout=30)
            baseline = rss_bytes(broker.pid)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            # When 200k messages (about 90 MB stored) pile up behind it
            value = b"v" * 400
            for start in range(0, total, 5000):
                producer.send_many(topic, [value] * 5000)
                if start % 50_000 == 0:
                    producer.flush(timeout=60)
            producer.flush(timeout=60)
        time.sleep(1.0)
        stop.set()
        sampler.join(10)
        with Admin(broker.address) as admin:
            described = admin.describe_group(topic, "g")
            stored_bytes = admin.describe_topic(topic)["size_bytes"]
    finally:
        stop.set()
        slow.stop()
    peak = max(r for _n, r in samples)
    early = max((r for n, r in samples if n <= 20_000), default=baseline)
    half = max((r for n, r in samples if n <= total // 2), default=baseline)
    report(
        "slow-consumer",
        published=total,
        stored_mib=round(stored_bytes / MiB, 1),
        backlog=described["lag"],
        consumed=len(slow.deliveries),
        max_in_flight=max(in_flight),
        rss_baseline_mib=round(baseline / MiB, 1),
        rss_after_20k_mib=round(early / MiB, 1),
        rss_after_100k_mib=round(half / MiB, 1),
        rss_peak_mib=round(peak / MiB, 1),
    )
    # Then the consumer never held more than its credit, the backlog is real,
    assert max(in_flight) <= credit
    assert described["lag"] > total // 2
    # and the broker grew by about its tail cache (16 MiB per topic), not with the 90 MB backlog:
    assert peak - baseline < 48 * MiB, f"RSS grew {(peak - baseline) / MiB:.0f} MiB"
    assert peak - half < 12 * MiB, "RSS still growing with the backlog in the second half"
