"""The cluster benchmark: ``benchmarks/cluster.json``, the ``nats:r3`` peer, per-process CPU and leader changes.

The pure parts (variant selection, skip reasons, leader counting, the NATS
log and ``/jsz`` readers) are tested without servers; one smoke test runs
``conveyor bench`` against a real three-server NATS cluster.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conveyor.benchmarks.suite.runner import LeaderWatch, add_process_cpu, changes, missing_variants, select_variants
from conveyor.benchmarks.suite.scenario import Scenario, load_config
from conveyor.benchmarks.suite.summary import check_targets, markdown_table, observations, process_cpu
from conveyor.benchmarks.suite.systems import base, system
from conveyor.benchmarks.suite.systems.nats_cluster import (
    consumer_counts,
    count_elections,
    route_urls,
    stream_leaders,
)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_JSON = ROOT / "benchmarks" / "cluster.json"


def test_cluster_config_has_replicated_throughput_and_latency_with_the_placeholders() -> None:
    for quick in (False, True):
        config = load_config(CLUSTER_JSON, quick=quick)
        shapes = {(s.producers, s.consumers, s.rate, s.message_size, s.fsync) for s in config.scenarios}
        assert (1, 2, "max", 100, "batch") in shapes and (1, 2, 5000, 100, "batch") in shapes
        for s in config.scenarios:
            assert {"conveyor:batch", "conveyor:r3", "nats:r3", "nats:file"} <= set(s.systems)
    variants = config.settings["variants"]
    assert variants["conveyor:r3"]["replication_factor"] == 3
    assert variants["conveyor:r3"]["min_insync_replicas"] == 2
    assert "pending" not in variants["conveyor:r3"]  # built: the Conveyor cluster system runs it
    targets = config.settings["targets"]
    ratios = {(t["vs"], t["min_ratio"]) for t in targets if t["system"] == "conveyor:r3" and "vs" in t}
    assert ratios == {("conveyor:batch", 0.5), ("nats:r3", 5)}
    assert any(t["metric"] == "leader_changes" and t["max"] == 0 for t in config.settings["targets"])


def test_an_explicit_variant_runs_only_where_it_is_named() -> None:
    nats = system("nats")
    everywhere = Scenario("x")
    named = Scenario("y", systems=("nats:r3", "nats:file"))
    assert [v.id for v in select_variants(everywhere, nats, None)] == ["nats:file"]
    assert [v.id for v in select_variants(everywhere, nats, ["nats"])] == ["nats:file"]
    assert [v.id for v in select_variants(everywhere, nats, ["nats:r3"])] == ["nats:r3"]
    assert [v.id for v in select_variants(named, nats, None)] == ["nats:file", "nats:r3"]
    assert [v.id for v in select_variants(named, nats, ["nats:r3"])] == ["nats:r3"]
    paced_none = Scenario("z", fsync="none", systems=("nats:r3",))
    (r3,) = select_variants(paced_none, nats, None)
    assert "memory storage" in r3.durability


def test_a_variant_no_system_provides_yet_is_skipped_with_the_configs_reason(tmp_path: Path) -> None:
    # The cluster config as it would be with a Conveyor variant not built yet (r9), with its reason.
    text = CLUSTER_JSON.read_text().replace("conveyor:r3", "conveyor:r9")
    text = text.replace(
        '"min_insync_replicas": 2', '"min_insync_replicas": 2, "pending": "the r9 system is not built yet"', 1
    )
    path = tmp_path / "cluster.json"
    path.write_text(text)
    config = load_config(path)
    conveyor, nats = system("conveyor"), system("nats")
    runs = [(s, one, v) for s in config.scenarios for one in (conveyor, nats) for v in select_variants(s, one, None)]
    assert "conveyor:r9" not in {v.id for _s, _sys, v in runs}
    missing = missing_variants(config, runs, {})
    assert {m["variant"] for m in missing} == {"conveyor:r9"}
    assert len(missing) == len(config.scenarios)
    assert "not built yet" in missing[0]["reason"]
    # A system that is not installed gives its own reason; --systems narrows what is reported.
    no_nats = [r for r in runs if r[1] is conveyor]
    reasons = {m["variant"]: m["reason"] for m in missing_variants(config, no_nats, {"nats": "nats-server is missing"})}
    assert reasons["nats:r3"] == "nats-server is missing"
    assert missing_variants(config, no_nats, {}, wanted=["conveyor:batch"]) == []
    conveyor.why_not = lambda variant: "etcd is not installed"  # type: ignore[method-assign]
    own = missing_variants(config, runs, {}, systems={"conveyor": conveyor, "nats": nats})
    assert {m["reason"] for m in own} == {"etcd is not installed"}  # the system's own reason comes first
    report = {"results": [], "settings": config.settings, "skipped_variants": missing}
    notes = {t["system"]: t["note"] for t in check_targets(report)}
    assert "not built yet" in notes["conveyor:r9"]
    assert "conveyor:r9 in" in markdown_table(report)


def test_the_cluster_targets_compare_r3_with_one_node_and_with_nats_r3() -> None:
    from tests.bench.test_bench_smoke import _result

    config = load_config(CLUSTER_JSON)
    name = "cluster-1p-2c-100B-batch"
    results = [
        _result(name, "conveyor:batch", 300_000, 400.0),
        {**_result(name, "conveyor:r3", 160_000, 500.0), "leader_changes": 0},
        {**_result(name, "conveyor:batch", 50_000, 300.0), "variant": "nats:r3", "system": "nats", "title": "NATS"},
    ]
    report = {
        "results": results,
        "settings": config.settings,
        "scenarios": [{"name": name, "rate": "max", "producers": 1, "consumers": 2, "message_size": 100, "fsync": ""}],
        "machine": {"cpus": 2},
    }
    met = {(t["system"], t.get("vs"), t["metric"]): t["met"] for t in check_targets(report) if t["scenario"] == name}
    assert met[("conveyor:r3", "conveyor:batch", "e2e_msg_per_s")] is True  # 160,000 >= 50% of 300,000
    assert met[("conveyor:r3", "nats:r3", "e2e_msg_per_s")] is False  # 3.2x, not 5x
    assert met[("conveyor:r3", None, "leader_changes")] is True
    notes = " ".join(observations(report))
    assert "Conveyor (r3) end-to-end 160,000 msg/s" in notes and "Conveyor (batch)" in notes


class FakeServer:
    """Leaders as a list of samples, and an election counter (or none)."""

    def __init__(self, samples: list[dict[str, str] | None], elections: list[int] | None = None) -> None:
        self.samples, self.elections = samples, elections

    def leaders(self, endpoint: dict[str, Any]) -> dict[str, str] | None:
        return self.samples.pop(0) if len(self.samples) > 1 else self.samples[0]

    def leader_elections(self) -> int | None:
        if self.elections is None:
            return None
        return self.elections.pop(0) if len(self.elections) > 1 else self.elections[0]


def test_leader_changes_are_counted_from_samples_or_from_the_servers_own_count() -> None:
    assert changes({"stream": "a", "meta": "x"}, {"stream": "b", "meta": "x", "consumer g0": "c"}) == 1
    sampled = LeaderWatch(FakeServer([{"s": "a@1"}, {"s": "a@1"}, {}, {"s": "b@2"}, {"s": "a@3"}]), {})  # type: ignore[arg-type]
    for _ in range(3):
        sampled.sample()
    sampled.finish()
    assert sampled.result()["leader_changes"] == 2  # an empty (failed) sample is skipped, not a change
    assert sampled.result()["leaders"]["end"] == {"s": "a@3"}
    counted = LeaderWatch(FakeServer([{"s": "a"}], elections=[7, 9]), {})  # type: ignore[arg-type]
    counted.finish()
    assert counted.result()["leader_changes"] == 2  # the servers saw two elections the samples missed
    none = LeaderWatch(FakeServer([None]), {})  # type: ignore[arg-type]
    none.sample()
    none.finish()
    assert none.result() == {"leader_changes": None}


def test_cpu_per_message_is_reported_for_each_server_process() -> None:
    result: dict[str, Any] = {
        "cpu": {"server": 3.0, "producer 1": 2.0, "consumer 1": 0.5},
        "cpu_total": 5.5,
        "unique": 100_000,
        "e2e_seconds": 4.0,
        "bottleneck": {"process": "server", "cpu_seconds": 3.0, "busy_fraction": 0.75},
    }
    add_process_cpu(result, {"nats-1": 0.5, "nats-2": 1.0, "nats-3": 1.5})
    assert result["server_cpu"] == {"nats-1": 0.5, "nats-2": 1.0, "nats-3": 1.5}
    assert list(process_cpu(result)) == ["nats-1", "nats-2", "nats-3", "producer 1", "consumer 1"]
    assert result["cpu_us_per_message"]["nats-3"] == 15.0 and result["cpu_us_per_message"]["total"] == 55.0
    assert result["bottleneck"]["process"] == "producer 1"  # the busiest process, not the servers' sum
    single: dict[str, Any] = {"cpu": {"server": 1.0, "producer 1": 1.0}, "cpu_total": 2.0, "unique": 1000}
    add_process_cpu(single, {"server": 1.0})
    assert "server_cpu" not in single and single["cpu_us_per_message"]["server"] == 1000.0


def test_nats_logs_and_monitoring_answers_are_read_as_leaders() -> None:
    log = (
        "[1] [INF] Self is new JetStream cluster metadata leader\n"
        "[1] [INF] JetStream cluster new metadata leader: nats-1/conveyor-bench\n"
        "[1] [INF] JetStream cluster new stream leader for '$G > s1'\n"
        "[1] [INF] JetStream cluster new consumer leader for '$G > s1 > g0'\n"
    )
    assert count_elections(log) == 3  # the "new metadata leader: x" line is every other server's view of it
    assert route_urls([1, 2, 3], 1) == "nats://127.0.0.1:1,nats://127.0.0.1:3"

    def view(consumer_leader: str, pending: int) -> dict[str, Any]:
        consumer = {"name": "g0", "num_pending": pending, "num_ack_pending": 7, "cluster": {"leader": consumer_leader}}
        stream = {"name": "s1", "cluster": {"leader": "nats-2"}, "consumer_detail": [consumer]}
        return {"meta_cluster": {"leader": "nats-1"}, "account_details": [{"stream_detail": [stream]}]}

    assert stream_leaders(view("nats-3", 0), "s1") == {"meta": "nats-1", "stream": "nats-2", "consumer g0": "nats-3"}
    assert stream_leaders(view("nats-3", 0), "other") == {"meta": "nats-1"}
    views = [("nats-1", view("nats-3", 999)), ("nats-3", view("nats-3", 5))]
    assert consumer_counts(views, "s1") == {"g0": (5, 7)}  # the consumer leader's count, not a follower's


def test_conveyor_leaders_come_from_metadata(conveyor_broker: Any) -> None:
    from conveyor.benchmarks.suite.systems.conveyor import MetadataLeaders
    from conveyor.broker.client.admin import Admin

    with Admin(conveyor_broker.address) as admin:
        admin.create_topic("bench.leaders")
    ask = MetadataLeaders([conveyor_broker.address], timeout=30)
    leaders = ask(["bench.leaders", "bench.absent"])
    assert leaders == {"controller": "local", "bench.leaders/0": "local@0"}  # a single node: itself, epoch 0
    assert MetadataLeaders(["tcp://127.0.0.1:9"], timeout=0.2)(["bench.leaders"]) == {}  # no answer: no sample


def _nats_missing() -> str:
    if not shutil.which("nats-server"):
        return "nats-server is not installed (make bench-peers, or apt-get install nats-server)"
    try:
        import nats  # noqa: F401
    except ImportError:
        return "the nats-py client is not installed (make bench-peers, or pip install nats-py)"
    return ""


@pytest.mark.skipif(not shutil.which("nats-server"), reason="nats-server is not installed (make bench-peers)")
@pytest.mark.timeout(120)
def test_a_cluster_whose_port_was_taken_is_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = iter([int(held.getsockname()[1])])  # the first server's client port is in use: it exits at once
        real = base.free_port
        monkeypatch.setattr(base, "free_port", lambda: next(taken, 0) or real())
        nats = system("nats")
        server = nats.start(base.Variant("nats", "r3", "NATS JetStream", "R3", explicit=True), tmp_path / "run")
        try:
            assert set(server.processes()) == {"nats-1", "nats-2", "nats-3"}
            assert next(taken, None) is None
            first_try = (tmp_path / "try0" / "nats-cluster" / "nats-1" / "nats.log").read_text()
            assert "address already in use" in first_try
            assert (tmp_path / "try1" / "nats-cluster").is_dir()
        finally:
            nats.close()  # type: ignore[attr-defined]


@pytest.mark.skipif(bool(_nats_missing()), reason=_nats_missing() or "")
@pytest.mark.timeout(120)
def test_nats_r3_and_conveyor_r3_run_on_three_server_clusters(tmp_path: Path) -> None:
    config = {
        "settings": {"targets": [{"scenario": "tiny-r3", "system": "nats:r3", "metric": "leader_changes", "max": 0}]},
        "scenarios": [
            {
                "name": "tiny-r3",
                "messages": 2000,
                "batch_size": 200,
                "duration": 10,
                "systems": ["nats:r3", "conveyor:r3"],
            }
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "conveyor", "bench", "--config", str(path), "--systems", "nats,conveyor"]
    cmd += ["--json", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in report["results"]}
    assert set(by_variant) == {"nats:r3", "conveyor:r3"}, report.get("skipped_variants")
    ours = by_variant["conveyor:r3"]
    assert ours["ok"] and ours["exactly_once"] and ours["unique"] == 2000, ours["errors"]
    assert {"broker n1", "broker n2", "broker n3", "etcd"} <= set(ours["cpu_us_per_message"])
    assert ours["leader_changes"] == 0
    r = by_variant["nats:r3"]
    assert r["ok"] and r["exactly_once"], r["errors"]
    assert r["unique"] == 2000
    assert set(r["server_cpu"]) == {"nats-1", "nats-2", "nats-3"}
    assert {"nats-1", "nats-2", "nats-3", "producer 1", "consumer 1", "total"} <= set(r["cpu_us_per_message"])
    assert isinstance(r["leader_changes"], int)
    assert {"meta", "stream", "consumer g0"} <= set(r["leaders"]["start"])
    assert not report.get("skipped_variants")
    assert "nats-1" in proc.stdout and "conveyor:r3" in proc.stdout


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make test installs etcd-server)")
@pytest.mark.timeout(120)
def test_conveyor_r3_runs_on_three_brokers_and_etcd(tmp_path: Path) -> None:
    """The replicated Conveyor system alone (no NATS needed): three brokers, etcd, a topic with RF 3."""
    config = {
        "scenarios": [
            {"name": "tiny-r3", "messages": 2000, "batch_size": 200, "duration": 10, "systems": ["conveyor:r3"]}
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "conveyor", "bench", "--config", str(path), "--systems", "conveyor:r3"]
    cmd += ["--json", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["variant"] == "conveyor:r3" and ours["ok"] and ours["exactly_once"], ours["errors"]
    assert ours["unique"] == 2000 and ours["leader_changes"] == 0
    assert {"broker n1", "broker n2", "broker n3", "etcd"} <= set(ours["cpu_us_per_message"])
