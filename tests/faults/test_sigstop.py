"""SIGSTOP/SIGCONT: a broker that freezes, a consumer that freezes.

A frozen broker: producers time out and resend on new sockets while it is
stopped; when it resumes it reads every copy, and stores each batch once.
A frozen consumer: it misses its heartbeats, the broker takes its messages
back and hands them to the other member; when it wakes it re-subscribes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import zmq
from conveyor.broker.wire.protocol import Command, decode, encode

from conveyor import Producer
from tests.faults.fault_helpers import (
    ConsumerThread,
    Load,
    consumers,
    drain_group,
    fetch_all,
    judge,
    judge_group,
    report,
)
from tests.helpers import wait_for


def test_a_frozen_broker_stores_every_resent_batch_once(brokers):
    # Given producers and a consumer group under load
    broker = brokers.start(extra=["--heartbeat-ms", "500"])
    stops = 3
    with (
        Load(broker.address, "frozen", producers=3, chunk=20, request_timeout_ms=300) as load,
        consumers(broker.address, "frozen", "g") as group,
    ):
        for _ in range(stops):
            before = load.confirmed_count
            assert wait_for(lambda b=before: load.confirmed_count > b + 50, timeout=20)
            # When the broker is stopped for longer than the producers' request timeout
            os.kill(broker.pid, signal.SIGSTOP)
            time.sleep(0.3)  # confirms already on their way may still land
            frozen = load.confirmed_count
            time.sleep(1.2)
            assert load.confirmed_count == frozen, "confirms from a stopped broker"
            os.kill(broker.pid, signal.SIGCONT)
        load.stop()
        assert not load.failures()
        assert drain_group(broker.address, "frozen", "g", group, timeout=30)
        time.sleep(0.3)
    # Then every batch was stored once, though it was sent several times
    stored = fetch_all(broker.address, "frozen")
    verdict = judge(load.confirmed(), load.sent(), stored)
    members = judge_group(group, stored)
    resent = broker.metric("conveyor_duplicate_batches_total")
    reconnects = sum(t.producer._io.reconnects for t in load.threads)
    report(
        "sigstop-broker",
        stops=stops,
        producer_reconnects=reconnects,
        duplicate_batches_recognised=resent,
        **verdict.numbers(),
        group_duplicates=members.duplicates,
        group_missing=len(members.missing),
    )
    verdict.assert_safe()
    assert resent > 0, "no resend reached the broker: the test did not test idempotence"
    assert not members.missing


CONSUMER = textwrap.dedent(
    """
    import sys, time
    from conveyor.broker.client.subscription import Subscription
    sub = Subscription(sys.argv[2], "g", address=sys.argv[1], credit=100, batch_size=20, heartbeat_ms=300, liveness=3)
    while not sub.subscribed:
        sub.receive(timeout=0.1)
    print("subscribed", flush=True)
    while True:
        try:
            batch = sub.receive(timeout=0.2)
        except Exception as exc:  # NOT_SUBSCRIBED and the like: the session reconnects
            print("error", exc, flush=True)
            continue
        if batch:
            print("got", batch[0].offset, len(batch), flush=True)
            time.sleep(0.05)
            sub.ack(batch)
    """
)


def test_a_frozen_consumer_loses_its_messages_to_the_other_member(brokers):
    # Given two members of a group: a consumer process that acks slowly, and a thread
    broker = brokers.start(extra=["--heartbeat-ms", "300"])
    with Producer(broker.address) as producer:
        producer.send("slowpoke", "first").result(timeout=10)
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, broker.address, "slowpoke"], stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    other = ConsumerThread(broker.address, "slowpoke", "g", credit=100, ack_delay=0.02)
    other.start()
    try:
        assert wait_for(lambda: "subscribed\n" in lines, timeout=20), "the consumer process did not subscribe"
        total = 3000
        with Producer(broker.address) as producer:
            for i in range(total - 1):
                producer.send("slowpoke", f"m{i}")
                if i % 100 == 0:
                    time.sleep(0.01)
            producer.flush(timeout=20)
        assert wait_for(lambda: any(line.startswith("got") for line in lines), timeout=10)
        # When the consumer process is stopped while it holds messages
        proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Then the broker evicts it after its missed heartbeats and the other member gets everything
        assert drain_group(broker.address, "slowpoke", "g", [other], timeout=30)
        evicted_after = time.monotonic() - stopped_at
        redelivered = [d for d in other.deliveries if d[2] > 1]
        assert redelivered, "nothing the frozen consumer held came back"
        # And when it is woken up it re-subscribes and takes its share of new messages again
        proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        seen = len(lines)
        with Producer(broker.address) as producer:
            for i in range(500):
                producer.send("slowpoke", f"late{i}")
        assert drain_group(broker.address, "slowpoke", "g", [other], timeout=30)
        assert wait_for(lambda: any(line.startswith("got") for line in lines[seen:]), timeout=10)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        other.stop()
    stored = fetch_all(broker.address, "slowpoke")
    assert len(stored) == total + 500
    by_process = sum(int(line.split()[2]) for line in lines if line.startswith("got"))
    report(
        "sigstop-consumer",
        messages=len(stored),
        delivered_to_process=by_process,
        delivered_to_thread=len(other.deliveries),
        redelivered_after_freeze=len(redelivered),
        drained_after_s=round(evicted_after, 2),
        redelivered_metric=broker.metric("conveyor_redelivered_messages_total"),
    )


def test_a_resent_batch_alone_is_confirmed_with_its_first_offsets(brokers):
    """The resend of a batch whose confirm was lost is answered even when nothing else is appended.

    (It was not: confirms went out only in passes that appended something, so producers
    resending after a broker crash or freeze waited forever; found by the kill -9 loop.)
    """
    broker = brokers.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    body = msgpack.packb([[None, None, b"once"]])
    answers = []
    try:
        for rid in (1, 2, 3):
            sock.send_multipart(encode(Command.PUBLISH, {"rid": rid, "topic": "resend", "pid": 7, "seq": 0}, body))
            assert sock.poll(5000), f"no answer to send #{rid}"
            answers.append(decode(sock.recv_multipart()).header)
    finally:
        sock.close()
    assert [(a["base_offset"], a["duplicate"]) for a in answers] == [(0, False), (0, True), (0, True)]
    assert [v for _o, v in fetch_all(broker.address, "resend")] == [b"once"]
