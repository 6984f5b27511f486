"""Real brokers in this process whose replication roles a test sets directly (no etcd yet)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import zmq
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.server.broker import Broker
from conveyor.broker.server.partitions import Partitions
from conveyor.broker.server.replication import IsrChange
from conveyor.broker.wire.protocol import Frame, decode
from conveyor.broker.wire.record import pack_records
from prometheus_client import CollectorRegistry

from tests.helpers import wait_for

T = TypeVar("T")


@dataclass
class Node:
    """One broker, its loop thread and its roles; ``proposed`` holds the ISR changes it asked for."""

    node_id: str
    data_dir: Path
    lag_max_ms: int = 10_000
    fsync: str = "batch"
    broker: Broker = field(init=False)
    address: str = ""
    thread: threading.Thread | None = None
    proposed: list[IsrChange] = field(default_factory=list)
    write_isr: bool = True  # act as the agent: every proposal is written at once

    def start(self) -> Node:
        settings = BrokerSettings(
            bind="tcp://127.0.0.1:*", data_dir=str(self.data_dir), metrics_port=-1, fsync=self.fsync
        )
        self.broker = Broker(settings, registry=CollectorRegistry())
        self.address = self.broker.bind()
        self.broker.replicate(self.node_id, propose=self._propose, lag_max_ms=self.lag_max_ms)
        self.thread = threading.Thread(target=self.broker.serve_forever, kwargs={"install_signals": False}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.broker.running, message=f"broker {self.node_id} running")
        return self

    def stop(self) -> None:
        if self.thread is not None:
            self.broker.stop()
            self.thread.join(30)
            assert not self.thread.is_alive(), f"broker {self.node_id} stopped"
            self.thread = None

    @property
    def partitions(self) -> Partitions:
        assert self.broker.partitions is not None
        return self.broker.partitions

    def on_loop(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``fn`` on the broker's loop thread and return what it returned."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the test's thread
                box["error"] = exc
            finally:
                done.set()

        self.broker.call_soon(run)
        assert done.wait(timeout), f"the loop of {self.node_id} ran the call"
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    def _propose(self, change: IsrChange) -> None:
        """On the loop thread: the agent would CAS it; here it is written at once (or left pending)."""
        self.proposed.append(change)
        if self.write_isr:
            self.broker.call_soon(lambda: self.partitions.isr_written(change.topic, change.partition, change.isr))

    def log_offsets(self, topic: str) -> tuple[int, int]:
        """(end, durable) of the topic's log, read on the loop."""

        def read() -> tuple[int, int]:
            log_ = self.broker.store.logs.get(topic)
            return (0, 0) if log_ is None else (log_.end_offset, log_.durable_offset)

        return self.on_loop(read)

    def segments(self, topic: str) -> dict[str, bytes]:
        """The topic's segment files, by name (read after the broker stopped or synced)."""
        directory = self.data_dir / "topics" / topic
        return {p.name: p.read_bytes() for p in sorted(directory.glob("*.log"))}


def request(address: str, frames: list[Any], timeout: float = 30.0) -> Frame:
    """Send one request on a fresh DEALER and return the decoded answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        assert sock.poll(int(timeout * 1000)), f"an answer from {address}"
        return decode(sock.recv_multipart())
    finally:
        sock.close()


def batch(*values: bytes) -> bytes:
    return pack_records([(None, None, value) for value in values])


def lead(node: Node, topic: str, *, epoch: int, replicas: list[str], isr: list[str], min_insync: int) -> None:
    node.on_loop(
        lambda: node.partitions.become_leader(topic, epoch=epoch, replicas=replicas, isr=isr, min_insync=min_insync)
    )


def follow(node: Node, topic: str, leader: Node, *, epoch: int) -> None:
    node.on_loop(
        lambda: node.partitions.become_follower(topic, leader=leader.node_id, address=leader.address, epoch=epoch)
    )
