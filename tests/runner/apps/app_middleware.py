"""Consumers wrapped in middleware (tests/runner/test_publish_middleware.py): every hook call is a line in hooks.log.

The runner's middleware: ``--middleware app_middleware:Outer`` (a class) and this module's ``middleware``
list; ``mw-ok`` has its own, inside them; ``mw-broken``'s own raises in every hook.
"""

from __future__ import annotations

import os
from typing import Any

from conveyor import Message, Middleware, Nack, consumer, retry_policy

OUT = os.environ.get("CONVEYOR_TEST_OUT", "/tmp")


def write(line: str) -> None:
    with open(os.path.join(OUT, "hooks.log"), "a") as f:
        f.write(line + "\n")


class Recorder:
    """A plain class (no base): every hook writes ``tag hook topic offset extra``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def _line(self, hook: str, message: Any = None, extra: Any = "") -> None:
        where = f"{message.topic} {message.offset}" if message is not None else "- -"
        write(f"{self.tag} {hook} {where} {extra}".rstrip())

    def on_start(self, runner: Any) -> None:
        self._line("on_start")

    def on_stop(self, runner: Any) -> None:
        self._line("on_stop")

    def before_handle(self, message: Message) -> None:
        self._line("before_handle", message)

    def after_handle(self, message: Message, result: Any) -> None:
        self._line("after_handle", message, result)

    def on_error(self, message: Message, exc: BaseException) -> None:
        self._line("on_error", message, type(exc).__name__)

    def on_retry(self, message: Message, exc: BaseException, attempt: int) -> None:
        self._line("on_retry", message, attempt)

    def on_dead_letter(self, message: Message, reason: str) -> None:
        self._line("on_dead_letter", message, reason.split(":")[0])


class Outer(Recorder):
    def __init__(self) -> None:
        super().__init__("outer")


class Broken(Middleware):
    """Raises in every hook: logged and counted, never in the way."""

    def before_handle(self, message: Message) -> None:
        raise RuntimeError("broken before_handle")

    def after_handle(self, message: Message, result: Any) -> None:
        raise RuntimeError("broken after_handle")


middleware = [Recorder("module")]


@consumer("mw-ok", group="mw-ok", middleware=[Recorder("own")])
def ok(message: Message) -> str:
    return f"done-{message.value}"


@consumer("mw-retry", group="mw-retry")
@retry_policy(max_attempts=3, initial_delay=0.05, backoff="fixed")
def flaky(message: Message) -> None:
    if message.attempt < 2:
        raise ConnectionError("once")


@consumer("mw-dead", group="mw-dead")
@retry_policy(max_attempts=2, initial_delay=0.05, backoff="fixed")
def doomed(message: Message) -> None:
    raise ValueError("always")


@consumer("mw-broken", group="mw-broken", middleware=[Broken()])
def handled_anyway(message: Message) -> None:
    write(f"handled mw-broken {message.offset}")


@consumer("mw-nacked", group="mw-nacked")
@retry_policy(max_attempts=2, initial_delay=0.05, backoff="fixed")
def nacked(message: Message) -> None:
    """Always Nack: past the group's max_deliveries the broker dead-letters it itself."""
    raise Nack(delay=0.05, reason="not yet")
