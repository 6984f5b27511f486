"""The producer follows a new leader: a unit test of ``Producer`` against stand-in ROUTERs.

Three stand-ins speak the wire protocol: every one answers METADATA naming
node ``a`` the leader; ``a`` answers every PUBLISH ``NOT_LEADER`` naming ``b``
and its address; ``b`` confirms. The producer must resend each batch to
``b`` with the same producer id and sequence, in sequence order, and each
future must resolve once, with ``b``'s offset.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import zmq
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.client.producer import Producer
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode

from conveyor.errors import NotLeader


class StandIns:
    """Three ROUTERs (m, a, b) served by one thread until ``stop``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket[Any]] = {}
        self.addresses: dict[str, str] = {}
        for name in ("m", "a", "b"):
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")
            self.sockets[name] = sock
            self.addresses[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.published: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}  # (pid, seq) in arrival order
        self.metadata_asked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        by_socket = {sock: name for name, sock in self.sockets.items()}
        for sock in self.sockets.values():
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                peer, *body = sock.recv_multipart()
                frame = decode(body)
                reply = self._answer(by_socket[sock], frame)
                if reply is not None:
                    sock.send_multipart([peer, *reply])

    def _answer(self, name: str, frame: Any) -> list[Any] | None:
        rid = frame.get("rid")
        if frame.command is Command.METADATA:
            self.metadata_asked += 1
            leader, epoch = self._leader()
            partition = {
                "leader": leader,
                "leader_addr": self.addresses[leader],
                "leader_epoch": epoch,
                "replicas": ["a", "b"],
                "isr": ["a", "b"],
                "offline": False,
            }
            nodes = {n: self.addresses[n] for n in ("m", "a", "b")}
            return commands.metadata_result(
                rid, node=name, controller="m", nodes=nodes, topics={"orders": {"partitions": {"0": partition}}}
            )
        if frame.command is not Command.PUBLISH:
            return None
        pid, seq = frame.get("pid"), frame.get("seq")
        self.published[name].append((pid, seq))
        if name == "a":
            b = self.addresses["b"]
            refusal = NotLeader("not leader", topic="orders", partition=0, leader="b", leader_addr=b, leader_epoch=2)
            return commands.error(refusal, rid)
        return commands.published(rid, "orders", base_offset=100 + seq, count=1, duplicate=False)

    def _leader(self) -> tuple[str, int]:
        """The leader METADATA names, and its epoch."""
        return "a", 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.ctx.term()


def test_batches_refused_by_a_former_leader_are_resent_in_order_to_the_new_one_with_the_same_pid_and_seq():
    stand_ins = StandIns()
    try:
        # Given a producer whose bootstrap list names the metadata stand-in first
        bootstrap = [stand_ins.addresses["m"], stand_ins.addresses["b"]]
        with Producer(bootstrap, linger_ms=0, batch_size=1, request_timeout_ms=30_000) as producer:
            # When three batches go out: METADATA says a leads, a says b does
            futures = [producer.send("orders", f"m{i}".encode()) for i in range(3)]
            offsets = [future.result(timeout=30) for future in futures]
            pid = producer.producer_id
        # Then each future resolved with b's offset for its batch
        assert offsets == [100, 101, 102]
        # And b got every batch with the producer's id and the sequence a saw, in sequence order
        assert (pid, 0) in stand_ins.published["a"]
        assert set(stand_ins.published["a"]) <= set(stand_ins.published["b"]) == {(pid, 0), (pid, 1), (pid, 2)}
        assert list(dict.fromkeys(stand_ins.published["b"])) == [(pid, 0), (pid, 1), (pid, 2)]
        assert stand_ins.metadata_asked >= 1
    finally:
        stand_ins.close()


