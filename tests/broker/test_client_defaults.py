"""What every client does when it is given no address, and when its broker is not there.

``CONVEYOR_BROKER`` points every client at its broker, as it does the
command line. A wait that runs out says which broker it waited for, and
closing a producer whose broker is down costs ``close_timeout_ms``, not the
delivery timeout. All against a real broker process (or a port where none
listens).
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from conveyor.broker.client.async_producer import AsyncProducer

from conveyor import Admin, Producer, Runner, Subscription, consumer
from conveyor.errors import ConfigError, RequestTimeout
from tests.helpers import free_address, wait_for


@consumer("env-runner", group="g")
def _handler(message):  # a consumer for the Runner: never run, only subscribed
    pass


def test_every_client_takes_its_address_from_conveyor_broker(conveyor_broker, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BROKER", conveyor_broker.address)
    with Producer(linger_ms=1) as producer:
        assert producer.address == conveyor_broker.address
        assert producer.send("env-topic", b"sync").result(timeout=30) == 0

    async def produce() -> int:
        async with AsyncProducer(linger_ms=1) as producer:
            assert producer.address == conveyor_broker.address
            return await producer.send_and_wait("env-topic", b"async")

    assert asyncio.run(produce()) == 1
    with Admin() as admin:
        assert admin.address == conveyor_broker.address
        assert admin.describe_topic("env-topic")["end_offset"] == 2
    subscription = Subscription("env-topic", "env-group")
    try:
        assert subscription.address == conveyor_broker.address
        got: list = []
        wait_for(lambda: got.extend(subscription.receive(timeout=0.1)) or len(got) >= 2, timeout=30)
        assert [m.value for m in got] == [b"sync", b"async"]
    finally:
        subscription.close()
    assert Runner([_handler], metrics_port=-1).broker == conveyor_broker.address


def test_an_address_given_wins_over_conveyor_broker(conveyor_broker, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BROKER", free_address())
    with Admin(conveyor_broker.address) as admin:
        assert admin.address == conveyor_broker.address
        admin.hello()


def test_a_bad_conveyor_broker_names_the_variable(monkeypatch):
    monkeypatch.setenv("CONVEYOR_BROKER", "127.0.0.1:5555")
    for client in (Producer, Admin, AsyncProducer):
        with pytest.raises(ConfigError, match=r"CONVEYOR_BROKER.*tcp://HOST:PORT"):
            client()


def test_a_wait_on_a_down_broker_names_the_broker():
    address = free_address()
    producer = Producer(address, close_timeout_ms=500)
    future = producer.send("down", b"x")
    with pytest.raises(RequestTimeout) as timed_out:
        future.result(timeout=1)
    assert isinstance(timed_out.value, TimeoutError), "callers that catch TimeoutError keep working"
    assert address in str(timed_out.value) and "is a broker running there?" in str(timed_out.value)
    with pytest.raises(RequestTimeout, match=address):
        producer.flush(timeout=0.5)
    with pytest.raises(RequestTimeout, match=address):
        producer.close()
    assert address in str(future.exception(timeout=5)), "close() failed what it gave up on"


def test_leaving_a_with_block_is_bounded_when_the_broker_is_down():
    address = free_address()
    started = time.monotonic()
    expected = re.escape(f"1 message(s) not confirmed by {address}")
    with pytest.raises(RequestTimeout, match=expected), Producer(address, close_timeout_ms=1000) as producer:
        future = producer.send("down", b"x")
    took = time.monotonic() - started
    assert took < 20, f"close took {took:.1f} s (the delivery timeout is 120 s)"
    assert isinstance(future.exception(timeout=5), RequestTimeout)

    async def leave() -> asyncio.Future[int]:
        async with AsyncProducer(address, close_timeout_ms=1000) as producer:
            return await producer.send("down", b"x")

    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=address):
        asyncio.run(leave())
    assert time.monotonic() - started < 20


def test_an_error_in_the_block_is_not_replaced_by_the_close_timeout():
    with pytest.raises(KeyError), Producer(free_address(), close_timeout_ms=200) as producer:
        producer.send("down", b"x")
        raise KeyError("the caller's own error")


def test_close_waits_as_long_as_the_broker_keeps_confirming(conveyor_broker):
    """The bound is on silence: a live broker confirming a backlog is not cut off at close_timeout_ms."""
    with Producer(conveyor_broker.address, close_timeout_ms=2000, linger_ms=1) as producer:
        futures = producer.send_many("backlog", [b"m%d" % i for i in range(100_000)])
    assert [f.result(timeout=0) for f in futures[-3:]] == [99_997, 99_998, 99_999]
