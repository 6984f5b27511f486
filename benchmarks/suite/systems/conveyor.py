"""Conveyor: a broker process per run (fresh data directory, the scenario's fsync policy), or ``--broker ADDR``.

Producer: ``conveyor.Producer.send()`` per value with the producer's defaults,
as a user writes it (``send_many()`` when the scenario says so). Consumer: the
low-level ``conveyor.broker.client.subscription.Subscription`` (receive a delivered batch, ack
it as a range).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import runtime_seconds, tree
from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base

TITLE = "Conveyor"


def partition_leaders(view: Any, topics: Sequence[str]) -> dict[str, str]:
    """``{"controller": node, "<topic>/<partition>": "node@epoch"}`` from a METADATA answer (a ``ClusterView``).

    The epoch is in the value, so a re-election of the same node counts as a
    change; an offline partition reads ``"offline@epoch"``.
    """
    found = {"controller": view.controller} if view.controller else {}
    for topic in topics:
        for number, info in sorted(view.topics.get(topic, {}).items()):
            found[f"{topic}/{number}"] = f"{'offline' if info.offline else info.leader}@{info.leader_epoch}"
    return found


class MetadataLeaders:
    """Who leads a run's topics, asked with METADATA of any of ``addresses``: a Conveyor cluster's ``leaders`` hook.

    A server of several brokers gives its ``Server.leaders`` as
    ``MetadataLeaders(addresses)(topics)``; an unanswered question is an
    empty sample (skipped), never a change.
    """

    def __init__(self, addresses: Sequence[str], timeout: float = 1.0) -> None:
        self.addresses = list(addresses)
        self.timeout = timeout

    def __call__(self, topics: Sequence[str]) -> dict[str, str]:
        from conveyor.broker.client.metadata import ask_metadata

        try:
            view = ask_metadata(self.addresses, list(topics), timeout=self.timeout)
        except Exception:  # no broker answered in time: this sample is skipped
            return {}
        return partition_leaders(view, topics)


class ConveyorServer(base.Server):
    def __init__(self, workdir: Path | None, fsync: str, address: str = "") -> None:
        from conveyor.testing import BrokerProcess

        self.broker: Any = None
        if address:
            self.address = address
            self.external = True
            self.pids = []
        else:
            assert workdir is not None
            self.broker = BrokerProcess(workdir / "conveyor-data", fsync=fsync).start()
            self.address = self.broker.address
            self.pids = [self.broker.pid]
        self._admin: Any = None

    def admin(self) -> Any:
        from conveyor.broker.client.admin import Admin

        if self._admin is None:
            self._admin = Admin(self.address, timeout_ms=2000)
        return self._admin

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        topic = f"bench.{run}"
        self.admin().create_topic(topic)
        return {"address": self.address, "topic": topic, "groups": [f"g{i}" for i in range(scenario.groups)]}

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        lag = in_flight = 0
        try:
            for group in endpoint["groups"]:
                info = self.admin().describe_group(endpoint["topic"], group)
                lag += int(info.get("lag", 0))
                in_flight += int(info.get("in_flight", 0))
        except Exception:  # the group may not exist yet, or the broker is busy: skip this sample
            self._close_admin()
            return {"lag": None, "in_flight": None}
        return {"lag": lag, "in_flight": in_flight}

    def cleanup(self, endpoint: dict[str, Any]) -> None:
        if self.external:
            try:
                self.admin().delete_topic(endpoint["topic"])
            except Exception:
                pass

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def stop(self) -> None:
        self._close_admin()
        if self.broker is not None:
            self.broker.stop()


class ConveyorClusterServer(ConveyorServer):
    """Three brokers in cluster mode and their etcd (``conveyor.cluster_process.ClusterProcess``), per run.

    The run's topic is created through the controller with the variant's
    replication factor and min_insync_replicas, and ``prepare`` waits until its
    in-sync set is full, so the run starts replicated. Leader changes are
    sampled from METADATA (node and epoch).
    """

    def __init__(self, workdir: Path, fsync: str, settings: dict[str, Any]) -> None:
        from conveyor.cluster_process import ClusterProcess

        self.settings = settings
        self.cluster = ClusterProcess(workdir / "conveyor-cluster", nodes=int(settings.get("nodes", 3)), fsync=fsync)
        self.cluster.start()
        self.broker = None
        self.external = False
        self.address = self.cluster.bootstrap
        self.pids = [b.pid for b in self.cluster.brokers.values()] + [self.cluster.etcd.pid]
        self._admin = None
        self._leaders = MetadataLeaders(self.address.split(","))

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        from conveyor.broker.client.metadata import Metadata

        topic = f"bench.{run}"
        rf = int(self.settings.get("replication_factor", 3))
        self.admin().create_topic(
            topic, replication_factor=rf, min_insync_replicas=int(self.settings.get("min_insync_replicas", 2))
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = Metadata(self.address).refresh([topic]).topics.get(topic, {}).get(0)
            if info is not None and info.leader is not None and len(info.isr) == rf:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"Conveyor cluster: {topic} did not get {rf} in-sync replicas in 60 s")
        return {"address": self.address, "topic": topic, "groups": [f"g{i}" for i in range(scenario.groups)]}

    def processes(self) -> dict[str, list[int]]:
        named = {f"broker {node}": tree(b.pid) for node, b in self.cluster.brokers.items()}
        named["etcd"] = tree(self.cluster.etcd.pid)
        return named

    def leaders(self, endpoint: dict[str, Any]) -> dict[str, str] | None:
        return self._leaders([endpoint["topic"]])

    def stop(self) -> None:
        self._close_admin()
        self.cluster.stop()


def stored_per_broker(scrape: str, topic: str) -> int:
    """Messages a broker appended to ``topic``'s partition logs (``T`` and every ``T#k``), from its metrics text."""
    return int(broker_counters(scrape, topic)["stored"])


