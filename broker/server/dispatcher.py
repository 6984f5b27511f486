"""Dispatching: the groups a pass woke send their deliveries, each group on its own.

A group's dispatch plans whole stored batches for the members with credit;
each plan goes out as one DELIVER. A DELIVER that bounces (the peer's queue
is full) marks the member busy and puts the plan back, until the peer talks
again. A group whose dispatch raises is contained: the others go on, and it
is tried again after 1 s, doubling to 30 s while it fails. Lease expiries
and delayed redeliveries are timers in a heap whose earliest entry sets the
loop's poll timeout: nothing polls.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.server.confirms import Send
from conveyor.broker.server.containment import Containment
from conveyor.broker.server.dispatch_guard import dispatch_contained
from conveyor.broker.server.group_table import GroupIndex
from conveyor.broker.server.groups import Delivery, Group
from conveyor.broker.server.peers import Peers
from conveyor.broker.wire import commands

from conveyor.errors import ConveyorError

if TYPE_CHECKING:
    from conveyor.broker.server.group_log import DeliveryGate

DISPATCH_RETRY_SECONDS = (1.0, 30.0)  # first and longest wait before a group whose dispatch raised is tried again


class GroupTimers:
    """When each group must next look at its leases and delayed redeliveries.

    A heap; a group has at most one live entry (its earliest), stale ones are skipped when they come up.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Group]] = []
        self._at: dict[Group, float] = {}  # each group's earliest entry in the heap
        self._seq = itertools.count()

    def schedule(self, group: Group) -> None:
        """Make sure the loop wakes for the group's next lease expiry or delayed redelivery."""
        when = group.next_deadline()
        if when is None or self._at.get(group, float("inf")) <= when:
            return  # nothing timed, or an earlier wake-up is already set (it schedules again)
        self._at[group] = when
        heapq.heappush(self._heap, (when, next(self._seq), group))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def due(self, now: float, live: Callable[[Group], bool]) -> list[Group]:
        """Pop the timers that are due: the groups (still ``live``) that must look at their leases and delays."""
        due: dict[Group, None] = {}
        while self._heap and self._heap[0][0] <= now:
            when, _seq, group = heapq.heappop(self._heap)
            if self._at.get(group) == when:
                del self._at[group]
            if live(group):
                due[group] = None
        return list(due)


class Dispatcher:
    """Dispatches ``to_dispatch`` (the loop's set); records every dispatched group in ``moved``."""

    def __init__(
        self,
        store: Store,
        groups: GroupIndex,
        peers: Peers,
        *,
        to_dispatch: set[Group],
        moved: set[Group],
        send: Send,
        metrics: Any,
        containment: Containment,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.groups = groups
        self.peers = peers
        self.to_dispatch = to_dispatch
        self.moved = moved
        self.timers = GroupTimers()
        self.retries: dict[Group, tuple[float, float]] = {}  # group -> (due, backoff)
        self._send = send
        self._metrics = metrics
        self._containment = containment
        self._clock = clock
        # Cluster mode: DELIVERs of led topics wait until the group-state record counting them is
        # replicated (``group_log.DeliveryGate``); None on a single node.
        self.gate: DeliveryGate | None = None

    def run(self) -> None:
        gate = self.gate
        if gate is not None:
            gate.release()
        groups = list(self.to_dispatch)
        self.to_dispatch.clear()
        for group in groups:
            log_ = self.store.logs.get(group.topic)
            if log_ is None or self.groups.get((group.topic, group.name)) is not group:
                self.retries.pop(group, None)
                continue
            retry = self.retries.get(group) if self.retries else None
            if retry is None or self._clock() >= retry[0]:  # a group paused after a failure waits for its retry
                # Gated: planned past HW, so the record counting it replicates with the messages.
                gated = gate is not None and gate.gates(group.topic)
                self._dispatch_group(group, gate.planning_view(log_) if gate is not None and gated else log_, retry)
            self.moved.add(group)
            self.timers.schedule(group)
            if gate is not None:
                gate.touch(group)
            if group.dead:
                # Dead letters made after this pass's ``DeadLetters.handle`` (a member found gone while the
                # loop sent confirms or DEAD_LETTERED events: what it held went past max_deliveries) are
                # written by the next pass's; without this the group left the set and they waited, unwritten
                # and holding the committed offset, for the group's next event (a restart, say).
                self.to_dispatch.add(group)
        if gate is not None:
            gate.write()  # one group-state record per topic for this pass; its DELIVERs wait for it

    def retries_due(self, now: float) -> None:
        """Queue the groups whose retry after a failed dispatch is due."""
        for group, (due, _backoff) in list(self.retries.items()):
            if due <= now:
                self.to_dispatch.add(group)

    def _dispatch_group(self, group: Group, log_: TopicLog, retry: tuple[float, float] | None) -> None:
        try:
            # A failed dispatch changes nothing; what lies before an unreadable batch is still delivered.
            plans, error = dispatch_contained(group, log_)
            for plan in plans:
                self._deliver(group, plan)
        except Exception as exc:
            error = exc
        if error is not None:  # contained to this group, which is tried again later
            self._failed(group, error)
        elif retry is not None:
            del self.retries[group]

    def _failed(self, group: Group, exc: Exception) -> None:
        offset = exc.fields.get("offset", group.next_offset) if isinstance(exc, ConveyorError) else group.next_offset
        self._containment.record("dispatch", exc, {"topic": group.topic, "group": group.name, "offset": offset})
        name = exc.name if isinstance(exc, ConveyorError) else type(exc).__name__
        self._metrics.dispatch_errors.labels(group.topic, group.name, name).inc()
        _due, backoff = self.retries.get(group, (0.0, DISPATCH_RETRY_SECONDS[0] / 2))
        backoff = min(backoff * 2, DISPATCH_RETRY_SECONDS[1])
        self.retries[group] = (self._clock() + backoff, backoff)

    def _deliver(self, group: Group, plan: Delivery) -> None:
        if plan.member.peer not in self.peers:
            return  # gone during this dispatch: leaving already put its offsets back
        if plan.member.busy:
            group.undeliver(plan)  # an earlier DELIVER of this dispatch bounced: keep the member's order
            return
        entries = plan.entries
        frames = commands.deliver(
            plan.member.sub_id, group.topic, [e.to_wire() for e in entries], [e.batch.body for e in entries]
        )
        if self.gate is not None and self.gate.gates(group.topic):
            self.gate.hold(group, plan, frames)
            return
        self.send_plan(group, plan, frames)

    def send_plan(self, group: Group, plan: Delivery, frames: list[Any]) -> None:
        """Send a planned DELIVER; one that bounces marks its member busy and goes back uncounted."""
        if plan.member.peer not in self.peers:
            return  # gone since it was planned: leaving already put its offsets back
        if plan.member.busy:
            group.undeliver(plan)
            return
        entries = plan.entries
        if not self._send(plan.member.peer, frames):
            if self.peers.mark_busy(plan.member.peer, group, plan.member):
                group.undeliver(plan)
            return
        messages = sum(e.end - e.first if e.offsets is None else len(e.offsets) for e in entries)
        counters = self._metrics.group(group.topic, group.name)
        counters.delivered_messages.inc(messages)
        counters.delivered_bytes.inc(sum(len(e.batch.body) for e in entries))
