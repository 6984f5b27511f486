"""NATS JetStream: one ``nats-server -js`` for the whole bench (a stream per run), when it is installed.

Durability, stated next to the numbers:

- ``file``: a stream with file storage. The server writes every message to its
  files before the publish ack, but by default does not fsync each write (it
  syncs periodically), so this is weaker than Conveyor's ``fsync=batch``. The
  peer the issue names for ``fsync=batch``.
- ``memory``: a stream with memory storage. The match for ``fsync=none``.
- ``r3``: a stream with three replicas on a local three-server cluster
  (``nats_cluster.NatsCluster``), file storage under ``fsync=batch`` and memory
  storage under ``fsync=none``. The peer for Conveyor's replicated topics. It
  runs only where a scenario or ``--systems`` names ``nats:r3`` (see
  ``benchmarks/cluster.json``); ``settings.variants["nats:r3"]`` may set
  ``servers`` and ``replicas`` (3 and 3).

Producer: nats-py ``js.publish_async()`` (acks awaited together, up to
``publish_async_max_pending`` outstanding). Consumer: one durable pull consumer
per group, shared by the group's processes (``fetch(batch=credit)``), explicit
ack per message.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base
from conveyor.benchmarks.suite.systems.nats_cluster import NatsCluster, ServerExited

TITLE = "NATS JetStream"
DURABILITY = {
    "file": "file storage, publish acks (server default sync: no fsync per message)",
    "memory": "memory storage, publish acks",
}
R3_DURABILITY = {
    "file": "R3 stream on 3 servers, file storage, publish acked by 2 of 3 (no fsync per message)",
    "memory": "R3 stream on 3 servers, memory storage, publish acked by 2 of 3",
}


class NatsServer:
    """The one nats-server process; ``base.ModeView`` is what a run sees."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "nats"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = base.free_port()
        self.http_port = base.free_port()
        log = self.dir / "nats.log"
        cmd = [
            shutil.which("nats-server") or "nats-server",
            "-js",
            "-sd",
            str(self.dir / "store"),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.http_port),
            "-l",
            str(log),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.pids = [self.proc.pid]
        base.wait_port(self.port, self.proc, 20, "nats-server", log)
        self.url = f"nats://127.0.0.1:{self.port}"

    def prepare_mode(self, run: str, scenario: Scenario, storage: str) -> dict[str, Any]:
        stream = run.replace(".", "_")
        subject = f"bench.{stream}"
        groups = [f"g{i}" for i in range(scenario.groups)]

        async def setup() -> None:
            import nats
            from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType

            nc = await nats.connect(self.url)
            js = nc.jetstream()
            kind = StorageType.FILE if storage == "file" else StorageType.MEMORY
            await js.add_stream(name=stream, subjects=[subject], storage=kind)
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
            await nc.close()

        asyncio.run(setup())
        return {"url": self.url, "stream": stream, "subject": subject, "groups": groups}

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        url = f"http://127.0.0.1:{self.http_port}/jsz?consumers=true"
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                info = json.load(reply)
        except Exception:
            return {"lag": None, "in_flight": None}
        lag = in_flight = 0
        for account in info.get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream.get("name") != endpoint["stream"]:
                    continue
                for consumer in stream.get("consumer_detail", []):
                    lag += int(consumer.get("num_pending", 0))
                    in_flight += int(consumer.get("num_ack_pending", 0))
        return {"lag": lag, "in_flight": in_flight}

    def cleanup(self, endpoint: dict[str, Any]) -> None:
        async def drop() -> None:
            import nats

            nc = await nats.connect(self.url)
            await nc.jetstream().delete_stream(endpoint["stream"])
            await nc.close()

        asyncio.run(drop())

    def stop(self) -> None:
        base.terminate(self.proc)


