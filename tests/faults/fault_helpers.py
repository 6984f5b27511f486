"""What every fault test shares: load that records what was confirmed, and the oracle.

The oracle is the one RabbitMQ's Jepsen test uses: after the fault, read the
whole topic (FETCH) and drain the group, and compare with what producers had
confirmed. ``lost`` must be empty; ``duplicated`` is counted (in the log it
must be 0: producers are idempotent; in a group it is what at-least-once
allows); ``unexpected`` (values nobody sent) must be empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity
from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Producer
from conveyor.errors import ConveyorError
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for

REPORT = Path(os.environ.get("CONVEYOR_FAULT_REPORT", "/tmp/conveyor-fault-report.jsonl"))


def soak_seconds() -> float:
    return float(os.environ.get("CONVEYOR_SOAK_SECONDS", "540"))


def report(test: str, **numbers: Any) -> None:
    """Print a test's counts and append them to the run's report (one JSON line)."""
    line = {"test": test, **numbers}
    print(json.dumps(line))
    with contextlib.suppress(OSError), REPORT.open("a") as f:
        f.write(json.dumps(line) + "\n")


# --- brokers -------------------------------------------------------------------------------


class Brokers:
    """Every broker a test starts; all killed (SIGCONT first) at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[BrokerProcess] = []

    def start(
        self,
        name: str = "broker",
        *,
        fsync: str = "batch",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        data_dir: Path | None = None,
    ) -> BrokerProcess:
        broker = BrokerProcess(data_dir or self.root / name, fsync=fsync, extra=extra, env=env)
        self.started.append(broker)
        return broker.start()

    def cleanup(self) -> None:
        for broker in self.started:
            if broker.proc is not None and broker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(broker.proc.pid, signal.SIGCONT)
                broker.kill()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# --- the log and the oracle --------------------------------------------------------------


def fetch_all(address: str, topic: str, *, timeout_ms: int = 20_000) -> list[tuple[int, Any]]:
    """Every (offset, value) of the topic, in order, read with FETCH."""
    out: list[tuple[int, Any]] = []
    with Admin(address, timeout_ms=timeout_ms) as admin:
        end = admin.describe_topic(topic)["end_offset"]
        offset = admin.describe_topic(topic)["start_offset"]
        while offset < end:
            batch = admin.fetch(topic, offset, 5000)
            if not batch:
                break
            out += [(m.offset, m.value) for m in batch]
            offset = batch[-1].offset + 1
    return out


@dataclass
class Verdict:
    confirmed: int
    stored: int
    lost: list[Any]
    misplaced: list[Any]  # stored, but not at the offset the confirm named
    log_duplicates: int
    unexpected: list[Any]

    def numbers(self) -> dict[str, int]:
        return {
            "confirmed": self.confirmed,
            "stored": self.stored,
            "lost": len(self.lost),
            "misplaced": len(self.misplaced),
            "log_duplicates": self.log_duplicates,
            "unexpected": len(self.unexpected),
        }

    def assert_safe(self, *, log_duplicates_allowed: bool = False) -> None:
        assert not self.lost, f"{len(self.lost)} confirmed messages lost, e.g. {self.lost[:5]}"
        assert not self.misplaced, f"{len(self.misplaced)} confirmed at another offset, e.g. {self.misplaced[:5]}"
        assert not self.unexpected, f"values nobody sent: {self.unexpected[:5]}"
        if not log_duplicates_allowed:
            assert self.log_duplicates == 0, f"{self.log_duplicates} values stored twice despite idempotence"


def judge(confirmed: dict[Any, int], sent: set[Any], stored: list[tuple[int, Any]]) -> Verdict:
    at = dict(stored)
    counts = Counter(v for _o, v in stored)
    lost = [v for v in confirmed if counts[v] == 0]
    misplaced = [v for v, o in confirmed.items() if counts[v] and at.get(o) != v]
    return Verdict(
        confirmed=len(confirmed),
        stored=len(stored),
        lost=lost,
        misplaced=misplaced,
        log_duplicates=sum(c - 1 for c in counts.values() if c > 1),
        unexpected=[v for v in counts if v not in sent],
    )


