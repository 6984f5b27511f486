"""The scale-out benchmark (``conveyor bench --scale-out``): CPU per stored message per broker, 1/2/4 partitions.

The pure parts (what each broker stored, read from its metrics; CPU per stored
message; the section's medians, ratios, checks and projection; the paced
single-broker run that matches each k-broker run's per-broker load, and the
ratios to it) are tested on made-up numbers. One smoke test runs the real
thing on tiny counts: etcd and k brokers in cluster mode, a topic of k
partitions, a producer and two consumers as processes, then the paced match.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conveyor.benchmarks.cli import SCALE_OUT_CONFIG
from conveyor.benchmarks.suite.report import render_html
from conveyor.benchmarks.suite.runner import _load_matching, add_stored_cpu, median_runs, plan
from conveyor.benchmarks.suite.scaleout import (
    load_matched_identity,
    load_matched_scenario,
    markdown,
    projection,
    scale_out,
)
from conveyor.benchmarks.suite.scenario import Scenario, load_config
from conveyor.benchmarks.suite.summary import check_targets, markdown_table
from conveyor.benchmarks.suite.systems import system
from conveyor.benchmarks.suite.systems.conveyor import broker_counters, stored_per_broker

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = "scaleout-1p-2c-100B-batch"
# The partition counts the smoke test runs on real clusters (4 brokers would take longer to start).
SMOKE_VARIANTS = ("conveyor:p1", "conveyor:p2")


def test_the_config_runs_1_2_and_4_partitions_one_broker_each_with_the_targets() -> None:
    config = load_config(SCALE_OUT_CONFIG)
    variants = config.settings["variants"]
    assert {v: (s["nodes"], s["partitions"], s["replication_factor"]) for v, s in variants.items()} == {
        "conveyor:p1": (1, 1, 1),
        "conveyor:p2": (2, 2, 1),
        "conveyor:p4": (4, 4, 1),
    }
    assert all(s["credit_per_partition"] for s in variants.values())  # each broker: the same delivery window
    (scenario,) = config.scenarios
    assert scenario.name == SCENARIO and scenario.rate == "max" and set(scenario.systems) == set(variants)
    targets = {(t["system"], t["metric"]): t for t in config.settings["targets"]}
    assert targets[("conveyor:p2", "e2e_msg_per_s")]["min_ratio"] == 1.0
    assert targets[("conveyor:p4", "leader_changes")]["max"] == 0
    # The CPU claim is the scale-out section's (medians over the repetitions), not a per-run target.
    assert config.settings["scale_out"] == {
        "baseline": "conveyor:p1",
        "tolerance": 0.1,
        "cores": [8, 32],
        "load_matched": True,  # each k > 1 run is followed by one broker paced to each broker's rate
    }
    conveyor = system("conveyor")
    conveyor.configure(variants)
    ids = [v.id for v in conveyor.variants(scenario)]
    assert {"conveyor:p1", "conveyor:p2", "conveyor:p4"} <= set(ids)
    assert [v.id for v in conveyor.variants(Scenario("plain"))] == ["conveyor:batch", "conveyor:r3", *ids[2:]]
    assert all(v.explicit for v in conveyor.variants(scenario) if v.mode.startswith("p"))  # never run unasked


def test_a_broker_counts_the_messages_of_every_partition_log_of_the_topic_and_no_other() -> None:
    text = "\n".join(
        [
            "# TYPE conveyor_published_messages_total counter",
            'conveyor_published_messages_total{topic="bench.t"} 1500.0',
            'conveyor_published_messages_total{topic="bench.t#3"} 2500.0',
            'conveyor_published_messages_total{topic="bench.t2"} 99.0',  # another topic with the same prefix
            'conveyor_published_messages_created{topic="bench.t"} 1.7e+09',
            'conveyor_published_bytes_total{topic="bench.t"} 150000.0',
        ]
    )
    assert stored_per_broker(text, "bench.t") == 4000
    assert stored_per_broker(text, "absent") == 0
    more = (
        text
        + "\n"
        + "\n".join(
            [
                'conveyor_published_batches_total{topic="bench.t#1"} 4.0',
                "conveyor_loop_iteration_duration_seconds_count 10.0",
                "conveyor_loop_iteration_duration_seconds_sum 0.5",
                'conveyor_fsync_duration_seconds_bucket{le="0.001"} 2.0',
                "conveyor_fsync_duration_seconds_count 3.0",
                "conveyor_fsync_duration_seconds_sum 0.003",
            ]
        )
    )
    assert broker_counters(more, "bench.t") == {
        "stored": 4000.0,
        "batches": 4.0,
        "passes": 10.0,
        "busy_seconds": 0.5,
        "group_commits": 3.0,
        "fsync_seconds": 0.003,
    }


def test_cpu_per_stored_message_divides_each_brokers_cpu_by_what_it_stored() -> None:
    result: dict[str, Any] = {"wall_seconds": 10.0}
    procs = {"broker n1": 1.5, "broker n2": 1.0, "etcd": 0.2}
    add_stored_cpu(result, procs, {"broker n1": 1_000_000, "broker n2": 500_000}, {"broker n1": 0.01, "etcd": 0.005})
    assert result["cpu_us_per_stored_message"] == {"broker n1": 1.5, "broker n2": 2.0}
    assert result["max_server_us_per_stored_message"] == 2.0
    # 1.5 s less 0.01 s/s over the 10 s run is 1.4 s for 1,000,000 messages
    assert result["cpu_us_per_stored_message_less_background"] == {"broker n1": 1.4, "broker n2": 2.0}
    nothing: dict[str, Any] = {}
    add_stored_cpu(nothing, procs, None)
    assert nothing == {}


def _run(variant: str, e2e: float, brokers: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """A made-up scale-out result: ``brokers`` maps each broker to (messages stored, CPU seconds)."""
    from tests.bench.test_bench_smoke import _result

    unique = sum(n for n, _ in brokers.values())
    result: dict[str, Any] = {
        **_result(SCENARIO, variant, e2e, 100.0),
        "unique": unique,
        "cpu": {
            "server": 0.0,
            "producer 1": unique * 2e-6,
            "consumer 1": unique * 0.5e-6,
            "consumer 2": unique * 0.5e-6,
        },
        "server_cpu": {**{name: cpu for name, (_n, cpu) in brokers.items()}, "etcd": unique * 0.1e-6},
        "wall_seconds": 5.0,
        "leaders": {
            "start": {"controller": "n1", **{f"t/{i}": f"{name.split()[1]}@1" for i, name in enumerate(brokers)}}
        },
    }
    add_stored_cpu(result, result["server_cpu"], {name: n for name, (n, _cpu) in brokers.items()})
    return result


def _report(results: list[dict[str, Any]]) -> dict[str, Any]:
    config = load_config(SCALE_OUT_CONFIG)
    return {
        "results": results,
        "settings": config.settings,
        "scenarios": [{**s.to_dict(), "label": s.label(), "participants": s.participants} for s in config.scenarios],
        "machine": {"cpus": 2},
        "generated": "now",
        "config": str(SCALE_OUT_CONFIG),
        "duration_seconds": 1.0,
        "systems": {},
    }


def test_the_section_compares_each_broker_with_the_single_one_and_projects_from_the_busiest() -> None:
    report = _report(
        [
            _run("conveyor:p1", 300_000, {"broker n1": (1_000_000, 1.00)}),
            _run("conveyor:p2", 310_000, {"broker n1": (500_000, 0.52), "broker n2": (500_000, 0.50)}),
            _run("conveyor:p4", 290_000, {f"broker n{i}": (250_000, 0.25 + 0.01 * i) for i in range(1, 5)}),
        ]
    )
    spread = [{"broker n1": 1.0}, {"broker n1": 0.9}, {"broker n1": 1.3}]  # the row's own run is the first
    report["results"][0]["repeats"] = {
        "metric": "end-to-end msg/s",
        "values": [1, 2, 3],
        "cpu_us_per_stored_message": spread,
    }
    section = scale_out(report)
    assert section is not None
    (s,) = section["scenarios"]
    rows = {row["partitions"]: row for row in s["rows"]}
    assert rows[2]["brokers"]["broker n1"]["ratio"] == 1.04 and rows[2]["max_ratio"] == 1.04
    assert rows[4]["max_ratio"] == pytest.approx(1.16) and not rows[4]["within"]  # n4: 0.29 s / 250,000 = 1.16 µs
    assert rows[2]["e2e_ratio"] == pytest.approx(1.033, abs=1e-3)
    assert rows[2]["clients_us_per_message"] == 3.0 and rows[2]["etcd_us_per_message"] == 0.1
    checks = {c["claim"].split()[0]: c["met"] for c in s["checks"]}
    assert checks == {"each": False, "end-to-end": True, "one": True}
    p = s["projection"]
    assert p["basis"] == {
        "variant": "conveyor:p4",
        "broker_us_per_message": 1.16,
        "clients_us_per_message": 3.0,
        "etcd_us_per_message": 0.1,
    }
    eight, thirty_two = p["machines"]
    assert eight == {
        "cores": 8,
        "brokers_only_msg_per_s": round(8e6 / 1.16),
        "with_clients_msg_per_s": round(8e6 / 4.26),
    }
    assert thirty_two["brokers_only_msg_per_s"] == round(32e6 / 1.16)
    assert p["this_machine"]["cores"] == 2 and p["this_machine"]["measured_e2e_msg_per_s"] == 310_000
    text = markdown(section)
    assert "Projection (not a measurement)" in text and "| 32 |" in text and "1.160" in text
    assert "1: broker n1 1.000/0.900/1.300" in text  # every repetition's figure, not only the median run's
    report["scale_out"] = section
    met = {(t["system"], t["metric"]): t["met"] for t in check_targets(report)}
    assert met[("conveyor:p2", "e2e_msg_per_s")] is True
    table = markdown_table(report)
    assert ">= 1.0x conveyor:p1" in table and "### Scale-out" in table
    page = render_html(report)
    assert "id='scale-out'" in page and page.count("<svg") >= 3


def test_repeated_runs_keep_every_repetitions_cpu_per_stored_message() -> None:
    runs = [
        _run("conveyor:p2", e2e, {"broker n1": (1000, cpu), "broker n2": (1000, 0.001)})
        for e2e, cpu in [(3.0, 0.0011), (1.0, 0.0012), (2.0, 0.0013)]
    ]
    (pick,) = median_runs(runs)
    assert pick["e2e_msg_per_s"] == 2.0  # the median by throughput, as for every scenario
    assert [per["broker n1"] for per in pick["repeats"]["cpu_us_per_stored_message"]] == [1.1, 1.2, 1.3]


def test_each_brokers_figure_is_its_median_over_the_repetitions() -> None:
    one = _run("conveyor:p1", 300_000, {"broker n1": (1_000_000, 1.0)})
    two = _run("conveyor:p2", 300_000, {"broker n1": (500_000, 0.5), "broker n2": (500_000, 0.5)})
    one["repeats"] = {"values": [3, 1, 2], "cpu_us_per_stored_message": [{"broker n1": v} for v in (1.0, 1.2, 0.9)]}
    pairs = ((1.0, 1.1), (1.4, 1.05), (1.02, 1.0))
    two["repeats"] = {
        "values": [3, 1, 2],
        "cpu_us_per_stored_message": [{"broker n1": a, "broker n2": b} for a, b in pairs],
    }
    (s,) = scale_out(_report([one, two]))["scenarios"]  # type: ignore[index]
    p1, p2 = s["rows"]
    assert p1["max_us_per_message"] == 1.0  # the median of 1.0, 1.2 and 0.9
    assert p2["brokers"]["broker n1"]["us_per_message"] == 1.02 and p2["brokers"]["broker n2"]["us_per_message"] == 1.05
    assert p2["max_ratio"] == 1.05 and p2["within"]  # one bad repetition (1.4) does not decide


def test_a_run_of_k_brokers_is_matched_by_one_broker_paced_to_each_brokers_stored_rate() -> None:
    config = load_config(SCALE_OUT_CONFIG)
    (scenario,) = config.scenarios
    two = _run("conveyor:p2", 290_000, {"broker n1": (1_500_000, 1.8), "broker n2": (1_500_000, 1.6)})
    two["e2e_seconds"] = 10.0
    add_stored_cpu(two, two["server_cpu"], two["stored"])
    assert two["stored_per_broker_msg_per_s"] == 150_000.0  # 1,500,000 each over 10 s
    paced = load_matched_scenario(scenario, two)
    assert paced is not None and paced.paced and paced.total_rate == 150_000
    assert paced.messages == 1_500_000 and paced.duration >= 10.0  # what each broker stored, not cut short
    assert paced.linger_ms == 10.0  # a full batch of 1,000 at 150,000 msg/s takes 6.7 ms: linger 1.5x that
    assert paced.eager is False and paced.send_many  # full batches, as the k brokers got
    same = ("batch_size", "credit", "fsync", "consumers", "groups", "producers", "message_size", "name")
    assert all(getattr(paced, f) == getattr(scenario, f) for f in same)
    slow = {**two, "e2e_seconds": 37.5}  # 40,000 msg/s: a longer linger, never below the max-rate one
    assert load_matched_scenario(scenario, slow).linger_ms == 38.0  # type: ignore[union-attr]
    assert load_matched_scenario(scenario, {**two, "ok": False}) is None
    assert load_matched_scenario(scenario, {k: v for k, v in two.items() if k != "stored"}) is None
    # The runner pairs every k > 1 variant with the baseline, only when the config asks for it.
    conveyor = system("conveyor")
    conveyor.configure(config.settings["variants"])
    runs = plan(config, {"conveyor": conveyor}, list(config.settings["variants"]))
    assert {k: v.id for k, v in _load_matching(config, runs).items()} == {
        "conveyor:p2": "conveyor:p1",
        "conveyor:p4": "conveyor:p1",
    }
    off = type(config)(config.scenarios, {**config.settings, "scale_out": {"baseline": "conveyor:p1"}}, "x")
    assert _load_matching(off, runs) == {}


def test_each_broker_is_compared_with_one_broker_paced_to_its_rate_and_the_unpaced_ratio_stays() -> None:
    one = _run("conveyor:p1", 300_000, {"broker n1": (3_000_000, 2.7)})  # 0.9 µs
    two = _run("conveyor:p2", 290_000, {"broker n1": (1_500_000, 1.8), "broker n2": (1_500_000, 1.65)})  # 1.2, 1.1
    four = _run("conveyor:p4", 320_000, {f"broker n{i}": (750_000, 0.975 + 0.0375 * i) for i in range(1, 5)})
    for r, seconds in ((one, 10.0), (two, 10.0), (four, 9.375)):
        r["e2e_seconds"] = seconds
        add_stored_cpu(r, r["server_cpu"], r["stored"])
    at_two = _run("conveyor:p1", 150_000, {"broker n1": (1_500_000, 1.68)})  # 1.12 µs paced to 150,000 msg/s
    at_four = _run("conveyor:p1", 80_000, {"broker n1": (750_000, 1.8)})  # 2.4 µs paced to 80,000 msg/s
    for r, k, rate in ((at_two, two, 150_000), (at_four, four, 80_000)):
        r["e2e_seconds"] = 1_500_000 / rate if r is at_two else 750_000 / rate
        add_stored_cpu(r, r["server_cpu"], r["stored"])
        r.update(load_matched_identity("conveyor:p1", k["variant"], int(k["variant"][-1]), rate))
        r["paced"] = True
    assert at_two["variant"] == "conveyor:p1@p2" and at_two["load_matched"]["for"] == "conveyor:p2"
    at_two["repeats"] = {
        "metric": "p99 ms",
        "values": [1, 2, 3],
        "cpu_us_per_stored_message": [{"broker n1": v} for v in (1.12, 1.0, 1.3)],
        "stored_per_broker_msg_per_s": [150_000.0, 140_000.0, 160_000.0],
    }
    report = _report([one, two, at_two, four, at_four])
    (s,) = scale_out(report)["scenarios"]  # type: ignore[index]
    assert [row["variant"] for row in s["rows"]] == ["conveyor:p1", "conveyor:p2", "conveyor:p4"]  # no paced row
    rows = {row["partitions"]: row for row in s["rows"]}
    assert "load_matched" not in rows[1]
    m2 = rows[2]["load_matched"]
    assert m2["variant"] == "conveyor:p1@p2" and m2["us_per_message"] == 1.12  # the median of its repetitions
    assert m2["per_broker_msg_per_s"] == 150_000.0 and m2["paced_msg_per_s"] == 150_000.0
    assert m2["runs_us_per_message"] == [1.12, 1.0, 1.3] and m2["runs_paced_msg_per_s"] == [150_000, 140_000, 160_000]
    b2 = rows[2]["brokers"]
    assert b2["broker n1"]["load_matched_ratio"] == pytest.approx(1.2 / 1.12, abs=1e-3)
    assert b2["broker n2"]["load_matched_ratio"] == pytest.approx(1.1 / 1.12, abs=1e-3)
    assert b2["broker n1"]["ratio"] == pytest.approx(1.2 / 0.9, abs=1e-3)  # the unpaced ratio is still there
    assert m2["within"] and m2["not_above"]
    m4 = rows[4]["load_matched"]
    assert m4["us_per_message"] == 2.4 and m4["max_ratio"] == pytest.approx(1.5 / 2.4, abs=1e-3)  # 1.125 s / 750,000
    assert not m4["within"] and m4["not_above"]  # cheaper than the paced broker: not within 10% either way
    checks = {c["claim"]: c for c in s["checks"]}
    unpaced = next(c for name, c in checks.items() if name.startswith("each broker's"))
    assert unpaced["met"] is False and "1/k of the load" in unpaced["claim"]
    within = next(c for name, c in checks.items() if name.startswith("load-matched: each"))
    above = next(c for name, c in checks.items() if name.startswith("load-matched: no broker"))
    assert within["met"] is False and above["met"] is True
    assert "2 partitions: 0.982-1.071x (at 150,000 msg/s per broker)" in within["measured"]
    text = markdown(scale_out(report))  # type: ignore[arg-type]
    assert "Load-matched baseline" in text and "| 1.071 |" in text and "| 2.400 |" in text
    assert "2: per-broker rate 150,000, paced broker 150,000/140,000/160,000 msg/s at 1.120/1.000/1.300 µs" in text
    report["scale_out"] = scale_out(report)
    page = render_html(report)
    assert "1 broker paced to 80,000 msg/s" in page and page.count("<svg") >= 4


def test_no_section_without_the_setting_and_two_partitions_on_one_broker_is_flagged() -> None:
    report = _report([_run("conveyor:p1", 300_000, {"broker n1": (1000, 0.001)})])
    assert scale_out({**report, "settings": {}}) is None
    crowded = _run("conveyor:p2", 300_000, {"broker n1": (1000, 0.001), "broker n2": (1000, 0.001)})
    crowded["leaders"]["start"] = {"t/0": "n1@1", "t/1": "n1@1"}
    (s,) = scale_out(_report([crowded]))["scenarios"]  # type: ignore[index]
    assert {c["claim"].split()[0]: c["met"] for c in s["checks"]}["one"] is False
    assert projection([], [8]) == {}


def test_scale_out_and_config_are_one_or_the_other(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "conveyor", "bench", "--scale-out", "--config", str(SCALE_OUT_CONFIG)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not both" in proc.stderr


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make test installs etcd-server)")
@pytest.mark.timeout(150)
def test_scale_out_runs_on_real_clusters(tmp_path: Path) -> None:
    """The real thing on tiny counts: for each k, etcd and k brokers, a topic of k partitions, one leader each.

    After the 2 brokers, one broker paced to the rate each of them stored at (the load-matched baseline).
    """
    raw = json.loads(SCALE_OUT_CONFIG.read_text())
    for settings in raw["settings"]["variants"].values():
        settings["idle_seconds"] = 0.3
    raw["scenarios"][0]["quick"] = {"messages": 4000, "batch_size": 200, "duration": 10}
    raw["defaults"]["credit"] = 800
    path = tmp_path / "scaleout.json"
    path.write_text(json.dumps(raw))
    out, page = tmp_path / "out.json", tmp_path / "report.html"
    cmd = [sys.executable, "-m", "conveyor", "bench", "--config", str(path), "--quick", "--no-progress"]
    cmd += ["--systems", ",".join(SMOKE_VARIANTS), "--json", str(out), "--report", str(page)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    report = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in report["results"]}
    assert set(by_variant) == {*SMOKE_VARIANTS, "conveyor:p1@p2"}, proc.stderr
    matched = by_variant.pop("conveyor:p1@p2")  # one broker paced to the rate each of the two stored at
    assert matched["ok"] and matched["exactly_once"] and matched["paced"], (matched["errors"], proc.stderr[-3000:])
    assert matched["unique"] == 2000 and set(matched["stored"]) == {"broker n1"}  # what each of the two stored
    assert matched["load_matched"]["for"] == "conveyor:p2"
    assert matched["load_matched"]["rate"] == round(by_variant["conveyor:p2"]["stored_per_broker_msg_per_s"])
    for variant, r in by_variant.items():
        assert r["ok"] and r["exactly_once"] and r["unique"] == 4000, (variant, r["errors"], proc.stderr[-3000:])
        k = report["settings"]["variants"][variant]["partitions"]
        assert set(r["stored"]) == {f"broker n{i}" for i in range(1, k + 1)}
        assert sum(r["stored"].values()) == 4000  # replication factor 1: each message stored once, by its leader
        assert set(r["cpu_us_per_stored_message"]) == set(r["stored"]) and r["leader_changes"] == 0
        assert set(r["background_cpu_per_s"]) == {*r["stored"], "etcd"}
        assert sum(d["batches"] for d in r["server_details"].values()) >= 4000 / 200  # batches of at most 200
        assert all(d["passes"] > 0 and d["group_commits"] > 0 for d in r["server_details"].values())
    (s,) = report["scale_out"]["scenarios"]
    assert [row["partitions"] for row in s["rows"]] == [int(v[-1]) for v in SMOKE_VARIANTS]
    assert all(row["one_partition_per_broker"] for row in s["rows"]), [row["leaders"] for row in s["rows"]]
    assert [m["cores"] for m in s["projection"]["machines"]] == [8, 32]
    m = s["rows"][1]["load_matched"]
    assert m["variant"] == "conveyor:p1@p2" and m["us_per_message"] and m["max_ratio"]
    assert "Load-matched baseline" in proc.stdout
    assert "### Scale-out" in proc.stdout and "id='scale-out'" in page.read_text()
    assert "Where a broker's CPU goes" in proc.stdout
