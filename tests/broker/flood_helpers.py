"""Helpers for the flood tests: a raw client that floods, CPU of a broker process, a steady pair.

The raw client speaks the wire protocol directly, as an adversary would: it
sends thousands of SUBSCRIBEs (or FETCHes) without waiting for each answer.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

import zmq
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.net.transport import recv_frames, send_frames
from conveyor.broker.wire.protocol import Command, Frame, decode, encode

from conveyor import Producer


class RawClient:
    """One DEALER connection speaking the protocol frame by frame."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)

    def send(self, command: Command, header: dict[str, Any], *payload: bytes) -> None:
        send_frames(self.sock, encode(command, header, *payload))

    def replies(self, count: int, timeout: float = 30.0) -> list[Frame]:
        """Up to ``count`` replies (heartbeats skipped), waiting at most ``timeout``."""
        got: list[Frame] = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            while len(got) < count:
                frames = recv_frames(self.sock)
                if frames is None:
                    break
                frame = decode(frames)
                if frame.command not in (Command.HEARTBEAT, Command.DELIVER, Command.EVENT):  # answers only
                    got.append(frame)
        return got

    def subscribe_many(self, topics: list[str], *, group: str = "flood", first_sub: int = 1) -> list[Frame]:
        """SUBSCRIBE to every topic without waiting, then collect one answer each."""
        for i, topic in enumerate(topics):
            self.send(Command.SUBSCRIBE, {"rid": i, "sub": first_sub + i, "topic": topic, "group": group})
        return self.replies(len(topics), timeout=60.0)

    def close(self) -> None:
        self.sock.close(linger=0)


def outcomes(replies: list[Frame]) -> collections.Counter[str]:
    """SUBSCRIBED, or the error's name, per reply."""
    return collections.Counter(
        r.command.name if r.command is not Command.ERROR else str(r.get("name")) for r in replies
    )


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(pid: int, timeout: float = 30.0) -> None:
    """Wait (at most ``timeout``) until the process uses under 10% of a core: its background work is done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.05:
            return


def cycles(producer: Producer, sub: Subscription, topic: str, count: int) -> None:
    """``count`` publish, confirm, deliver, ack round trips, one message each."""
    for i in range(count):
        producer.send(topic, f"c{i}").result(timeout=30)
        got: list[Any] = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = sub.receive(timeout=1.0)
        assert got, "a published message was not delivered in 30 s"
        sub.ack(got)


def cpu_per_cycle(pid: int, address: str, topic: str, count: int = 300) -> float:
    """Broker CPU seconds per round trip, over ``count`` round trips (the best of three runs)."""
    best = float("inf")
    with (
        Producer(address, linger_ms=0, batch_size=1) as producer,
        Subscription(topic, "steady", address=address, credit=10) as sub,
    ):
        cycles(producer, sub, topic, 20)  # warm up: the topic, the group, the caches
        for _ in range(3):
            before = cpu_seconds(pid)
            cycles(producer, sub, topic, count)
            best = min(best, (cpu_seconds(pid) - before) / count)
    return best


class SteadyPair(threading.Thread):
    """A producer publishing one message at a time: the longest wait between two confirms."""

    def __init__(self, address: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.address, self.topic = address, topic
        self.stop_event = threading.Event()
        self.longest_gap = 0.0
        self.confirmed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Producer(self.address, linger_ms=0, batch_size=1) as producer:
                last = time.monotonic()
                while not self.stop_event.is_set():
                    producer.send(self.topic, b"x").result(timeout=60)
                    now = time.monotonic()
                    self.longest_gap = max(self.longest_gap, now - last)
                    last = now
                    self.confirmed += 1
                    time.sleep(0.005)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)
