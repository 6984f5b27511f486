"""``conveyor bench --compare OLD.json``: this run against an earlier one, as ratios, with regressions flagged.

The regression guard of the hot path (issue #19): commit a run's JSON, and
the next run prints, for every scenario and variant found in both, end-to-end
throughput new/old and latency p50 and p99 new/old. A run is judged on the
metric its scenario is for: throughput for a max-rate scenario (its latency is
mostly queueing), p50 and p99 for a paced one (its throughput is the pace). A
ratio past the threshold on that metric is a regression; the other ratios are
printed for reading, never flagged. Absolute numbers differ between machines
and days: compare runs made on the same machine, and prefer ``--repeat 3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Comparison:
    """One scenario and variant found in both runs; a ratio is None where either run lacks the number."""

    scenario: str
    variant: str
    paced: bool
    throughput: float | None  # e2e msg/s, new / old: below 1 is slower
    p50: float | None  # new / old: above 1 is slower
    p99: float | None
    regressions: tuple[str, ...]  # the judged metrics past the threshold: "throughput", "p50", "p99"


def _ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old <= 0:
        return None
    return float(new) / float(old)


def _by_key(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The results that carry numbers (a failed run has none), by (scenario, variant)."""
    return {(r["scenario"], r["variant"]): r for r in report.get("results", []) if "e2e_msg_per_s" in r}


def compare(new: dict[str, Any], old: dict[str, Any], threshold: float = 0.10) -> list[Comparison]:
    """Every (scenario, variant) in both reports, in the new report's order, with regressions past ``threshold``.

    Throughput regresses below ``1 - threshold`` of the old; latency above ``1 + threshold``.
    """
    before = _by_key(old)
    out = []
    for key, now in _by_key(new).items():
        then = before.get(key)
        if then is None:
            continue
        paced = bool(now.get("paced"))
        lat_new, lat_old = now.get("latency_ms") or {}, then.get("latency_ms") or {}
        throughput = _ratio(now.get("e2e_msg_per_s"), then.get("e2e_msg_per_s"))
        p50, p99 = _ratio(lat_new.get("p50"), lat_old.get("p50")), _ratio(lat_new.get("p99"), lat_old.get("p99"))
        if paced:
            judged = [(name, r) for name, r in (("p50", p50), ("p99", p99)) if r is not None and r > 1 + threshold]
        else:
            judged = [("throughput", throughput)] if throughput is not None and throughput < 1 - threshold else []
        out.append(Comparison(key[0], key[1], paced, throughput, p50, p99, tuple(name for name, _ in judged)))
    return out


def _fmt(ratio: float | None, flagged: bool) -> str:
    text = "—" if ratio is None else f"{ratio:.2f}x"
    return f"**{text}**" if flagged else text


def comparison_table(rows: list[Comparison], threshold: float, old_name: str = "OLD") -> str:
    """A markdown table of ``rows``, a regression's ratio in bold, and a line that counts them."""
    lines = [
        f"Compared with {old_name} (new/old; regression: throughput below {1 - threshold:.2f}x on a max-rate "
        f"scenario, p50 or p99 above {1 + threshold:.2f}x on a paced one)",
        "",
        "| scenario | variant | throughput | p50 | p99 | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = f"REGRESSION ({', '.join(r.regressions)})" if r.regressions else "ok"
        lines.append(
            f"| {r.scenario} | {r.variant} | {_fmt(r.throughput, 'throughput' in r.regressions)} "
            f"| {_fmt(r.p50, 'p50' in r.regressions)} | {_fmt(r.p99, 'p99' in r.regressions)} | {verdict} |"
        )
    if not rows:
        lines.append("| (no scenario and variant in both runs) | | | | | |")
    lines += ["", f"{sum(1 for r in rows if r.regressions)} regression(s) in {len(rows)} compared run(s)"]
    return "\n".join(lines)
