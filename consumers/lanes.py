"""Lanes: the workers that run handlers, one message (or batch) after another.

A consumer with ``concurrency=N`` has N lanes. Delivered messages are cut
into chunks and queued to lanes; with ``key_ordered`` a message's lane is
chosen by its key, so one key is always handled by one lane, in order.
A lane reports what happened to a whole chunk at once (acks as offsets,
retries, dead letters), so the I/O thread settles in ranges, not messages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.broker.client.message import Message
from conveyor.consumers.context import Context, Publisher, bind, failure, publish_failed
from conveyor.consumers.middleware import Failure, Hooks
from conveyor.consumers.typed import handler_call
from conveyor.decorators.consumer import AckPolicy, Consumer
from conveyor.decorators.exceptions import InvalidMessage, Nack, Reject
from conveyor.decorators.retry import describe
from conveyor.monitoring.logs import enter_handling, leave_handling

log = logging.getLogger("conveyor.runner")

Job = tuple[Any, list[Message], BaseException | None]  # slot, messages, the broker's dead-letter error (or None)


@dataclass
class Report:
    """What a lane did with one chunk; the I/O thread turns it into settles."""

    slot: Any
    acked: list[int] = field(default_factory=list)
    retried: list[tuple[int, int, str]] = field(default_factory=list)  # offset, delay ms, error
    released: list[int] = field(default_factory=list)  # never tried (draining)
    dead: list[tuple[int, str]] = field(default_factory=list)  # offset, reason
    durations: list[float] = field(default_factory=list)
    ok: int = 0  # handled without an exception
    dropped: int = 0  # failed for good, not dead-lettered (dead_letter=False)
    invalid: int = 0  # did not decode into the handler's model: dead-lettered at once (or dropped)


_NO_HEAD = -1


class KeyGate:
    """Key order inside a lane: a key whose message waits for a retry parks its later messages.

    Waiting is not a delivery attempt: parked messages stay held by the runner
    (their leases are renewed with everything else it holds), are never nacked,
    and run in offset order once the key's head is back and settled (or was
    dead-lettered). The broker holds the key's newer messages back meanwhile.
    """

    def __init__(self) -> None:
        self.blocked: dict[Any, int] = {}  # key -> offset of the message it waits for
        self.parked: dict[Any, list[Message]] = {}

    def take(self, unit: list[Message]) -> list[Message]:
        """The messages of ``unit`` that may run now; the others are parked behind their key's head."""
        run: list[Message] = []
        for message in unit:
            key = message.key
            head = self.blocked.get(key, _NO_HEAD)
            if message.ref == head:
                del self.blocked[key]  # the retried message itself is back
                run.append(message)
            elif head != _NO_HEAD or key in self.parked:  # behind its head, or behind what waits for it
                self.parked.setdefault(key, []).append(message)
            else:
                run.append(message)
        return run

    def block(self, messages: list[Message]) -> None:
        """These messages will come again: their keys wait for them."""
        for message in messages:
            head = self.blocked.get(message.key, _NO_HEAD)
            if head == _NO_HEAD or message.ref < head:
                self.blocked[message.key] = message.ref

    def forget(self, messages: list[Message]) -> None:
        """These messages will not come again (the broker dead-lettered them): their keys go on."""
        for message in messages:
            if self.blocked.get(message.key, _NO_HEAD) == message.ref:
                del self.blocked[message.key]

    def release(self, messages: list[Message]) -> list[Message]:
        """Parked messages whose key no longer waits, in offset order."""
        out: list[Message] = []
        for key in {m.key for m in messages}:
            if key not in self.blocked and key in self.parked:
                out += self.parked.pop(key)
        out.sort(key=_offset)
        return out

    @property
    def parked_count(self) -> int:
        return sum(map(len, self.parked.values()))


def _offset(message: Message) -> int:
    return message.ref


