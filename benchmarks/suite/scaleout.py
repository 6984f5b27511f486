"""The scale-out section of a report: CPU per stored message per broker at 1, 2, 4 partitions, and a projection.

``benchmarks/scaleout.json`` runs one workload on clusters of k brokers with k
partitions (one partition leader per broker, replication factor 1). On a
machine whose few cores are shared by every broker and the clients, wall-clock
throughput cannot grow with k, so the question is asked of CPU instead: does
each broker spend the same CPU per message it stores as the single broker did?
If it does, a machine with more cores serves proportionally more, and the
projection for bigger machines is ``cores / (CPU per message)``. Pure: it
reads a report dict (``run_bench``'s) and returns plain data, Markdown or HTML.

The shared cores cap the total, so each of k brokers is fed about 1/k of it,
and a broker's CPU per message depends on its load (fewer batches per loop
pass and group commit when it is fed less). With ``load_matched`` the runner
follows every run of k > 1 brokers with one of the single broker paced to the
rate each of the k brokers stored at (``load_matched_scenario``), and the
section divides each broker's CPU per message by that paced broker's: the
cost of partitions and brokers at equal load per broker.
"""

from __future__ import annotations

import math
from dataclasses import replace
from html import escape
from typing import Any

from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.svg import hbars

Row = dict[str, Any]


def _partitions(report: dict[str, Any], variant: str) -> int | None:
    settings = report.get("settings", {}).get("variants", {}).get(variant, {})
    return int(settings["partitions"]) if "partitions" in settings else None


def _clients_us(r: dict[str, Any]) -> float | None:
    """CPU µs per message of the producers and consumers together (what the clients cost, wherever they run)."""
    unique = r.get("unique") or 0
    if not unique:
        return None
    seconds = sum(v for k, v in r.get("cpu", {}).items() if k.startswith(("producer", "consumer")))
    return round(seconds * 1e6 / unique, 3)


def _row(r: dict[str, Any], k: int) -> Row:
    """One partition count: each broker's CPU per stored message as the median over the run's repetitions.

    The suite reports the repetition with the median throughput; a broker's CPU
    per message varies between repetitions on its own (more on a busy machine),
    so the section takes each broker's median over all of them instead.
    """
    repeats = r.get("repeats") or {}
    runs = _spread(repeats.get("cpu_us_per_stored_message") or [r.get("cpu_us_per_stored_message")])
    less = _spread(
        repeats.get("cpu_us_per_stored_message_less_background") or [r.get("cpu_us_per_stored_message_less_background")]
    )
    server_cpu = r.get("server_cpu", {})
    unique = r.get("unique") or 0
    brokers = {
        name: {
            "stored": r.get("stored", {}).get(name, 0),
            "cpu_seconds": server_cpu.get(name),
            "us_per_message": _median(runs.get(name)),
            "runs_us_per_message": runs.get(name, []),
            "us_per_message_less_background": _median(less.get(name)),
            "background_cpu_per_s": r.get("background_cpu_per_s", {}).get(name),
            "work": _work(r.get("server_details", {}).get(name)),
        }
        for name in r.get("stored", {})
    }
    medians = [b["us_per_message"] for b in brokers.values() if b["us_per_message"] is not None]
    etcd = server_cpu.get("etcd")
    return {
        "variant": r["variant"],
        "partitions": k,
        "brokers": brokers,
        "leaders": {p: v for p, v in (r.get("leaders", {}).get("start") or {}).items() if p != "controller"},
        "e2e_msg_per_s": r.get("e2e_msg_per_s"),
        "messages": unique,
        "ok": bool(r.get("ok")),
        "max_us_per_message": max(medians, default=None),
        "clients_us_per_message": _clients_us(r),
        "etcd_us_per_message": round(etcd * 1e6 / unique, 3) if etcd is not None and unique else None,
        "other_cpu": r.get("other_cpu"),
        "e2e_seconds": r.get("e2e_seconds"),
        "repetitions": len(repeats.get("values") or [None]),
        "runs_key": (repeats.get("metric") or "end-to-end msg/s", repeats.get("values") or [r.get("e2e_msg_per_s")]),
        "per_broker_msg_per_s": _rate_median(r),
        "runs_per_broker_msg_per_s": _runs(r, "stored_per_broker_msg_per_s"),
    }