def test_a_producer_given_several_brokers_keeps_no_more_in_flight_than_a_leader_deduplicates():
    from conveyor.broker.client.options import RESEND_WINDOW
    from conveyor.broker.log.idempotence import WINDOW

    assert RESEND_WINDOW == WINDOW
    with Producer(["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"], max_in_flight=64) as several:
        assert several.max_in_flight == WINDOW
    with Producer("tcp://127.0.0.1:9", max_in_flight=64) as one:
        assert one.max_in_flight == 64, "one broker: as before clusters"


def test_the_async_producer_follows_the_leader_the_same_way():
    stand_ins = StandIns()

    async def run() -> tuple[list[int], int]:
        bootstrap = [stand_ins.addresses["m"], stand_ins.addresses["b"]]
        async with AsyncProducer(bootstrap, linger_ms=0, batch_size=1, request_timeout_ms=30_000) as producer:
            futures = [await producer.send("orders", f"m{i}".encode()) for i in range(3)]
            offsets = [await asyncio.wait_for(future, 30) for future in futures]
            return offsets, producer.producer_id

    try:
        offsets, pid = asyncio.run(run())
        assert offsets == [100, 101, 102]
        assert (pid, 0) in stand_ins.published["a"]
        assert set(stand_ins.published["a"]) <= set(stand_ins.published["b"]) == {(pid, 0), (pid, 1), (pid, 2)}
        assert list(dict.fromkeys(stand_ins.published["b"])) == [(pid, 0), (pid, 1), (pid, 2)]
    finally:
        stand_ins.close()


class HungLeader(StandIns):
    """``a`` takes every PUBLISH and never answers (hung, or gone without a word). METADATA names ``a`` at
    epoch 1 for two more asks once ``a`` got a batch (a cluster does so until a's lease ends), then ``b``
    at epoch 2; ``b`` confirms."""

    ASKS_NAMING_A = 2

    def __init__(self) -> None:
        self.asked_after_publish = 0
        super().__init__()

    def _leader(self) -> tuple[str, int]:
        if not self.published["a"]:
            return "a", 1
        self.asked_after_publish += 1
        return ("a", 1) if self.asked_after_publish <= self.ASKS_NAMING_A else ("b", 2)

    def _answer(self, name: str, frame: Any) -> list[Any] | None:
        if name == "a" and frame.command is Command.PUBLISH:
            self.published["a"].append((frame.get("pid"), frame.get("seq")))
            return None
        return super()._answer(name, frame)


def _publish_one(kind: str, bootstrap: list[str], request_timeout_ms: int) -> tuple[int, int]:
    """One message through a ``kind`` producer: its offset, and the producer's id."""
    if kind == "Producer":
        with Producer(bootstrap, linger_ms=0, batch_size=1, request_timeout_ms=request_timeout_ms) as producer:
            return producer.send("orders", b"m0").result(timeout=30), producer.producer_id

    async def run() -> tuple[int, int]:
        async with AsyncProducer(bootstrap, linger_ms=0, batch_size=1, request_timeout_ms=request_timeout_ms) as aio:
            return await asyncio.wait_for(await aio.send("orders", b"m0"), 30), aio.producer_id

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["Producer", "AsyncProducer"])
def test_a_leader_that_does_not_answer_in_time_is_suspect_until_metadata_names_the_next(kind: str) -> None:
    stand_ins = HungLeader()
    try:
        # Given a leader that takes a batch and never answers
        bootstrap = [stand_ins.addresses["m"], stand_ins.addresses["b"]]
        offset, pid = _publish_one(kind, bootstrap, request_timeout_ms=2000)
        # Then after its request timeout the batch waited for METADATA (asked every 200 ms) to name the next
        # leader, rather than going back to the silent one while it was still named and waiting again
        assert stand_ins.published["a"] == [(pid, 0)]
        assert stand_ins.published["b"] == [(pid, 0)]
        assert offset == 100
        assert stand_ins.asked_after_publish > HungLeader.ASKS_NAMING_A
    finally:
        stand_ins.close()