COUNTERS = {  # what a broker's /metrics says about its work: name in the run's details -> sample name
    "stored": "conveyor_published_messages_total",
    "batches": "conveyor_published_batches_total",
    "passes": "conveyor_loop_iteration_duration_seconds_count",
    "busy_seconds": "conveyor_loop_iteration_duration_seconds_sum",
    "group_commits": "conveyor_fsync_duration_seconds_count",
    "fsync_seconds": "conveyor_fsync_duration_seconds_sum",
}
PER_TOPIC = ("stored", "batches")


def broker_counters(scrape: str, topic: str) -> dict[str, float]:
    """The ``COUNTERS`` of one broker's metrics text; the per-topic ones summed over ``topic``'s partition logs."""
    out = dict.fromkeys(COUNTERS, 0.0)
    by_sample = {sample: name for name, sample in COUNTERS.items()}
    for line in scrape.splitlines():
        sample, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        name = by_sample.get(sample)
        if name is None:
            continue
        if name in PER_TOPIC:
            found = re.search(r'topic="([^"]*)"', rest)
            if not found or not (found.group(1) == topic or found.group(1).startswith(f"{topic}#")):
                continue
        out[name] += float(line.rpartition(" ")[2])
    return out


def user_system_seconds(pids: list[int]) -> tuple[float, float]:
    """utime and stime (seconds) of ``pids``, all threads, from /proc/PID/stat."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user / tick, system / tick


class ConveyorPartitionedServer(ConveyorClusterServer):
    """``nodes`` brokers in cluster mode and etcd, and a topic of ``partitions`` partitions with replication factor 1.

    The scale-out benchmark (``benchmarks/scaleout.json``): the controller spreads
    the partitions' leaders over the nodes, one per node when there are as many
    partitions as nodes, so each broker process serves one partition. ``prepare``
    waits until every partition has a leader (the run's ``leaders`` say where);
    ``stored`` reads from each broker's metrics how many of the run's messages it
    appended, which is what its CPU is divided by. Before the run each process's
    CPU at rest is measured (``idle_seconds``, 2 s): ``background``. With
    ``credit_per_partition`` the scenario's credit is each partition's: a
    consumer is given that times the partition count, so every broker sees the
    same delivery window whatever the count (a window of a couple of batches
    per partition costs a broker more CPU per message).
    """

    def __init__(self, workdir: Path, fsync: str, settings: dict[str, Any]) -> None:
        super().__init__(workdir, fsync, {"nodes": settings.get("partitions", 1), **settings})
        self._background: dict[str, float] = {}
        self._start: dict[str, dict[str, float]] = {}

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        from conveyor.broker.client.metadata import Metadata

        topic = f"bench.{run}"
        partitions = int(self.settings.get("partitions", 1))
        self.admin().create_topic(
            topic, partitions=partitions, replication_factor=int(self.settings.get("replication_factor", 1))
        )
        deadline = time.monotonic() + 60
        while True:
            found = Metadata(self.address).refresh([topic]).topics.get(topic, {})
            leaders = {number: info.leader for number, info in found.items() if info.leader and not info.offline}
            if len(leaders) == partitions:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"Conveyor cluster: {topic} has leaders for {sorted(leaders)} of {partitions}")
            time.sleep(0.05)
        self._background = self._idle_rates(float(self.settings.get("idle_seconds", 2.0)))
        endpoint = {"address": self.address, "topic": topic, "groups": [f"g{i}" for i in range(scenario.groups)]}
        if self.settings.get("credit_per_partition"):  # the Subscription splits its credit over the partitions
            endpoint["credit"] = scenario.consumer_credit * partitions
        self._start = self._work(topic)
        return endpoint

    def _work(self, topic: str) -> dict[str, dict[str, float]]:
        """Each broker's counters, user and system CPU seconds now (``details`` gives what the run added)."""
        import urllib.request

        out = {}
        for node, broker in self.cluster.brokers.items():
            text = urllib.request.urlopen(broker.metrics_url, timeout=30).read().decode()
            user, system = user_system_seconds(tree(broker.pid))
            out[f"broker {node}"] = {**broker_counters(text, topic), "user_seconds": user, "system_seconds": system}
        return out

    def details(self, endpoint: dict[str, Any]) -> dict[str, dict[str, float]]:
        """What each broker did during the run: batches, loop passes, group commits, fsync time, user/system CPU.

        From the end of ``prepare`` to now (the run, plus the clients' start): it
        tells why a broker's CPU per message moved (more passes or group commits
        per batch when each broker gets fewer batches at a time).
        """
        end = self._work(endpoint["topic"])
        return {
            name: {key: round(value - self._start.get(name, {}).get(key, 0.0), 4) for key, value in now.items()}
            for name, now in end.items()
        }

    def _idle_rates(self, seconds: float) -> dict[str, float]:
        """Each process's CPU seconds per second over ``seconds`` of no load (the topic made, no client yet)."""
        named = self.processes()
        before = {name: runtime_seconds(pids) for name, pids in named.items()}
        time.sleep(seconds)  # a measuring window, not a wait for a condition
        return {name: round((runtime_seconds(pids) - before[name]) / seconds, 5) for name, pids in named.items()}

    def background(self, endpoint: dict[str, Any]) -> dict[str, float]:
        return dict(self._background)

    def stored(self, endpoint: dict[str, Any]) -> dict[str, int]:
        return {name: int(work["stored"]) for name, work in self._work(endpoint["topic"]).items()}


class System(base.System):
    name = "conveyor"
    title = TITLE

    def __init__(self, broker: str = "") -> None:
        self.external_address = broker
        self.reuse_server = bool(broker)
        self._external: ConveyorServer | None = None

    def unavailable(self) -> str | None:
        return None

    def variants(self, scenario: Scenario) -> list[base.Variant]:
        if self.external_address:
            return [base.Variant("conveyor", "external", TITLE, f"external broker {self.external_address}")]
        durability = "fsync=batch: group commit before confirm" if scenario.fsync == "batch" else "fsync=none"
        r3 = self.settings_for("r3")
        replicated = base.Variant(
            "conveyor",
            "r3",
            TITLE,
            f"{r3.get('nodes', 3)} nodes, replication factor {r3.get('replication_factor', 3)}, "
            f"min_insync_replicas {r3.get('min_insync_replicas', 2)}, fsync={scenario.fsync} on each",
            explicit=True,
            fsync=scenario.fsync,
        )
        return [base.Variant("conveyor", scenario.fsync, TITLE, durability), replicated, *self._scale_out(scenario)]

    def _scale_out(self, scenario: Scenario) -> list[base.Variant]:
        """One explicit variant per ``conveyor:<mode>`` of the config that sets ``partitions`` (``conveyor:p2``)."""
        out = []
        for variant_id, settings in self.variant_settings.items():
            if "partitions" not in settings:
                continue
            k, nodes = int(settings["partitions"]), int(settings.get("nodes", settings["partitions"]))
            durability = (
                f"{nodes} broker{'s' if nodes > 1 else ''} and etcd, {k} partition{'s' if k > 1 else ''}, "
                f"replication factor {settings.get('replication_factor', 1)}, fsync={scenario.fsync}"
            )
            mode = variant_id.split(":", 1)[1]
            out.append(base.Variant("conveyor", mode, TITLE, durability, explicit=True, fsync=scenario.fsync))
        return out

    def why_not(self, variant: str) -> str | None:
        if variant != "conveyor:r3" and "partitions" not in self.variant_settings.get(variant, {}):
            return None
        import importlib.util
        import shutil

        if shutil.which("etcd") is None:
            return "etcd is not installed (Debian: etcd-server; make bench-cluster installs it)"
        if importlib.util.find_spec("requests") is None:
            return "the cluster extra is not installed: pip install 'conveyor[cluster]'"
        return None

    def start(self, variant: base.Variant, workdir: Path) -> base.Server:
        if self.external_address:
            if self._external is None:
                self._external = ConveyorServer(None, "", self.external_address)
            return self._external
        if variant.mode == "r3":
            return ConveyorClusterServer(workdir, variant.fsync or "batch", self.settings_for("r3"))
        if "partitions" in self.settings_for(variant.mode):
            return ConveyorPartitionedServer(workdir, variant.fsync or "batch", self.settings_for(variant.mode))
        return ConveyorServer(workdir, variant.mode)

    def version(self) -> str:
        from importlib.metadata import version

        try:
            return f"conveyor {version('conveyor')}"
        except Exception:
            return "conveyor"

    def client_api(self) -> str:
        return "conveyor.Producer.send() (send_many() where a scenario says); conveyor.Subscription receive()/ack()"


# --- clients ------------------------------------------------------------------------------------


class Producer(base.ProducerClient):
    api = "Producer.send()"

    def __init__(self, endpoint: dict[str, Any], scenario: Scenario) -> None:
        from conveyor.broker.client.producer import Producer as ConveyorProducer

        self.topic = endpoint["topic"]
        self.producer = ConveyorProducer(endpoint["address"], **scenario.conveyor_producer_options)
        self.send_many = getattr(self.producer, "send_many", None) if scenario.send_many else None
        if self.send_many is not None:
            self.api = "Producer.send_many()"

    def send(self, values: list[bytes]) -> None:
        if self.send_many is not None:
            self.send_many(self.topic, values)
        else:
            send, topic = self.producer.send, self.topic
            for value in values:
                send(topic, value)

    def flush(self) -> int:
        try:
            self.producer.flush(timeout=120)
        except TimeoutError:
            return int(self.producer._outstanding)
        return 0

    def close(self) -> None:
        self.producer.close(timeout=5)


class Consumer(base.ConsumerClient):
    def __init__(self, endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> None:
        from conveyor.broker.client.subscription import Subscription

        self.sub = Subscription(
            endpoint["topic"],
            endpoint["groups"][group],
            address=endpoint["address"],
            credit=int(endpoint.get("credit") or scenario.consumer_credit),
        )
        deadline = time.monotonic() + 30
        while not self.sub.subscribed and time.monotonic() < deadline:
            self.sub.receive(timeout=0.05)
        if not self.sub.subscribed:
            raise RuntimeError("Conveyor: not subscribed within 30 s")
        self.last: list[Any] = []

    def receive(self, timeout: float) -> list[bytes]:
        batch = self.sub.receive(timeout=timeout)
        self.last = batch
        return [m.body for m in batch]

    def ack(self) -> None:
        if self.last:
            self.sub.ack(self.last)
            self.last = []

    def close(self) -> None:
        self.sub.close()


def make_producer(endpoint: dict[str, Any], scenario: Scenario, index: int) -> base.ProducerClient:
    return Producer(endpoint, scenario)


def make_consumer(endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> base.ConsumerClient:
    return Consumer(endpoint, scenario, group, index)
