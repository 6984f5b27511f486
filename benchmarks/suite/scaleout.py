"""The scale-out section of a report: CPU per stored message per broker at 1, 2, 4 partitions, and a projection.

``benchmarks/scaleout.json`` runs one workload on clusters of k brokers with k
partitions (one partition leader per broker, replication factor 1). On a
machine whose few cores are shared by every broker and the clients, wall-clock
throughput cannot grow with k, so the question is asked of CPU instead: does
each broker spend the same CPU per message it stores as the single broker did?
If it does, a machine with more cores serves proportionally more, and the
projection for bigger machines is ``cores / (CPU per message)``. Pure: it
reads a report dict (``run_bench``'s) and returns plain data, Markdown or HTML.
"""

from __future__ import annotations

from html import escape
from typing import Any

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
        scenarios.append(_scenario(name, rows, base, tolerance, cores, machine_cores))
    return {"tolerance": tolerance, "cores": cores, "scenarios": scenarios}


def _scenario(
    name: str, rows: list[Row], base: Row, tolerance: float, cores: list[int], machine: int
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
    return {
        "scenario": name,
        "baseline": base["variant"],
        "rows": rows,
        "checks": _checks(rows, base, tolerance),
        "projection": projection(rows, cores, machine),
    }


def _one_each(row: Row) -> bool:
    """Every broker leads exactly one of the topic's partitions (the controller spread them)."""
    nodes = [leader.split("@", 1)[0] for leader in row["leaders"].values()]
    return len(nodes) == row["partitions"] and len(set(nodes)) == len(nodes)


def _checks(rows: list[Row], base: Row, tolerance: float) -> list[dict[str, Any]]:
    others = [row for row in rows if row is not base]
    two = next((row for row in rows if row["partitions"] == 2), None)
    return [
        {
            "claim": f"each broker's CPU per stored message within {tolerance:.0%} of the single broker's",
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
        {
            "claim": "one partition leader on each broker",
            "met": all(row["one_partition_per_broker"] for row in rows),
            "measured": "; ".join(f"{row['partitions']}: {', '.join(row['leaders'].values())}" for row in rows),
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
        work = [
            f"| {row['partitions']} | {name} | {w['batches']:,} | {w['cpu_us_per_batch']:,.1f} "
            f"| {w['passes_per_batch']:.2f} | {w['group_commits_per_batch']:.2f} "
            f"| {w['fsync_ms_per_batch']:.3f} | {w['system_share']:.0%} |"
            for row in s["rows"]
            for name, b in sorted(row["brokers"].items())
            if (w := b.get("work"))
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
