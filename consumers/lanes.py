"""Lanes: the workers that run handlers, one message (or batch) after another.

A consumer with ``concurrency=N`` has N lanes. Delivered messages are cut
into chunks and queued to lanes; with ``key_ordered`` a message's lane is
chosen by its key, so one key is always handled by one lane, in order.
A lane reports what happened to a whole chunk at once (acks as offsets,
retries, dead letters), so the I/O thread settles in ranges, not messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from consumers.exceptions import Nack, Reject
from consumers.message import Message
from decorators.consumer import Consumer
from decorators.retry import describe

log = logging.getLogger("conveyor.runner")

WAITING_FOR_KEY = "waiting for an earlier message with the same key"


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


class LaneState:
    """Per-lane memory for key order: keys waiting for a retried message."""

    def __init__(self) -> None:
        self.blocked: dict[Any, tuple[int, int]] = {}  # key -> (offset retried, delay ms)


def handle_outcome(
    consumer: Consumer, messages: list[Message], exc: BaseException | None, report: Report, state: LaneState
) -> None:
    """Turn a handler's result into acks, retries or dead letters."""
    offsets = [m.offset for m in messages]
    if exc is None:
        report.acked += offsets
        report.ok += len(offsets)
        return
    if isinstance(exc, Nack):
        report.retried += [(o, int(exc.delay * 1000), exc.reason) for o in offsets]
        return
    if isinstance(exc, Reject):
        _dead(consumer, messages, exc, f"rejected: {exc.reason}", report)
        return
    attempt = max(m.attempt for m in messages)
    decision = consumer.policy.decide(exc, attempt)
    if decision.retry:
        delay = int(decision.delay * 1000)
        report.retried += [(o, delay, decision.reason) for o in offsets]
        if consumer.key_ordered:
            for m in messages:
                state.blocked.setdefault(m.key, (m.offset, delay))
        return
    _dead(consumer, messages, exc, decision.reason, report)


def _dead(consumer: Consumer, messages: list[Message], exc: BaseException, reason: str, report: Report) -> None:
    if consumer.policy.dead_letter is False:
        report.acked += [m.offset for m in messages]  # dropped on purpose, after the hooks
        report.dropped += len(messages)
    else:
        report.dead += [(m.offset, reason) for m in messages]
    for hook in consumer.error_handlers:
        for message in messages:
            try:
                hook(message, exc)
            except Exception:
                log.exception("error handler %r failed", hook)


def held_back(consumer: Consumer, message: Message, state: LaneState, report: Report) -> bool:
    """Key order: while an earlier message of this key waits for its retry, follow it."""
    if not consumer.key_ordered or message.key not in state.blocked:
        return False
    offset, delay = state.blocked[message.key]
    if message.offset <= offset:
        del state.blocked[message.key]  # the retried message itself is back
        return False
    report.retried.append((message.offset, delay, WAITING_FOR_KEY))
    return True


def units(consumer: Consumer, chunk: list[Message]) -> list[list[Message]]:
    """What one handler call receives: one message, or a batch of them."""
    if consumer.batch:
        return [chunk[i : i + consumer.batch_size] for i in range(0, len(chunk), consumer.batch_size)]
    return [[m] for m in chunk]


class ThreadLane:
    """A thread running a sync handler over queued chunks."""

    def __init__(
        self, consumer: Consumer, done: Callable[[Report], None], stopping: threading.Event, name: str
    ) -> None:
        self.consumer = consumer
        self.done = done
        self.stopping = stopping
        self.queue: queue.SimpleQueue[tuple[Any, list[Message]] | None] = queue.SimpleQueue()
        self.state = LaneState()
        self.busy = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, slot: Any, chunk: list[Message]) -> None:
        self.busy += 1
        self.queue.put((slot, chunk))

    def close(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            slot, chunk = item
            try:
                self.done(self._process(slot, chunk))
            finally:
                self.busy -= 1

    def _process(self, slot: Any, chunk: list[Message]) -> Report:
        if not (self.consumer.batch or self.consumer.key_ordered):
            return self._process_plain(slot, chunk)
        report = Report(slot)
        fn = self.consumer.fn
        for unit in units(self.consumer, chunk):
            if self.stopping.is_set():
                report.released += [m.offset for m in unit]
                continue
            if not self.consumer.batch and held_back(self.consumer, unit[0], self.state, report):
                continue
            started = time.perf_counter()
            exc: BaseException | None = None
            try:
                fn(unit if self.consumer.batch else unit[0])
            except Exception as error:
                exc = error
            report.durations.append(time.perf_counter() - started)
            handle_outcome(self.consumer, unit, exc, report, self.state)
        return report

    def _process_plain(self, slot: Any, chunk: list[Message]) -> Report:
        """The common case, one message per call, kept lean: it runs once per message."""
        report = Report(slot)
        fn, clock, stopping = self.consumer.fn, time.perf_counter, self.stopping
        acked, durations = report.acked, report.durations
        for i, message in enumerate(chunk):
            if stopping.is_set():
                report.released += [m.offset for m in chunk[i:]]
                break
            started = clock()
            try:
                fn(message)
            except Exception as error:
                durations.append(clock() - started)
                handle_outcome(self.consumer, [message], error, report, self.state)
                continue
            durations.append(clock() - started)
            acked.append(message.offset)
        report.ok += len(acked) - report.dropped
        return report


class AsyncLane:
    """A task on the runner's event loop running an ``async def`` handler."""

    def __init__(
        self,
        consumer: Consumer,
        done: Callable[[Report], None],
        stopping: threading.Event,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.consumer = consumer
        self.done = done
        self.stopping = stopping
        self.loop = loop
        self.state = LaneState()
        self.busy = 0
        self.queue: asyncio.Queue[tuple[Any, list[Message]] | None] = asyncio.Queue()
        self.task = asyncio.run_coroutine_threadsafe(self._run(), loop)

    def submit(self, slot: Any, chunk: list[Message]) -> None:
        self.busy += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (slot, chunk))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def join(self, timeout: float) -> None:
        """Wait for the task to end, so that stopping the loop does not leave it pending."""
        with contextlib.suppress(Exception):
            self.task.result(timeout)

    async def _run(self) -> None:
        while (item := await self.queue.get()) is not None:
            slot, chunk = item
            try:
                self.done(await self._process(slot, chunk))
            finally:
                self.busy -= 1

    async def _process(self, slot: Any, chunk: list[Message]) -> Report:
        report = Report(slot)
        fn: Callable[[Any], Awaitable[Any]] = self.consumer.fn
        for unit in units(self.consumer, chunk):
            if self.stopping.is_set():
                report.released += [m.offset for m in unit]
                continue
            if not self.consumer.batch and held_back(self.consumer, unit[0], self.state, report):
                continue
            started = time.perf_counter()
            exc: BaseException | None = None
            try:
                await fn(unit if self.consumer.batch else unit[0])
            except Exception as error:
                exc = error
            report.durations.append(time.perf_counter() - started)
            handle_outcome(self.consumer, unit, exc, report, self.state)
        return report


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


__all__ = ["WAITING_FOR_KEY", "AsyncLane", "Report", "ThreadLane", "describe", "split"]
