"""The tail cache: reads of recent batches, eviction by bytes, truncation."""

from __future__ import annotations

from conveyor.broker.log.tail_cache import TailCache
from conveyor.broker.wire.record import Batch


def batch(base: int, count: int = 2, size: int = 10) -> Batch:
    return Batch(base, count, 0, bytes([base % 256]) * size)


def filled(max_bytes: int, n: int, *, count: int = 2, size: int = 10) -> TailCache:
    cache = TailCache(max_bytes)
    for i in range(n):
        cache.add(batch(i * count, count, size))
    return cache


def live_bytes(cache: TailCache) -> int:
    return sum(len(b.body) for b in cache._batches[cache._head :])


def test_read_returns_batches_from_the_one_holding_the_offset():
    cache = filled(1000, 5)

    batches = cache.read(5, max_bytes=1000)

    assert [b.base_offset for b in batches] == [4, 6, 8]


def test_read_honours_max_bytes_but_returns_at_least_one_batch():
    cache = filled(1000, 5)
    assert [b.base_offset for b in cache.read(0, max_bytes=25)] == [0, 2]
    assert [b.base_offset for b in cache.read(0, max_bytes=1)] == [0]


def test_read_stops_once_max_messages_are_covered():
    """A credit-limited dispatch asks for a few messages: walking a MiB of tiny batches for them made
    each dispatch pass cost in proportion to the backlog (quadratic over a backlog of one-message batches)."""
    cache = filled(1 << 20, 10_000, count=1)

    assert [b.base_offset for b in cache.read(5, max_bytes=1 << 20, max_messages=3)] == [5, 6, 7]
    assert [b.base_offset for b in filled(1000, 5).read(5, max_bytes=1000, max_messages=2)] == [4, 6]
    assert len(cache.read(5, max_bytes=1 << 20)) == 9_995  # without a limit: bytes only, as before


def test_read_below_the_cached_range_is_a_miss():
    cache = filled(30, 5)  # room for three batches of 10 bytes
    assert cache.start_offset == 4
    assert cache.read(3, max_bytes=100) is None
    assert [b.base_offset for b in cache.read(4, max_bytes=100)] == [4, 6, 8]


def test_an_empty_or_disabled_cache_misses():
    assert TailCache(100).read(0, 100) is None
    disabled = filled(0, 3)
    assert len(disabled) == 0
    assert disabled.read(0, 100) is None


def test_eviction_keeps_the_newest_batches_within_max_bytes():
    cache = filled(35, 10)
    assert len(cache) == 3
    assert cache.bytes == live_bytes(cache) == 30


def test_a_batch_larger_than_the_cache_is_still_kept_alone():
    cache = TailCache(5)
    cache.add(batch(0, size=50))
    cache.add(batch(2, size=50))
    assert [b.base_offset for b in cache.read(2, 100)] == [2]
    assert len(cache) == 1


def test_eviction_compacts_without_losing_order():
    cache = filled(100, 5000, count=1, size=10)
    assert len(cache) == 10
    assert len(cache._batches) < 5000  # evicted entries were compacted away
    assert [b.base_offset for b in cache.read(4995, 1000)] == [4995, 4996, 4997, 4998, 4999]


def test_truncate_drops_batches_at_and_after_the_offset():
    cache = filled(1000, 5)

    cache.truncate(6)

    assert [b.base_offset for b in cache.read(0, 1000)] == [0, 2, 4]
    assert cache.bytes == live_bytes(cache) == 30


def test_truncate_inside_a_batch_drops_that_batch_too():
    cache = filled(1000, 5)

    cache.truncate(7)

    assert [b.base_offset for b in cache.read(0, 1000)] == [0, 2, 4]
    assert cache.bytes == 30


def test_truncate_into_the_evicted_range_keeps_byte_accounting_right():
    # Given a cache that already evicted its oldest batches
    cache = filled(30, 5)
    assert cache.start_offset == 4
    # When the log is truncated below what the cache holds
    cache.truncate(1)
    # Then nothing is cached and the byte count is zero, not negative
    assert len(cache) == 0
    assert cache.bytes == 0
    # And the cache still bounds what it keeps afterwards
    for i in range(10):
        cache.add(batch(100 + i * 2))
    assert cache.bytes == live_bytes(cache) <= 30


def test_truncate_then_append_continues_the_cached_range():
    cache = filled(1000, 5)
    cache.truncate(4)
    cache.add(batch(4, size=3))
    assert [(b.base_offset, len(b.body)) for b in cache.read(2, 1000)] == [(2, 10), (4, 3)]


def test_drop_before_forgets_batches_wholly_below_the_offset():
    cache = filled(1000, 5)

    cache.drop_before(5)

    assert cache.start_offset == 4
    assert cache.read(3, 1000) is None
    assert cache.bytes == live_bytes(cache) == 30