def handle_outcome(
    consumer: Consumer,
    messages: list[Message],
    exc: BaseException | None,
    report: Report,
    gate: KeyGate,
    hooks: Hooks | None = None,
    result: Any = None,
) -> None:
    """Turn a handler's result into acks, retries or dead letters (and call the middleware's hooks on them)."""
    offsets = [m.ref for m in messages]
    if exc is None:
        report.acked += offsets
        report.ok += len(offsets)
        if hooks and hooks.each_message:
            hooks.after(messages, result)
        return
    if isinstance(exc, InvalidMessage):
        _invalid(consumer, messages, exc, report, gate, hooks)
        return
    if hooks:
        hooks.error(messages, exc)
    attempt = max(m.attempt for m in messages)
    if isinstance(exc, Nack):
        delay = _delay_ms(exc.delay)
        report.retried += [(o, delay, exc.reason) for o in offsets]
        if _comes_again(consumer):
            gate.block(messages)
        if hooks:
            hooks.failure(consumer, messages, Failure(exc, attempt, True, delay, exc.reason))
            hooks.retry(messages, exc)
        return
    if isinstance(exc, Reject):
        reason = f"rejected: {exc.reason}"
        if hooks:
            hooks.failure(consumer, messages, Failure(exc, attempt, False, 0, reason))
        _dead(consumer, messages, exc, reason, report, hooks)
        return
    first = min((m.first_delivered for m in messages if m.first_delivered), default=None)
    decision = consumer.policy.decide(exc, attempt, first_delivered=first)
    if decision.retry:
        delay = _delay_ms(decision.delay)
        if hooks:  # LoggingMiddleware (consumers/builtin_middleware.py) logs it
            hooks.failure(consumer, messages, Failure(exc, attempt, True, delay, decision.reason))
        report.retried += [(o, delay, decision.reason) for o in offsets]
        if _comes_again(consumer):
            gate.block(messages)
        if hooks:
            hooks.retry(messages, exc)
        return
    if hooks:
        hooks.failure(consumer, messages, Failure(exc, attempt, False, 0, decision.reason))
    _dead(consumer, messages, exc, decision.reason, report, hooks)


def _invalid(
    consumer: Consumer,
    messages: list[Message],
    exc: InvalidMessage,
    report: Report,
    gate: KeyGate,
    hooks: Hooks | None = None,
) -> None:
    """Messages that did not decode: dead-lettered now, never retried; the rest of a batch as its handler did."""
    invalid = exc.invalid if exc.invalid is not None else [(m, exc.error) for m in messages]
    bad = {id(m) for m, _ in invalid}
    report.invalid += len(invalid)
    for message, error in invalid:
        invalid_error = InvalidMessage(error)
        reason = f"invalid message: {error}"
        if hooks:  # LoggingMiddleware logs it
            hooks.failure(consumer, [message], Failure(invalid_error, message.attempt, False, 0, reason))
            hooks.error([message], invalid_error)
        _dead(consumer, [message], invalid_error, reason, report, hooks)
    rest = [m for m in messages if id(m) not in bad]
    if rest:
        handle_outcome(consumer, rest, exc.handler_error, report, gate, hooks)


def _comes_again(consumer: Consumer) -> bool:
    """A retried message of a key-ordered consumer comes back (acked early, it never does: nothing waits)."""
    return consumer.key_ordered and consumer.ack_policy is AckPolicy.AUTO


def _dead(
    consumer: Consumer,
    messages: list[Message],
    exc: BaseException,
    reason: str,
    report: Report,
    hooks: Hooks | None = None,
) -> None:
    if consumer.policy.dead_letter is False:
        report.acked += [m.ref for m in messages]  # dropped on purpose, after the hooks
        report.dropped += len(messages)
    else:
        report.dead += [(m.ref, reason) for m in messages]
        if hooks:
            hooks.dead_letter(messages, reason)
    call_error_handlers(consumer, messages, exc)


def call_error_handlers(consumer: Consumer, messages: list[Message], exc: BaseException) -> None:
    for hook in consumer.error_handlers:
        for message in messages:
            try:
                hook(message, exc)
            except Exception:
                log.exception("error handler %r failed", hook)


class Work:
    """One queued job of a lane: the units to run, in order, with key order kept by the lane's gate."""

    def __init__(
        self,
        consumer: Consumer,
        gate: KeyGate,
        report: Report,
        stopping: threading.Event,
        hooks: Hooks | None = None,
    ) -> None:
        self.consumer = consumer
        self.hooks = hooks
        self.gate = gate
        self.report = report
        self.stopping = stopping
        self.todo: collections.deque[list[Message]] = collections.deque()

    def add(self, messages: list[Message]) -> None:
        self.todo.extend(units(self.consumer, messages))

    def dead_lettered(self, messages: list[Message], exc: BaseException) -> None:
        """The broker dead-lettered these itself: the error handlers run, and their keys go on."""
        call_error_handlers(self.consumer, messages, exc)
        if self.hooks:
            self.hooks.dead_letter(messages, describe(exc))
        self.gate.forget(messages)
        self._release(messages)

    def next(self) -> list[Message] | None:
        """The next unit to call the handler with, or None when the job is done."""
        while self.todo:
            unit = self.todo.popleft()
            if self.stopping.is_set():
                self.report.released += [m.ref for m in unit]
                continue
            if self.consumer.key_ordered:
                unit = self.gate.take(unit)
            if unit:
                return unit
        return None

    def done(self, unit: list[Message], exc: BaseException | None, seconds: float, result: Any = None) -> None:
        self.report.durations.append(seconds)
        handle_outcome(self.consumer, unit, exc, self.report, self.gate, self.hooks, result)
        if self.consumer.key_ordered and self.gate.parked:
            self._release(unit)

    def _release(self, messages: list[Message]) -> None:
        freed = self.gate.release(messages)
        if freed:  # they run next, before anything newer of their keys
            self.todo.extendleft(reversed(units(self.consumer, freed)))


