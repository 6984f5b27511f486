"""Tables, target checks and the observations written from the numbers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from conveyor.benchmarks.suite import scaleout

Result = dict[str, Any]


def by_scenario(report: dict[str, Any]) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = defaultdict(list)
    for r in report["results"]:
        out[r["scenario"]].append(r)
    return out


def find(report: dict[str, Any], scenario: str, variant: str) -> Result | None:
    for r in report["results"]:
        if r["scenario"] == scenario and (r["variant"] == variant or r["system"] == variant):
            return r if "e2e_msg_per_s" in r else None
    return None


def metric(r: Result, name: str) -> float | None:
    value = r.get("latency_ms", {}).get(name) if name in ("p50", "p95", "p99", "p99.9", "avg", "max") else r.get(name)
    return None if value is None else float(value)


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets in the config's settings, each with what was measured and whether it was met.

    A target is ``{"scenario", "system", "metric", "vs" (another variant) and "min_ratio"}``
    (``system`` at least ``min_ratio`` times ``vs``), ``{... "vs", "max_ratio"}`` (``system`` at
    most ``max_ratio`` times ``vs``: a latency within 1.25x of the floor's), ``{... "vs", "lower": true}``
    (``system`` below ``vs``), or an absolute ``"min"`` / ``"max"`` bound.
    """
    checks = []
    for t in report.get("settings", {}).get("targets", []):
        mine = find(report, t["scenario"], t["system"])
        check: dict[str, Any] = {**t, "measured": None, "met": None}
        if mine is None:
            check["note"] = skip_reason(report, t["scenario"], t["system"]) or "not run"
            checks.append(check)
            continue
        value = metric(mine, t["metric"])
        check["measured"] = value
        if "vs" in t:
            peer = find(report, t["scenario"], t["vs"])
            peer_value = metric(peer, t["metric"]) if peer else None
            check["peer_measured"] = peer_value
            if peer_value is None or value is None:
                why = skip_reason(report, t["scenario"], t["vs"])
                check["note"] = f"{t['vs']} not run" + (f": {why}" if why else "")
            elif t.get("lower"):
                check["ratio"] = round(peer_value / value, 2) if value else None
                check["met"] = value < peer_value
            elif "max_ratio" in t:
                check["ratio"] = round(value / peer_value, 2) if peer_value else None
                check["met"] = check["ratio"] is not None and check["ratio"] <= t["max_ratio"]
            else:
                check["ratio"] = round(value / peer_value, 2) if peer_value else None
                check["met"] = check["ratio"] is not None and check["ratio"] >= t["min_ratio"]
        elif value is not None:
            ok_min = value >= t["min"] if "min" in t else True
            ok_max = value <= t["max"] if "max" in t else True
            check["met"] = ok_min and ok_max
        checks.append(check)
    return checks


def skip_reason(report: dict[str, Any], scenario: str, variant: str) -> str:
    """Why ``variant`` did not run in ``scenario`` (not installed, not built yet), or ``""``."""
    for m in report.get("skipped_variants", []):
        if m["variant"] == variant and m["scenario"] in (scenario, "*"):
            return f"not run: {m['reason']}"
    reason = report.get("skipped_systems", {}).get(variant.split(":", 1)[0])
    return f"not run: {reason}" if reason else ""


METRIC_NAMES = {"e2e_msg_per_s": "end-to-end msg/s", "leader_changes": "leader changes"}


def describe_target(t: dict[str, Any]) -> str:
    what = METRIC_NAMES.get(t["metric"], t["metric"])
    why = f" ({t['why']})" if t.get("why") else ""
    if "vs" in t:
        if t.get("lower"):
            return f"{t['scenario']}: {t['system']} {what} below {t['vs']}{why}"
        if "max_ratio" in t:
            return f"{t['scenario']}: {t['system']} {what} <= {t['max_ratio']}x {t['vs']}{why}"
        return f"{t['scenario']}: {t['system']} {what} >= {t['min_ratio']}x {t['vs']}{why}"
    bounds = []
    if "min" in t:
        bounds.append(f">= {t['min']:,}")
    if "max" in t:
        bounds.append(f"<= {t['max']:,}")
    return f"{t['scenario']}: {t['system']} {what} {' and '.join(bounds)}{why}"


