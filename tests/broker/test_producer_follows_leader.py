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
            partition = {
                "leader": "a",
                "leader_addr": self.addresses["a"],
                "leader_epoch": 1,
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
