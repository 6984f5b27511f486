"""``@retry_policy``: attach a ``RetryPolicy`` to a consumer, above or below ``@consumer``.

The policy itself (and what it decides) lives in ``policy``, which ``consumer`` reads too; this module
only attaches it, so the two decorators import one way: ``retry`` -> ``consumer`` -> ``policy``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from conveyor.decorators.consumer import Consumer, check_dead_letter
from conveyor.decorators.policy import (
    MAX_ATTEMPTS,
    RETRY_ATTR,
    RETRY_OPTIONS,
    UNBOUNDED_DELIVERIES,
    Decision,
    RetryPolicy,
    attempt_limit,
    default_retriable,
    describe,
)

__all__ = [
    "MAX_ATTEMPTS",
    "RETRY_ATTR",
    "RETRY_OPTIONS",
    "UNBOUNDED_DELIVERIES",
    "Decision",
    "RetryPolicy",
    "attempt_limit",
    "default_retriable",
    "describe",
    "retry_policy",
]

F = TypeVar("F")


def retry_policy(**options: Any) -> Callable[[F], F]:
    """Attach a retry policy to a consumer; works above or below ``@consumer``."""
    unknown = set(options) - RETRY_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown retry_policy option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(RETRY_OPTIONS))}"
        )
    if "max_attempts" in options and options.get("stop") is not None:
        raise TypeError(
            "retry_policy takes max_attempts or stop, not both (stop=stop_after_attempt(n) is max_attempts)"
        )
    if "max_delay" in options and options.get("wait") is not None:
        raise TypeError("max_delay caps the built-in backoffs; with your own wait, cap it there (wait_*(max=...))")
    for name in ("backoff", "initial_delay", "multiplier"):
        if name in options and options.get("wait") is not None:
            raise TypeError(f"{name} shapes the built-in backoffs and is unused with wait=; pass one or the other")
    policy = RetryPolicy(**options)

    def attach(target: F) -> F:
        if isinstance(target, Consumer):
            target.retry = policy
            check_dead_letter(target)
        elif callable(target):
            setattr(target, RETRY_ATTR, policy)
        else:
            raise TypeError("@retry_policy decorates a function or a @consumer")
        return target

    return attach