def target_cell(t: dict[str, Any]) -> str:
    if t.get("measured") is None:
        return t.get("note", "not run")
    fmt = "{:,.0f}" if t["metric"].endswith("per_s") or t["metric"] == "leader_changes" else "{:.2f} ms"
    text = fmt.format(t["measured"])
    if t.get("peer_measured") is not None:
        text += f" vs {fmt.format(t['peer_measured'])}"
        if t.get("ratio") is not None:
            text += f" ({t['ratio']:.2f}x)"
    return text


def _fmt_lat(r: Result, key: str) -> str:
    value = r.get("latency_ms", {}).get(key)
    return "" if value is None else f"{value:.2f}"


def markdown_table(report: dict[str, Any]) -> str:
    head = (
        "| scenario | system | durability | producer msg/s | end-to-end msg/s | msg/s per participant "
        "| avg ms | p50 ms "
        "| p95 ms | p99 ms | p99.9 ms | max depth | max in-flight | CPU s server | busiest process (CPU s) "
        "| exactly once |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    )
    rows = []
    for r in report["results"]:
        if "e2e_msg_per_s" not in r:
            rows.append(f"| {r['scenario']} | {r['title']} | {r['durability']} | failed: {'; '.join(r['errors'])} |")
            continue
        once = "yes" if r["exactly_once"] else f"NO ({r['duplicates']} dup, {r['lost']} lost)"
        busiest = r["bottleneck"]
        server_cpu = r["cpu"].get("server")
        rows.append(
            f"| {r['scenario']} | {r['title']} | {r['durability']} | {r['producer_msg_per_s']:,.0f} "
            f"| {r['e2e_msg_per_s']:,.0f} | {r['efficiency_msg_per_s_per_participant']:,.0f} "
            f"| {_fmt_lat(r, 'avg')} | {_fmt_lat(r, 'p50')} | {_fmt_lat(r, 'p95')} | {_fmt_lat(r, 'p99')} "
            f"| {_fmt_lat(r, 'p99.9')} | {max(r['max_depth'], r.get('max_lag') or 0):,} "
            f"| {'' if r.get('max_in_flight') is None else format(r['max_in_flight'], ',')} "
            f"| {'' if server_cpu is None else f'{server_cpu:.2f}'} "
            f"| {busiest['process']} ({busiest['cpu_seconds']:.2f}) | {once} |"
        )
    out = [head, *rows, "", process_table(report)]
    if report.get("repeat", 1) > 1:
        out.append(f"\nEach row is the median of {report['repeat']} interleaved runs (p99 when paced, else msg/s).")
    skipped = report.get("skipped_variants", [])
    if skipped:
        out += ["", "Not run: " + "; ".join(f"{m['variant']} in {m['scenario']} ({m['reason']})" for m in skipped)]
    checks = check_targets(report)
    if checks:
        out += ["", "| target | measured | met |", "|---|---|---|"]
        for t in checks:
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            out.append(f"| {describe_target(t)} | {target_cell(t)} | {met} |")
    if report.get("scale_out"):
        out += ["", scaleout.markdown(report["scale_out"])]
    return "\n".join(out)


def process_cpu(r: Result) -> dict[str, float]:
    """CPU seconds of every process of a run: each server process when there are several, then the clients."""
    cpu = r.get("cpu", {})
    servers = r.get("server_cpu") or ({"server": cpu["server"]} if "server" in cpu else {})
    return {**servers, **{k: v for k, v in cpu.items() if k != "server"}}


def process_table(report: dict[str, Any]) -> str:
    """Per run: CPU microseconds per message of each process (each server of a cluster too), and leader changes."""
    lines = [
        "| scenario | system | CPU µs per message, by process | CPU µs per message, all | leader changes |",
        "|---|---|---|---:|---:|",
    ]
    for r in report["results"]:
        per = r.get("cpu_us_per_message")
        if not per:
            continue
        parts = ", ".join(f"{k} {v:,.1f}" for k, v in per.items() if k != "total")
        changes = "" if r.get("leader_changes") is None else str(r["leader_changes"])
        lines.append(f"| {r['scenario']} | {r['variant']} | {parts} | {per.get('total', 0):,.1f} | {changes} |")
    return "\n".join(lines)


def observations(report: dict[str, Any]) -> list[str]:
    """Sentences written from the numbers: who is fastest, the best concurrency, the bottleneck, ratios."""
    notes: list[str] = []
    results = [r for r in report["results"] if "e2e_msg_per_s" in r]
    scenarios = {s["name"]: s for s in report["scenarios"]}
    if not results:
        return ["No run produced numbers."]
    failed = [r for r in report["results"] if not r.get("ok")]
    if failed:
        notes.append(
            "Runs with errors or a failed exactly-once check: "
            + "; ".join(
                f"{r['scenario']} / {r['variant']} ({'; '.join(r.get('errors', [])) or 'check'})" for r in failed
            )
            + "."
        )
    else:
        total = sum(r["unique"] for r in results)
        notes.append(
            f"Every run delivered every message exactly once per group ({total:,} deliveries checked, "
            "no duplicates, no losses)."
        )
    # Ratios against peers, scenario by scenario (matching durability only).
    for name, runs in by_scenario({"results": results}).items():
        mine = [r for r in runs if r["system"] == "conveyor"]
        peers = [r for r in runs if r["system"] != "conveyor"]
        for c in mine if peers else []:
            notes += _ratios(name, c, peers, mine, scenarios)
    # Leader changes: a replicated system should have none while nothing is injected.
    for r in results:
        if r.get("leader_changes"):
            notes.append(
                f"{r['scenario']} / {r['variant']}: {r['leader_changes']} leader change(s) during the run, with no "
                "fault injected (a missed lease refresh or heartbeat: the CPU was too busy)."
            )
    # Stalls in the paced runs: one bad stretch can make the whole run's p99.
    for r in results:
        if scenarios.get(r["scenario"], {}).get("rate", "max") == "max":
            continue
        series = r.get("latency_series") or []
        if len(series) < 10:
            continue
        p99s = sorted(point[2] for point in series)
        typical = p99s[len(p99s) // 2]
        worst = max(series, key=lambda point: point[2])
        if typical > 0 and worst[2] > 5 * typical:
            notes.append(
                f"{r['scenario']} / {r['title']} ({r['variant'].split(':', 1)[1]}): a stall of {worst[3]:.0f} ms "
                f"around {worst[0]:.1f} s into the run; outside it the p99 of each "
                f"{series[1][0] - series[0][0]:.2f} s slice is typically {typical:.1f} ms "
                f"(whole-run p99 {metric(r, 'p99') or 0:.1f} ms)."
            )
    # Best concurrency: among Conveyor max-rate runs with the same message size and fsync.
    families: dict[tuple[int, str, str], list[Result]] = defaultdict(list)  # one per variant: r3 apart from one node
    for r in results:
        s = scenarios.get(r["scenario"], {})
        if r["system"] == "conveyor" and s.get("rate") == "max":
            families[(s["message_size"], s["fsync"], r["variant"])].append(r)
    for (size, fsync, _variant), runs in families.items():
        shapes = {(scenarios[r["scenario"]]["producers"], scenarios[r["scenario"]]["consumers"]) for r in runs}
        if len(shapes) < 2:
            continue
        best = max(runs, key=lambda r: r["e2e_msg_per_s"])
        eff = max(runs, key=lambda r: r["efficiency_msg_per_s_per_participant"])
        bs, es = scenarios[best["scenario"]], scenarios[eff["scenario"]]
        text = (
            f"Best concurrency for Conveyor ({size} B, fsync={fsync}): {bs['producers']} producer(s) -> "
            f"{bs['consumers']} consumer(s) gives the most end-to-end throughput ({best['e2e_msg_per_s']:,.0f} msg/s)"
        )
        if eff is best:
            text += ", and the most per participant."
        else:
            text += (
                f"; {es['producers']} -> {es['consumers']} the most per participant "
                f"({eff['efficiency_msg_per_s_per_participant']:,.0f} msg/s each). On "
                f"{report['machine'].get('cpus', '?')} cores, more processes mostly share the same CPUs."
            )
        notes.append(text)
    # A shared machine: how much of it other processes took during each system's runs.
    cpus = report.get("machine", {}).get("cpus") or 1
    shared = [r for r in results if r.get("e2e_seconds") and r.get("other_cpu", 0) / r["e2e_seconds"] > 0.25]
    if shared:
        worst = max(shared, key=lambda r: r["other_cpu"] / r["e2e_seconds"])
        notes.append(
            f"The machine was shared: in {len(shared)} of {len(results)} runs other processes used more than a "
            f"quarter of a core on average (up to {worst['other_cpu'] / worst['e2e_seconds']:.1f} of {cpus} cores, "
            f"in {worst['scenario']} / {worst['variant']}). Every system ran under the same conditions, one after "
            "the other, but absolute numbers are pessimistic and a CPU share well under 100% for the busiest "
            "process then means waiting for a core rather than spare capacity."
        )
    # Bottlenecks by CPU.
    for r in results:
        if r["system"] != "conveyor":
            continue
        b = r["bottleneck"]
        if not b["process"]:
            continue
        frac = b.get("busy_fraction") or 0.0
        state = "saturated (one core's worth)" if frac >= 0.85 else f"busy {frac * 100:.0f}% of the run"
        shares = ", ".join(f"{k} {v:.2f}" for k, v in sorted(process_cpu(r).items(), key=lambda kv: -kv[1])[:4])
        notes.append(
            f"{r['scenario']} / Conveyor: the busiest process is the {b['process']} "
            f"({b['cpu_seconds']:.2f} CPU s, {state}); CPU s: {shares}"
            + (f"; other processes used {r['other_cpu']:.2f} CPU s meanwhile" if r.get("other_cpu", 0) > 0.5 else "")
            + "."
        )
    for t in check_targets(report):
        if t["met"] is None:
            continue
        notes.append(f"Target {'met' if t['met'] else 'MISSED'}: {describe_target(t)} - {target_cell(t)}.")
    return notes


def _ratios(
    name: str, c: Result, peers: list[Result], mine: list[Result], scenarios: dict[str, dict[str, Any]]
) -> list[str]:
    """One sentence comparing a Conveyor run with the peers of its scenario."""
    paced = scenarios.get(name, {}).get("rate", "max") != "max"
    who = "Conveyor" if len(mine) == 1 else f"Conveyor ({c['variant'].split(':', 1)[1]})"
    parts = []
    for p in peers:
        if paced:
            cp99, pp99 = metric(c, "p99"), metric(p, "p99")
            if cp99 and pp99:
                versus = f"{pp99 / cp99:.1f}x {who}'s" if pp99 >= cp99 else f"{who}'s is {cp99 / pp99:.1f}x higher"
                parts.append(f"{p['title']} ({p['durability']}) p99 {pp99:.2f} ms, {versus}")
        elif p["e2e_msg_per_s"]:
            parts.append(
                f"{c['e2e_msg_per_s'] / p['e2e_msg_per_s']:.1f}x {p['title']} ({p['durability']}, "
                f"{p['e2e_msg_per_s']:,.0f} msg/s)"
            )
    if not parts:
        return []
    if paced:
        return [f"{name}: {who} p99 {metric(c, 'p99') or 0:.2f} ms; " + "; ".join(parts) + "."]
    return [f"{name}: {who} end-to-end {c['e2e_msg_per_s']:,.0f} msg/s, " + "; ".join(parts) + "."]