def units(consumer: Consumer, chunk: list[Message]) -> list[list[Message]]:
    """What one handler call receives: one message, or a batch of them."""
    if consumer.batch:
        return [chunk[i : i + consumer.batch_size] for i in range(0, len(chunk), consumer.batch_size)]
    return [[m] for m in chunk]


class _Lane:
    """What a sync and an async lane share: the consumer's call, its key gate, its publishing context."""

    def __init__(
        self,
        consumer: Consumer,
        done: Callable[[Report], None],
        stopping: threading.Event,
        hooks: Hooks | None,
        publisher: Publisher | None,
    ) -> None:
        self.consumer = consumer
        self.done = done
        self.stopping = stopping
        self.gate = KeyGate()
        self.busy = 0
        self.call = handler_call(consumer)
        self.hooks = hooks or None  # for failures: rare
        self.each = hooks if hooks and hooks.each_message else None  # per message: only if some hook wants it
        self.ctx = Context(publisher, consumer, consumer.confirm_publishes)

    def _work(self, slot: Any, chunk: list[Message], dead: BaseException | None) -> tuple[Report, Work]:
        """The units of a chunk (or of ``dead`` messages, for their error handlers) and the report they fill."""
        report = Report(slot)
        work = Work(self.consumer, self.gate, report, self.stopping, self.hooks)
        if dead is None:
            work.add(chunk)
        else:
            work.dead_lettered(chunk, dead)
        return report, work

    def _begin(self, unit: list[Message], cursor: Any) -> float:
        """Before a unit's call: log lines, hooks and ``conveyor.publish()`` now refer to it; its start time."""
        cursor.current = unit
        if self.each:
            self.each.before(unit)
        self.ctx.begin(unit)
        return time.perf_counter()


