"""A retry policy: when to retry, how long to wait, when to give up (``@retry_policy`` attaches one).

Decisions are computed with tenacity (stop, wait and retry strategies, so
tenacity's own objects can be passed as they are) and carried out by the
broker: a retry is a NACK with the computed delay, the attempt number is
the broker's delivery count (it survives a killed runner), and giving up is
a TERM into the dead-letter topic. Nothing sleeps while holding a lease.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import tenacity

BACKOFFS = ("exponential", "fixed", "linear")

# The broker's bound for a policy whose stop counts no attempts (stop_after_delay, stop_never, a
# function): the policy decides, and the bound only ends a message that kills every runner it meets.
UNBOUNDED_DELIVERIES = 1_000_000
# The wire's bound for a group's max_deliveries (a signed 32-bit count): the most attempts a policy may ask for.
MAX_ATTEMPTS = 2**31 - 1


def default_retriable(exc: BaseException) -> bool:
    """Retry unless the error says it is not retriable (``retriable = False``)."""
    return bool(getattr(exc, "retriable", True))


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay: float = 0.0
    reason: str = ""


@dataclass
class RetryPolicy:
    max_attempts: int = 5
    backoff: str = "exponential"
    initial_delay: float = 0.5
    max_delay: float = 60.0
    multiplier: float = 2.0
    jitter: float = 0.0
    retry_on: tuple[type[BaseException], ...] = ()
    give_up_on: tuple[type[BaseException], ...] = ()
    dead_letter: str | bool | None = None
    stop: Any = None
    wait: Any = None
    retry: Any = None
    _built: tuple[Any, Any, Any] = field(default=(None, None, None), repr=False)

    def __post_init__(self) -> None:
        if self.backoff not in BACKOFFS:
            raise TypeError(f"backoff must be one of {', '.join(BACKOFFS)}, not {self.backoff!r}")
        if not _is_int(self.max_attempts) or not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise TypeError(f"max_attempts must be an int from 1 to {MAX_ATTEMPTS}, not {self.max_attempts!r}")
        for name in ("initial_delay", "max_delay", "multiplier", "jitter"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise TypeError(f"{name} must be a finite number of at least 0, not {value!r}")
        if self.multiplier < 1:
            raise TypeError(f"multiplier must be at least 1 (a backoff that shrinks), not {self.multiplier!r}")
        if self.max_delay < self.initial_delay:
            raise TypeError(f"max_delay ({self.max_delay}) is below initial_delay ({self.initial_delay})")
        for name in ("stop", "wait", "retry"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} takes a tenacity strategy (a callable), not {value!r}")
            if value is not None:
                _check_strategy(name, value)
        if not (self.dead_letter is None or isinstance(self.dead_letter, bool | str)):
            raise TypeError(f"dead_letter takes a topic name, True or False, not {self.dead_letter!r}")
        self.retry_on = _types(self.retry_on, "retry_on")
        self.give_up_on = _types(self.give_up_on, "give_up_on")
        self._built = (
            self.stop or tenacity.stop_after_attempt(self.max_attempts),
            self.wait or self._wait(),
            self.retry or tenacity.retry_if_exception(self._should_retry),
        )

    def _wait(self) -> Any:
        if self.backoff == "fixed":
            base: Any = tenacity.wait_fixed(self.initial_delay)
        elif self.backoff == "linear":
            base = tenacity.wait_incrementing(
                start=self.initial_delay, increment=self.initial_delay, max=self.max_delay
            )
        else:
            base = tenacity.wait_exponential(
                multiplier=self.initial_delay, exp_base=self.multiplier, max=self.max_delay
            )
        return base + tenacity.wait_random(0, self.jitter) if self.jitter else base

    def _should_retry(self, exc: BaseException) -> bool:
        if self.give_up_on and isinstance(exc, self.give_up_on):
            return False
        if self.retry_on:
            return isinstance(exc, self.retry_on)
        return default_retriable(exc)

    def decide(self, exc: BaseException, attempt: int, *, first_delivered: float | None = None) -> Decision:
        """What to do after ``attempt`` (1-based, the broker's count) failed with ``exc``.

        ``first_delivered``: when the broker first delivered the message (seconds since
        the epoch), so that time-based stops measure from there, across runners.
        """
        stop, wait, retry = self._built
        state = _state(exc, attempt, first_delivered)
        reason = describe(exc)
        if not retry(state):
            return Decision(False, reason=f"not retriable: {reason}")
        # ``max_delay`` caps the built-in backoffs (in ``_wait``); a ``wait`` of the user's is taken as given.
        delay = max(0.0, float(wait(state)))
        state.upcoming_sleep = delay  # as tenacity sets it before asking stop (stop_before_delay reads it)
        if stop(state):
            return Decision(False, reason=f"gave up after {attempt} attempts: {reason}")
        return Decision(True, delay=delay, reason=reason)

    @property
    def attempts_limit(self) -> int:
        """The delivery limit the broker enforces for this policy: the policy's own count.

        ``stop_after_attempt(n)`` gives n; ``a | b`` the smaller of the counts it holds,
        ``a & b`` the larger when both count. A stop that counts no attempts
        (``stop_after_delay``) gives ``UNBOUNDED_DELIVERIES``: the policy decides.
        """
        if self.stop is None:
            return self.max_attempts
        return attempt_limit(self.stop) or UNBOUNDED_DELIVERIES

    def describe(self) -> dict[str, Any]:
        """The policy as data, for the CLI and logs."""
        return {
            "max_attempts": self.max_attempts if self.stop is None else repr(self.stop),
            "backoff": self.backoff if self.wait is None else repr(self.wait),
            "initial_delay": self.initial_delay,
            "max_delay": self.max_delay,
            "retry_on": [t.__name__ for t in self.retry_on],
            "give_up_on": [t.__name__ for t in self.give_up_on],
            "dead_letter": self.dead_letter,
        }


def attempt_limit(stop: Any) -> int | None:
    """The most attempts a tenacity stop allows, or None when it does not count attempts."""
    if isinstance(stop, tenacity.stop_after_attempt):
        return int(stop.max_attempt_number)
    if isinstance(stop, tenacity.stop_any):  # stops at the first of its stops: the smallest count
        counts = [c for c in map(attempt_limit, stop.stops) if c is not None]
        return min(counts) if counts else None
    if isinstance(stop, tenacity.stop_all):  # stops once all agree: only bounded when each counts
        all_counts = [attempt_limit(s) for s in stop.stops]
        counted = [c for c in all_counts if c is not None]
        return max(counted) if counted and len(counted) == len(all_counts) else None
    return None


def _check_strategy(name: str, strategy: Any) -> None:
    """A tenacity strategy's numbers: finite, and every ``stop_after_attempt(n)`` within ``MAX_ATTEMPTS``.

    Found here, at declaration, rather than as an ``INVALID_REQUEST`` when the runner
    subscribes, or as a wait of nan seconds (taken as 0) at the first failure.
    """
    if isinstance(strategy, tenacity.stop_after_attempt):
        count = strategy.max_attempt_number
        if not _is_int(count) or not 1 <= count <= MAX_ATTEMPTS:
            raise TypeError(f"stop_after_attempt takes an int from 1 to {MAX_ATTEMPTS}, not {count!r}")
        return
    if not type(strategy).__module__.startswith("tenacity"):
        return  # the user's own function: what it returns is checked when it runs
    for field_name, value in getattr(strategy, "__dict__", {}).items():
        if isinstance(value, tuple | list):
            for inner in value:
                _check_strategy(name, inner)
        elif _is_number(value) and not math.isfinite(value):
            raise TypeError(f"{name}={type(strategy).__name__}(...) takes finite numbers, not {field_name}={value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _types(value: Any, name: str) -> tuple[type[BaseException], ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise TypeError(f"{name} takes exception types, got {item!r}")
    return tuple(items)


def _state(exc: BaseException, attempt: int, first_delivered: float | None = None) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    if first_delivered:  # tenacity measures on the monotonic clock: place the first delivery on it
        state.start_time = time.monotonic() - max(0.0, time.time() - first_delivered)
    state.set_exception((type(exc), exc, exc.__traceback__))
    return state


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4096]


# Where ``@retry_policy`` leaves a policy on a plain function, for ``@consumer`` to pick up below it.
RETRY_ATTR = "__conveyor_retry__"
RETRY_OPTIONS = frozenset(RetryPolicy.__dataclass_fields__) - {"_built"}
