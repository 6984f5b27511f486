"""A local three-server NATS cluster with JetStream: the peer for Conveyor's replicated topics (``nats:r3``).

Each server is its own ``nats-server`` process with JetStream, its own store
directory, client port, cluster port and monitoring port (free ports on
127.0.0.1), and ``--routes`` to the two others. The cluster is ready when
every server names the same JetStream meta leader. A run's stream has
``num_replicas=3`` (each consumer inherits it): a publish is acked once a
majority of the stream's servers (2 of 3) stored it, with no fsync per message
(JetStream's default).

Leader changes are counted from the servers' logs, which say so on every
election: ``Self is new JetStream cluster metadata leader``, ``JetStream
cluster new stream leader for ...`` and ``... new consumer leader for ...``
(on the winner). Who leads the run's stream and consumers is also sampled from
``/jsz`` on the monitoring ports.

The clients are the single server's (``nats_jetstream.Producer`` and
``Consumer``), given every server's URL: nats-py picks one at random, so
producer and consumers spread over the cluster as an application's would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import tree
from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base

READY_TIMEOUT = 60.0  # every server up and one meta leader (a few seconds idle; more on a loaded 2-core box)
ELECTION_LINES = (
    "Self is new JetStream cluster metadata leader",
    "JetStream cluster new stream leader for",
    "JetStream cluster new consumer leader for",
)


class ServerExited(RuntimeError):
    """A server of the cluster exited while it started (e.g. a free port was taken meanwhile): worth a retry."""


def route_urls(cluster_ports: list[int], me: int) -> str:
    """The ``--routes`` value of server ``me``: every other server's cluster port."""
    return ",".join(f"nats://127.0.0.1:{port}" for i, port in enumerate(cluster_ports) if i != me)


def count_elections(text: str) -> int:
    """How many leader elections a nats-server log reports (each is logged once, by its winner)."""
    return sum(text.count(line) for line in ELECTION_LINES)


def stream_leaders(jsz: dict[str, Any], stream: str) -> dict[str, str]:
    """``{"meta": ..., "stream": ..., "consumer g0": ...}`` from one ``/jsz?streams=true&consumers=true`` answer."""
    found: dict[str, str] = {}
    meta = (jsz.get("meta_cluster") or {}).get("leader")
    if meta:
        found["meta"] = meta
    for account in jsz.get("account_details", []):
        for detail in account.get("stream_detail", []):
            if detail.get("name") != stream:
                continue
            leader = (detail.get("cluster") or {}).get("leader")
            if leader:
                found["stream"] = leader
            for consumer in detail.get("consumer_detail", []):
                leader = (consumer.get("cluster") or {}).get("leader")
                if leader:
                    found[f"consumer {consumer.get('name')}"] = leader
    return found


def consumer_counts(views: list[tuple[str, dict[str, Any]]], stream: str) -> dict[str, tuple[int, int]]:
    """``{consumer: (num_pending, num_ack_pending)}`` from the ``/jsz`` of the server that leads each consumer."""
    out: dict[str, tuple[int, int]] = {}
    for server, view in views:
        for account in view.get("account_details", []):
            for detail in account.get("stream_detail", []):
                if detail.get("name") != stream:
                    continue
                for consumer in detail.get("consumer_detail", []):
                    if (consumer.get("cluster") or {}).get("leader") == server:
                        pending = (int(consumer.get("num_pending", 0)), int(consumer.get("num_ack_pending", 0)))
                        out[str(consumer.get("name"))] = pending
    return out


