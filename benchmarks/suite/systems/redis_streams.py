"""Redis Streams: a fresh ``redis-server`` per run on a free loopback port, in a temporary directory.

Durability, stated next to the numbers:

- ``always``: ``appendonly yes`` + ``appendfsync always`` (the AOF is fsynced
  before replies go out; Redis does this once per event-loop pass, a group
  commit like Conveyor's ``fsync=batch``). The match for ``fsync=batch``.
- ``everysec``: ``appendonly yes`` + ``appendfsync everysec`` (up to a second
  of acknowledged writes can be lost). Shown as an extra row.
- ``none``: no AOF, no RDB snapshots (``save ""``). The match for ``fsync=none``.

Producer: ``XADD`` pipelined with redis-py, one pipeline (one round trip) per
batch. Consumer: ``XREADGROUP`` in a consumer group (``COUNT`` = credit,
``BLOCK``), and ``XACK`` of the previous batch sent in the same pipeline as
the next read.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base

TITLE = "Redis Streams"
DURABILITY = {
    "always": "appendonly yes, appendfsync always",
    "everysec": "appendonly yes, appendfsync everysec",
    "none": "no persistence (no AOF, no RDB)",
}
FIELD = b"d"


class RedisServer(base.Server):
    def __init__(self, mode: str, workdir: Path) -> None:
        import redis

        self.dir = workdir / f"redis-{mode}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = base.free_port()
        cmd = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if mode == "none":
            cmd += ["--appendonly", "no"]
        else:
            cmd += ["--appendonly", "yes", "--appendfsync", mode]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.pids = [self.proc.pid]
        base.wait_port(self.port, self.proc, 20, "redis-server", self.dir / "redis.log")
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        self.client.ping()

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        stream = f"bench:{run}"
        groups = [f"g{i}" for i in range(scenario.groups)]
        for group in groups:
            self.client.xgroup_create(stream, group, id="0", mkstream=True)
        return {"host": "127.0.0.1", "port": self.port, "stream": stream, "groups": groups}

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        lag = in_flight = 0
        try:
            for info in self.client.xinfo_groups(endpoint["stream"]):
                lag += int(info.get("lag") or 0)
                in_flight += int(info.get("pending") or 0)
        except Exception:
            return {"lag": None, "in_flight": None}
        return {"lag": lag, "in_flight": in_flight}

    def stop(self) -> None:
        try:
            self.client.close()
        finally:
            base.terminate(self.proc)


class System(base.System):
    name = "redis"
    title = TITLE

    def unavailable(self) -> str | None:
        if not shutil.which("redis-server"):
            return "redis-server is not installed (make bench-deps)"
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis Python client is not installed (make bench-deps)"
        return None

    def variants(self, scenario: Scenario) -> list[base.Variant]:
        if scenario.fsync == "batch":
            return [
                base.Variant("redis", "always", TITLE, DURABILITY["always"]),
                base.Variant("redis", "everysec", TITLE, DURABILITY["everysec"], matches=False),
            ]
        return [base.Variant("redis", "none", TITLE, DURABILITY["none"])]

    def start(self, variant: base.Variant, workdir: Path) -> base.Server:
        return RedisServer(variant.mode, workdir)

    def version(self) -> str:
        import redis

        server = base.run_version([shutil.which("redis-server") or "redis-server", "--version"])
        return f"{server.split(' sha=')[0]}; redis-py {redis.__version__}"

    def client_api(self) -> str:
        return "redis-py: XADD in a pipeline per batch; XREADGROUP COUNT/BLOCK with XACK pipelined"


# --- clients ------------------------------------------------------------------------------------


class Producer(base.ProducerClient):
    api = "XADD pipelined (one pipeline per batch)"

    def __init__(self, endpoint: dict[str, Any]) -> None:
        import redis

        self.client = redis.Redis(host=endpoint["host"], port=endpoint["port"], socket_timeout=60)
        self.stream = endpoint["stream"]

    def send(self, values: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        xadd, stream = pipe.xadd, self.stream
        for value in values:
            xadd(stream, {FIELD: value})
        pipe.execute()

    def flush(self) -> int:
        return 0  # every pipeline was answered (and fsynced under appendfsync always) before send() returned

    def close(self) -> None:
        self.client.close()


class Consumer(base.ConsumerClient):
    def __init__(self, endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> None:
        import redis

        self.client = redis.Redis(host=endpoint["host"], port=endpoint["port"], socket_timeout=60)
        self.stream = endpoint["stream"]
        self.group = endpoint["groups"][group]
        self.name = f"c{index}"
        self.count = scenario.consumer_credit
        self.pending: list[bytes] = []  # ids received, acked with the next read
        self.received: list[Any] = []
        self.client.ping()

    def receive(self, timeout: float) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        if self.pending:
            pipe.xack(self.stream, self.group, *self.pending)
            self.pending = []
        pipe.xreadgroup(self.group, self.name, {self.stream: ">"}, count=self.count, block=max(1, int(timeout * 1000)))
        reply = pipe.execute()[-1]
        if not reply:
            return []
        entries = reply[0][1]
        self.received = entries
        return [fields[FIELD] for _id, fields in entries]

    def ack(self) -> None:
        self.pending += [entry_id for entry_id, _ in self.received]
        self.received = []

    def close(self) -> None:
        if self.pending:
            self.client.xack(self.stream, self.group, *self.pending)
        self.client.close()


def make_producer(endpoint: dict[str, Any], scenario: Scenario, index: int) -> base.ProducerClient:
    return Producer(endpoint)


def make_consumer(endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> base.ConsumerClient:
    return Consumer(endpoint, scenario, group, index)
