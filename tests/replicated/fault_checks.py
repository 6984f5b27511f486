"""What the fault tests of a replicated topic share: who leads (as METADATA says), paced load, and the oracle."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from conveyor.broker.client.metadata import PartitionInfo, ask_metadata
from conveyor.broker.client.producer import Producer

from conveyor.cluster_process import ClusterProcess
from tests.helpers import wait_for
from tests.replicated.replica_logs import records


def partition(cluster: ClusterProcess, topic: str, asking: Iterable[str] | None = None) -> PartitionInfo | None:
    """Partition 0 of ``topic`` as the nodes ``asking`` (default: all) see it; the newest epoch any of them knows.

    Each node is asked on its own: a node that was stopped may still answer with the view it had.
    """
    best: PartitionInfo | None = None
    for node in asking if asking is not None else cluster.node_ids:
        try:
            view = ask_metadata([cluster.address(node)], [topic], timeout=2.0)
        except Exception:  # a node that is down or stopped answers nothing: ask the others
            continue
        found = view.topics.get(topic, {}).get(0)
        if found is not None and (best is None or found.leader_epoch > best.leader_epoch):
            best = found
    return best


def leader_of(
    cluster: ClusterProcess, topic: str, *, other_than: str | None = None, asking: Iterable[str] | None = None
) -> tuple[str, int]:
    """(leader, epoch) once METADATA names a leader (other than ``other_than``)."""
    nodes = list(asking) if asking is not None else None

    def ask() -> tuple[str, int] | None:
        found = partition(cluster, topic, nodes)
        if found is None or found.leader in (None, other_than) or found.offline:
            return None
        return found.leader, found.leader_epoch

    return wait_for(ask, timeout=90, message=f"a leader of {topic} other than {other_than}")


def wait_in_sync(cluster: ClusterProcess, topic: str, node: str, timeout: float = 120) -> PartitionInfo:
    """Until METADATA lists ``node`` in the topic's in-sync set."""

    def ask() -> PartitionInfo | None:
        found = partition(cluster, topic)
        return found if found is not None and node in found.isr else None

    return wait_for(ask, timeout=timeout, message=f"{node} in the in-sync set of {topic}")


@dataclass
class Load:
    """A producer thread sending ``prefix-i`` at a bounded pace until stopped; every future kept."""

    cluster: ClusterProcess
    topic: str
    prefix: str = "m"
    per_pause: int = 50  # sends between two 10 ms pauses: at most about 5,000 msg/s
    limit: int = 200_000
    request_timeout_ms: int = 5000
    futures: list[tuple[bytes, Future[int]]] = field(default_factory=list)
    confirm_times: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    producer: Producer | None = None
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> Load:
        self.producer = Producer(
            self.cluster.bootstrap,
            linger_ms=2,
            delivery_timeout_ms=180_000,
            request_timeout_ms=self.request_timeout_ms,
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        assert self.producer is not None
        try:
            for i in range(self.limit):
                if self.stop.is_set():
                    return
                value = f"{self.prefix}-{i}".encode()
                future = self.producer.send(self.topic, value)
                future.add_done_callback(lambda f: f.exception() or self.confirm_times.append(time.monotonic()))
                self.futures.append((value, future))
                if i % self.per_pause == 0:
                    time.sleep(0.01)  # bounded pacing of the load, not synchronisation
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def confirmed_since(self, when: float) -> int:
        return sum(1 for t in list(self.confirm_times) if t > when)

    def finish(self, timeout: float = 180) -> dict[int, bytes]:
        """Stop sending, wait for every confirm; offset -> value (each send confirmed once, at its own offset)."""
        assert self.producer is not None and self.thread is not None
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, f"the load failed: {self.error!r}"
        self.producer.flush(timeout)
        confirmed: dict[int, bytes] = {}
        for value, future in self.futures:
            offset = future.result(timeout)
            assert offset not in confirmed, f"offset {offset} confirmed for {confirmed[offset]!r} and {value!r}"
            confirmed[offset] = value
        self.producer.close()
        return confirmed


@contextlib.contextmanager
def dumped(cluster: ClusterProcess, lines: int = 80) -> Iterator[None]:
    """On a failure, print the end of each broker's output: what a failed fault test needs to be understood."""
    try:
        yield
    except BaseException:
        for node in cluster.node_ids:
            broker = cluster.brokers.get(node)
            if broker is not None:
                print(f"----- {node} -----\n" + "".join(broker.output[-lines:]))
        raise


def check_replicas(cluster: ClusterProcess, topic: str, confirmed: dict[int, bytes]) -> dict[str, int]:
    """The oracle, on the stopped cluster: every confirmed (offset, value) on every replica, at that offset;
    no offset holding two different values across replicas. Returns each replica's record count."""
    logs = {node: dict(records(cluster.node(node).data_dir, topic)) for node in cluster.node_ids}
    for node, held in logs.items():
        lost = [offset for offset, value in confirmed.items() if held.get(offset) != value]
        assert not lost, f"{node} lost or changed {len(lost)} confirmed offsets, first {sorted(lost)[:5]}"
    offsets = set().union(*(held.keys() for held in logs.values()))
    for offset in offsets:
        values = {held[offset] for held in logs.values() if offset in held}
        assert len(values) == 1, f"offset {offset} holds different values across replicas: {values}"
    return {node: len(held) for node, held in logs.items()}
