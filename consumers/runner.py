"""The consumer runner: every ``@consumer`` of some modules, one subscription each.

The main thread is the I/O thread: it owns the sockets, hands delivered
messages to lanes (threads for sync handlers, tasks on one event loop for
``async def`` ones), settles what lanes report in offset ranges, renews
leases of everything it holds, and heartbeats. Handlers never touch a
socket, so a slow handler never makes the broker think the runner died.

SIGTERM/SIGINT: pause credit, give back what no lane started, let lanes
finish within ``graceful_timeout``, give back the rest, say BYE. ``run()``
returns 0, or 3 (``exitcodes.HANDLERS_ABANDONED``) when handlers were still
running at the timeout: their messages were given back for redelivery, and
``abandoned`` says how many.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import operator
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from conveyor.broker.client.message import Message
from conveyor.broker.client.subscription import DeadLettered, Subscription
from conveyor.broker.config.addresses import broker_addresses
from conveyor.broker.net.wakeup import drain
from conveyor.consumers.builtin_middleware import default_middleware as builtin_middleware
from conveyor.consumers.context import Publisher
from conveyor.consumers.lanes import AsyncLane, Report, ThreadLane, split
from conveyor.consumers.middleware import ChunkSummary, Hooks, checked, label
from conveyor.consumers.start_check import (
    BACKLOG_WARNING,
    check_default_start,
    check_new_groups,
    start_of,
    warn_replay,
)
from conveyor.consumers.tracing import with_tracing
from conveyor.decorators.consumer import AckPolicy, Consumer, shared_group_problems
from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY, live, loop_check, ready, report
from conveyor.monitoring.http import MetricsServer
from conveyor.monitoring.metrics import HealthCollector, RunnerMetrics
from prometheus_client import CollectorRegistry

from conveyor import exitcodes
from conveyor.errors import ConfigError

log = logging.getLogger("conveyor.runner")

_OFFSET = operator.attrgetter("ref")  # the offset on partition 0 (Message.ref): what settles it

Lane = ThreadLane | AsyncLane
UNHEALTHY_AFTER = 30.0  # seconds without the broker before /healthz says UNHEALTHY (--unhealthy-after)
LONGEST_WAIT = 1.0  # the I/O loop's longest poll: the heartbeat and the lease-renewal check


@dataclass(eq=False)
class Slot:
    """One consumer at run time: its subscription, lanes and held offsets."""

    consumer: Consumer
    subscription: Subscription
    lanes: list[Lane]
    held: set[int] = field(default_factory=set)
    next_lane: int = 0
    last_renewal: float = 0.0
    labels: tuple[str, str, str] = ("", "", "")
    hooks: Hooks = field(default_factory=lambda: Hooks([]))


async def _cancel_other_tasks() -> None:
    """Cancel every other task of the running loop (async handlers given up at the graceful timeout) and wait:
    stopping the loop under a task still cancelling would leave it pending ("Task was destroyed")."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Runner:
    def __init__(
        self,
        consumers: list[Consumer],
        *,
        broker: str | Sequence[str] | None = None,
        concurrency: int | None = None,
        graceful_timeout: float = 15.0,
        metrics_port: int = 9101,
        metrics_bind: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        unhealthy_after: float = UNHEALTHY_AFTER,
        default_start: str = "earliest",
        backlog_warning: int = BACKLOG_WARNING,
        middleware: Sequence[Any] = (),
        default_middleware: Sequence[Any] | None = None,
    ) -> None:
        """``unhealthy_after``: seconds a consumer may be without its broker before /healthz says UNHEALTHY.

        ``default_start``: where a new group starts when its ``@consumer`` names no ``start=``;
        ``backlog_warning``: a new group about to read more messages than this from ``earliest`` is
        logged and counted (0: no check). Consumers of one topic sharing a group must say ``shared_group=True``.
        ``middleware``: objects with hooks around every consumer's messages, outside each consumer's own
        (consumers/middleware.py). Handlers publish through one producer the runner owns (consumers/context.py).
        ``default_middleware``: what goes outermost, before ``middleware``: by default the runner's own metrics and
        failure log lines (``MetricsMiddleware``, ``LoggingMiddleware``: consumers/builtin_middleware.py); give a
        list to replace them, ``()`` to run without them.
        """
        if not consumers:
            raise ValueError("no @consumer to run")
        problems = shared_group_problems(consumers)
        if problems:
            raise ConfigError("\n".join(problems), problems=problems)
        self.consumers = consumers
        self.default_start = check_default_start(default_start)
        if backlog_warning < 0:
            raise ConfigError(f"--backlog-warning must be 0 (off) or more, not {backlog_warning}")
        self.backlog_warning = backlog_warning
        # OpenTelemetry's TracingMiddleware goes first when a TracerProvider is configured (consumers/tracing.py)
        defaults = builtin_middleware() if default_middleware is None else default_middleware
        self.middleware = with_tracing(
            [_instance(m, "Runner(middleware=...)") for m in [*defaults, *middleware]],
            (m for c in consumers for m in c.middleware),
        )
        for c in consumers:
            c.middleware = [_instance(m, f"{c.name}: @consumer(middleware=...)") for m in c.middleware]
        # One broker or a bootstrap list (comma-separated); CONVEYOR_BROKER when not given. Each subscription
        # finds its topic's leader and subscribes again on a new one.
        self.broker = ",".join(broker_addresses(broker))
        self.concurrency = concurrency
        self.graceful_timeout = graceful_timeout
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.metrics = RunnerMetrics(self.registry)
        self.registry.register(HealthCollector(self.health))
        if not unhealthy_after > 0:
            raise ConfigError(f"--unhealthy-after must be more than 0 seconds, not {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self._last_pass = time.monotonic()
        self.metrics_server: MetricsServer | None = None
        if metrics_port >= 0:
            self.metrics_server = MetricsServer(
                self.registry,
                self.health,
                host=metrics_bind,
                port=metrics_port,
                live=lambda: live(self.health()),
                ready=self.readiness,
            )
        self.stopping = threading.Event()
        self.slots: list[Slot] = []
        self._reports: collections.deque[Report] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self.abandoned = 0  # messages given back because their handlers outran the graceful timeout
        self.publisher = Publisher(self.broker)
        self._all_hooks = Hooks(
            _unique([*self.middleware, *(m for c in consumers for m in c.middleware)]), self._hook_failed
        )

    def _hook_failed(self, middleware: Any, hook: str) -> None:
        self.metrics.middleware_errors.labels(label(middleware), hook).inc()

    # --- setup ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._all_hooks.call("on_start", self)
        check_new_groups(
            self.consumers,
            self.broker,
            default_start=self.default_start,
            threshold=self.backlog_warning,
            on_replay=self._replays,
        )
        if any(c.is_async for c in self.consumers):
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="conveyor-async", daemon=True).start()
        for consumer in self.consumers:
            self.slots.append(self._slot(consumer))
        if self.metrics_server:
            self.metrics_server.start()

    def _replays(self, consumer: Consumer, messages: int) -> None:
        """A new group is about to read a long topic from the start: say so, and count it."""
        warn_replay(consumer, messages, self.backlog_warning)
        self.metrics.new_group_replays.labels(consumer.name, consumer.topic, consumer.group).inc()

    def _slot(self, consumer: Consumer) -> Slot:
        lanes_n = self.concurrency or consumer.concurrency
        policy = consumer.policy
        # "" asks for the default dead-letter topic: a redeploy without one undoes an earlier custom one.
        dead_letter = policy.dead_letter if isinstance(policy.dead_letter, str) else ""
        subscription = Subscription(
            consumer.topic,
            consumer.group,
            address=self.broker,
            credit=max(consumer.credit, lanes_n),
            start=start_of(consumer, self.default_start),
            key_affinity=consumer.key_ordered,
            max_deliveries=policy.attempts_limit,
            ack_timeout_ms=consumer.ack_timeout_ms,
            dead_letter_topic=dead_letter,
        )
        lanes: list[Lane] = []
        hooks = Hooks([*self.middleware, *consumer.middleware], self._hook_failed)
        for i in range(lanes_n):
            if consumer.is_async:
                assert self._loop is not None
                lanes.append(
                    AsyncLane(consumer, self._report, self.stopping, self._loop, hooks=hooks, publisher=self.publisher)
                )
            else:
                name = f"{consumer.__name__}-{i}"
                lanes.append(
                    ThreadLane(consumer, self._report, self.stopping, name, hooks=hooks, publisher=self.publisher)
                )
        labels = (consumer.name, consumer.topic, consumer.group)
        self._declare_series(labels)
        slot = Slot(consumer, subscription, lanes, labels=labels, hooks=hooks)
        subscription.on_dead_letter = lambda messages, exc: self._dead_lettered(slot, messages, exc)
        return slot

    def _declare_series(self, labels: tuple[str, str, str]) -> None:
        """Show every handler in /metrics (and dashboards) before its first message (MetricsMiddleware declares
        the series it records)."""
        self.metrics.in_process.labels(*labels)
        self.metrics.new_group_replays.labels(*labels)

    def _report(self, report: Report) -> None:
        """Called from lanes: hand the report to the I/O thread and wake it."""
        self._reports.append(report)
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # already awake with bytes pending
        except OSError:
            pass  # closed: a handler that outran the graceful timeout ended after the runner gave it up

    # --- the loop ---------------------------------------------------------------------------

    def run(self, *, install_signals: bool = True, ready: Callable[[Runner], None] | None = None) -> int:
        """Run until stopped; ``ready`` is called once the broker has answered every subscription."""
        self._start()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
            signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._running = True
        announced = ready is None
        try:
            while self._running and not self.stopping.is_set():
                self._pass(self._poll_timeout())
                if not announced and all(slot.subscription.subscribed for slot in self.slots):
                    announced = True  # ready means subscribed: the broker answered every consumer
                    assert ready is not None
                    ready(self)
            self._drain()
        finally:
            if install_signals:
                signal.set_wakeup_fd(-1)
            self._all_hooks.call("on_stop", self)
            self._close()
        return exitcodes.HANDLERS_ABANDONED if self.abandoned else exitcodes.OK

    def stop(self) -> None:
        """Begin the graceful shutdown; safe from signal handlers and other threads."""
        self.stopping.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _poll_timeout(self) -> float:
        ticks = [slot.subscription.tick() for slot in self.slots]
        return min([*ticks, self._renewal_due(), LONGEST_WAIT])

    def _pass(self, timeout: float) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for slot in self.slots:
            for sock in slot.subscription.sockets:  # in a cluster, one per partition leader
                poller.register(sock, zmq.POLLIN)
                by_socket[sock] = slot
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        events = dict(poller.poll(int(timeout * 1000) + 1))
        self._last_pass = time.monotonic()
        if self._wake_r.fileno() in events:
            drain(self._wake_r)
        ready = {id(slot) for sock, slot in by_socket.items() if sock in events}
        for slot in self.slots:
            if id(slot) in ready:
                self._deliver(slot, slot.subscription.read_ready())
        self._settle_reports()
        self._renew_leases()

    def _deliver(self, slot: Slot, messages: list[Message]) -> None:
        if not messages:
            return
        offsets = list(map(_OFFSET, messages))
        if slot.held.isdisjoint(offsets):  # the common case, checked at C speed
            fresh = messages
        else:  # a redelivery of something we still hold is a twin: skip it
            fresh = [m for m in messages if m.ref not in slot.held]
            offsets = [m.ref for m in fresh]
        slot.held.update(offsets)
        if slot.consumer.ack_policy is AckPolicy.EARLY:
            slot.subscription.ack(fresh)
        self.metrics.in_process.labels(*slot.labels).inc(len(fresh))
        chunks = split(slot.consumer, fresh, len(slot.lanes))
        for i, chunk in enumerate(chunks):
            if chunk:
                lane = slot.lanes[i] if slot.consumer.key_ordered else self._least_busy(slot)
                lane.submit(slot, chunk)

    def _dead_lettered(self, slot: Slot, messages: list[Message], exc: DeadLettered) -> None:
        """The broker dead-lettered these itself: their lanes call the error handlers (never this thread)
        and let their keys go on."""
        if slot.hooks.chunks:
            slot.hooks.chunk(slot.consumer, ChunkSummary(dead_lettered=len(messages)))
        for i, chunk in enumerate(split(slot.consumer, messages, len(slot.lanes))):
            if chunk:
                lane = slot.lanes[i] if slot.consumer.key_ordered else self._least_busy(slot)
                lane.submit(slot, chunk, exc)

    def _least_busy(self, slot: Slot) -> Lane:
        slot.next_lane = (slot.next_lane + 1) % len(slot.lanes)
        rotated = slot.lanes[slot.next_lane :] + slot.lanes[: slot.next_lane]
        return min(rotated, key=lambda lane: lane.busy)

    # --- settling ---------------------------------------------------------------------------

    def _settle_reports(self) -> None:
        while self._reports:
            report = self._reports.popleft()
            slot: Slot = report.slot
            self._settle(slot, report)

    def _settle(self, slot: Slot, report: Report) -> None:
        sub = slot.subscription
        early = slot.consumer.ack_policy is AckPolicy.EARLY
        if report.acked and not early:
            sub.ack(report.acked)
        by_delay: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
        for offset, delay, error in report.retried:
            by_delay[(delay, error)].append(offset)
        if not early:
            for (delay, error), offsets in by_delay.items():
                sub.nack(offsets, delay_ms=delay, error=error)
            if report.released:
                sub.nack(report.released, release=True, error="runner shutting down")
            by_reason: dict[str, list[int]] = collections.defaultdict(list)
            for offset, reason in report.dead:
                by_reason[reason].append(offset)
            for reason, offsets in by_reason.items():
                sub.term(offsets, reason=reason)
        settled = len(report.acked) + len(report.retried) + len(report.released) + len(report.dead)
        slot.held.difference_update(
            report.acked, (o for o, _d, _e in report.retried), report.released, (o for o, _r in report.dead)
        )
        self._record(slot, report, settled)

    def _record(self, slot: Slot, report: Report, settled: int) -> None:
        """What the runner holds, and ``after_chunk`` for the middleware that counts (MetricsMiddleware)."""
        self.metrics.in_process.labels(*slot.labels).dec(settled)
        if slot.hooks.chunks:
            summary = ChunkSummary(
                report.ok, len(report.retried), len(report.dead), report.dropped, report.invalid, report.durations
            )
            slot.hooks.chunk(slot.consumer, summary)

    def _renewal_due(self) -> float:
        """Seconds until held messages need an IN_PROGRESS."""
        now = time.monotonic()
        dues = [slot.last_renewal + slot.consumer.ack_timeout_ms / 3000 - now for slot in self.slots if slot.held]
        return max(0.0, min(dues)) if dues else 1.0

    def _renew_leases(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.held and now - slot.last_renewal >= slot.consumer.ack_timeout_ms / 3000:
                slot.subscription.in_progress(sorted(slot.held))
                slot.last_renewal = now
            elif not slot.held:
                slot.last_renewal = now

    # --- shutdown -----------------------------------------------------------------------------

    def _drain(self) -> None:
        """Stop taking work, let lanes finish within the timeout, give back the rest."""
        log.info("draining: up to %.1f s for in-flight messages", self.graceful_timeout)
        for slot in self.slots:
            slot.subscription.set_credit(0, 1)
        deadline = time.monotonic() + self.graceful_timeout
        while time.monotonic() < deadline and self._busy():
            self._pass(min(0.05, max(0.0, deadline - time.monotonic())))
        self._settle_reports()
        outran = self._busy()
        given_back = 0
        for slot in self.slots:
            if slot.held:
                given_back += len(slot.held)
                slot.subscription.nack(sorted(slot.held), release=True, error="runner shutting down")
                slot.held.clear()
        if outran:
            self.abandoned = given_back
            log.warning(
                "graceful timeout (%.1f s) passed with handlers still running: gave back %d message(s) for redelivery",
                self.graceful_timeout,
                given_back,
            )

    def _busy(self) -> bool:
        return any(lane.busy for slot in self.slots for lane in slot.lanes)

    def _close(self) -> None:
        self.publisher.close(timeout=5.0)  # the drain waited for handlers, and so for what they published
        for slot in self.slots:
            for lane in slot.lanes:
                lane.close()
            slot.subscription.close()
        if self._loop is not None:
            if self.abandoned:  # their messages were given back: no point in waiting for the handlers
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result(timeout=5)
            for slot in self.slots:
                for lane in slot.lanes:
                    if isinstance(lane, AsyncLane):
                        lane.join(timeout=5)  # it has its None: it ends at once (the drain waited for work)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.metrics_server:
            self.metrics_server.stop()
        self._wake_r.close()
        self._wake_w.close()

    def health(self) -> dict[str, Any]:
        """Per consumer: HEALTHY while subscribed, DEGRADED without the broker, UNHEALTHY after ``unhealthy_after``.

        Plus ``event_loop``: the I/O thread passes at least every second (heartbeats, lease renewals); five
        seconds more means it is wedged, and only then does ``/livez`` fail.
        """
        now = time.monotonic()
        lag = max(0.0, now - self._last_pass - LONGEST_WAIT)
        checks = {"event_loop": loop_check(lag, degraded_after=LONGEST_WAIT, unhealthy_after=5 * LONGEST_WAIT)}
        for slot in list(self.slots):
            subscription = slot.subscription
            down = subscription.down_seconds(now)
            status = HEALTHY if down == 0 else UNHEALTHY if down >= self.unhealthy_after else DEGRADED
            checks[slot.consumer.name] = {
                "status": status,
                "subscribed": subscription.subscribed,
                "without_broker_seconds": round(down, 3),
                "unhealthy_after_seconds": self.unhealthy_after,
            }
        return report(checks)

    def readiness(self) -> dict[str, Any]:
        """Ready once every consumer is subscribed, until the shutdown begins."""
        found = self.health()
        waiting = [name for name, check in found["checks"].items() if check.get("subscribed") is False]
        if waiting:
            return {"ready": False, "status": found["status"], "reason": "not subscribed: " + ", ".join(waiting)}
        return ready(found, serving=self._running and not self.stopping.is_set() and bool(self.slots))


def _instance(middleware: Any, where: str) -> Any:
    """A middleware given as its class is made with no arguments; anything without a hook is refused."""
    if isinstance(middleware, type):
        try:
            middleware = middleware()
        except Exception as exc:
            raise ConfigError(f"{where}: {label(middleware)}() failed: {type(exc).__name__}: {exc}") from None
    return checked(middleware, where)


def _unique(items: list[Any]) -> list[Any]:
    return list({id(m): m for m in items}.values())
