"""A real cluster on one machine: etcd and N broker processes on free loopback ports.

``ClusterProcess`` is what the cluster tests, the benchmark and ``make cluster``
start: an ``EtcdProcess`` (or one you pass in) and one ``BrokerProcess`` per
node, each with its own data directory under ``directory``, a fixed port (so a
restarted node comes back where clients and followers look for it) and
``--cluster``/``--node-id``/``--advertise``. ``bootstrap`` is the list a
client is given. It needs no pytest.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

from conveyor.broker_process import BrokerProcess
from conveyor.etcd_process import EtcdProcess, free_port


class ClusterProcess:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        nodes: int = 3,
        etcd: EtcdProcess | None = None,
        fsync: str = "batch",
        extra: list[str] | None = None,
        node_extra: dict[str, list[str]] | None = None,
        lease_ms: int = 2000,
    ) -> None:
        self.directory = Path(directory)
        self.node_ids = [f"n{i + 1}" for i in range(nodes)]
        self._own_etcd = etcd is None
        self.etcd = etcd or EtcdProcess(self.directory / "etcd")
        self.fsync = fsync
        self.extra = list(extra or [])
        self.node_extra = dict(node_extra or {})
        self.lease_ms = lease_ms
        self.brokers: dict[str, BrokerProcess] = {}
        self.cluster_name = "default"

    @property
    def etcd_url(self) -> str:
        return "etcd://" + self.etcd.endpoint.removeprefix("http://")

    @property
    def bootstrap(self) -> str:
        """``tcp://a,tcp://b,tcp://c``: what clients are given."""
        return ",".join(self.address(node) for node in self.node_ids)

    def address(self, node: str) -> str:
        return self.brokers[node].address

    def start(self, timeout: float = 60.0) -> ClusterProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._own_etcd and not self.etcd.running():
            self.etcd.start()
        for node in self.node_ids:
            self.brokers[node] = self._broker(node)
        for broker in self.brokers.values():
            broker.start(timeout)
        self.wait_registered(self.node_ids, timeout)
        return self

    def registered(self) -> set[str]:
        """The nodes whose key is in etcd now (alive as far as the cluster knows)."""
        prefix = f"/conveyor/{self.cluster_name}/nodes/".encode()
        answer = self.etcd.post(
            "kv/range",
            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(_prefix_end(prefix)).decode()},
        )
        return {base64.b64decode(kv["key"]).decode().rpartition("/")[2] for kv in answer.get("kvs", [])}

    def wait_registered(self, nodes: list[str], timeout: float = 60.0) -> None:
        """Until every node in ``nodes`` is registered: a topic created earlier would get fewer replicas."""
        deadline = time.monotonic() + timeout
        while not set(nodes) <= self.registered():
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {sorted(set(nodes) - self.registered())} did not register in {timeout} s")
            time.sleep(0.05)

    def _broker(self, node: str) -> BrokerProcess:
        address = f"tcp://127.0.0.1:{free_port()}"
        broker = BrokerProcess(
            self.directory / node,
            fsync=self.fsync,
            extra=[
                "--cluster",
                self.etcd_url,
                "--node-id",
                node,
                "--advertise",
                address,
                "--cluster-lease-ms",
                str(self.lease_ms),
                *self.extra,
                *self.node_extra.get(node, []),
            ],
        )
        broker._bind = address  # a node keeps its address across restarts: it is in etcd and in clients' lists
        return broker

    def node(self, node: str) -> BrokerProcess:
        return self.brokers[node]

    def stop(self) -> None:
        """SIGTERM every broker (each hands off what it leads), then etcd if this cluster started it."""
        errors: list[BaseException] = []
        for broker in self.brokers.values():
            try:
                broker.stop()
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        if self._own_etcd:
            self.etcd.close()
        if errors:
            raise errors[0]

    def kill(self) -> None:
        for broker in self.brokers.values():
            broker.kill()
        if self._own_etcd:
            self.etcd.close()

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


__all__ = ["ClusterProcess"]
