"""Numbers from the raw reports: percentiles, exactly-once, series over time."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

PERCENTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0), ("p99.9", 99.9))


def percentiles_ms(latencies_us: Sequence[int]) -> dict[str, float]:
    """avg, p50, p95, p99, p99.9 (nearest rank) and max, in milliseconds; {} without samples."""
    n = len(latencies_us)
    if not n:
        return {}
    ordered = sorted(latencies_us)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(n * p / 100) - 1))] / 1000

    out = {"avg": sum(ordered) / n / 1000}
    out.update({name: rank(p) for name, p in PERCENTILES})
    out["max"] = ordered[-1] / 1000
    out["samples"] = float(n)
    return out


def exactly_once(sent: Sequence[tuple[int, int]], groups_seqs: Sequence[Sequence[array[int]]]) -> dict[str, Any]:
    """Was every sequence number sent processed exactly once in every group? Counts summed over groups.

    ``sent``: the ``[first, end)`` ranges of sequence numbers the producers sent (a producer that
    stopped at the duration bound sent only the start of its share). ``unexpected`` counts numbers
    nobody sent (corruption); they count as duplicates too.
    """
    size = max((end for _, end in sent), default=0)
    valid = bytearray(size)
    for first, end in sent:
        valid[first:end] = b"\x01" * (end - first)
    expected = sum(valid)
    received = duplicates = lost = unique_total = unexpected = 0
    for group in groups_seqs:
        seen = bytearray(size)
        dup = 0
        for seqs in group:
            received += len(seqs)
            for seq in seqs:
                if seq >= size or not valid[seq]:
                    unexpected += 1
                elif seen[seq]:
                    dup += 1
                else:
                    seen[seq] = 1
        unique = sum(seen)
        unique_total += unique
        duplicates += dup
        lost += expected - unique
    duplicates += unexpected
    return {
        "expected": expected * len(groups_seqs),
        "received": received,
        "unique": unique_total,
        "duplicates": duplicates,
        "unexpected": unexpected,
        "lost": lost,
        "exactly_once": duplicates == 0 and lost == 0,
    }


def latency_series(
    sent_ms: Sequence[int], latencies_us: Sequence[int], start_ms: float, points: int = 60
) -> list[list[float]]:
    """``[[seconds since start, p50 ms, p99 ms, max ms], ...]`` bucketed by send time."""
    if not sent_ms:
        return []
    span = max(1.0, max(sent_ms) - start_ms)
    width = max(50.0, span / points)
    buckets: dict[int, list[int]] = {}
    for t, lat in zip(sent_ms, latencies_us, strict=True):
        buckets.setdefault(max(0, int((t - start_ms) // width)), []).append(lat)
    out = []
    for b in sorted(buckets):
        values = sorted(buckets[b])
        n = len(values)
        p50 = values[(n - 1) // 2] / 1000
        p99 = values[min(n - 1, max(0, math.ceil(n * 0.99) - 1))] / 1000
        out.append([round((b + 0.5) * width / 1000, 3), p50, p99, values[-1] / 1000])
    return out
