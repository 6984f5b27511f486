"""Offset-range arithmetic, checked against plain sets of offsets on random inputs."""

from __future__ import annotations

import itertools
import random

from conveyor.broker.wire.ranges import count, intersect, normalize, subtract, to_ranges, window


def offsets(ranges) -> set[int]:
    return {o for a, b in ranges for o in range(a, b)}


def random_ranges(rng: random.Random, n: int, span: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        a = rng.randrange(span)
        out.append((a, a + rng.randrange(0, 12)))  # empty ones too, overlapping, in any order
    return out


def test_range_operations_agree_with_sets_of_offsets():
    rng = random.Random(7)
    for _ in range(2000):
        left = normalize(random_ranges(rng, rng.randrange(0, 8), 60))
        right = normalize(random_ranges(rng, rng.randrange(0, 8), 60))
        # normalized: sorted, disjoint, not touching, none empty
        for rs in (left, right):
            assert all(a < b for a, b in rs)
            assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(rs))
        rest, removed = subtract(left, right)
        assert offsets(rest) == offsets(left) - offsets(right)
        assert removed == len(offsets(left) & offsets(right))
        assert offsets(intersect(left, right)) == offsets(left) & offsets(right)
        assert count(rest) + removed == count(left)
        if left:
            lo, hi = rng.randrange(70), rng.randrange(70)
            starts = [a for a, _ in left]
            near = window(left, starts, min(lo, hi), max(lo, hi) + 1)
            inside = set(range(min(lo, hi), max(lo, hi) + 1))
            assert offsets(left) & inside == offsets(near) & inside, "the window holds every overlapping range"


def test_to_ranges_groups_consecutive_offsets():
    assert to_ranges([3, 4, 5, 9, 11, 12]) == [(3, 6), (9, 10), (11, 13)]
    assert to_ranges([]) == []


def test_thousands_of_scattered_acks_in_any_order():
    # 15,000 single-offset ranges, shuffled, off a 30,000-offset lease: one merge after one sort
    acks = [(o, o + 1) for o in range(0, 30_000, 2)]
    random.Random(3).shuffle(acks)
    rest, removed = subtract([(0, 30_000)], normalize(acks))
    assert removed == 15_000
    assert rest == [(o, o + 1) for o in range(1, 30_000, 2)]