def _work(d: dict[str, float] | None) -> dict[str, float] | None:
    """Per stored batch: CPU µs, loop passes, group commits; and the share of the CPU spent in the kernel."""
    if not d or not d.get("batches"):
        return None
    batches = d["batches"]
    cpu = d.get("user_seconds", 0.0) + d.get("system_seconds", 0.0)
    return {
        "batches": int(batches),
        "cpu_us_per_batch": round(cpu * 1e6 / batches, 1),
        "passes_per_batch": round(d.get("passes", 0.0) / batches, 2),
        "group_commits_per_batch": round(d.get("group_commits", 0.0) / batches, 2),
        "fsync_ms_per_batch": round(d.get("fsync_seconds", 0.0) * 1e3 / batches, 3),
        "system_share": round(d.get("system_seconds", 0.0) / cpu, 3) if cpu else 0.0,
    }


def _median(values: list[float] | None) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return round(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2, 3)


def _spread(runs: list[dict[str, float] | None]) -> dict[str, list[float]]:
    """Each broker's figure in every repetition, in run order: ``{"broker n1": [0.81, 0.84, 0.80]}``."""
    out: dict[str, list[float]] = {}
    for per in runs:
        for name, us in (per or {}).items():
            out.setdefault(name, []).append(us)
    return out


def per_broker_rate(result: dict[str, Any]) -> float | None:
    """Messages each broker stored per second of the run: the mean of what they stored over the end-to-end time."""
    stored = result.get("stored") or {}
    seconds = result.get("e2e_seconds") or 0.0
    if not stored or not seconds:
        return None
    return round(sum(stored.values()) / len(stored) / seconds, 1)


def load_matched_scenario(scenario: Scenario, result: dict[str, Any]) -> Scenario | None:
    """The same workload for one broker, paced to the rate each broker of ``result`` stored at; None: no rate.

    As many messages as each of those brokers stored (the mean), at that rate,
    so the single broker carries one of them's load for as long. Batches stay
    the scenario's size: the producer lingers long enough for a full batch at
    that rate (the k brokers were sent full batches by a producer at full speed).
    Same credit, fsync and consumers: only the producer's pace changes.
    """
    rate = per_broker_rate(result)
    if not rate or not result.get("ok"):
        return None
    stored = result["stored"]
    messages = max(scenario.producers, round(sum(stored.values()) / len(stored)))
    linger = max(scenario.linger_ms or 5.0, math.ceil(1500 * scenario.batch_size / rate))
    return replace(
        scenario,
        rate=round(rate),
        messages=messages,
        duration=max(scenario.duration, 2 * messages / rate),
        linger_ms=float(linger),
        eager=False,  # wait out the linger: full batches, as the k brokers got
    )


def load_matched_identity(baseline: str, variant: str, partitions: int, rate: float) -> dict[str, Any]:
    """What a load-matched run's result says it is: its own variant id (``conveyor:p1@p2``) and what it matches."""
    return {
        "variant": f"{baseline}@{variant.split(':', 1)[1]}",
        "durability": f"1 broker and etcd, 1 partition, paced to {rate:,.0f} msg/s "
        f"(each broker's stored rate at {partitions} partitions)",
        "load_matched": {"for": variant, "partitions": partitions, "rate": rate},
    }


