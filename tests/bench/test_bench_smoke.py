"""``conveyor bench`` end to end on a tiny scenario: real broker, real producer and consumer processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor.benchmarks.suite.scenario import Scenario, load_config
from conveyor.benchmarks.suite.stats import exactly_once, percentiles_ms
from conveyor.benchmarks.suite.summary import check_targets, markdown_table, observations

ROOT = Path(__file__).resolve().parents[2]

RESULT_FIELDS = {
    "scenario",
    "system",
    "variant",
    "durability",
    "producer_msg_per_s",
    "e2e_msg_per_s",
    "efficiency_msg_per_s_per_participant",
    "latency_ms",
    "latency_series",
    "max_depth",
    "max_lag",
    "max_in_flight",
    "cpu",
    "bottleneck",
    "sent",
    "received",
    "unique",
    "duplicates",
    "lost",
    "exactly_once",
    "ok",
}


@pytest.mark.timeout(90)
def test_bench_runs_end_to_end(tmp_path: Path) -> None:
    config = {
        "settings": {
            "targets": [
                {"scenario": "tiny", "system": "conveyor:batch", "metric": "e2e_msg_per_s", "min": 1},
            ]
        },
        "scenarios": [
            {
                "name": "tiny",
                "producers": 1,
                "consumers": 2,
                "messages": 3000,
                "message_size": 100,
                "batch_size": 200,
                "rate": "max",
                "fsync": "batch",
                "duration": 10,
            },
            {
                "name": "tiny-paced",
                "producers": 2,
                "consumers": 1,
                "groups": 2,
                "messages": 1000,
                "rate": 2000,
                "fsync": "none",
                "duration": 10,
            },
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out, html = tmp_path / "out.json", tmp_path / "report.html"
    cmd = [sys.executable, "-m", "conveyor", "bench", "--config", str(path), "--systems", "conveyor"]
    cmd += ["--json", str(out), "--report", str(html), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["machine"]["cpus"]
    assert [r["scenario"] for r in report["results"]] == ["tiny", "tiny-paced"]
    for r in report["results"]:
        assert set(r) >= RESULT_FIELDS, RESULT_FIELDS - set(r)
        assert r["system"] == "conveyor"
        assert r["exactly_once"] and r["ok"], r["errors"]
        assert r["duplicates"] == 0 and r["lost"] == 0
        assert r["e2e_msg_per_s"] > 0 and r["producer_msg_per_s"] > 0
        assert {"avg", "p50", "p95", "p99", "p99.9"} <= set(r["latency_ms"])
        assert "server" in r["cpu"] and any(k.startswith("producer") for k in r["cpu"])
    tiny, paced = report["results"]
    assert tiny["sent"] == tiny["unique"] == 3000
    assert paced["sent"] == 1000 and paced["unique"] == 2000  # two groups: each gets everything
    assert paced["max_lag"] is not None and paced["max_in_flight"] is not None
    text = html.read_text()
    assert text.startswith("<!doctype html>") and "<svg" in text
    offline = text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "http://" not in offline and "https://" not in offline  # self-contained: nothing to fetch
    assert "| tiny | Conveyor |" in proc.stdout
    assert check_targets(report)[0]["met"] is True


def test_default_config_loads_and_has_the_required_scenarios() -> None:
    for quick in (False, True):
        config = load_config(ROOT / "benchmarks" / "default.json", quick=quick)
        shapes = {(s.producers, s.consumers, s.rate, s.message_size, s.fsync) for s in config.scenarios}
        assert (1, 2, "max", 100, "batch") in shapes and (1, 2, "max", 100, "none") in shapes
        assert (4, 8, "max", 100, "batch") in shapes
        assert any(s.rate == 5000 for s in config.scenarios)
        assert {1024, 65536} <= {s.message_size for s in config.scenarios}


def test_scenario_validation() -> None:
    with pytest.raises(ValueError):
        Scenario("bad name")
    with pytest.raises(ValueError):
        Scenario("x", fsync="sometimes")
    with pytest.raises(ValueError):
        Scenario("x", message_size=4)
    assert Scenario("x", producers=3, messages=10).per_producer == [4, 3, 3]


def test_statistics() -> None:
    from array import array

    check = exactly_once([(0, 5)], [[array("I", [0, 1, 2]), array("I", [2, 3])]])
    assert check["duplicates"] == 1 and check["lost"] == 1 and not check["exactly_once"]
    # Two producers that stopped early (at the duration bound): only what they sent is expected.
    check = exactly_once([(0, 2), (10, 13)], [[array("I", [0, 1, 10]), array("I", [11, 12])]])
    assert check["exactly_once"] and check["expected"] == 5 and check["unique"] == 5
    check = exactly_once([(0, 2)], [[array("I", [0, 1, 7])]])
    assert check["unexpected"] == 1 and not check["exactly_once"]
    lat = percentiles_ms(list(range(1, 1001)))  # 1..1000 us
    assert lat["p50"] == 0.5 and lat["p99"] == 0.99 and lat["max"] == 1.0
    assert markdown_table({"results": [], "settings": {}}).startswith("| scenario")
    assert observations({"results": [], "scenarios": [], "machine": {}}) == ["No run produced numbers."]


def _result(scenario: str, variant: str, e2e: float, p99: float) -> dict[str, object]:
    system, mode = variant.split(":")
    return {
        "scenario": scenario,
        "system": system,
        "variant": variant,
        "title": {"conveyor": "Conveyor", "redis": "Redis Streams"}[system],
        "durability": mode,
        "matching_durability": True,
        "producer_msg_per_s": e2e * 1.1,
        "e2e_msg_per_s": e2e,
        "e2e_mb_per_s": e2e * 100 / 1e6,
        "efficiency_msg_per_s_per_participant": e2e / 3,
        "msg_per_cpu_second": e2e,
        "latency_ms": {"avg": p99 / 3, "p50": p99 / 4, "p95": p99 / 2, "p99": p99, "p99.9": p99 * 2, "max": p99 * 3},
        "latency_series": [[0.1, p99 / 4, p99, p99 * 3], [0.2, p99 / 4, p99, p99 * 3]],
        "samples": [{"t": 0.2, "sent": 10, "consumed": 5, "depth": 5, "lag": 5, "in_flight": 1}],
        "max_depth": 5,
        "max_lag": 5,
        "max_in_flight": 1,
        "cpu": {"server": 1.0, "producer 1": 2.0, "consumer 1": 0.5, "consumer 2": 0.5},
        "cpu_total": 4.0,
        "bottleneck": {"process": "producer 1", "cpu_seconds": 2.0, "busy_fraction": 0.95},
        "e2e_seconds": 2.1,
        "wall_seconds": 2.5,
        "other_cpu": 0.0,
        "sent": 1000,
        "received": 1000,
        "unique": 1000,
        "duplicates": 0,
        "lost": 0,
        "exactly_once": True,
        "errors": [],
        "ok": True,
    }


def test_report_compares_with_peers_and_checks_targets() -> None:
    from conveyor.benchmarks.suite.report import render_html

    report = {
        "generated": "now",
        "duration_seconds": 1.0,
        "config": "x.json",
        "machine": {"cpus": 2, "python": "3.11", "platform": "linux"},
        "systems": {"conveyor": {"title": "Conveyor", "version": "1", "client": "send_many"}},
        "skipped_systems": {"nats": "not installed"},
        "settings": {
            "targets": [
                {
                    "scenario": "max",
                    "system": "conveyor:batch",
                    "metric": "e2e_msg_per_s",
                    "vs": "redis:always",
                    "min_ratio": 10,
                },
                {"scenario": "paced", "system": "conveyor:batch", "metric": "p99", "vs": "redis:always", "lower": True},
            ]
        },
        "scenarios": [
            {"name": "max", "rate": "max", "producers": 1, "consumers": 2, "message_size": 100, "fsync": "batch"},
            {"name": "paced", "rate": 5000, "producers": 1, "consumers": 2, "message_size": 100, "fsync": "batch"},
        ],
        "results": [
            _result("max", "conveyor:batch", 200_000, 100.0),
            _result("max", "redis:always", 25_000, 300.0),
            _result("paced", "conveyor:batch", 5000, 3.0),
            _result("paced", "redis:always", 5000, 9.0),
        ],
    }
    checks = check_targets(report)
    assert [c["met"] for c in checks] == [False, True]
    assert checks[0]["ratio"] == 8.0 and checks[1]["ratio"] == 3.0
    notes = " ".join(observations(report))
    assert "8.0x Redis Streams" in notes and "exactly once" in notes and "busiest process" in notes
    html = render_html(report)
    assert "Targets" in html and "missed" in html and html.count("<svg") >= 5
    assert "not installed" in html


def test_repeated_runs_are_interleaved_and_the_median_run_is_reported() -> None:
    from conveyor.benchmarks.suite.runner import median_runs, plan
    from conveyor.benchmarks.suite.systems.base import Variant

    class FakeSystem:
        def __init__(self, name: str) -> None:
            self.name = name

        def variants(self, scenario: Scenario) -> list[Variant]:
            return [Variant(self.name, "x", self.name, "")]

    config = load_config(ROOT / "benchmarks" / "default.json")
    one = type(config)(config.scenarios[:1], config.settings, config.source)
    systems = {"conveyor": FakeSystem("conveyor"), "redis": FakeSystem("redis")}
    order = [sys_obj.name for _s, sys_obj, _v in plan(one, systems, None, repeat=3)]  # type: ignore[arg-type]
    assert order == ["conveyor", "redis"] * 3  # rounds, not runs of one system back to back

    def run(variant: str, p99: float, paced: bool = True, ok: bool = True) -> dict[str, object]:
        return {"scenario": "s", "variant": variant, "paced": paced, "latency_ms": {"p99": p99}, "ok": ok}

    chosen = median_runs([run("a", 9.0), run("b", 1.0), run("a", 3.0), run("a", 5.0), run("b", 2.0)])
    a, b = chosen
    assert a["latency_ms"] == {"p99": 5.0} and a["repeats"] == {"metric": "p99 ms", "values": [9.0, 3.0, 5.0]}
    assert b["latency_ms"] == {"p99": 1.0}  # of two, the lower middle
    failed = median_runs([run("a", 1.0), run("a", 2.0, ok=False), run("a", 3.0)])
    assert failed[0]["ok"] is False  # a failed repetition is never hidden behind a good median
    maxed = median_runs([{**run("m", 0, paced=False), "e2e_msg_per_s": v} for v in (300.0, 100.0, 200.0)])
    assert maxed[0]["e2e_msg_per_s"] == 200.0


def test_paced_values_are_stamped_with_their_due_time() -> None:
    from conveyor.benchmarks.suite.payload import make_scheduled_values, read_stamp

    values = make_scheduled_values(range(10, 14), b"..", first_due_ns=1_000_000, interval_ns=200_000.0)
    assert [read_stamp(v) for v in values] == [(1_000_000, 10), (1_200_000, 11), (1_400_000, 12), (1_600_000, 13)]
