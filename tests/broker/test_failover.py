"""Consumers and brokers that die: nothing confirmed or committed is lost."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from conveyor.broker.client.subscription import Subscription

from conveyor import Admin
from tests.broker.broker_helpers import drain, quiet
from tests.helpers import publish, wait_for

HOLDER = textwrap.dedent(
    """
    import sys, time
    from conveyor.broker.client.subscription import Subscription
    sub = Subscription(sys.argv[2], "g", address=sys.argv[1], credit=int(sys.argv[3]))
    held = 0
    while held < int(sys.argv[3]):
        held += len(sub.receive(timeout=0.2))
    print("holding", held, flush=True)
    time.sleep(600)
    """
)


def test_consumer_killed_with_unacked_messages_loses_nothing(conveyor_broker):
    # Given a consumer process holding 300 unacked messages, and a healthy peer
    address = conveyor_broker.address
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, address, "held", "300"], stdout=subprocess.PIPE, text=True)
    try:
        publish(address, "held", list(range(300)))
        assert holder.stdout is not None and holder.stdout.readline().startswith("holding 300")
        healthy = Subscription("held", "g", address=address, credit=100)
        assert quiet([healthy], 0.5) == [], "the holder has all the credit it asked for"
        # When it is killed without a goodbye
        holder.kill()
        holder.wait(10)
        # Then the broker evicts it after missed heartbeats and the peer gets everything
        (got,) = drain([healthy], 300, timeout=20)
        assert sorted(m.value for m in got) == list(range(300))
        assert all(m.attempt == 2 for m in got)
        assert quiet([healthy], 0.5) == []
        healthy.close()
    finally:
        holder.kill()
        holder.wait(10)


def _restart_keeps_everything(broker, *, kill: bool) -> None:
    address = broker.address
    offsets = publish(address, "durable", [f"v{i}" for i in range(2000)])
    assert offsets == list(range(2000))
    sub = Subscription("durable", "g", address=address, credit=500)
    (first,) = drain([sub], 700, timeout=10)
    sub.ack(first)
    acked = {m.offset for m in first}
    with Admin(address) as admin:
        assert wait_for(lambda: admin.describe_group("durable", "g")["committed_offset"] >= min(len(first), 700))
        committed = admin.describe_group("durable", "g")["committed_offset"]
    # Let the periodic offset commit reach the disk before the crash.
    time.sleep(0.4)
    sub.close()
    broker.restart(kill=kill)
    with Admin(broker.address) as admin:
        assert admin.describe_topic("durable")["end_offset"] == 2000
        assert admin.describe_group("durable", "g")["committed_offset"] >= committed
        values = []
        offset = 0
        while offset < 2000:
            batch = admin.fetch("durable", offset, 1000)
            values += [m.value for m in batch]
            offset = batch[-1].offset + 1
        assert values == [f"v{i}" for i in range(2000)]
    sub = Subscription("durable", "g", address=broker.address, credit=500)
    (rest,) = drain([sub], 2000 - committed, timeout=10)
    assert {m.offset for m in rest} | acked >= set(range(2000))
    assert min(m.offset for m in rest) >= committed
    sub.close()


def test_restart_after_sigterm_keeps_messages_and_offsets(conveyor_broker):
    _restart_keeps_everything(conveyor_broker, kill=False)


def test_restart_after_kill_9_keeps_messages_and_offsets(conveyor_broker):
    _restart_keeps_everything(conveyor_broker, kill=True)