def _get_json(url: str, timeout: float = 1.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            data = json.load(reply)
    except Exception:  # not up yet, busy, or gone: the caller decides
        return None
    return data if isinstance(data, dict) else None


class NatsNode:
    """One server of the cluster."""

    def __init__(self, root: Path, index: int, ports: tuple[int, int, int], routes: str) -> None:
        self.name = f"nats-{index + 1}"
        self.port, self.cluster_port, self.http_port = ports
        self.dir = root / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "nats.log"
        cmd = [
            shutil.which("nats-server") or "nats-server",
            "-js",
            "-sd",
            str(self.dir / "store"),
            "-n",
            self.name,
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.http_port),
            "--cluster_name",
            "conveyor-bench",
            "--cluster",
            f"nats://127.0.0.1:{self.cluster_port}",
            "--routes",
            routes,
            "-l",
            str(self.log),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.url = f"nats://127.0.0.1:{self.port}"

    def jsz(self, query: str = "") -> dict[str, Any] | None:
        return _get_json(f"http://127.0.0.1:{self.http_port}/jsz{query}")

    def elections(self) -> int:
        try:
            return count_elections(self.log.read_text(errors="replace"))
        except OSError:
            return 0


class NatsCluster:
    """Three ``nats-server -js`` processes routed to each other; shared by every ``nats:r3`` run of a bench."""

    def __init__(self, root: Path, servers: int = 3, replicas: int = 3) -> None:
        self.replicas = replicas
        self.dir = root / "nats-cluster"
        ports = [(base.free_port(), base.free_port(), base.free_port()) for _ in range(servers)]
        cluster_ports = [p[1] for p in ports]
        self.nodes: list[NatsNode] = []
        try:
            for i in range(servers):
                self.nodes.append(NatsNode(self.dir, i, ports[i], route_urls(cluster_ports, i)))
            for node in self.nodes:
                base.wait_port(node.port, node.proc, 30, node.name, node.log)
            self.meta_leader = self._wait_for_meta_leader(READY_TIMEOUT)
        except BaseException as exc:
            exited = [node.name for node in self.nodes if node.proc.poll() is not None]
            self.stop()
            if exited and isinstance(exc, RuntimeError):
                raise ServerExited(f"{', '.join(exited)} exited: {exc}") from exc
            raise
        self.pids = [node.proc.pid for node in self.nodes]
        self.urls = [node.url for node in self.nodes]
        self._views_cache: list[tuple[str, dict[str, Any]]] = []
        self._views_at = 0.0

    def _wait_for_meta_leader(self, timeout: float) -> str:
        """Block until every server names the same JetStream meta leader (the cluster can create streams)."""
        deadline = time.monotonic() + timeout
        seen: list[str | None] = []
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    tail = node.log.read_text(errors="replace")[-2000:] if node.log.exists() else ""
                    raise RuntimeError(f"{node.name} exited with {node.proc.returncode}\n{tail}")
            seen = [((node.jsz() or {}).get("meta_cluster") or {}).get("leader") for node in self.nodes]
            if seen[0] and all(s == seen[0] for s in seen):
                return str(seen[0])
            time.sleep(0.1)
        raise RuntimeError(f"no JetStream meta leader within {timeout:.0f} s (the servers name {seen})")

    def prepare_mode(self, run: str, scenario: Scenario, storage: str) -> dict[str, Any]:
        """A stream of ``replicas`` replicas and one durable pull consumer per group, each with a leader."""
        stream = run.replace(".", "_")
        subject = f"bench.{stream}"
        groups = [f"g{i}" for i in range(scenario.groups)]

        async def setup() -> None:
            import nats
            from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType

            nc = await nats.connect(self.urls)
            js = nc.jetstream()
            kind = StorageType.FILE if storage == "file" else StorageType.MEMORY
            deadline = time.monotonic() + READY_TIMEOUT
            while True:  # right after the meta election the peers may not all be current yet
                try:
                    await js.add_stream(name=stream, subjects=[subject], storage=kind, num_replicas=self.replicas)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            for group in groups:
                config = ConsumerConfig(
                    durable_name=group,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    max_ack_pending=scenario.consumer_credit * scenario.consumers,
                    max_waiting=512,
                    ack_wait=60,
                )
                await js.add_consumer(stream, config)
            while not await self._all_led(js, stream, groups):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stream {stream}: no leader for the stream or a consumer within the deadline")
                await asyncio.sleep(0.1)
            await nc.close()

        asyncio.run(setup())
        return {"url": list(self.urls), "stream": stream, "subject": subject, "groups": groups}

    async def _all_led(self, js: Any, stream: str, groups: list[str]) -> bool:
        info = await js.stream_info(stream)
        if not (info.cluster and info.cluster.leader):
            return False
        for group in groups:
            consumer = await js.consumer_info(stream, group)
            if not (consumer.cluster and consumer.cluster.leader):
                return False
        return True

    def _views(self) -> list[tuple[str, dict[str, Any]]]:
        """Every server's ``/jsz`` with streams and consumers, read at most once per sampling tick."""
        now = time.monotonic()
        if now - self._views_at > 0.1:
            views = [(node.name, node.jsz("?streams=true&consumers=true")) for node in self.nodes]
            self._views_cache = [(name, view) for name, view in views if view is not None]
            self._views_at = now
        return self._views_cache

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        """Lag and in-flight of each consumer as its leader counts them (a follower's copy lags behind)."""
        counts = consumer_counts(self._views(), endpoint["stream"])
        if len(counts) < len(endpoint["groups"]):
            return {"lag": None, "in_flight": None}
        return {"lag": sum(c[0] for c in counts.values()), "in_flight": sum(c[1] for c in counts.values())}

    def leaders(self, endpoint: dict[str, Any]) -> dict[str, str] | None:
        found: dict[str, str] = {}
        for _name, view in self._views():  # the first server that knows a leader names it
            for part, leader in stream_leaders(view, endpoint["stream"]).items():
                found.setdefault(part, leader)
        return found

    def leader_elections(self) -> int:
        return sum(node.elections() for node in self.nodes)

    def processes(self) -> dict[str, list[int]]:
        return {node.name: tree(node.proc.pid) for node in self.nodes}

    def cleanup(self, endpoint: dict[str, Any]) -> None:
        async def drop() -> None:
            import nats

            nc = await nats.connect(self.urls)
            await nc.jetstream().delete_stream(endpoint["stream"])
            await nc.close()

        asyncio.run(drop())

    def stop(self) -> None:
        for node in self.nodes:
            base.terminate(node.proc)
