"""The HTML report: one self-contained file (inline CSS and SVG, no scripts, nothing fetched)."""

from __future__ import annotations

from html import escape
from typing import Any

from conveyor.benchmarks.suite import scaleout
from conveyor.benchmarks.suite.summary import (
    by_scenario,
    check_targets,
    describe_target,
    observations,
    process_cpu,
    target_cell,
)
from conveyor.benchmarks.suite.svg import hbars, line_chart

COLOURS = {
    "conveyor": "#1f5fbf",
    "conveyor:r3": "#5dade2",
    "redis:always": "#c0392b",
    "redis:everysec": "#e67e22",
    "redis:none": "#8e2a1f",
    "nats:file": "#27ae60",
    "nats:memory": "#7dcea0",
    "nats:r3": "#145a32",
    "rabbitmq:persistent": "#8e44ad",
    "rabbitmq:transient": "#c39bd3",
}
PERCENTILE_KEYS = ("p50", "p95", "p99", "p99.9")

CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:right;vertical-align:top}
th{background:#f4f6f8}td.l,th.l{text-align:left}
tr.conveyor td{background:#f3f7fd}
.bad{color:#b00;font-weight:600}.good{color:#16703a;font-weight:600}
.note{color:#555;font-size:12px}.warn{background:#fff4e0;border:1px solid #f0c36d;padding:8px;margin:8px 0}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
ul.obs li{margin:4px 0}
code{background:#f4f4f4;padding:0 3px}
"""


def colour(variant: str) -> str:
    return COLOURS.get(variant) or COLOURS.get(variant.split(":")[0], "#555")


def _num(value: Any, fmt: str = ",.0f") -> str:
    if value is None or value == "":
        return ""
    return format(value, fmt)


def _lat(r: dict[str, Any], key: str) -> str:
    value = r.get("latency_ms", {}).get(key)
    return "" if value is None else f"{value:.2f}"


def _name(r: dict[str, Any]) -> str:
    return f"{r['title']} ({r['durability']})"


def short(r: dict[str, Any]) -> str:
    """``Conveyor batch``, ``Redis Streams always``: for chart labels (the tables state the durability in full)."""
    return f"{r['title']} {r['variant'].split(':', 1)[1]}"


def results_table(results: list[dict[str, Any]], scenarios: dict[str, dict[str, Any]]) -> str:
    head = (
        "<tr><th class=l>scenario</th><th class=l>system</th><th class=l>durability</th>"
        "<th>producer msg/s</th><th>end-to-end msg/s</th><th>MB/s</th><th>msg/s per participant</th>"
        "<th>msg per CPU s</th><th>avg ms</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>p99.9 ms</th>"
        "<th>max ms</th><th>max depth (clients)</th><th>max lag (server)</th><th>max in-flight</th>"
        "<th>CPU s server</th><th>CPU s clients</th><th class=l>busiest process</th><th>sent</th>"
        "<th>duplicates</th><th>lost</th><th class=l>exactly once</th></tr>"
    )
    rows = []
    for r in results:
        cls = ' class="conveyor"' if r["system"] == "conveyor" else ""
        swatch = f'<span class=sw style="background:{colour(r["variant"])}"></span>'
        if "e2e_msg_per_s" not in r:
            rows.append(
                f"<tr{cls}><td class=l>{escape(r['scenario'])}</td><td class=l>{swatch}{escape(r['title'])}</td>"
                f"<td class=l>{escape(r['durability'])}</td><td class='l bad' colspan=21>failed: "
                f"{escape('; '.join(r.get('errors', [])))}</td></tr>"
            )
            continue
        clients = sum(v for k, v in r["cpu"].items() if k != "server")
        b = r["bottleneck"]
        busy = f"{b['process']} {b['cpu_seconds']:.2f} s" + (
            f" ({b['busy_fraction'] * 100:.0f}%)" if b.get("busy_fraction") is not None else ""
        )
        once = (
            "<span class=good>yes</span>"
            if r["exactly_once"]
            else f"<span class=bad>NO</span> {escape('; '.join(r.get('errors', [])))}"
        )
        if r["exactly_once"] and r.get("errors"):
            once += f" <span class=bad>{escape('; '.join(r['errors']))}</span>"
        rows.append(
            f"<tr{cls}><td class=l>{escape(r['scenario'])}</td><td class=l>{swatch}{escape(r['title'])}</td>"
            f"<td class=l>{escape(r['durability'])}</td>"
            f"<td>{_num(r['producer_msg_per_s'])}</td><td><b>{_num(r['e2e_msg_per_s'])}</b></td>"
            f"<td>{_num(r['e2e_mb_per_s'], ',.1f')}</td><td>{_num(r['efficiency_msg_per_s_per_participant'])}</td>"
            f"<td>{_num(r.get('msg_per_cpu_second'))}</td>"
            + "".join(f"<td>{_lat(r, k)}</td>" for k in ("avg", *PERCENTILE_KEYS, "max"))
            + f"<td>{_num(r['max_depth'])}</td><td>{_num(r.get('max_lag'))}</td><td>{_num(r.get('max_in_flight'))}</td>"
            f"<td>{_num(r['cpu'].get('server'), '.2f')}</td><td>{clients:.2f}</td><td class=l>{escape(busy)}</td>"
            f"<td>{_num(r['sent'])}</td><td>{_num(r['duplicates'])}</td><td>{_num(r['lost'])}</td>"
            f"<td class=l>{once}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def targets_table(report: dict[str, Any]) -> str:
    checks = check_targets(report)
    if not checks:
        return ""
    rows = []
    for t in checks:
        met = {True: "<span class=good>met</span>", False: "<span class=bad>missed</span>", None: "n/a"}[t["met"]]
        rows.append(
            f"<tr><td class=l>{escape(describe_target(t))}</td><td class=l>{escape(target_cell(t))}</td>"
            f"<td class=l>{met}</td></tr>"
        )
    return (
        "<h2>Targets</h2><table><tr><th class=l>target</th><th class=l>measured</th><th class=l>result</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def scenario_section(name: str, runs: list[dict[str, Any]], scenario: dict[str, Any]) -> str:
    ok = [r for r in runs if "e2e_msg_per_s" in r]
    out = [f"<h2 id='{escape(name)}'>{escape(name)}</h2>"]
    out.append(f"<p>{escape(scenario.get('label', ''))}. {escape(scenario.get('description', ''))}</p>")
    if not ok:
        return "".join(out) + "<p class=bad>No run of this scenario produced numbers.</p>"
    paced = scenario.get("rate", "max") != "max"
    repeated = [r for r in ok if r.get("repeats")]
    if repeated:
        out.append(
            "<p class=note>Runs (the median one is shown): "
            + "; ".join(
                f"{escape(short(r))}: {escape(r['repeats']['metric'])} "
                + ", ".join(_num(v, ".2f" if r.get("paced", paced) else ",.0f") for v in r["repeats"]["values"])
                for r in repeated
            )
            + "</p>"
        )
    out.append("<h3>Throughput</h3>")
    bars = []
    for r in ok:
        bars.append((f"{short(r)}: end-to-end", r["e2e_msg_per_s"], colour(r["variant"]), ""))
        bars.append((f"{short(r)}: producer", r["producer_msg_per_s"], colour(r["variant"]) + "88", ""))
    out.append(hbars(bars))
    if paced:
        out.append(
            f"<p class=note>Paced at {scenario['rate']:,} msg/s: throughput only shows that every system kept up.</p>"
        )
    out.append("<h3>Latency percentiles (send to handler, ms, log scale)</h3>")
    xs = [(i, k) for i, k in enumerate(PERCENTILE_KEYS)]
    series = []
    for r in ok:
        pts = [(float(i), r["latency_ms"][k]) for i, k in xs if r.get("latency_ms", {}).get(k) is not None]
        series.append((short(r), colour(r["variant"]), pts, not r.get("matching_durability", True)))
    out.append(line_chart(series, x_label="percentile", y_label="ms", log_y=True, x_ticks=[(i, k) for i, k in xs]))
    out.append("<h3>Latency over the run (p99 solid, p50 dashed; by send time)</h3>")
    series = []
    for r in ok:
        pts = r.get("latency_series", [])
        series.append((f"{short(r)} p99", colour(r["variant"]), [(p[0], p[2]) for p in pts], False))
        series.append((f"{short(r)} p50", colour(r["variant"]), [(p[0], p[1]) for p in pts], True))
    out.append(line_chart(series, x_label="seconds since the first send", y_label="ms", log_y=True))
    out.append("<h3>Queue depth (sent but not yet processed, all groups)</h3>")
    series = [
        (short(r), colour(r["variant"]), [(s["t"], float(s["depth"])) for s in r.get("samples", [])], False) for r in ok
    ]
    out.append(line_chart(series, x_label="seconds since start", y_label="messages"))
    out.append("<h3>CPU seconds per process (CPU µs per message)</h3>")
    servers: list[str] = []
    clients: list[str] = []
    for r in ok:
        server_names = set(r.get("server_cpu") or {"server"})
        for p in process_cpu(r):
            column = servers if p in server_names else clients
            if p not in column:
                column.append(p)
    procs = servers + clients
    leaders = any(r.get("leader_changes") is not None for r in ok)
    head = (
        "<tr><th class=l>system</th>"
        + "".join(f"<th>{escape(p)}</th>" for p in procs)
        + "<th>total</th><th>wall s</th><th>other processes</th>"
        + ("<th>leader changes</th>" if leaders else "")
        + "</tr>"
    )
    rows = []
    for r in ok:
        cpu, per = process_cpu(r), r.get("cpu_us_per_message", {})
        cells = "".join(f"<td>{_cpu_cell(cpu.get(p), per.get(p))}</td>" for p in procs)
        changes = r.get("leader_changes")
        flag = "" if not changes else " class=bad"
        rows.append(
            f"<tr><td class=l>{escape(_name(r))}</td>{cells}<td>{_cpu_cell(r['cpu_total'], per.get('total'))}</td>"
            f"<td>{r['e2e_seconds']:.2f}</td><td>{r.get('other_cpu', 0):.2f}</td>"
            + (f"<td{flag}>{'' if changes is None else changes}</td>" if leaders else "")
            + "</tr>"
        )
    out.append(f"<table>{head}{''.join(rows)}</table>")
    return "".join(out)


def _cpu_cell(seconds: float | None, us_per_message: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.2f}" + (f" ({us_per_message:,.1f})" if us_per_message is not None else "")


def render_html(report: dict[str, Any]) -> str:
    scenarios = {s["name"]: s for s in report["scenarios"]}
    m = report["machine"]
    busy = [
        r
        for r in report["results"]
        if r.get("e2e_seconds") and r.get("other_cpu", 0) > 0.15 * r["e2e_seconds"] * (m.get("cpus") or 1)
    ]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<title>Conveyor benchmark report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Conveyor benchmark report</h1>",
        f"<p>Generated {escape(report['generated'])} by <code>conveyor bench --config {escape(report['config'])}"
        f"{' --quick' if report.get('quick') else ''}</code> in {report['duration_seconds']:.0f} s. "
        f"Machine: {escape(str(m.get('cpu_model', '')))}, {m.get('cpus')} CPUs, {m.get('memory_gib', '?')} GiB, "
        f"{escape(m.get('platform', ''))}, Python {escape(m.get('python', ''))}.</p>",
    ]
    if report.get("repeat", 1) > 1:
        parts.append(
            f"<p class=note>Every run was made {report['repeat']} times, the systems taking turns; each row is the "
            "median run (by p99 for the paced scenarios, by end-to-end msg/s otherwise), and the 'runs' line under "
            "each scenario lists every repetition.</p>"
        )
    if report.get("quick"):
        parts.append("<p class=warn>A --quick run: small message counts, a smoke test rather than a measurement.</p>")
    if busy:
        parts.append(
            "<p class=warn>Other processes on this machine used more than 15% of its CPU during "
            f"{len(busy)} run(s) (the 'other processes' column): their numbers are pessimistic.</p>"
        )
    if report.get("skipped_systems"):
        parts.append(
            "<p class=note>Not run: "
            + "; ".join(f"{escape(k)}: {escape(v)}" for k, v in report["skipped_systems"].items())
            + "</p>"
        )
    if report.get("skipped_variants"):
        parts.append(
            "<p class=note>Variants not run: "
            + "; ".join(
                f"{escape(m['variant'])} in {escape(m['scenario'])}: {escape(m['reason'])}"
                for m in report["skipped_variants"]
            )
            + "</p>"
        )
    parts.append(targets_table(report))
    if report.get("scale_out"):
        parts.append(scaleout.html(report["scale_out"]))
    parts.append("<h2>Observations</h2><ul class=obs>")
    parts += [f"<li>{escape(o)}</li>" for o in observations(report)]
    parts.append("</ul>")
    parts.append("<h2>All results</h2>")
    parts.append(results_table(report["results"], scenarios))
    tp = [
        (f"{r['scenario']}: {short(r)}", r["e2e_msg_per_s"], colour(r["variant"]), "")
        for r in report["results"]
        if "e2e_msg_per_s" in r and scenarios.get(r["scenario"], {}).get("rate", "max") == "max"
    ]
    if tp:
        parts.append("<h3>End-to-end throughput, every max-rate scenario and system</h3>")
        parts.append(hbars(tp, width=980))
    p99 = [
        (f"{r['scenario']}: {short(r)}", r["latency_ms"]["p99"], colour(r["variant"]), "ms")
        for r in report["results"]
        if r.get("latency_ms", {}).get("p99") is not None
        and scenarios.get(r["scenario"], {}).get("rate", "max") != "max"
    ]
    if p99:
        parts.append("<h3>p99 latency of the paced scenarios (lower is better)</h3>")
        parts.append(hbars(p99, width=980, unit="ms"))
    parts.append(
        "<p class=note>Jump to: " + " · ".join(f"<a href='#{escape(n)}'>{escape(n)}</a>" for n in scenarios) + "</p>"
    )
    for name, runs in by_scenario(report).items():
        parts.append(scenario_section(name, runs, scenarios.get(name, {})))
    parts.append(
        "<h2>Systems, clients and durability</h2><table><tr><th class=l>system</th><th class=l>version</th>"
        "<th class=l>client calls</th></tr>"
    )
    for info in report["systems"].values():
        parts.append(
            f"<tr><td class=l>{escape(info['title'])}</td><td class=l>{escape(info['version'])}</td>"
            f"<td class=l>{escape(info['client'])}</td></tr>"
        )
    parts.append("</table>")
    parts.append(METHOD)
    parts.append("</body></html>")
    return "\n".join(parts)


METHOD = """
<h2>How it is measured</h2>
<ul class=note>
<li>Every producer and every consumer is its own process (multiprocessing, spawn), and so is each server: no
shared GIL. Consumers connect and subscribe first; all processes then start on one signal.</li>
<li><b>Producer msg/s</b>: messages sent / (last producer's confirm of its last message - first send).
<b>End-to-end msg/s</b>: distinct messages processed / (last receive - first send). <b>Per participant</b>:
end-to-end / (producers + consumers). <b>msg per CPU s</b>: messages / CPU seconds of every process,
server included.</li>
<li><b>Latency</b>: every value starts with a time stamp (<code>time.time_ns()</code>) and a unique sequence
number; the consumer subtracts the stamp from the time the batch reached its handler. One machine, one clock. At
max rate the stamp is the send time and latency is mostly queueing. In the paced scenarios the stamp is the time
the message was <i>due</i> by the schedule, so a client whose send blocks (a synchronous round trip) is charged
for the messages it sends late (no coordinated omission, as wrk2 and HdrHistogram measure).</li>
<li><b>Depth</b>: sent minus processed, sampled 5 times a second from the clients' counters (every system);
<b>lag</b> and <b>in-flight</b> as the server reports them (Conveyor: Admin.describe_group; Redis: XINFO GROUPS
lag and pending; NATS: consumer num_pending and num_ack_pending; RabbitMQ: ready messages).</li>
<li><b>CPU</b>: utime + stime from /proc of each server process tree, and of each client process (all threads)
from the start signal to the end; a system of several servers (a cluster) has each server counted on its own, and
each process's CPU per message (µs) is given next to its seconds. The busiest process with its CPU time as a share
of the run's wall time tells the bottleneck: near 100% is a saturated core.</li>
<li><b>Leader changes</b> (replicated systems): leaders that changed during the run, with no fault injected, from
the servers' own count where they keep one (the NATS servers' logs) or from sampling who leads (target 0).</li>
<li><b>Exactly once</b>: every sequence number sent must be processed exactly once in every group (no faults
are injected): duplicates and losses are counted.</li>
</ul>
"""
