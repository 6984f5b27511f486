"""A real cluster on one machine: etcd and N broker processes on free loopback ports.

``ClusterProcess`` is what the cluster tests, the benchmark and ``make cluster``
start: an ``EtcdProcess`` (or one you pass in) and one ``BrokerProcess`` per
node, each with its own data directory under ``directory``, a fixed port (so a
restarted node comes back where clients and followers look for it) and
``--cluster``/``--node-id``/``--advertise``. ``bootstrap`` is the list a
client is given. It needs no pytest.

``conveyor cluster local`` runs one that lasts: it passes the ports it used
the first time (``addresses``, ``metrics_ports``, the etcd's own), sends each
broker's output to ``log_dir`` and starts every process in a session of its
own (``new_session``), so that Ctrl-C in the terminal reaches only the
command, which then stops the brokers and etcd in order.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Mapping
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
        addresses: Mapping[str, str] | None = None,
        metrics_ports: Mapping[str, int] | None = None,
        etcd_ports: tuple[int, int] = (0, 0),
        log_dir: str | os.PathLike[str] | None = None,
        new_session: bool = False,
    ) -> None:
        """``addresses``/``metrics_ports``: a node's fixed ``tcp://HOST:PORT`` and metrics port (default: free
        ones); ``etcd_ports``: the client and peer ports of the etcd it starts; ``log_dir``: each broker's
        output goes to ``<node>.log`` there."""
        self.directory = Path(directory)
        self.node_ids = [f"n{i + 1}" for i in range(nodes)]
        self._own_etcd = etcd is None
        self.etcd = etcd or EtcdProcess(
            self.directory / "etcd", client_port=etcd_ports[0], peer_port=etcd_ports[1], new_session=new_session
        )
        self.addresses = dict(addresses or {})
        self.metrics_ports = dict(metrics_ports or {})
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.new_session = new_session
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
        """The node's fixed address (known before it first starts: it is in etcd and in clients' lists)."""
        broker = self.brokers[node]
        return broker.address or broker._bind

    def start(self, timeout: float = 60.0, *, nodes: list[str] | None = None) -> ClusterProcess:
        """Start etcd and the brokers (``nodes``: only these; ``start_node`` starts the others later)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._own_etcd and not self.etcd.running():
            self.etcd.start()
        wanted = list(nodes if nodes is not None else self.node_ids)
        for node in self.node_ids:
            self.brokers[node] = self._broker(node)
        try:
            for node in wanted:
                self._first_start(node, timeout)
            self.wait_registered(wanted, timeout)
        except BaseException:
            self.kill()  # a half-started cluster would outlive the test that failed to start it
            raise
        return self

    def _first_start(self, node: str, timeout: float) -> None:
        """Start ``node``; a free port another process took since it was probed is swapped for a new one.

        Only a port this class chose may change, and only before anything could have used it: ``start``
        has not returned, so no client holds the bootstrap list yet.
        """
        for _attempt in range(5):
            broker = self.brokers[node]
            try:
                broker.start(timeout)
                return
            except RuntimeError:
                taken = "Address already in use" in "".join(broker.output[-5:])
                if not taken or node in self.addresses:
                    raise
                self.brokers[node] = self._broker(node)
        raise RuntimeError(f"{node}: no free port could be bound in 5 attempts")

    def start_node(self, node: str, timeout: float = 60.0) -> BrokerProcess:
        """Start one node that ``start(nodes=...)`` left down (or a stopped one) and wait until it registers."""
        broker = self.brokers[node].start(timeout)
        self.wait_registered([node], timeout)
        return broker

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
        address = self.addresses.get(node) or f"tcp://127.0.0.1:{free_port()}"
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        broker = BrokerProcess(
            self.directory / node,
            fsync=self.fsync,
            log_path=self.log_dir / f"{node}.log" if self.log_dir is not None else None,
            new_session=self.new_session,
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
        if node in self.metrics_ports:
            broker._metrics_port = str(self.metrics_ports[node])
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
            self.etcd.stop()  # SIGTERM: etcd closes its WAL cleanly
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