# --- load -----------------------------------------------------------------------------------


class ProducerThread(threading.Thread):
    """Sends unique values in chunks with its own Producer and records every confirm."""

    def __init__(
        self,
        address: str,
        topic: str,
        name: str,
        *,
        chunk: int = 20,
        pause: float = 0.0,
        limit: int = 1_000_000,
        request_timeout_ms: int = 400,
        delivery_timeout_ms: int = 60_000,
        value: Callable[[str, int], Any] | None = None,
    ) -> None:
        super().__init__(name=f"producer-{name}", daemon=True)
        self.address, self.topic, self.label = address, topic, name
        self.chunk, self.pause, self.limit = chunk, pause, limit
        self.request_timeout_ms, self.delivery_timeout_ms = request_timeout_ms, delivery_timeout_ms
        self.value = value or (lambda label, n: f"{label}-{n}")
        self.stop_event = threading.Event()
        self.sent: set[Any] = set()
        self.confirmed: dict[Any, int] = {}
        self.failed: list[tuple[Any, BaseException]] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        producer = Producer(
            self.address,
            linger_ms=2,
            request_timeout_ms=self.request_timeout_ms,
            delivery_timeout_ms=self.delivery_timeout_ms,
            retry_wait=tenacity.wait_fixed(0.05),
        )
        self.producer = producer
        n = 0
        try:
            while not self.stop_event.is_set() and n < self.limit:
                values = [self.value(self.label, n + i) for i in range(min(self.chunk, self.limit - n))]
                n += len(values)
                with self.lock:
                    self.sent.update(values)
                futures = [producer.send(self.topic, v) for v in values]
                for v, future in zip(values, futures, strict=True):
                    try:
                        offset = future.result(timeout=self.delivery_timeout_ms / 1000 + 5)
                    except Exception as exc:
                        self.failed.append((v, exc))
                    else:
                        with self.lock:
                            self.confirmed[v] = offset
                if self.pause:
                    time.sleep(self.pause)
        finally:
            with contextlib.suppress(Exception):
                producer.close(timeout=self.delivery_timeout_ms / 1000 + 5)

    def stop(self, timeout: float = 90.0) -> None:
        self.stop_event.set()
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} did not stop"


