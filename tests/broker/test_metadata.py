"""METADATA from a real single-node broker, and the client's routing on a bootstrap list."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.client.metadata import Metadata, ask_metadata
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.net.requester import Requester
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command
from conveyor.broker.wire.schema import check_metadata_result

from conveyor import Admin, Producer
from tests.helpers import free_address, wait_for


def test_a_single_node_broker_answers_metadata_as_the_only_node(conveyor_broker):
    # Given a broker with one topic
    with Admin(conveyor_broker.address) as admin:
        admin.create_topic("orders")
    # When a client asks METADATA of every topic, then of one it does not have
    with Requester(conveyor_broker.address) as requester:
        every = requester.call(commands.metadata)
        some = requester.call(lambda rid: commands.metadata(["orders", "missing"], rid=rid))
    # Then it answers itself as node, controller and leader at epoch 0, in the documented shape
    assert every.command is Command.METADATA_RESULT
    assert check_metadata_result(every.header) is None
    assert every.get("node") == "local" and every.get("controller") == "local"
    assert every.get("nodes") == {"local": conveyor_broker.address}
    assert every.get("topics") == {
        "orders": {
            "partitions": {
                "0": {
                    "leader": "local",
                    "leader_addr": conveyor_broker.address,
                    "leader_epoch": 0,
                    "replicas": ["local"],
                    "isr": ["local"],
                    "offline": False,
                }
            }
        }
    }
    # And a topic it does not know is left out
    assert set(some.get("topics")) == {"orders"}


def test_the_node_name_is_the_node_flag(conveyor_broker_factory):
    broker = conveyor_broker_factory(extra=["--node", "edge-1"])
    view = ask_metadata([broker.address])
    assert view.node == "edge-1" and view.nodes == {"edge-1": broker.address}


def test_a_bootstrap_list_whose_first_broker_is_dead_finds_the_live_one(conveyor_broker):
    # Given a bootstrap list that starts with an address nobody listens on
    metadata = Metadata([free_address(), conveyor_broker.address], stagger=0.2)
    # When a topic's leader is looked up
    leader = metadata.leader_for("anything")
    # Then the live broker answered, and it leads the topic (it will make it)
    assert leader == conveyor_broker.address
    assert metadata.view is not None and metadata.view.source == conveyor_broker.address


def test_one_address_is_used_without_asking(conveyor_broker):
    metadata = Metadata(conveyor_broker.address)
    assert metadata.leader_for("orders") == conveyor_broker.address
    assert metadata.refreshes == 0


def test_a_producer_and_admin_given_a_dead_broker_first_use_the_live_one(conveyor_broker):
    # Given a bootstrap list whose first address nobody listens on
    bootstrap = f"{free_address()},{conveyor_broker.address}"
    # When a producer and an admin client are given it
    with Producer(bootstrap, linger_ms=1) as producer:
        offsets = [producer.send("listed", f"m{i}".encode()).result(timeout=30) for i in range(5)]
    with Admin(bootstrap) as admin:
        described = admin.describe_topic("listed")
        fetched = admin.fetch("listed", 0, 10)
    # Then both reached the live broker, without waiting for the dead one to time out
    assert offsets == [0, 1, 2, 3, 4]
    assert described["end_offset"] == 5
    assert [m.value for m in fetched] == [f"m{i}".encode() for i in range(5)]


def test_the_bootstrap_list_may_come_from_conveyor_broker(conveyor_broker, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BROKER", f"{free_address()}, {conveyor_broker.address}")
    with Admin() as admin:
        assert admin.metadata.bootstrap[1] == conveyor_broker.address
        assert admin.list_topics() == []


def test_a_subscription_given_a_dead_broker_first_subscribes_on_the_live_one(conveyor_broker):
    # Given messages on a topic, and a bootstrap list that starts with a dead address
    with Producer(conveyor_broker.address) as producer:
        for i in range(3):
            producer.send("subscribed", f"m{i}".encode())
    bootstrap = [free_address(), conveyor_broker.address]
    # When a subscription is given the list
    with Subscription("subscribed", "g", address=bootstrap) as sub:
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got += sub.receive(timeout=1)
        sub.ack(got)
        # Then it subscribed on the live broker and got everything
        assert sub.address == conveyor_broker.address
    assert [m.value for m in got] == [b"m0", b"m1", b"m2"]


def test_an_async_producer_given_a_dead_broker_first_uses_the_live_one(conveyor_broker):
    async def run() -> list[int]:
        bootstrap = [free_address(), conveyor_broker.address]
        async with AsyncProducer(bootstrap, linger_ms=0, batch_size=1) as producer:
            futures = [await producer.send("async-listed", f"m{i}".encode()) for i in range(30)]
            return list(await asyncio.gather(*futures))

    # Thirty one-message batches, at most eight awaiting a confirm at a time: all stored, in order
    assert asyncio.run(asyncio.wait_for(run(), 60)) == list(range(30))


def test_conveyor_tail_takes_a_bootstrap_list(conveyor_broker):
    with Producer(conveyor_broker.address) as producer:
        for i in range(2):
            producer.send("tailed", f"m{i}".encode()).result(timeout=30)
    bootstrap = f"{free_address()},{conveyor_broker.address}"
    tail = [sys.executable, "-m", "conveyor", "tail", "--broker", bootstrap, "tailed", "--from", "earliest"]
    done = subprocess.run([*tail, "--count", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "m0", "1", "m1"]  # offset and value


def test_a_producer_following_leaders_moves_on_when_its_leader_is_killed(conveyor_broker_factory):
    # Given two brokers in a producer's list, and the one it publishes to
    brokers = [conveyor_broker_factory(name="one"), conveyor_broker_factory(name="two")]
    with Producer([b.address for b in brokers], linger_ms=1, request_timeout_ms=120_000) as producer:
        assert producer.send("moving", b"first").result(timeout=30) == 0
        assert producer.metadata.view is not None
        used = next(b for b in brokers if b.address == producer.metadata.view.source)
        other = next(b for b in brokers if b is not used)
        # When that broker stops answering with a batch in flight, and is then killed
        used.signal(signal.SIGSTOP)
        in_flight = producer.send("moving", b"second")
        wait_for(lambda: producer._io.in_flight, timeout=30, message="the batch in flight")
        used.kill()
        # Then the batch goes to the broker METADATA now names, long before the request timeout
        assert in_flight.result(timeout=60) == 0
        assert producer.send("moving", b"third").result(timeout=30) == 1
        assert producer.metadata.view is not None and producer.metadata.view.source == other.address
    with Admin(other.address) as admin:
        assert [m.value for m in admin.fetch("moving", 0, 10)] == [b"second", b"third"]


def test_a_subscription_following_leaders_subscribes_again_where_metadata_points_when_its_broker_dies(
    conveyor_broker_factory,
):
    # Given two brokers in a subscription's list, and the one it subscribed on
    brokers = [conveyor_broker_factory(name="one"), conveyor_broker_factory(name="two")]
    with Subscription("moving", "g", address=[b.address for b in brokers]) as sub:
        wait_for(lambda: sub.receive(timeout=0.2) == [] and sub.subscribed, timeout=30, message="subscribed")
        used = next(b for b in brokers if b.address == sub.address)
        other = next(b for b in brokers if b is not used)
        # When that broker is killed and the message is published on the other
        used.kill()
        with Producer(other.address) as producer:
            producer.send("moving", b"after").result(timeout=30)
        # Then the subscription subscribes there and gets it
        got: list = []
        wait_for(lambda: got.extend(sub.receive(timeout=0.5)) or got, timeout=60, message="the message")
        sub.ack(got)
        assert sub.address == other.address
    assert [m.value for m in got] == [b"after"]


def test_an_async_producer_following_leaders_moves_on_when_its_leader_is_killed(conveyor_broker_factory):
    brokers = [conveyor_broker_factory(name="one"), conveyor_broker_factory(name="two")]

    async def run() -> tuple[int, int, str]:
        async with AsyncProducer([b.address for b in brokers], linger_ms=1, request_timeout_ms=120_000) as producer:
            assert await producer.send_and_wait("moving", b"first") == 0
            assert producer.metadata.view is not None
            used = next(b for b in brokers if b.address == producer.metadata.view.source)
            used.signal(signal.SIGSTOP)
            in_flight = await producer.send("moving", b"second")
            for _ in range(3000):  # until the batch has left for the stopped broker (30 s at most)
                if any(batch.address for batch in producer._in_flight.values()):
                    break
                await asyncio.sleep(0.01)
            used.kill()
            second = await asyncio.wait_for(in_flight, 60)
            third = await producer.send_and_wait("moving", b"third")
            return second, third, producer.metadata.view.source

    second, third, source = asyncio.run(asyncio.wait_for(run(), 120))
    assert (second, third) == (0, 1)
    other = next(b for b in brokers if b.address == source)
    with Admin(other.address) as admin:
        assert [m.value for m in admin.fetch("moving", 0, 10)] == [b"second", b"third"]
