"""Requester: replies matched by request id, stale ones dropped, retries on a fresh socket, a silence named."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from conveyor.broker.net.requester import Requester
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode

from conveyor.errors import BrokerUnavailable, ShuttingDown, UnknownTopic

Answer = Callable[[Any], list[list[Any]]]  # a request's rid -> the replies to send


class FakeBroker:
    """A ROUTER that answers each request with the next scripted replies (bounded: stops with the test)."""

    def __init__(self, script: list[Answer]) -> None:
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.script = list(script)
        self.peers: set[bytes] = set()  # one identity per socket the client opened
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            peer, *frames = self.router.recv_multipart()
            self.peers.add(peer)
            rid = decode(frames).get("rid")
            for reply in self.script.pop(0)(rid) if self.script else []:
                self.router.send_multipart([peer, *reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.router.close(linger=0)


@pytest.fixture
def broker_with() -> Iterator[Callable[[list[Answer]], FakeBroker]]:
    started: list[FakeBroker] = []

    def start(script: list[Answer]) -> FakeBroker:
        started.append(FakeBroker(script))
        return started[-1]

    yield start
    for broker in started:
        broker.close()


def ok(rid: Any) -> list[list[Any]]:
    return [commands.result(rid, "ok")]


def stale_then_ok(rid: Any) -> list[list[Any]]:
    return [commands.result(rid - 1, "stale"), commands.result(rid, "ok")]


def silent(rid: Any) -> list[list[Any]]:
    return []


def shutting_down(rid: Any) -> list[list[Any]]:
    return [commands.error(ShuttingDown("going away"), rid)]


def unknown_topic(rid: Any) -> list[list[Any]]:
    return [commands.error(UnknownTopic("no such topic"), rid)]


def test_a_reply_to_an_older_request_is_dropped(broker_with):
    broker = broker_with([stale_then_ok])
    with Requester(broker.address, timeout=30) as requester:
        reply = requester.request(Command.ADMIN, {"op": "list_topics"})
    assert reply.get("result") == "ok"


def test_silence_is_broker_unavailable_and_the_next_request_gets_a_fresh_socket(broker_with):
    broker = broker_with([silent, ok])
    with Requester(broker.address, timeout=0.5) as requester:
        with pytest.raises(BrokerUnavailable, match="no answer from"):
            requester.request(Command.ADMIN, {"op": "list_topics"})
        assert requester.reconnects == 1
        assert requester.request(Command.ADMIN, {"op": "list_topics"}, timeout=30).get("result") == "ok"
    assert len(broker.peers) == 2


def test_retriable_errors_are_retried_on_a_fresh_socket_until_an_answer(broker_with):
    broker = broker_with([shutting_down, silent, ok])
    with Requester(broker.address, timeout=1.0, retry_for=60) as requester:
        assert requester.request(Command.ADMIN, {"op": "list_topics"}).get("result") == "ok"
        assert requester.reconnects == 2
    assert len(broker.peers) == 3


def test_an_error_that_is_not_retriable_is_raised_at_once_and_keeps_the_socket(broker_with):
    broker = broker_with([unknown_topic, ok])
    with Requester(broker.address, timeout=30, retry_for=60) as requester:
        with pytest.raises(UnknownTopic):
            requester.request(Command.ADMIN, {"op": "describe_topic", "topic": "x"})
        assert requester.request(Command.ADMIN, {"op": "list_topics"}).get("result") == "ok"
        assert requester.reconnects == 0
    assert len(broker.peers) == 1


def test_without_retry_for_a_retriable_error_is_raised(broker_with):
    broker = broker_with([shutting_down])
    with Requester(broker.address, timeout=30) as requester, pytest.raises(ShuttingDown):
        requester.request(Command.ADMIN, {"op": "list_topics"})


def test_a_request_encoder_gets_the_rid(broker_with):
    broker = broker_with([ok])
    with Requester(broker.address, timeout=30) as requester:
        assert requester.call(lambda rid: commands.admin("list_topics", rid=rid)).get("result") == "ok"