def scale_out(report: dict[str, Any]) -> dict[str, Any] | None:
    """The section for every scenario that ran partitioned variants; None when the config asks for none.

    Each scenario's rows (one per partition count) carry each broker's CPU per
    stored message and its ratio to the baseline's (the single broker's), and
    the end-to-end throughput and its ratio. ``checks`` are the three claims of
    the scale-out target; ``projection`` is ``cores / µs per message``.
    """
    settings = report.get("settings", {}).get("scale_out")
    if not settings:
        return None
    tolerance = float(settings.get("tolerance", 0.1))
    cores = [int(c) for c in settings.get("cores", [8, 32])]
    machine_cores = int(report.get("machine", {}).get("cpus") or 0)
    scenarios = []
    for name in dict.fromkeys(r["scenario"] for r in report.get("results", [])):
        rows = []
        for r in report["results"]:
            k = _partitions(report, r["variant"])
            if r["scenario"] == name and k is not None and "e2e_msg_per_s" in r:
                rows.append(_row(r, k))
        if not rows:
            continue
        rows.sort(key=lambda row: row["partitions"])
        base = next((row for row in rows if row["variant"] == settings.get("baseline")), rows[0])
        matched = {
            r["load_matched"]["for"]: r
            for r in report["results"]
            if r["scenario"] == name and r.get("load_matched") and "e2e_msg_per_s" in r
        }
        scenarios.append(_scenario(name, rows, base, tolerance, cores, machine_cores, matched))
    return {"tolerance": tolerance, "cores": cores, "scenarios": scenarios}


