"""A producer's options, checked before anything is sent."""

from __future__ import annotations

import math
from typing import Any

from conveyor.errors import ConfigError

# The batches per producer a broker remembers for deduplication (conveyor.broker.log.idempotence.WINDOW,
# which a test checks): a producer that may resend to a new leader keeps at most this many in flight per topic.
RESEND_WINDOW = 8


def check_producer_options(**options: Any) -> None:
    """A producer's numbers: times finite and not negative, counts and sizes whole and at least 1.

    ``linger_ms=nan`` or ``request_timeout_ms=-1`` would otherwise be taken and
    turn every wait into never or at once.
    """
    problems = []
    for name, value in options.items():
        counted = name in ("batch_size", "max_batch_bytes", "max_in_flight", "buffer_memory")
        if counted and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(f"{name} must be an int of at least 1, not {value!r}")
        elif not counted and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf
        ):
            problems.append(f"{name} must be a finite number of milliseconds, at least 0, not {value!r}")
    if problems:
        raise ConfigError("; ".join(problems), options=sorted(options))