class Load:
    """Several producer threads on one topic; the union of what they sent and had confirmed."""

    def __init__(self, address: str, topic: str, producers: int = 3, **kwargs: Any) -> None:
        self.threads = [ProducerThread(address, topic, f"p{i}", **kwargs) for i in range(producers)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for t in self.threads:
            t.stop_event.set()
        for t in self.threads:
            t.stop()

    @property
    def confirmed_count(self) -> int:
        return sum(len(t.confirmed) for t in self.threads)

    def confirmed(self) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for t in self.threads:
            with t.lock:
                out.update(t.confirmed)
        return out

    def sent(self) -> set[Any]:
        out: set[Any] = set()
        for t in self.threads:
            with t.lock:
                out |= t.sent
        return out

    def failures(self) -> list[tuple[Any, BaseException]]:
        return [f for t in self.threads for f in t.failed]

    def describe(self) -> str:
        """Each producer's confirms and unconfirmed batches: what to look at when load stalls."""
        lines = []
        now = time.monotonic()
        for t in self.threads:
            io = getattr(getattr(t, "producer", None), "_io", None)
            flights = [
                f"seq {f.seq} x{f.attempts} sent {now - f.sent_at:.1f}s ago"
                for f in list(getattr(io, "in_flight", {}).values())
            ]
            lines.append(
                f"{t.label}: {len(t.confirmed)} confirmed, reconnects {getattr(io, 'reconnects', '?')}, {flights}"
            )
        return "\n".join(lines)


class ConsumerThread(threading.Thread):
    """A group member that records every delivery (offset, value, attempt) and acks it."""

    def __init__(self, address: str, topic: str, group: str, *, credit: int = 200, ack_delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.address, self.topic, self.group = address, topic, group
        self.credit, self.ack_delay = credit, ack_delay
        self.stop_event = threading.Event()
        self.deliveries: list[tuple[int, Any, int]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        sub = Subscription(
            self.topic, self.group, address=self.address, credit=self.credit, heartbeat_ms=500, liveness=4
        )
        try:
            while not self.stop_event.is_set():
                try:
                    batch = sub.receive(timeout=0.1)
                    if not batch:
                        continue
                    with self.lock:
                        self.deliveries += [(m.offset, m.value, m.attempt) for m in batch]
                    if self.ack_delay:
                        time.sleep(self.ack_delay)
                    sub.ack(batch)
                except ConveyorError as exc:
                    self.errors.append(str(exc))
        finally:
            sub.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(15)


@dataclass
class GroupVerdict:
    delivered: int
    unique: int
    duplicates: int
    missing: list[int] = field(default_factory=list)


def judge_group(consumers: list[ConsumerThread], stored: list[tuple[int, Any]]) -> GroupVerdict:
    """Every stored (offset, value) must have been delivered; re-deliveries are counted.

    Pairs, not offsets: after a power cut under fsync=none an offset can be
    reused by a new message, which the group must get too.
    """
    deliveries = [d for c in consumers for d in c.deliveries]
    seen = Counter((offset, value) for offset, value, _attempt in deliveries)
    return GroupVerdict(
        delivered=len(deliveries),
        unique=len(seen),
        duplicates=len(deliveries) - len(seen),
        missing=[o for o, v in stored if (o, v) not in seen],
    )


def drain_group(address: str, topic: str, group: str, consumers: list[ConsumerThread], timeout: float = 30) -> bool:
    """Wait until the group has settled everything in the topic."""
    with Admin(address) as admin:

        def done() -> bool:
            try:
                described = admin.describe_group(topic, group)
            except ConveyorError:  # not subscribed yet: no group
                return False
            return described["committed_offset"] >= admin.describe_topic(topic)["end_offset"]

        try:
            return wait_for(done, timeout, 0.1)
        except AssertionError:
            return False


@contextlib.contextmanager
def consumers(address: str, topic: str, group: str, n: int = 2, **kwargs: Any) -> Iterator[list[ConsumerThread]]:
    threads = [ConsumerThread(address, topic, group, **kwargs) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield threads
    finally:
        for t in threads:
            t.stop()


# --- a TCP proxy that can stall and cut --------------------------------------------------------


class Proxy(threading.Thread):
    """127.0.0.1:PORT -> target, byte for byte, until told to ``stall`` or ``cut``.

    ``stall``: connections stay open and nothing moves either way (a partition
    TCP cannot see). ``cut``: every connection is reset, new ones are refused
    while cut. ``heal``: bytes flow again.
    """

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        import socket

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.mode = "pass"
        self.pairs: dict[Any, Any] = {}
        self.running = True
        self.connections = 0
        self.bytes = 0

    def stall(self) -> None:
        self.mode = "stall"

    def cut(self) -> None:
        self.mode = "cut"

    def heal(self) -> None:
        self.mode = "pass"

    def close(self) -> None:
        self.running = False
        self.join(5)

    def _drop(self, sock: Any) -> None:
        import socket
        import struct

        peer = self.pairs.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self.pairs.pop(s, None)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            s.close()

    def run(self) -> None:
        import select
        import socket

        while self.running:
            if self.mode == "cut":
                for sock in list(self.pairs):
                    self._drop(sock)
            readable = [self.listener] + (list(self.pairs) if self.mode == "pass" else [])
            try:
                ready, _, _ = select.select(readable, [], [], 0.02)
            except (OSError, ValueError):
                continue
            for sock in ready:
                if sock is self.listener:
                    try:
                        client, _addr = self.listener.accept()
                    except BlockingIOError:
                        continue
                    if self.mode == "cut":
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        client.close()
                        continue
                    upstream = socket.create_connection(self.target)
                    self.pairs[client], self.pairs[upstream] = upstream, client
                    self.connections += 1
                    continue
                if sock not in self.pairs or self.mode != "pass":
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)
                    continue
                try:
                    self.pairs[sock].sendall(data)
                    self.bytes += len(data)
                except (OSError, KeyError):
                    self._drop(sock)
        for sock in list(self.pairs):
            self._drop(sock)
        self.listener.close()
