"""Middleware: objects whose optional hooks the runner calls around each message, dramatiq-style.

A middleware is any object; it defines only the hooks it needs (``Middleware``
below names them all, as no-ops, for those who like a base class):

- ``on_start(runner)`` / ``on_stop(runner)``: the runner starts (before the first
  subscription) and stops (after the drain);
- ``before_handle(message)``: the handler is about to be called;
- ``after_handle(message, result)``: it returned ``result`` and the message will be
  acked (after the messages it published were confirmed, when that is asked for);
- ``on_error(message, exc)``: it raised (or a publish of its failed), then one of
- ``on_retry(message, exc, attempt)``: the message comes again (``attempt`` is the one
  that failed), or
- ``on_dead_letter(message, reason)``: it goes to the dead-letter topic (by the
  runner's decision, or the broker's after ``max_deliveries`` or lease expiries);
- ``on_failure(consumer, messages, failure)``: once per handler call that failed (once per
  message that did not decode), when the runner has decided what comes of it: ``failure``
  is a ``Failure`` (the exception, the attempt, retried or not, the delay, the reason);
- ``after_chunk(consumer, summary)``: once per chunk of messages a lane handled, on the
  runner's I/O thread once the chunk is settled: ``summary`` is a ``ChunkSummary`` (counts
  by outcome, and each handler call's duration). Count here, not per message.

Order: the runner's middleware (``--middleware``, a module's ``middleware = [...]``)
wrap each consumer's own (``@consumer(..., middleware=[...])``). ``on_start`` and
``before_handle`` run in that order, the other hooks in reverse, like nested
``try`` blocks. A batch handler's hooks run once per message of the batch.

A hook that raises is logged and counted (``conveyor_runner_middleware_errors_total``)
and changes nothing: the message is handled and settled as if the hook had not
been there, and the runner goes on. Hooks run on the handler's lane (its thread,
or the event loop for ``async def`` handlers: keep them short and non-blocking).
A consumer with no middleware pays nothing: its lanes skip the hooks entirely; middleware
without ``before_handle`` and ``after_handle`` costs no call per message either.

The runner's own metrics and failure log lines are middleware too (``MetricsMiddleware``,
``LoggingMiddleware`` in consumers/builtin_middleware.py), outermost in every chain unless
``Runner(default_middleware=...)`` says otherwise; they use only ``after_chunk`` and ``on_failure``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConfigError

log = logging.getLogger("conveyor.runner")

HOOKS = (
    "on_start",
    "on_stop",
    "before_handle",
    "after_handle",
    "on_error",
    "on_retry",
    "on_dead_letter",
    "on_failure",
    "after_chunk",
)
_IN_ORDER = frozenset({"on_start", "before_handle"})  # the others run in reverse (innermost first)


class Middleware:
    """Every hook, doing nothing: subclass it and override what you need (or write a plain class)."""

    def on_start(self, runner: Any) -> None: ...

    def on_stop(self, runner: Any) -> None: ...

    def before_handle(self, message: Any) -> None: ...

    def after_handle(self, message: Any, result: Any) -> None: ...

    def on_error(self, message: Any, exc: BaseException) -> None: ...

    def on_retry(self, message: Any, exc: BaseException, attempt: int) -> None: ...

    def on_dead_letter(self, message: Any, reason: str) -> None: ...

    def on_failure(self, consumer: Any, messages: list[Any], failure: Failure) -> None: ...

    def after_chunk(self, consumer: Any, summary: ChunkSummary) -> None: ...


@dataclass
class Failure:
    """What the runner decided for a handler call that failed (``on_failure``)."""

    exc: BaseException  # what the handler raised (``Nack``, ``Reject``, ``InvalidMessage`` included)
    attempt: int  # the attempt that failed (the highest of a batch's messages)
    retry: bool  # the messages come again; else they are dead-lettered (or dropped: ``dead_letter=False``)
    delay_ms: int = 0  # when retried: in how long
    reason: str = ""  # the retry policy's reason, or the dead letter's


@dataclass
class ChunkSummary:
    """What became of one chunk a lane handled (``after_chunk``); counts of messages."""

    ok: int = 0  # handled and acked
    retried: int = 0
    dead_lettered: int = 0  # by the runner; by the broker itself too (then a summary of those alone)
    failed: int = 0  # failed for good and dropped (``dead_letter=False``)
    invalid: int = 0  # did not decode into the handler's model (counted in dead_lettered or failed too)
    durations: list[float] = field(default_factory=list)  # seconds, one per handler call


OnHookError = Callable[[Any, str], None]  # (middleware, hook name): counts a hook that raised


class Hooks:
    """The hooks of an ordered list of middleware, each list ready to call in its order."""

    def __init__(self, middleware: Sequence[Any], on_hook_error: OnHookError | None = None) -> None:
        self.middleware = list(middleware)
        self.on_hook_error = on_hook_error
        self.calls: dict[str, list[tuple[Any, Callable[..., Any]]]] = {}
        for name in HOOKS:
            found = [(m, getattr(m, name)) for m in self.middleware if _has(m, name)]
            self.calls[name] = found if name in _IN_ORDER else found[::-1]
        # the lanes' per-message path calls into these hooks only when one of them has a per-message hook
        self.each_message = bool(self.calls["before_handle"] or self.calls["after_handle"])
        self.chunks = bool(self.calls["after_chunk"])

    def __bool__(self) -> bool:
        return bool(self.middleware)

    def call(self, name: str, *args: Any) -> None:
        """Call hook ``name`` of every middleware that has it; one that raises is logged and counted."""
        for middleware, hook in self.calls[name]:
            try:
                hook(*args)
            except Exception:
                log.exception(
                    "middleware %s: %s raised (ignored, the message is handled as usual)", label(middleware), name
                )
                if self.on_hook_error is not None:
                    try:
                        self.on_hook_error(middleware, name)
                    except Exception:  # counting must not fail the lane either
                        log.exception("counting a middleware error failed")

    # per-message helpers, for the lanes

    def before(self, messages: Iterable[Any]) -> None:
        if self.calls["before_handle"]:  # middleware without this hook costs no call per message
            for message in messages:
                self.call("before_handle", message)

    def after(self, messages: Iterable[Any], result: Any) -> None:
        if self.calls["after_handle"]:
            for message in messages:
                self.call("after_handle", message, result)

    def error(self, messages: Iterable[Any], exc: BaseException) -> None:
        if self.calls["on_error"]:
            for message in messages:
                self.call("on_error", message, exc)

    def retry(self, messages: Iterable[Any], exc: BaseException) -> None:
        if self.calls["on_retry"]:
            for message in messages:
                self.call("on_retry", message, exc, message.attempt)

    def dead_letter(self, messages: Iterable[Any], reason: str) -> None:
        if self.calls["on_dead_letter"]:
            for message in messages:
                self.call("on_dead_letter", message, reason)

    def failure(self, consumer: Any, messages: list[Any], failure: Failure) -> None:
        if self.calls["on_failure"]:
            self.call("on_failure", consumer, messages, failure)

    def chunk(self, consumer: Any, summary: ChunkSummary) -> None:
        self.call("after_chunk", consumer, summary)


def _has(middleware: Any, name: str) -> bool:
    """``middleware`` defines hook ``name`` (the ``Middleware`` base class's no-ops do not count: never called)."""
    hook = getattr(middleware, name, None)
    return callable(hook) and getattr(type(middleware), name, None) is not getattr(Middleware, name)


def label(middleware: Any) -> str:
    """The name a middleware is logged and counted under: its class's qualified name."""
    cls = middleware if isinstance(middleware, type) else type(middleware)
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve(spec: str) -> list[Any]:
    """``module:attr`` -> middleware: a class is instantiated without arguments, an instance used as it is,
    a list or tuple taken whole. ``module`` alone takes its ``middleware`` list."""
    module_name, _, attr = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"--middleware {spec}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    target = getattr(module, attr or "middleware", None)
    if target is None:
        raise ConfigError(f"--middleware {spec}: {module_name} has no attribute {attr or 'middleware'!r}")
    items = list(target) if isinstance(target, list | tuple) else [target]
    out = []
    for item in items:
        if isinstance(item, type):
            try:
                item = item()
            except Exception as exc:
                raise ConfigError(f"--middleware {spec}: {label(item)}() failed: {type(exc).__name__}: {exc}") from None
        out.append(checked(item, f"--middleware {spec}"))
    return out


def checked(middleware: Any, where: str) -> Any:
    """A middleware must have at least one hook: anything else is a mistake (a function, a misspelt name)."""
    if isinstance(middleware, type) or not any(callable(getattr(middleware, name, None)) for name in HOOKS):
        raise ConfigError(f"{where}: {middleware!r} has none of the middleware hooks ({', '.join(HOOKS)})")
    return middleware


def parse_specs(text: str) -> list[str]:
    """``--middleware a.b:C,d:E`` -> ["a.b:C", "d:E"]."""
    return [part.strip() for part in text.split(",") if part.strip()]
