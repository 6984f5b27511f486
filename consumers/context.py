"""Publishing from a handler: ``conveyor.publish()`` and ``conveyor.context()``.

Inside a handler the runner runs, ``publish(topic, value, key=, headers=)`` sends
through one idempotent ``Producer`` the runner owns (made on the first publish,
flushed and closed when the runner stops), and links the new message to the one
being handled with two headers:

- ``x-correlation-id``: the handled message's own ``x-correlation-id``, or, for the
  first message of a chain, its id (``topic/partition/offset``): every message a
  chain of handlers publishes carries the id of the message that began it;
- ``x-causation-id``: the handled message's id (``topic/partition/offset``): the
  message this one was published in reaction to.

Headers given to ``publish`` are added after these (so they may override them).

Why a context variable and not a handler parameter: a handler's first parameter
already says what it takes (a ``Message``, or a model for typed handlers), batch
handlers take lists, and the code that publishes is often a helper a few calls
below the handler. ``publish`` imported from ``conveyor`` works from any of
them with no change to a signature, the way dramatiq's ``CurrentMessage`` and
FastStream's ``context`` do. Each lane (a thread, or a task on the runner's
event loop) sets the variable once and points it at the unit it is handling, so
the per-message cost is an attribute store. It is bound only while the handler
runs, in its thread or task (and tasks those create); elsewhere ``context()``
raises ``RuntimeError``.

Confirm before ack (``@consumer(..., confirm_publishes=True)``, the default):
a message is acked only once every message published while handling it is
confirmed durable by the broker, so consume -> publish loses nothing if the
runner dies in between. A publish that fails makes the handled message fail
(``PublishFailed``): not acked, retried or dead-lettered by its retry policy.
It costs only the handlers that publish, one confirm round trip per chunk of
messages a lane holds (plain handlers), or per call (batch, key-ordered and
``async def`` handlers). ``confirm_publishes=False`` acks when the handler
returns; a publish that fails later is only logged.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any

from conveyor.broker.client.message import Message
from conveyor.broker.client.producer import Producer

log = logging.getLogger("conveyor.runner")

CORRELATION_ID = "x-correlation-id"
CAUSATION_ID = "x-causation-id"


class PublishFailed(Exception):
    """A message published while handling this one was not confirmed: this one fails too (and is retried)."""


def message_id(message: Message) -> str:
    """A message's id across the cluster: ``topic/partition/offset``."""
    return f"{message.topic}/{message.partition}/{message.offset}"


def link_headers(cause: Message) -> dict[str, str]:
    """The headers that tie a message published while handling ``cause`` to it."""
    own = message_id(cause)
    return {CORRELATION_ID: cause.headers.get(CORRELATION_ID) or own, CAUSATION_ID: own}


class Publisher:
    """The runner's one producer, made on the first publish (a runner that never publishes opens nothing)."""

    def __init__(self, broker: str, **producer_options: Any) -> None:
        self.broker = broker
        self.producer_options = producer_options
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    @property
    def producer(self) -> Producer:
        producer = self._producer
        if producer is None:
            with self._lock:
                if self._producer is None:
                    self._producer = Producer(self.broker, **self.producer_options)
                producer = self._producer
        return producer

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for outstanding confirms, then close."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=timeout)
            except Exception as exc:
                log.warning("closing the runner's producer: %s: %s", type(exc).__name__, exc)


class Context:
    """What a handler is handling, and how it publishes: ``conveyor.context()`` inside a handler.

    ``messages``: the unit the handler was called with (one message, or a batch);
    ``message``: its first. ``published``: the futures of what it published so far.
    """

    __slots__ = ("confirm", "consumer", "messages", "published", "publisher")

    def __init__(self, publisher: Publisher | None, consumer: Any, confirm: bool) -> None:
        self.publisher = publisher
        self.consumer = consumer
        self.confirm = confirm
        self.messages: Sequence[Message] = ()
        self.published: list[Future[int]] = []

    @property
    def message(self) -> Message:
        return self.messages[0]

    def publish(
        self,
        topic: str,
        value: Any,
        *,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        partition: int | None = None,
        cause: Message | None = None,
        delay: float | timedelta | None = None,
        not_before: datetime | float | None = None,
        ttl: float | timedelta | None = None,
    ) -> Future[int]:
        """Send ``value`` to ``topic`` linked to the handled message (``cause``: which one of a batch; the first
        by default). The future resolves to the offset once durable; with ``confirm_publishes`` the handled
        message waits for it before it is acked (its confirm, not its delay). ``delay``, ``not_before``,
        ``ttl``: as ``Producer.send``."""
        if self.publisher is None or not self.messages:
            raise RuntimeError("publish() is for a handler the runner is running (use a Producer elsewhere)")
        linked = link_headers(cause if cause is not None else self.messages[0])
        if headers:
            linked.update(headers)
        asked = (("delay", delay), ("not_before", not_before), ("ttl", ttl))
        times: dict[str, Any] = {name: v for name, v in asked if v is not None}  # a stand-in producer may not take them
        future = self.publisher.producer.send(topic, value, key=key, headers=linked, partition=partition, **times)
        if self.confirm:
            self.published.append(future)
        else:
            future.add_done_callback(_log_failure)
        return future

    def begin(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        if self.published:
            self.published = []

    def end(self) -> list[Future[int]]:
        """What the unit published that is to be confirmed; the context is unbound until the next unit."""
        published = self.published
        if published:
            self.published = []
        self.messages = ()
        return published


def _log_failure(future: Future[int]) -> None:
    exc = future.exception()
    if exc is not None:
        log.error("a message published from a handler was not confirmed: %s: %s", type(exc).__name__, exc)


_current: contextvars.ContextVar[Context | None] = contextvars.ContextVar("conveyor_context", default=None)


def bind(ctx: Context) -> None:
    """Make ``ctx`` the current context of this thread (or task): a lane does it once."""
    _current.set(ctx)


def current_consumer() -> Any:
    """The consumer whose lane this thread (or task) is, or None outside the runner's lanes (for middleware)."""
    ctx = _current.get()
    return None if ctx is None else ctx.consumer


def context() -> Context:
    """The handler's context: the message being handled, and ``publish``."""
    ctx = _current.get()
    if ctx is None or not ctx.messages:
        raise RuntimeError("conveyor.context() is available only inside a handler the runner is running")
    return ctx


def publish(
    topic: str,
    value: Any,
    *,
    key: str | bytes | None = None,
    headers: dict[str, str] | None = None,
    partition: int | None = None,
    cause: Message | None = None,
    delay: float | timedelta | None = None,
    not_before: datetime | float | None = None,
    ttl: float | timedelta | None = None,
) -> Future[int]:
    """Publish from inside a handler, with the runner's producer, linked to the handled message."""
    return context().publish(
        topic,
        value,
        key=key,
        headers=headers,
        partition=partition,
        cause=cause,
        delay=delay,
        not_before=not_before,
        ttl=ttl,
    )


def failure(futures: list[Future[int]]) -> PublishFailed | None:
    """Wait for ``futures``; the first failure as ``PublishFailed``, or None when all were confirmed."""
    for future in futures:
        exc = future.exception()
        if exc is not None:
            return publish_failed(exc)
    return None


def publish_failed(exc: BaseException) -> PublishFailed:
    error = PublishFailed(f"a message published while handling this one was not confirmed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
