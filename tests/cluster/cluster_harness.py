"""Agents for the cluster model tests, on the real etcd of the ``etcd`` fixture (tests/cluster/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from conveyor.broker.cluster.agent import ClusterAgent
from conveyor.broker.cluster.etcd import Etcd
from conveyor.broker.cluster.events import ClusterEvent, ClusterSettings

from conveyor.etcd_process import EtcdProcess


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Node:
    """One agent and every event it handed out, kept in order."""

    def __init__(self, agent: ClusterAgent) -> None:
        self.agent = agent
        self.seen: list[ClusterEvent] = []

    def events(self) -> list[ClusterEvent]:
        self.seen.extend(self.agent.poll())
        return self.seen

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events() if isinstance(e, kind)]


def settings(node_id: str, endpoints: tuple[str, ...], lease_ms: int = 1000) -> ClusterSettings:
    return ClusterSettings(
        endpoints=endpoints,
        node_id=node_id,
        advertise=f"tcp://127.0.0.1:{5000 + sum(map(ord, node_id))}",
        cluster_name="test",
        lease_ms=lease_ms,
    )


@contextmanager
def started(agents: list[ClusterAgent]) -> Iterator[list[Node]]:
    nodes = [Node(a) for a in agents]
    for a in agents:
        a.start()
    try:
        yield nodes
    finally:
        for a in agents:
            a.close()


@dataclass
class Backend:
    """The test's etcd and the clients made of it (closed after the test)."""

    process: EtcdProcess
    clients: list[Etcd] = field(default_factory=list)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return (self.process.endpoint,)

    def client(self) -> Etcd:
        self.clients.append(Etcd(list(self.endpoints)))
        return self.clients[-1]

    def agent(self, node_id: str, lease_ms: int = 1000) -> ClusterAgent:
        return ClusterAgent(settings(node_id, self.endpoints, lease_ms), etcd=self.client())


@pytest.fixture(name="backend")
def backend_fixture(etcd: EtcdProcess) -> Iterator[Backend]:
    backend = Backend(etcd)
    yield backend
    for client in backend.clients:
        client.close()
