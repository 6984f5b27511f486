"""``@consumer``: a plain function becomes a subscription the runner can run.

The decorator returns a ``Consumer`` that holds the function and its
options as data (the runner and the CLI read them) and stays callable like
the function itself, so handlers remain easy to unit-test.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from conveyor.decorators.policy import RETRY_ATTR, RetryPolicy

from conveyor.names import fit_name


class AckPolicy(enum.Enum):
    AUTO = "auto"  # ack after the handler returns (at-least-once)
    EARLY = "early"  # ack before calling the handler (at-most-once)


@dataclass
class Consumer:
    fn: Callable[..., Any]
    topic: str
    group: str
    batch: bool = False
    batch_size: int = 100
    prefetch: int = 0
    concurrency: int = 1
    start: Any = None  # where a new group starts; None: the runner's --default-start (earliest unless told)
    key_ordered: bool = False
    ack_policy: AckPolicy = AckPolicy.AUTO
    ack_timeout_ms: int = 30_000
    retry: RetryPolicy | None = None
    error_handlers: list[Callable[..., Any]] = field(default_factory=list)
    shared_group: bool = False  # another consumer of the topic reads in this group on purpose (they split it)
    # acked only once what the handler published is confirmed (consumers/context.py says why by default)
    confirm_publishes: bool = True
    middleware: list[Any] = field(default_factory=list)  # this consumer's own, inside the runner's

    def __post_init__(self) -> None:
        self.retry = self.retry or getattr(self.fn, RETRY_ATTR, None)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        if not isinstance(self.ack_policy, AckPolicy):
            self.ack_policy = AckPolicy(self.ack_policy)
        _check_options(self)
        self.__name__ = getattr(self.fn, "__name__", "consumer")
        self.__doc__ = getattr(self.fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def name(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"

    @property
    def credit(self) -> int:
        """Messages the runner may hold for this consumer (the broker's credit)."""
        if self.prefetch:
            return self.prefetch
        per_lane = self.batch_size * 2 if self.batch else 64
        return max(100, per_lane * self.concurrency)

    @property
    def policy(self) -> RetryPolicy:
        return self.retry or DEFAULT_RETRY

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "topic": self.topic,
            "group": self.group,
            "start": self.start,
            "batch": self.batch,
            "concurrency": self.concurrency,
            "key_ordered": self.key_ordered,
            "credit": self.credit,
            "retry": self.policy.describe(),
        }


def _check_options(c: Consumer) -> None:
    """Refuse at declaration what the runner or the broker could not honour."""
    for name in ("batch", "key_ordered", "shared_group", "confirm_publishes"):
        if not isinstance(getattr(c, name), bool):
            raise TypeError(f"{name} takes True or False, not {getattr(c, name)!r}")
    for name, low in (("concurrency", 1), ("batch_size", 1), ("prefetch", 0), ("ack_timeout_ms", 1)):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise TypeError(f"{name} must be an int of at least {low}, not {value!r}")
    if c.batch and c.prefetch and c.prefetch < c.batch_size:
        raise TypeError(f"prefetch ({c.prefetch}) below batch_size ({c.batch_size}): no batch could ever fill")
    if c.ack_timeout_ms > 2**31 - 1:
        raise TypeError(f"ack_timeout_ms must be at most {2**31 - 1}, not {c.ack_timeout_ms}")
    if not isinstance(c.middleware, list | tuple):
        raise TypeError(f"middleware takes a list of middleware objects, not {c.middleware!r}")
    c.middleware = list(c.middleware)
    if c.retry is not None and not isinstance(c.retry, RetryPolicy):
        raise TypeError("retry takes a RetryPolicy (use @retry_policy)")
    check_dead_letter(c)


def check_dead_letter(c: Consumer) -> None:
    """A dead-letter topic that is the consumer's own topic would deliver each dead letter to it again."""
    if c.retry is not None and c.retry.dead_letter == c.topic:
        raise TypeError(
            f"dead_letter={c.topic!r} is the consumer's own topic: dead letters would loop back to it "
            "(name another topic, or leave it out for <topic>.dlq)"
        )


DEFAULT_RETRY = RetryPolicy()
OPTIONS = (
    "group",
    "batch",
    "batch_size",
    "prefetch",
    "concurrency",
    "start",
    "key_ordered",
    "ack_policy",
    "ack_timeout_ms",
    "shared_group",
    "confirm_publishes",
    "middleware",
)


def consumer(topic: str, **options: Any) -> Callable[[Callable[..., Any]], Consumer]:
    """Declare a consumer of ``topic``; ``group`` defaults to the function's qualified name."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown consumer option(s): {', '.join(sorted(unknown))}; known: {', '.join(OPTIONS)}")
    if not isinstance(topic, str) or not topic:
        raise TypeError("@consumer needs a topic name")

    def wrap(fn: Callable[..., Any]) -> Consumer:
        if isinstance(fn, Consumer):
            raise TypeError(f"{fn.name} is already a consumer")
        if not callable(fn):
            raise TypeError("@consumer decorates a function")
        # module.qualname, made a valid group name (a nested function's "<locals>", a long path)
        group = options.get("group") or fit_name(f"{fn.__module__}.{fn.__qualname__}")
        return Consumer(fn, topic, **{**options, "group": group})

    return wrap


def shared_group_problems(consumers: Iterable[Consumer]) -> list[str]:
    """Consumers of one topic in one group split its messages between them: a mistake unless each says so.

    The default group is the function's name, so this happens when ``group=`` is copied from one handler to
    the next; each would silently get only some of the messages. ``shared_group=True`` on every one of them
    declares it. The same group name on other topics shares nothing (a group belongs to its topic).
    """
    by_group: dict[tuple[str, str], list[Consumer]] = {}
    for c in consumers:
        by_group.setdefault((c.topic, c.group), []).append(c)
    problems = []
    for (topic, group), sharing in by_group.items():
        undeclared = [c.name for c in sharing if not c.shared_group]
        if len(sharing) > 1 and undeclared:
            names = ", ".join(c.name for c in sharing)
            problems.append(
                f"consumers {names} all read topic {topic!r} in group {group!r}, so each would get only some "
                f"of its messages: give each its own group=, or declare shared_group=True on every one of them "
                f"(not declared: {', '.join(undeclared)})"
            )
    return problems


def error_handler(target: Consumer) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``hook(message, exc)``, called when ``target`` dead-letters a message."""
    if not isinstance(target, Consumer):
        raise TypeError("@error_handler takes the @consumer it watches")

    def register(hook: Callable[..., Any]) -> Callable[..., Any]:
        target.error_handlers.append(hook)
        return hook

    return register