class ThreadLane(_Lane):
    """A thread running a sync handler over queued chunks."""

    def __init__(
        self,
        consumer: Consumer,
        done: Callable[[Report], None],
        stopping: threading.Event,
        name: str,
        *,
        hooks: Hooks | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        super().__init__(consumer, done, stopping, hooks, publisher)
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, slot: Any, chunk: list[Message], dead: BaseException | None = None) -> None:
        """Queue a delivered chunk, or (``dead``) messages the broker dead-lettered, for their error handlers."""
        self.busy += 1
        self.queue.put((slot, chunk, dead))

    def close(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        bind(self.ctx)  # conveyor.publish() and context() in this thread: the unit the lane is handling
        while (item := self.queue.get()) is not None:
            slot, chunk, dead = item
            try:
                self.done(self._process(slot, chunk, dead))
            finally:
                self.busy -= 1

    def _process(self, slot: Any, chunk: list[Message], dead: BaseException | None = None) -> Report:
        if not (self.consumer.batch or self.consumer.key_ordered or dead):
            return self._process_plain(slot, chunk)
        report, work = self._work(slot, chunk, dead)
        fn, batch, ctx = self.call, self.consumer.batch, self.ctx
        token, cursor = enter_handling(self.consumer)  # log lines made meanwhile name the unit handled
        try:
            while (unit := work.next()) is not None:
                started = self._begin(unit, cursor)
                exc: BaseException | None = None
                result = None
                try:
                    result = fn(unit if batch else unit[0])
                except Exception as error:
                    exc = error
                seconds = time.perf_counter() - started
                published = ctx.end()
                if published and exc is None:  # confirm before ack: wait here, so key order holds on a failure
                    exc = failure(published)
                work.done(unit, exc, seconds, result)
        finally:
            leave_handling(token)
        return report

    def _process_plain(self, slot: Any, chunk: list[Message]) -> Report:
        """The common case, one message per call, kept lean: it runs once per message."""
        report = Report(slot)
        fn, clock, stopping, consumer = self.call, time.perf_counter, self.stopping, self.consumer
        ctx, hooks, each = self.ctx, self.hooks, self.each
        acked, durations = report.acked, report.durations
        confirming: list[tuple[Message, Any, list[Any]]] = []  # handled, waiting for what they published
        token, cursor = enter_handling(consumer)  # one ContextVar.set per chunk, an attribute store per message
        try:
            for i, message in enumerate(chunk):
                if stopping.is_set():
                    report.released += [m.ref for m in chunk[i:]]
                    break
                cursor.current = message  # log lines made meanwhile name this message
                if each:
                    each.before((message,))
                ctx.messages = (message,)
                started = clock()
                try:
                    result = fn(message)
                except Exception as error:
                    durations.append(clock() - started)
                    ctx.end()
                    handle_outcome(consumer, [message], error, report, self.gate, hooks)
                    continue
                durations.append(clock() - started)
                if ctx.published:
                    confirming.append((message, result, ctx.end()))
                    continue
                ctx.messages = ()
                acked.append(message.ref)
                if each:
                    each.after((message,), result)
            for message, result, published in confirming:  # one wait for the chunk's confirms, not one per message
                cursor.current = message
                unconfirmed = failure(published)
                if unconfirmed is None:
                    acked.append(message.ref)
                    if each:
                        each.after((message,), result)
                else:
                    handle_outcome(self.consumer, [message], unconfirmed, report, self.gate, hooks)
        finally:
            leave_handling(token)
        report.ok += len(acked) - report.dropped
        return report


class AsyncLane(_Lane):
    """A task on the runner's event loop running an ``async def`` handler."""

    def __init__(
        self,
        consumer: Consumer,
        done: Callable[[Report], None],
        stopping: threading.Event,
        loop: asyncio.AbstractEventLoop,
        *,
        hooks: Hooks | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        super().__init__(consumer, done, stopping, hooks, publisher)
        self.loop = loop
        self.queue: asyncio.Queue[Job | None] = asyncio.Queue()
        self.task = asyncio.run_coroutine_threadsafe(self._run(), loop)

    def submit(self, slot: Any, chunk: list[Message], dead: BaseException | None = None) -> None:
        self.busy += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (slot, chunk, dead))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def join(self, timeout: float) -> None:
        """Wait for the task to end, so that stopping the loop does not leave it pending."""
        with contextlib.suppress(Exception):
            self.task.result(timeout)

    async def _run(self) -> None:
        bind(self.ctx)  # in this lane's task (and tasks it creates) only
        while (item := await self.queue.get()) is not None:
            slot, chunk, dead = item
            try:
                self.done(await self._process(slot, chunk, dead))
            finally:
                self.busy -= 1

    async def _process(self, slot: Any, chunk: list[Message], dead: BaseException | None = None) -> Report:
        report, work = self._work(slot, chunk, dead)
        fn: Callable[[Any], Awaitable[Any]] = self.call
        batch, ctx = self.consumer.batch, self.ctx
        token, cursor = enter_handling(self.consumer)  # log lines made meanwhile name the unit handled
        try:
            while (unit := work.next()) is not None:
                started = self._begin(unit, cursor)
                exc: BaseException | None = None
                result = None
                try:
                    result = await fn(unit if batch else unit[0])
                except Exception as error:
                    exc = error
                seconds = time.perf_counter() - started
                published = ctx.end()
                if published and exc is None:
                    exc = await _confirmed(published)
                work.done(unit, exc, seconds, result)
        finally:
            leave_handling(token)
        return report


async def _confirmed(published: list[Any]) -> BaseException | None:
    """Wait on the event loop (other lanes go on) for what a unit published; its first failure, or None."""
    for future in published:
        try:
            await asyncio.shield(asyncio.wrap_future(future))  # a cancelled lane must not cancel the producer's future
        except Exception as exc:
            return publish_failed(exc)
    return None


def split(consumer: Consumer, messages: list[Message], lanes: int) -> list[list[Message]]:
    """Cut a delivery into one chunk per lane (by key when order matters)."""
    if lanes == 1:
        return [messages]
    if consumer.key_ordered:
        chunks: list[list[Message]] = [[] for _ in range(lanes)]
        for message in messages:
            chunks[hash(message.key) % lanes].append(message)
        return chunks
    unit = consumer.batch_size if consumer.batch else 1
    size = max(unit, -(-len(messages) // lanes))
    size = -(-size // unit) * unit  # keep batch handlers' batches whole
    return [messages[i : i + size] for i in range(0, len(messages), size)]


__all__ = ["AsyncLane", "KeyGate", "Report", "ThreadLane", "describe", "split"]


def _delay_ms(seconds: float) -> int:
    """A retry delay as the wire's milliseconds: a ``wait=`` of the user's may return nan or inf."""
    if not seconds < MAX_DELAY_MS / 1000:  # inf, or nan: not retried at once by accident of a cast
        return MAX_DELAY_MS if seconds == seconds else 0
    return max(0, int(seconds * 1000))


MAX_DELAY_MS = 2**63 - 1  # the wire's signed 64-bit delay_ms
