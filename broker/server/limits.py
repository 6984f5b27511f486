"""What one client may make the broker hold: topics, groups, auto-creations per second, descriptors.

Each topic holds open files (its active segment, and every sealed one), so
the broker runs out of descriptors long before it runs out of memory: the
topic limit is the smaller of ``--max-topics`` and what the descriptors
allow with a reserve kept for connections, index files and the offsets
writer. Auto-creation is rate limited per broker and per connection (token
buckets): a client subscribing to thousands of new topics gets
``RATE_LIMITED`` with ``retry_after_ms`` instead of stalling everyone else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from collections.abc import Callable

from conveyor.errors import RateLimited, TopicLimit

log = logging.getLogger("conveyor.broker")

DESCRIPTOR_RESERVE = 128  # kept for sockets, index files, offsets files, the metrics server
FD_LIMIT_RECHECK_SECONDS = 1.0


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Kafka's start scripts advise); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # some systems cap it lower (macOS: OPEN_MAX)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int | None:
    """How many descriptors the process holds now (Linux ``/proc``), or None where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


class TokenBucket:
    """``rate`` tokens a second, at most ``rate`` saved up (one second's worth)."""

    __slots__ = ("_clock", "_last", "_tokens", "rate")

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._tokens = float(rate)
        self._last = clock()

    def take(self) -> float:
        """Take one token: 0 if it was there, else the seconds until one will be."""
        now = self._clock()
        self._tokens = min(float(self.rate), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate if self.rate > 0 else float("inf")

    def refund(self) -> None:
        """Give back a token taken for something that did not happen after all."""
        self._tokens = min(float(self.rate), self._tokens + 1)


class TopicLimits:
    """The topic limit (settings and descriptors) and the broker-wide auto-create rate."""

    def __init__(
        self, max_topics: int, auto_create_rate: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_topics = max_topics
        self.clock = clock
        self.descriptors = raise_descriptor_limit()
        self.broker_bucket = TokenBucket(auto_create_rate, clock)
        self.limit = max_topics
        self._checked = float("-inf")

    def refresh(self, topics: int) -> int:
        """Work out the limit again from the descriptors in use now (at most once a second)."""
        now = self.clock()
        if now - self._checked < FD_LIMIT_RECHECK_SECONDS:
            return self.limit
        self._checked = now
        in_use = open_descriptors()
        if in_use is None:
            self.limit = self.max_topics
        else:  # each new topic takes one descriptor (its first segment)
            room = self.descriptors - DESCRIPTOR_RESERVE - in_use
            self.limit = max(0, min(self.max_topics, topics + room))
        return self.limit

    def check_room(self, topics: int, name: str) -> None:
        """``TopicLimit`` if one more topic does not fit."""
        if topics >= self.refresh(topics):
            raise TopicLimit(
                f"cannot create topic {name}: the broker holds {topics} topics, its limit "
                f"(--max-topics {self.max_topics}, {self.descriptors} file descriptors) is {self.limit}",
                topic=name,
                limit=self.limit,
            )

    def check_rate(self, name: str, client: TokenBucket) -> None:
        """``RateLimited`` (retriable, with ``retry_after_ms``) if this auto-creation comes too fast."""
        taken: list[TokenBucket] = []
        for bucket, who in ((client, "this connection"), (self.broker_bucket, "the broker")):
            wait = bucket.take()
            if wait == 0:
                taken.append(bucket)
            else:
                for earlier in taken:
                    earlier.refund()
                retry_after_ms = max(1, int(wait * 1000) + 1)
                raise RateLimited(
                    f"cannot auto-create topic {name} now: {who} may auto-create {bucket.rate:g} topics a second; "
                    f"retry in {retry_after_ms} ms or create topics ahead (conveyor topics create)",
                    topic=name,
                    retry_after_ms=retry_after_ms,
                )