class System(base.SharedServerSystem):
    name = "nats"
    title = TITLE
    reuse_server = False  # each run gets a ModeView; the real server is started once (SharedServerSystem)

    def __init__(self) -> None:
        super().__init__()
        self.cluster: NatsCluster | None = None

    def unavailable(self) -> str | None:
        if not shutil.which("nats-server"):
            return "nats-server is not installed (apt-get install nats-server)"
        try:
            import nats  # noqa: F401
        except ImportError:
            return "the nats-py client is not installed (pip install nats-py)"
        return None

    def variants(self, scenario: Scenario) -> list[base.Variant]:
        mode = "file" if scenario.fsync == "batch" else "memory"
        r3 = base.Variant("nats", "r3", TITLE, R3_DURABILITY[mode], explicit=True, fsync=scenario.fsync)
        return [base.Variant("nats", mode, TITLE, DURABILITY[mode]), r3]

    def new_server(self, root: Path) -> NatsServer:
        return NatsServer(root)

    def start(self, variant: base.Variant, workdir: Path) -> base.Server:
        if variant.mode != "r3":
            return super().start(variant, workdir)
        if self.cluster is None:
            options = self.settings_for("r3")
            servers, replicas = int(options.get("servers", 3)), int(options.get("replicas", 3))
            for attempt in range(3):  # a free port can be taken by another process before a server binds it
                try:
                    self.cluster = NatsCluster(workdir.parent / f"try{attempt}", servers=servers, replicas=replicas)
                    break
                except ServerExited:
                    if attempt == 2:
                        raise
        assert self.cluster is not None
        return ClusterView(self.cluster)

    def close(self) -> None:
        super().close()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def version(self) -> str:
        import nats

        server = base.run_version([shutil.which("nats-server") or "nats-server", "--version"])
        return f"{server}; nats-py {getattr(nats, '__version__', '')}".strip()

    def client_api(self) -> str:
        return "nats-py: js.publish_async() + publish_async_completed(); pull consumer fetch(batch), msg.ack()"


class ClusterView(base.ModeView):
    """A run on the shared cluster: the stream's storage follows the scenario's fsync policy."""

    def __init__(self, cluster: NatsCluster) -> None:
        super().__init__(cluster, "r3")

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        return self.server.prepare_mode(run, scenario, "file" if scenario.fsync == "batch" else "memory")


# --- clients ------------------------------------------------------------------------------------


class Producer(base.ProducerClient):
    api = "js.publish_async()"

    def __init__(self, endpoint: dict[str, Any], scenario: Scenario) -> None:
        import nats

        self.loop = asyncio.new_event_loop()
        self.subject = endpoint["subject"]
        self.nc = self.loop.run_until_complete(nats.connect(endpoint["url"]))
        self.js = self.nc.jetstream(publish_async_max_pending=max(4000, 4 * scenario.batch_size))
        self.futures: list[Any] = []

    async def _send(self, values: list[bytes]) -> None:
        publish, subject = self.js.publish_async, self.subject
        futures = self.futures
        for value in values:
            futures.append(await publish(subject, value))

    def send(self, values: list[bytes]) -> None:
        self.loop.run_until_complete(self._send(values))

    def flush(self) -> int:
        async def wait() -> int:
            if self.futures:
                done = await asyncio.gather(*self.futures, return_exceptions=True)
                return sum(isinstance(d, BaseException) for d in done)
            return 0

        failed = self.loop.run_until_complete(wait())
        self.futures = []
        return failed

    def close(self) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()


class Consumer(base.ConsumerClient):
    def __init__(self, endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> None:
        import nats

        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(nats.connect(endpoint["url"]))
        js = self.nc.jetstream()
        self.sub = self.loop.run_until_complete(
            js.pull_subscribe_bind(durable=endpoint["groups"][group], stream=endpoint["stream"])
        )
        self.batch = scenario.consumer_credit
        self.last: list[Any] = []

    async def _fetch(self, timeout: float) -> list[Any]:
        import nats.errors

        try:
            return await self.sub.fetch(batch=self.batch, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []

    def receive(self, timeout: float) -> list[bytes]:
        self.last = self.loop.run_until_complete(self._fetch(max(timeout, 0.01)))
        return [m.data for m in self.last]

    async def _ack(self, msgs: list[Any]) -> None:
        for m in msgs:
            await m.ack()

    def ack(self) -> None:
        if self.last:
            self.loop.run_until_complete(self._ack(self.last))
            self.last = []

    def close(self) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()


def make_producer(endpoint: dict[str, Any], scenario: Scenario, index: int) -> base.ProducerClient:
    return Producer(endpoint, scenario)


def make_consumer(endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> base.ConsumerClient:
    return Consumer(endpoint, scenario, group, index)
