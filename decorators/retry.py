"""``@retry_policy``: when to retry, how long to wait, when to give up.

Decisions are computed with tenacity (stop, wait and retry strategies, so
tenacity's own objects can be passed as they are) and carried out by the
broker: a retry is a NACK with the computed delay, the attempt number is
the broker's delivery count (it survives a killed runner), and giving up is
a TERM into the dead-letter topic. Nothing sleeps while holding a lease.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

BACKOFFS = ("exponential", "fixed", "linear")
F = TypeVar("F")


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
        if self.max_attempts < 1:
            raise TypeError("max_attempts must be at least 1")
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

    def decide(self, exc: BaseException, attempt: int) -> Decision:
        """What to do after ``attempt`` (1-based, the broker's count) failed with ``exc``."""
        stop, wait, retry = self._built
        state = _state(exc, attempt)
        reason = describe(exc)
        if not retry(state):
            return Decision(False, reason=f"not retriable: {reason}")
        if stop(state):
            return Decision(False, reason=f"gave up after {attempt} attempts: {reason}")
        return Decision(True, delay=min(float(wait(state)), self.max_delay), reason=reason)

    @property
    def attempts_limit(self) -> int | None:
        """The broker-side safety net for this policy, when it is a plain count."""
        return self.max_attempts if self.stop is None else None

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


def _types(value: Any, name: str) -> tuple[type[BaseException], ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise TypeError(f"{name} takes exception types, got {item!r}")
    return tuple(items)


def _state(exc: BaseException, attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    state.set_exception((type(exc), exc, exc.__traceback__))
    return state


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4096]


RETRY_ATTR = "__conveyor_retry__"
RETRY_OPTIONS = frozenset(RetryPolicy.__dataclass_fields__) - {"_built"}


def retry_policy(**options: Any) -> Callable[[F], F]:
    """Attach a retry policy to a consumer; works above or below ``@consumer``."""
    unknown = set(options) - RETRY_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown retry_policy option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(RETRY_OPTIONS))}"
        )
    policy = RetryPolicy(**options)

    def attach(target: F) -> F:
        from decorators.consumer import Consumer

        if isinstance(target, Consumer):
            target.retry = policy
        elif callable(target):
            setattr(target, RETRY_ATTR, policy)
        else:
            raise TypeError("@retry_policy decorates a function or a @consumer")
        return target

    return attach
