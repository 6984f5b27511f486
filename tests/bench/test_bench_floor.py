"""The floor of ``conveyor bench`` (the bare pyzmq forwarder, with and without its log) and ``--compare``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conveyor.benchmarks.forwarder import decode, encode
from conveyor.benchmarks.suite.compare import compare, comparison_table
from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import system


def result(scenario: str, variant: str, e2e: float, p50: float, p99: float, paced: bool = False) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "variant": variant,
        "paced": paced,
        "e2e_msg_per_s": e2e,
        "latency_ms": {"p50": p50, "p99": p99},
    }


def test_compare_gives_ratios_of_runs_in_both_and_judges_each_scenario_by_its_metric() -> None:
    old = {
        "results": [
            result("max", "conveyor:batch", 100_000, 10.0, 20.0),
            result("max", "redis:always", 40_000, 1.0, 2.0),
            result("paced", "conveyor:batch", 5_000, 1.0, 2.0, paced=True),
            result("gone", "conveyor:batch", 1, 1, 1),
        ]
    }
    new = {
        "results": [
            result("max", "conveyor:batch", 85_000, 30.0, 60.0),  # slower: a regression; its latency is not judged
            result("max", "redis:always", 39_000, 1.0, 2.0),  # 0.975x: within 10 %
            result("paced", "conveyor:batch", 4_000, 1.05, 2.4, paced=True),  # p99 1.2x: a regression; not throughput
            result("new", "conveyor:batch", 1, 1, 1),  # not in OLD: not compared
            {"scenario": "max", "variant": "nats:file", "errors": ["failed"], "ok": False},  # no numbers
        ]
    }
    rows = {(r.scenario, r.variant): r for r in compare(new, old, threshold=0.10)}
    assert set(rows) == {("max", "conveyor:batch"), ("max", "redis:always"), ("paced", "conveyor:batch")}
    slower = rows[("max", "conveyor:batch")]
    assert slower.throughput == pytest.approx(0.85) and slower.p99 == pytest.approx(3.0)
    assert slower.regressions == ("throughput",)
    assert rows[("max", "redis:always")].regressions == ()
    assert rows[("paced", "conveyor:batch")].regressions == ("p99",)
    assert compare(new, old, threshold=0.25)[0].regressions == ()  # the threshold is the option's
    table = comparison_table(list(rows.values()), 0.10, "old.json")
    assert "REGRESSION (throughput)" in table and "**0.85x**" in table and "2 regression(s) in 3" in table


def test_compare_survives_missing_numbers() -> None:
    old = {"results": [result("s", "v", 0, 0, 0)]}
    new = {"results": [{"scenario": "s", "variant": "v", "e2e_msg_per_s": 5.0, "latency_ms": {}}]}
    (row,) = compare(new, old)
    assert row.throughput is None and row.p50 is None and row.regressions == ()
    assert "(no scenario and variant in both runs)" in comparison_table([], 0.1)


def test_batch_framing_round_trips() -> None:
    values = [b"", b"a", b"x" * 70_000]
    assert decode(encode(values)) == values


def test_the_floor_matches_each_fsync_policy_and_only_one_group() -> None:
    floor = system("forwarder")
    assert [(v.id, v.matches) for v in floor.variants(Scenario("b", fsync="batch"))] == [
        ("forwarder:fsync", True),
        ("forwarder:ram", False),
    ]
    assert [v.id for v in floor.variants(Scenario("n", fsync="none"))] == ["forwarder:ram"]
    assert floor.variants(Scenario("g", groups=2)) == []


@pytest.mark.timeout(120)
def test_both_forwarders_deliver_every_message_exactly_once_and_compare(tmp_path: Path) -> None:
    config = {
        "scenarios": [
            {"name": "floor-max", "messages": 4000, "batch_size": 200, "consumers": 2, "duration": 20},
            {"name": "floor-paced", "messages": 300, "rate": 1000, "fsync": "none", "consumers": 2, "duration": 20},
        ]
    }
    path, out = tmp_path / "floor.json", tmp_path / "out.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "conveyor", "bench", "--config", str(path), "--systems", "forwarder"]
    cmd += ["--no-progress", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    ran = {(r["scenario"], r["variant"]): r for r in report["results"]}
    assert set(ran) == {
        ("floor-max", "forwarder:fsync"),
        ("floor-max", "forwarder:ram"),
        ("floor-paced", "forwarder:ram"),
    }
    for r in ran.values():
        assert r["exactly_once"] and r["ok"] and r["lost"] == 0 and r["duplicates"] == 0, r
        assert r["unique"] == r["sent"] and r["failed_confirms"] == 0
    assert ran[("floor-max", "forwarder:fsync")]["sent"] == 4000

    # --compare with the run itself as OLD: every ratio is there; with a fake, faster OLD --fail-on-regression fails.
    faster = {"results": [{**r, "e2e_msg_per_s": r["e2e_msg_per_s"] * 100} for r in report["results"]]}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(faster))
    cmd = [*cmd[:-2], "--scenarios", "floor-max", "--systems", "forwarder:ram", "--compare", str(old)]
    informational = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert informational.returncode == 0, informational.stdout + informational.stderr
    assert "| floor-max | forwarder:ram |" in informational.stdout and "REGRESSION (throughput)" in informational.stdout
    failing = subprocess.run([*cmd, "--fail-on-regression"], capture_output=True, text=True, timeout=110)
    assert failing.returncode == 1, failing.stdout + failing.stderr


def test_a_max_ratio_target_holds_a_latency_within_a_factor_of_the_floor() -> None:
    from conveyor.benchmarks.suite.summary import check_targets, describe_target

    target = {"scenario": "l", "system": "conveyor:batch", "metric": "p99", "vs": "forwarder:fsync", "max_ratio": 1.25}
    report = {
        "settings": {"targets": [target, {**target, "metric": "p50"}]},
        "results": [
            {**result("l", "conveyor:batch", 5000, 1.3, 2.4, paced=True), "system": "conveyor"},
            {**result("l", "forwarder:fsync", 5000, 1.0, 2.0, paced=True), "system": "forwarder"},
        ],
    }
    p99, p50 = check_targets(report)
    assert (p99["ratio"], p99["met"]) == (1.2, True)
    assert (p50["ratio"], p50["met"]) == (1.3, False)
    assert describe_target(target) == "l: conveyor:batch p99 <= 1.25x forwarder:fsync"


def test_an_unreadable_compare_file_is_a_config_error_before_anything_runs(tmp_path: Path) -> None:
    bad = tmp_path / "old.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "nosuch.json"):
        cmd = [sys.executable, "-m", "conveyor", "bench", "--systems", "forwarder", "--compare", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "CONFIG_ERROR" in done.stderr and path.name in done.stderr, done.stderr
