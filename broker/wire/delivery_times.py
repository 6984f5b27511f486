"""Delayed and expiring batches: when a batch may be delivered, and until when.

A producer asked for ``delay``/``not_before`` or ``ttl`` puts those messages
in batches of their own; every record of such a batch carries the batch's
two times in its headers (``conveyor-not-before``, ``conveyor-expires``: ms
since the epoch, decimal), and the body's array header is written in its
32-bit form (``0xdd``), which a msgpack writer otherwise uses only from
65,536 records. So the broker tells a timed batch from any other by one
byte (``body[0]``) and reads the times from the first record's headers
only, once per timed batch: a batch without times costs one byte compare,
and the body is still a plain msgpack array any reader decodes, stored,
replicated and fetched as every other batch.

Times are per batch. A message's times are rounded to the producer's
batching window (``linger_ms``, at least 1 ms): its not-before up to the
window's end, its expiry down to the window's start. Messages whose rounded
times are equal share a batch, so a batch's not-before is the latest of its
messages' (each at most a window later than asked) and its expiry the
earliest (each at most a window earlier). Pure functions but ``now_ms``: no
sockets, and the clock is passed in.
"""

from __future__ import annotations

import io
import math
import time
from datetime import datetime, timedelta
from typing import Any

import msgpack

from conveyor.errors import InvalidDeliveryTime

NOT_BEFORE = "conveyor-not-before"
EXPIRES = "conveyor-expires"
TIMED_MARK = 0xDD  # the first byte of a timed batch's body: a msgpack array32 header
EXPIRED = "expired"  # the dead-letter reason (``x-last-error``) of a batch that expired undelivered

Times = tuple[int, int]  # (not_before_ms, expires_ms) since the epoch; 0: none


def _seconds(value: Any, name: str) -> float:
    """A duration in seconds (a number or a ``timedelta``), finite and not negative."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidDeliveryTime(
            f"{name} must be seconds (a number) or a timedelta, not {type(value).__name__}", field=name
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidDeliveryTime(f"{name} must be a finite number of seconds >= 0, not {value!r}", field=name)
    return seconds


def _instant_ms(value: Any) -> int:
    """``not_before`` as ms since the epoch: a datetime (naive is local time, as ``datetime.timestamp``) or
    seconds since the epoch."""
    if isinstance(value, datetime):
        return math.ceil(value.timestamp() * 1000)  # up: never a fraction of a ms early
    return math.ceil(_seconds(value, "not_before") * 1000)


def message_times(
    now_ms: int, *, delay: Any = None, not_before: Any = None, ttl: Any = None, window_ms: int = 1
) -> Times | None:
    """A message's (not_before_ms, expires_ms), rounded to ``window_ms``; None when it asks for neither.

    ``delay`` (seconds or a timedelta) and ``not_before`` (a datetime or epoch seconds) say when it may
    be delivered, ``ttl`` (seconds or a timedelta, > 0, counted from now) until when. Anything else, a
    negative or non-finite number, both ``delay`` and ``not_before``, or a ``ttl`` that ends before the
    message is due raises ``InvalidDeliveryTime``, at ``send()``.
    """
    if delay is None and not_before is None and ttl is None:
        return None
    if delay is not None and not_before is not None:
        raise InvalidDeliveryTime("give delay or not_before, not both", field="delay")
    due = 0
    if delay is not None:
        due = now_ms + math.ceil(_seconds(delay, "delay") * 1000)
    elif not_before is not None:
        due = _instant_ms(not_before)
    expires = 0
    if ttl is not None:
        seconds = _seconds(ttl, "ttl")
        if seconds <= 0:
            raise InvalidDeliveryTime(f"ttl must be more than 0 seconds, not {ttl!r}", field="ttl")
        expires = now_ms + int(seconds * 1000)
        if expires <= max(due, now_ms):
            raise InvalidDeliveryTime(
                f"ttl {seconds:g} s ends before the message is due (at {due} ms since the epoch)", field="ttl"
            )
    window = max(1, window_ms)
    if due <= now_ms:
        due = 0  # due already (a not_before in the past): no hold
    if not due and not expires:
        return None
    return (-(-due // window) * window, expires // window * window)


def now_ms() -> int:
    """The wall clock in ms, rounded up: a delay counted from it never ends a fraction of a ms early."""
    return -(-time.time_ns() // 1_000_000)


def time_headers(times: Times, headers: dict[str, str] | None) -> dict[str, str]:
    """``headers`` with the batch's times added (a new dict: the caller's is not changed)."""
    added = dict(headers) if headers else {}
    not_before, expires = times
    if not_before:
        added[NOT_BEFORE] = str(not_before)
    if expires:
        added[EXPIRES] = str(expires)
    return added


def timed_array_header(count: int) -> bytes:
    """The array header of a timed batch's body: always the 32-bit form, the mark the broker looks at."""
    return bytes((TIMED_MARK,)) + count.to_bytes(4, "big")


def pack_timed_records(records: list[Any]) -> bytes:
    """A timed batch's body (``pack_records`` with the 32-bit array header)."""
    pack = msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape").pack
    return timed_array_header(len(records)) + b"".join(map(pack, records))


def batch_times(body: bytes) -> Times | None:
    """The times a stored batch carries, or None for a batch without (almost always one byte compare).

    Reads the first record's key and headers only, never a value; headers that are not times (a huge
    batch written by plain msgpack) or do not parse are no times: such a batch is delivered as any other.
    """
    if not body or body[0] != TIMED_MARK:
        return None
    try:
        unpacker = msgpack.Unpacker(io.BytesIO(body), raw=False, strict_map_key=False)
        if unpacker.read_array_header() < 1 or unpacker.read_array_header() != 3:
            return None
        unpacker.skip()  # the key
        headers = unpacker.unpack()
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(headers, dict):
        return None
    return _times_of(headers)


def _times_of(headers: dict[Any, Any]) -> Times | None:
    try:
        not_before, expires = int(headers.get(NOT_BEFORE) or 0), int(headers.get(EXPIRES) or 0)
    except (TypeError, ValueError):
        return None
    return (not_before, expires) if not_before or expires else None


def headers_times(headers: dict[str, str] | None) -> Times | None:
    """A delivered message's times, from its headers (``Message.not_before`` / ``expires``)."""
    return _times_of(headers) if headers else None