def _scenario(
    name: str,
    rows: list[Row],
    base: Row,
    tolerance: float,
    cores: list[int],
    machine: int,
    matched: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    base_us = base["max_us_per_message"]
    for row in rows:
        for broker in row["brokers"].values():
            us = broker["us_per_message"]
            broker["ratio"] = round(us / base_us, 3) if us is not None and base_us else None
        ratios = [b["ratio"] for b in row["brokers"].values() if b["ratio"] is not None]
        row["max_ratio"] = max(ratios, default=None)
        row["min_ratio"] = min(ratios, default=None)
        row["within"] = bool(ratios) and all(abs(x - 1) <= tolerance for x in ratios)
        row["e2e_ratio"] = round(row["e2e_msg_per_s"] / base["e2e_msg_per_s"], 3) if base["e2e_msg_per_s"] else None
        row["one_partition_per_broker"] = _one_each(row)
        paced = (matched or {}).get(row["variant"])
        if paced is not None and row is not base:
            _match(row, paced, tolerance)
    return {
        "scenario": name,
        "baseline": base["variant"],
        "rows": rows,
        "checks": _checks(rows, base, tolerance),
        "projection": projection(rows, cores, machine),
    }


def _rate_median(r: dict[str, Any]) -> float | None:
    """The per-broker stored rate, the median over the repetitions."""
    runs = (r.get("repeats") or {}).get("stored_per_broker_msg_per_s") or [r.get("stored_per_broker_msg_per_s")]
    return _median([v for v in runs if v is not None])


def _match(row: Row, paced: dict[str, Any], tolerance: float) -> None:
    """Each broker of ``row`` against the single broker paced to its rate: ratios and the checks on them."""
    single = _row(paced, 1)
    paced_us = single["max_us_per_message"]
    for broker in row["brokers"].values():
        us = broker["us_per_message"]
        broker["load_matched_ratio"] = round(us / paced_us, 3) if us is not None and paced_us else None
    ratios = [b["load_matched_ratio"] for b in row["brokers"].values() if b["load_matched_ratio"] is not None]
    paced_broker = next(iter(single["brokers"].values()), None)
    row["load_matched"] = {
        "variant": paced["variant"],
        "per_broker_msg_per_s": row["per_broker_msg_per_s"],
        "runs_per_broker_msg_per_s": row["runs_per_broker_msg_per_s"],
        "target_msg_per_s": paced.get("load_matched", {}).get("rate"),
        "paced_msg_per_s": single["per_broker_msg_per_s"],
        "runs_paced_msg_per_s": single["runs_per_broker_msg_per_s"],
        "us_per_message": paced_us,
        "runs_us_per_message": paced_broker["runs_us_per_message"] if paced_broker else [],
        "work": paced_broker["work"] if paced_broker else None,
        "min_ratio": min(ratios, default=None),
        "max_ratio": max(ratios, default=None),
        "within": bool(ratios) and all(abs(x - 1) <= tolerance for x in ratios),
        "not_above": bool(ratios) and all(x <= 1 + tolerance for x in ratios),
    }


def _runs(r: dict[str, Any], key: str) -> list[float]:
    values = (r.get("repeats") or {}).get(key) or [r.get(key)]
    return [v for v in values if v is not None]


def _one_each(row: Row) -> bool:
    """Every broker leads exactly one of the topic's partitions (the controller spread them)."""
    nodes = [leader.split("@", 1)[0] for leader in row["leaders"].values()]
    return len(nodes) == row["partitions"] and len(set(nodes)) == len(nodes)


def _checks(rows: list[Row], base: Row, tolerance: float) -> list[dict[str, Any]]:
    others = [row for row in rows if row is not base]
    two = next((row for row in rows if row["partitions"] == 2), None)
    return [
        {
            "claim": f"each broker's CPU per stored message within {tolerance:.0%} of the single broker's "
            "(at full speed: on shared cores each of k brokers is fed about 1/k of the load)",
            "met": all(row["within"] for row in others) if others else None,
            "measured": "; ".join(
                f"{row['partitions']} partitions: {row['min_ratio']:.3f}-{row['max_ratio']:.3f}x"
                for row in others
                if row["max_ratio"] is not None
            ),
        },
        {
            "claim": "end-to-end throughput with 2 brokers not below 1 broker's",
            "met": None if two is None or two is base else bool(two["e2e_ratio"] and two["e2e_ratio"] >= 1.0),
            "measured": ""
            if two is None
            else f"{two['e2e_msg_per_s']:,.0f} vs {base['e2e_msg_per_s']:,.0f} msg/s ({two['e2e_ratio']:.3f}x)",
        },
        *_matched_checks(others, tolerance),
        {
            "claim": "one partition leader on each broker",
            "met": all(row["one_partition_per_broker"] for row in rows),
            "measured": "; ".join(f"{row['partitions']}: {', '.join(row['leaders'].values())}" for row in rows),
        },
    ]


def _matched_checks(others: list[Row], tolerance: float) -> list[dict[str, Any]]:
    """The CPU claim at equal load per broker: against one broker paced to each row's per-broker rate.

    Two readings: within the tolerance either way (the target's words), and
    not more than the tolerance above (what adding partitions and brokers costs;
    below means the k brokers were cheaper than one broker at their rate).
    None when no load-matched run was made.
    """
    matched = [row for row in others if row.get("load_matched")]
    if not matched:
        return []
    measured = "; ".join(
        f"{row['partitions']} partitions: {m['min_ratio']:.3f}-{m['max_ratio']:.3f}x "
        f"(at {_f(m['per_broker_msg_per_s'], ',.0f')} msg/s per broker)"
        for row in matched
        if (m := row["load_matched"])["max_ratio"] is not None
    )
    complete = len(matched) == len(others)
    return [
        {
            "claim": f"load-matched: each broker's CPU per stored message within {tolerance:.0%} of one broker's "
            "paced to the same per-broker rate",
            "met": all(row["load_matched"]["within"] for row in matched) if complete else False,
            "measured": measured,
        },
        {
            "claim": f"load-matched: no broker's CPU per stored message more than {tolerance:.0%} above one broker's "
            "paced to the same per-broker rate",
            "met": all(row["load_matched"]["not_above"] for row in matched) if complete else False,
            "measured": measured,
        },
    ]


def projection(rows: list[Row], cores: list[int], machine: int = 0) -> dict[str, Any]:
    """Messages per second a machine of ``cores`` cores could serve: a projection, not a measurement.

    Basis: the highest CPU per stored message of any broker in any row (the
    most expensive broker measured), and the clients' CPU per message of that
    row. Brokers alone (clients on other machines): ``cores / broker µs``;
    clients on the same machine: ``cores / (broker µs + clients µs)``. Assumes
    one broker process per core with at least as many partitions as cores,
    a broker's CPU per message as flat beyond 4 as up to it, and no limit from
    disk, network, memory bandwidth or etcd. The same formula for this machine's
    own cores is given next to what was measured here, as a check of it.
    """
    measured = [row for row in rows if row["max_us_per_message"] is not None]
    if not measured:
        return {}
    worst = max(measured, key=lambda row: row["max_us_per_message"])
    broker_us = float(worst["max_us_per_message"])
    clients_us = float(worst["clients_us_per_message"] or 0.0)
    etcd_us = float(worst["etcd_us_per_message"] or 0.0)

    def at(n: int) -> dict[str, Any]:
        return {
            "cores": n,
            "brokers_only_msg_per_s": round(n * 1e6 / broker_us),
            "with_clients_msg_per_s": round(n * 1e6 / (broker_us + clients_us + etcd_us)),
        }

    out: dict[str, Any] = {
        "basis": {
            "variant": worst["variant"],
            "broker_us_per_message": broker_us,
            "clients_us_per_message": clients_us,
            "etcd_us_per_message": etcd_us,
        },
        "machines": [at(n) for n in cores],
    }
    if machine:
        best = max(row["e2e_msg_per_s"] for row in rows)
        out["this_machine"] = {**at(machine), "measured_e2e_msg_per_s": best}
    return out


# --- rendering ---------------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".3f") -> str:
    return "" if value is None else format(value, fmt)


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def _met(met: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[met]


def markdown(section: dict[str, Any]) -> str:
    """The scale-out tables for stdout and ``results.md``."""
    out: list[str] = []
    for s in section["scenarios"]:
        out += [
            f"### Scale-out: {s['scenario']} (baseline {s['baseline']})",
            "",
            "| partitions = brokers | broker | stored | CPU s | CPU µs per stored message | ratio to 1 broker "
            "| less background µs | background CPU s/s | end-to-end msg/s | e2e ratio | clients µs/msg | etcd µs/msg |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in s["rows"]:
            for i, (name, b) in enumerate(sorted(row["brokers"].items())):
                first = i == 0
                head = row["partitions"] if first else ""
                out.append(
                    f"| {head} | {name} | {b['stored']:,} | {_f(b['cpu_seconds'], '.2f')} "
                    f"| {_f(b['us_per_message'])} | {_f(b['ratio'])} | {_f(b['us_per_message_less_background'])} "
                    f"| {_f(b['background_cpu_per_s'], '.4f')} "
                    f"| {_f(row['e2e_msg_per_s'], ',.0f') if first else ''} | {_f(row['e2e_ratio']) if first else ''} "
                    f"| {_f(row['clients_us_per_message']) if first else ''} "
                    f"| {_f(row['etcd_us_per_message']) if first else ''} |"
                )
        spread = [
            f"{row['partitions']}: "
            + ", ".join(
                f"{name} {'/'.join(f'{v:.3f}' for v in b['runs_us_per_message'])}"
                for name, b in sorted(row["brokers"].items())
            )
            + f" ({row['runs_key'][0]} {'/'.join(_num(v) for v in row['runs_key'][1])})"
            for row in s["rows"]
            if row["repetitions"] > 1
        ]
        if spread:
            out += [
                "",
                "Each broker's CPU µs per stored message is the median of its repetitions, in run order: "
                + "; ".join(spread)
                + ". Stored, CPU s and end-to-end are those of the run the suite reports (its median by that metric).",
            ]
        out += _matched_table(s["rows"])
        work = [
            f"| {row['partitions']} | {name} | {w['batches']:,} | {w['cpu_us_per_batch']:,.1f} "
            f"| {w['passes_per_batch']:.2f} | {w['group_commits_per_batch']:.2f} "
            f"| {w['fsync_ms_per_batch']:.3f} | {w['system_share']:.0%} |"
            for row in s["rows"]
            for name, b in sorted(row["brokers"].items())
            if (w := b.get("work"))
        ]
        work += [
            f"| 1 | paced to {row['partitions']} brokers' rate | {w['batches']:,} | {w['cpu_us_per_batch']:,.1f} "
            f"| {w['passes_per_batch']:.2f} | {w['group_commits_per_batch']:.2f} "
            f"| {w['fsync_ms_per_batch']:.3f} | {w['system_share']:.0%} |"
            for row in s["rows"]
            if row.get("load_matched") and (w := row["load_matched"]["work"])
        ]
        if work:
            out += [
                "",
                "Where a broker's CPU goes (the median-throughput run, from its own metrics): per batch it stored, "
                "its CPU, event-loop passes and group commits, time in fdatasync, and the kernel's share of its CPU.",
                "",
                "| partitions | broker | batches | CPU µs per batch | passes per batch | group commits per batch "
                "| fsync ms per batch | system CPU |",
                "|---:|---|---:|---:|---:|---:|---:|---:|",
                *work,
            ]
        out += ["", "| claim | measured | met |", "|---|---|---|"]
        out += [f"| {c['claim']} | {c['measured']} | {_met(c['met'])} |" for c in s["checks"]]
        p = s["projection"]
        if p:
            b = p["basis"]
            out += [
                "",
                f"Projection (not a measurement), from {b['variant']}'s busiest broker: "
                f"{b['broker_us_per_message']:.3f} µs per message per broker process, "
                f"clients {b['clients_us_per_message']:.3f} µs, etcd "
                f"{b['etcd_us_per_message']:.3f} µs. One broker per core, partitions >= cores, CPU per message "
                "as flat as measured up to 4 brokers, no disk, network or etcd limit.",
                "",
                "| cores | brokers only (clients elsewhere) msg/s | brokers + clients on the same machine msg/s |",
                "|---:|---:|---:|",
            ]
            out += [
                f"| {m['cores']} | {m['brokers_only_msg_per_s']:,} | {m['with_clients_msg_per_s']:,} |"
                for m in p["machines"]
            ]
            here = p.get("this_machine")
            if here:
                out.append(
                    f"| {here['cores']} (this machine, check) | {here['brokers_only_msg_per_s']:,} "
                    f"| {here['with_clients_msg_per_s']:,} (measured: {here['measured_e2e_msg_per_s']:,.0f}) |"
                )
        out.append("")
    return "\n".join(out)


def _matched_table(rows: list[Row]) -> list[str]:
    """Each broker against one broker paced to the rate each of them stored at (the load-matched baseline)."""
    matched = [row for row in rows if row.get("load_matched")]
    if not matched:
        return []
    out = [
        "",
        "Load-matched baseline: after each run of k brokers, one broker (the 1-partition setup, same workload, "
        "credit and fsync) with the producer paced so that it stores at the rate each of the k brokers stored at "
        "(their mean, stored messages over the run's seconds), as many messages as each of them stored. "
        "Medians over the repetitions; the ratio is each broker's CPU per stored message over the paced broker's.",
        "",
        "| partitions = brokers | broker | CPU µs per stored message | ratio to 1 broker unpaced "
        "| per-broker stored msg/s | 1 broker paced: stored msg/s | its CPU µs per stored message | ratio to it |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in matched:
        m = row["load_matched"]
        for i, (name, b) in enumerate(sorted(row["brokers"].items())):
            first = i == 0
            out.append(
                f"| {row['partitions'] if first else ''} | {name} | {_f(b['us_per_message'])} | {_f(b['ratio'])} "
                f"| {_f(m['per_broker_msg_per_s'], ',.0f') if first else ''} "
                f"| {_f(m['paced_msg_per_s'], ',.0f') if first else ''} "
                f"| {_f(m['us_per_message']) if first else ''} | {_f(b.get('load_matched_ratio'))} |"
            )
    spread = [
        f"{row['partitions']}: per-broker rate {'/'.join(_num(v) for v in m['runs_per_broker_msg_per_s'])}, "
        f"paced broker {'/'.join(_num(v) for v in m['runs_paced_msg_per_s'])} msg/s at "
        f"{'/'.join(f'{v:.3f}' for v in m['runs_us_per_message'])} µs"
        for row in matched
        if len((m := row["load_matched"])["runs_us_per_message"]) > 1
    ]
    if spread:
        out += ["", "The repetitions, in run order: " + "; ".join(spread) + "."]
    return out


def html(section: dict[str, Any]) -> str:
    """The scale-out section of the HTML report, with its charts."""
    parts = ["<h2 id='scale-out'>Scale-out: CPU per stored message per broker</h2>"]
    for s in section["scenarios"]:
        parts.append(f"<h3>{escape(s['scenario'])} (baseline {escape(s['baseline'])})</h3>")
        bars = []
        for row in s["rows"]:
            for name, b in sorted(row["brokers"].items()):
                if b["us_per_message"] is not None:
                    label = f"{_k(row['partitions'])}: {name}"
                    bars.append((label, b["us_per_message"], _colour(row["partitions"]), "µs"))
        parts.append("<p class=note>CPU µs per message each broker stored (lower is better; flat is scaling)</p>")
        parts.append(hbars(bars, unit="µs"))
        matched = []
        for row in s["rows"]:
            m = row.get("load_matched")
            if not m or m["us_per_message"] is None:
                continue
            rate = _f(m["paced_msg_per_s"] or m["target_msg_per_s"], ",.0f")
            matched.append((f"1 broker paced to {rate} msg/s", m["us_per_message"], _colour(1), "µs"))
            matched += [
                (f"{_k(row['partitions'])}: {name}", b["us_per_message"], _colour(row["partitions"]), "µs")
                for name, b in sorted(row["brokers"].items())
                if b["us_per_message"] is not None
            ]
        if matched:
            parts.append(
                "<p class=note>Load-matched: each broker's CPU µs per stored message next to one broker's paced to "
                f"the same per-broker rate (within {section['tolerance']:.0%}: the target at equal load per broker)</p>"
            )
            parts.append(hbars(matched, unit="µs"))
        tp = [(_k(row["partitions"]), row["e2e_msg_per_s"], _colour(row["partitions"]), "") for row in s["rows"]]
        parts.append("<p class=note>End-to-end throughput on this machine (its cores are shared by everything)</p>")
        parts.append(hbars(tp))
        p = s["projection"]
        if p:
            proj = [
                (f"{m['cores']} cores, brokers only", m["brokers_only_msg_per_s"], "#1f5fbf88", "")
                for m in p["machines"]
            ]
            proj += [
                (f"{m['cores']} cores, with clients", m["with_clients_msg_per_s"], "#1f5fbf", "") for m in p["machines"]
            ]
            parts.append("<p class=note>Projection (not measured): cores / CPU µs per message</p>")
            parts.append(hbars(proj))
        parts.append("<pre>" + escape(markdown({"scenarios": [s]})) + "</pre>")
    return "\n".join(parts)


def _k(k: int) -> str:
    return f"{k} partition{'s' if k > 1 else ''}, {k} broker{'s' if k > 1 else ''}"


def _colour(k: int) -> str:
    return {1: "#1f5fbf", 2: "#5dade2", 4: "#27ae60"}.get(k, "#8e44ad")
