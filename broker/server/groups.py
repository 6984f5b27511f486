"""Consumer groups: who holds which offsets, and who gets the next batch.

No sockets here. A ``Group`` turns "the log grew" or "a member has credit"
into ``Delivery`` plans, and acks, nacks, lease expiry and departures into
state changes. In-flight work is tracked per delivered chunk as offset
ranges, never per message, so a whole-batch ack is O(1).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.wire.delivery_times import EXPIRED, TIMED_MARK, batch_times
from conveyor.broker.wire.entry import wire_entry
from conveyor.broker.wire.ranges import Range, count, intersect, normalize, subtract, to_ranges, window
from conveyor.broker.wire.record import Batch, pack_records, unpack_records


@dataclass(slots=True)
class GroupSettings:
    max_deliveries: int = 10
    ack_timeout_ms: int = 30_000
    dead_letter_topic: str = ""
    key_affinity: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_deliveries": self.max_deliveries,
            "ack_timeout_ms": self.ack_timeout_ms,
            "dead_letter_topic": self.dead_letter_topic,
            "key_affinity": self.key_affinity,
        }

    def changes(self, other: GroupSettings) -> dict[str, tuple[Any, Any]]:
        """Each setting ``other`` has another value for: name -> (this value, other's)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}


@dataclass(eq=False, slots=True)
class Member:
    """One subscription of one connected peer to one group."""

    peer: bytes
    sub_id: int
    credit: int
    batch_size: int
    in_flight: int = 0
    chunks: dict[int, Chunk] = field(default_factory=dict)
    busy: bool = False  # the last send hit EAGAIN: wait until it talks again

    @property
    def available(self) -> int:
        return 0 if self.busy else max(0, self.credit - self.in_flight)

    @property
    def key(self) -> bytes:
        return self.peer + self.sub_id.to_bytes(4, "big")


@dataclass(eq=False, slots=True)
class Chunk:
    """Offsets delivered together to one member and not yet settled."""

    id: int
    member: Member
    ranges: list[Range]
    deliveries: int
    deadline: float
    appended_ms: int = 0  # append time of its first batch, for end-to-end latency
    first_ms: int = 0  # when its messages were first delivered (wall clock, ms): stop_after_delay counts from it

    @property
    def size(self) -> int:
        return count(self.ranges)


@dataclass(slots=True)
class Pending:
    """Offsets waiting to be delivered again."""

    ranges: list[Range]
    deliveries: int  # how many times they were delivered already
    not_before: float
    last_error: str = ""
    avoid: bytes = b""  # the member key that failed them, tried last
    first_ms: int = 0  # first delivery (wall clock, ms); 0 when never delivered
    # Key affinity: ``held`` offsets wait behind an earlier message of their key that waits for its
    # redelivery (they are due, but set no deadline: the item they wait for does); ``keys`` is a
    # superset of their keys, read once.
    held: bool = False
    keys: frozenset[Any] | None = None
    # Dead letters whose dead-letter topic cannot take them yet (cluster mode: not led here): they go
    # back to ``dead`` when due, never to a member (a redelivery would pass ``max_deliveries``).
    dead: bool = False


@dataclass(slots=True)
class Entry:
    """One batch (or a slice of one) inside a DELIVER."""

    batch: Batch
    first: int
    end: int
    deliveries: int
    offsets: list[int] | None = None  # a non-contiguous subset (key affinity)
    first_ms: int = 0  # first delivery of these messages, wall clock ms

    def to_wire(self) -> dict[str, Any]:
        """What the DELIVER (or EVENT) that carries this entry says of it (a ``DeliveryEntry`` map)."""
        batch = self.batch
        return wire_entry(
            batch.base_offset,
            batch.count,
            batch.timestamp_ms,
            self.first,
            self.end,
            self.deliveries,
            self.offsets,
            self.first_ms,
        )


# A DELIVER's header lists its entries, and a peer refuses headers over
# protocol.MAX_HEADER_BYTES (64 KiB): a member catching up on thousands of
# one-message batches would otherwise be sent a frame it cannot read, again
# and again. An entry's encoding is at most ENTRY_BYTES, plus OFFSET_BYTES
# per offset a keyed entry lists; a DELIVER is planned to fit HEADER_BUDGET,
# and more goes in a second DELIVER. Listed offsets are capped further so
# that the ACK of one DELIVER (one range per offset at worst) fits too.
ENTRY_BYTES = 72
OFFSET_BYTES = 9
HEADER_BUDGET = 48 * 1024
MAX_LISTED_OFFSETS = 2048
MAX_ENTRIES = HEADER_BUDGET // ENTRY_BYTES


def entry_cost(entry: Entry) -> int:
    return ENTRY_BYTES + OFFSET_BYTES * len(entry.offsets or ())


@dataclass(slots=True)
class Delivery:
    member: Member
    entries: list[Entry]
    chunks: list[Chunk]
    header_bytes: int = 0
    listed: int = 0  # offsets listed by keyed entries


class Plans:
    """The DELIVERs one dispatch plans: per member, one open DELIVER until its header is full."""

    def __init__(self) -> None:
        self.open: dict[int, Delivery] = {}
        self.all: list[Delivery] = []

    def add(self, member: Member, entries: list[Entry], chunk: Chunk) -> None:
        cost = sum(map(entry_cost, entries))
        listed = sum(len(e.offsets or ()) for e in entries)
        plan = self.open.get(id(member))
        if plan is None or plan.header_bytes + cost > HEADER_BUDGET or plan.listed + listed > MAX_LISTED_OFFSETS:
            plan = self.open[id(member)] = Delivery(member, [], [])
            self.all.append(plan)
        plan.entries.extend(entries)
        plan.chunks.append(chunk)
        plan.header_bytes += cost
        plan.listed += listed


@dataclass(slots=True)
class DeadLetter:
    """Messages past ``max_deliveries`` (or terminated), for the DLQ."""

    ranges: list[Range]
    deliveries: int
    reason: str
    by_broker: bool = False  # past max_deliveries (not a TERM): the consumer is told with an EVENT
    member: bytes = b""  # the member that had them last
    first_ms: int = 0
    expired: bool = False  # a timed batch past its expiry: saved as unsettled, so a restart checks it again


_chunk_ids = itertools.count(1)
_wait_ids = itertools.count(1)  # orders waiting batches of one due time, and tells a dispatch's own

# groups.json keeps at most this many unsettled ranges per group, the lowest: the group's saved next
# offset stops before the first one left out, so what lies beyond is delivered again (at least once),
# only without its count.
MAX_SAVED_RANGES = 10_000
# What a saved range is: not dead, past max_deliveries (the broker dead-letters it), terminated (TERM).
LIVE, DEAD_BY_BROKER, TERMINATED = 0, 1, 2
RESTARTED = "redelivered after a broker restart"
WAITING = "delayed"  # the note of a timed batch held back until its not-before time


def _wall_ms() -> int:
    return int(time.time() * 1000)


class Group:
    def __init__(
        self,
        topic: str,
        name: str,
        settings: GroupSettings,
        *,
        next_offset: int,
        clock: Callable[[], float],
    ) -> None:
        self.topic = topic
        self.name = name
        self.settings = settings
        self.next_offset = next_offset  # first offset never delivered
        self.clock = clock
        self.members: list[Member] = []
        self.joining: list[Member] = []  # key affinity: wait for in-flight to drain
        self.chunks: dict[int, Chunk] = {}
        self.pending: list[Pending] = []
        self._leases: list[tuple[float, int]] = []
        self._rr = 0
        self.dead: list[DeadLetter] = []
        self.settings_changed: dict[str, Any] | None = None  # the last change a newer subscription made
        self.skipped_by_retention = 0  # messages retention deleted before this group got to them
        self.on_skip: Callable[[Group, int], None] | None = None  # told of each skip (log and count it)
        self.wall_ms: Callable[[], int] = _wall_ms  # the wall clock (ms) that timed batches' times are on
        # Timed batches held back until their not-before time (``_timed``): a heap by due time, apart from
        # ``pending`` so that a dispatch looks at the earliest only, however many wait. With key affinity,
        # ``_waiting_keys`` counts the keys they hold (the keys later messages wait behind).
        self.waiting: list[tuple[float, int, Pending]] = []
        self._waiting_keys: Counter[Any] = Counter()
        self._waiting_keys_stale = False  # key affinity turned on while batches waited: count their keys again
        self._retained_start = 0  # the log start the waiting batches were last cut to

    def apply_settings(self, settings: GroupSettings) -> None:
        """New settings from a newer subscription: leases and deliveries from now on follow them."""
        if settings.key_affinity and not self.settings.key_affinity and self.waiting:
            self._waiting_keys_stale = True
        self.settings = settings

    # --- membership --------------------------------------------------------------

    def join(self, member: Member) -> None:
        if self.settings.key_affinity and self.chunks:
            self.joining.append(member)  # a new owner now would break per-key order
        else:
            self.members.append(member)

    def leave(self, member: Member, *, reason: str = "member left") -> None:
        """Take a member out; what it held is redelivered to the others first."""
        if member in self.joining:
            self.joining.remove(member)
        if member in self.members:
            self.members.remove(member)
        now = self.clock()
        for chunk in list(member.chunks.values()):
            self._drop_chunk(chunk)
            self._requeue(chunk.ranges, chunk.deliveries, now, reason, member.key, chunk.first_ms)

    def _admit_joiners(self) -> None:
        if self.joining and not self.chunks:
            self.members.extend(self.joining)
            self.joining.clear()

    # --- settling --------------------------------------------------------------------

    def settle(self, member: Member, ranges: list[Range]) -> list[Chunk]:
        """Remove acked offsets; return the chunks they touched."""
        touched = []
        for chunk, acked in _overlaps(member, ranges):
            chunk.ranges, removed = subtract(chunk.ranges, acked)
            if removed:
                touched.append(chunk)
                member.in_flight -= removed
                if not chunk.ranges:
                    self._drop_chunk(chunk, keep_inflight=True)
        return touched

    def nack(
        self, member: Member, ranges: list[Range], *, delay_ms: int = 0, error: str = "nack", release: bool = False
    ) -> int:
        """Take nacked offsets back; they come again after ``delay_ms``.

        ``release`` gives back messages the consumer never tried (a draining
        runner): their delivery does not count against ``max_deliveries``.
        """
        taken = self._take(member, ranges)
        now = self.clock()
        for chunk in taken:
            counted = chunk.deliveries - 1 if release else chunk.deliveries
            first_ms = chunk.first_ms if counted else 0
            self._requeue(chunk.ranges, counted, now + delay_ms / 1000, error, member.key, first_ms)
        return sum(chunk.size for chunk in taken)

    def terminate(self, member: Member, ranges: list[Range], reason: str) -> int:
        taken = self._take(member, ranges)
        for chunk in taken:
            self.dead.append(DeadLetter(chunk.ranges, chunk.deliveries, reason, False, member.key, chunk.first_ms))
        return sum(chunk.size for chunk in taken)

    def renew(self, member: Member, ranges: list[Range]) -> int:
        """IN_PROGRESS: push the lease of the chunks holding these offsets."""
        deadline = self.clock() + self.settings.ack_timeout_ms / 1000
        renewed = 0
        for chunk, asked in _overlaps(member, ranges):
            picked = intersect(chunk.ranges, asked)
            if not picked:
                continue
            rest, _ = subtract(chunk.ranges, picked)
            if rest:  # only part of the chunk is renewed: it becomes a chunk of its own
                chunk.ranges = rest
                first_ms = chunk.first_ms
                chunk = self._add_chunk(member, picked, chunk.deliveries, deadline, count_in_flight=False)
                chunk.first_ms = first_ms
            else:
                chunk.deadline = deadline
                heapq.heappush(self._leases, (deadline, chunk.id))
            renewed += count(picked)
        return renewed

    def undeliver(self, plan: Delivery) -> None:
        """A DELIVER could not be sent: put its offsets back, uncounted."""
        for chunk in plan.chunks:
            if chunk.id in self.chunks:
                self._drop_chunk(chunk)
                deliveries = chunk.deliveries - 1
                first_ms = chunk.first_ms if deliveries else 0
                self.pending.append(Pending(chunk.ranges, deliveries, self.clock(), "", plan.member.key, first_ms))

    def _take(self, member: Member, ranges: list[Range]) -> list[Chunk]:
        """Remove ``ranges`` from the member's chunks: what was taken, as detached chunks (counts kept)."""
        taken: list[Chunk] = []
        for chunk, asked in _overlaps(member, ranges):
            picked = intersect(chunk.ranges, asked)
            if picked:
                chunk.ranges, removed = subtract(chunk.ranges, picked)
                member.in_flight -= removed
                taken.append(Chunk(0, member, picked, chunk.deliveries, 0.0, first_ms=chunk.first_ms))
                if not chunk.ranges:
                    self._drop_chunk(chunk, keep_inflight=True)
        return taken

    def _drop_chunk(self, chunk: Chunk, *, keep_inflight: bool = False) -> None:
        self.chunks.pop(chunk.id, None)
        chunk.member.chunks.pop(chunk.id, None)
        if not keep_inflight:
            chunk.member.in_flight -= chunk.size

    def _requeue(
        self, ranges: list[Range], deliveries: int, not_before: float, error: str, avoid: bytes, first_ms: int = 0
    ) -> None:
        if not ranges:
            return
        if deliveries >= self.settings.max_deliveries:
            self.dead.append(DeadLetter(ranges, deliveries, error, True, avoid, first_ms))
            return
        self.pending.append(Pending(list(ranges), deliveries, not_before, error, avoid, first_ms))

    # --- time ------------------------------------------------------------------------

    def expire_leases(self) -> int:
        """Redeliver chunks whose ack timeout passed; return how many messages."""
        now = self.clock()
        expired = 0
        if any(p.dead for p in self.pending):
            due = [p for p in self.pending if p.dead and p.not_before <= now]
            self.pending = [p for p in self.pending if not (p.dead and p.not_before <= now)]
            self.dead += [DeadLetter(p.ranges, p.deliveries, p.last_error, True, p.avoid, p.first_ms) for p in due]
        while self._leases and self._leases[0][0] <= now:
            deadline, chunk_id = heapq.heappop(self._leases)
            chunk = self.chunks.get(chunk_id)
            if chunk is None or chunk.deadline != deadline:
                continue  # settled or renewed since
            expired += chunk.size
            self._drop_chunk(chunk)
            self._requeue(chunk.ranges, chunk.deliveries, now, "lease expired", chunk.member.key, chunk.first_ms)
        return expired

    def next_deadline(self) -> float | None:
        """The next lease expiry or delayed redelivery still to come.

        Pending work already due sets no deadline (a past one would spin the
        loop): it goes when credit comes back, at housekeeping, or (held
        behind its key) with the item it waits for.
        """
        while self._leases and self._leases[0][1] not in self.chunks:
            heapq.heappop(self._leases)
        times = [self._leases[0][0]] if self._leases else []
        now = self.clock()
        times += [p.not_before for p in self.pending if p.not_before > now]
        if self.waiting and self.waiting[0][0] <= now:  # came due since the dispatch that released the rest
            self._release_waiting(now)
            times.append(now)  # one wake-up dispatches it; pending now, it sets no deadline again
        if self.waiting:
            times.append(self.waiting[0][0])
        return min(times) if times else None

    def has_due(self, now: float) -> bool:
        """Pending work due now that is not just waiting behind its key."""
        return any(p.not_before <= now and not p.held and not p.dead for p in self.pending)

    # --- offsets -------------------------------------------------------------------------

    def saved_state(self, now: float, now_ms: int, dying: Sequence[DeadLetter] = ()) -> dict[str, Any]:
        """What ``groups.json`` keeps of the group beside its settings, so that a restart loses no count.

        ``unsettled`` rows are ``[start, end, deliveries, first_ms, due_ms, dead]``, sorted, at most
        ``MAX_SAVED_RANGES``: in flight (due at once after a restart, the delivery counted, as when a
        member vanishes), waiting for redelivery (``due_ms``: the wall-clock time it is due, 0 for
        now) and dead letters not yet stored (``dying``: the broker's writes in progress). ``now`` is
        ``clock()``, ``now_ms`` the wall clock in ms.
        """
        rows = [[a, b, c.deliveries, c.first_ms, 0, LIVE] for c in list(self.chunks.values()) for a, b in c.ranges]
        for p in [*self.pending, *(w[2] for w in list(self.waiting))]:
            due = int(now_ms + (p.not_before - now) * 1000) if p.not_before > now else 0
            rows += [[a, b, p.deliveries, p.first_ms, due, DEAD_BY_BROKER if p.dead else LIVE] for a, b in p.ranges]
        for d in [*self.dead, *dying]:
            dead = LIVE if d.expired else DEAD_BY_BROKER if d.by_broker else TERMINATED
            rows += [[a, b, d.deliveries, d.first_ms, 0, dead] for a, b in d.ranges]
        rows.sort()
        next_offset = self.next_offset
        if len(rows) > MAX_SAVED_RANGES:
            next_offset = min(next_offset, rows[MAX_SAVED_RANGES][0])
            del rows[MAX_SAVED_RANGES:]
        return {
            "committed_offset": min(next_offset, rows[0][0]) if rows else next_offset,
            "next_offset": next_offset,
            "unsettled": rows,
            "skipped_by_retention": self.skipped_by_retention,
        }

    def restore(self, rows: list[list[int]], now: float, now_ms: int) -> None:
        """Unsettled ranges saved by ``saved_state``: they come again with their counts and due times.

        Past ``max_deliveries`` (or terminated) they go to the dead-letter topic instead: a poison
        message gets no fresh attempts because the broker restarted.
        """
        for start, end, deliveries, first_ms, due_ms, dead in rows:
            end = min(end, self.next_offset)  # the log lost a tail the file had seen: those come as new
            if end <= start:
                continue
            if dead:
                reason = "terminated" if dead == TERMINATED else RESTARTED
                self.dead.append(DeadLetter([(start, end)], deliveries, reason, dead == DEAD_BY_BROKER, b"", first_ms))
                continue
            not_before = now + max(0, due_ms - now_ms) / 1000 if due_ms else now
            if not_before > now and not deliveries:
                # A timed batch held back, never delivered: in the heap again, its keys counted when a keyed
                # dispatch next runs (it reads them from the log then). A delayed nack stays in ``pending``.
                self._wait(Pending([(start, end)], deliveries, not_before, RESTARTED, b"", first_ms))
                self._waiting_keys_stale = self.settings.key_affinity
                continue
            self._requeue([(start, end)], deliveries, not_before, RESTARTED, b"", first_ms)

    @property
    def committed_offset(self) -> int:
        """The lowest offset not yet settled: where a restarted group resumes."""
        low = self.next_offset
        # list() copies atomically: the metrics thread reads this while the loop changes it.
        for chunk in list(self.chunks.values()):
            ranges = chunk.ranges
            if ranges:
                low = min(low, ranges[0][0])
        for pending in [*self.pending, *(w[2] for w in list(self.waiting))]:
            if pending.ranges:
                low = min(low, pending.ranges[0][0])
        return low

    @property
    def in_flight(self) -> int:
        return sum(m.in_flight for m in list(self.members))

    @property
    def pending_messages(self) -> int:
        """Offsets waiting to be redelivered (nacked, expired, or dead letters that could not be stored)."""
        return sum(count(p.ranges) for p in [*self.pending, *(w[2] for w in list(self.waiting))])

    def reset(self, offset: int) -> None:
        """Move the group; in-flight and pending work is forgotten."""
        for chunk in list(self.chunks.values()):
            self._drop_chunk(chunk)
        self.pending.clear()
        self.waiting.clear()
        self._waiting_keys.clear()
        self._leases.clear()
        self.next_offset = offset

    def skip_retained(self, start: int) -> int:
        """Retention deleted the log below ``start``: what this group still had to deliver there is skipped.

        The next offset moves up to ``start`` and waiting redeliveries and dead letters lose their part
        below it, as Kafka's ``auto.offset.reset=earliest`` does: reading there would fail, and nothing
        can bring those messages back. Chunks in flight stay (their member holds the messages and may
        still ack them); if they come back, they are skipped then. Returns how many messages were skipped.
        """
        skipped = 0
        if self.next_offset < start:
            skipped += start - self.next_offset
            self.next_offset = start
        if any(p.ranges and p.ranges[0][0] < start for p in self.pending):
            skipped += _cut_below(self.pending, start)
            self.pending = [p for p in self.pending if p.ranges]
        if self.waiting and start > self._retained_start:  # retention moved: look at the waiting batches again
            self._retained_start = start
            items = [w[2] for w in self.waiting]
            if any(p.ranges and p.ranges[0][0] < start for p in items):
                skipped += _cut_below(items, start)
                self.waiting = [w for w in self.waiting if w[2].ranges]
                heapq.heapify(self.waiting)
                self._count_waiting_keys()
        if any(d.ranges and d.ranges[0][0] < start for d in self.dead):
            skipped += _cut_below(self.dead, start)
            self.dead = [d for d in self.dead if d.ranges]
        if skipped:
            self.skipped_by_retention += skipped
            if self.on_skip is not None:
                self.on_skip(self, skipped)
        return skipped

    # --- dispatch ------------------------------------------------------------------------

    def dispatch(self, log: TopicLog, *, max_bytes: int = 1 << 20) -> list[Delivery]:
        """Plan deliveries for everything deliverable now, round-robin by credit."""
        if self.waiting and self.waiting[0][0] <= self.clock():
            self._release_waiting(self.clock())
        if self.next_offset >= log.visible_offset and not self.pending and not self.joining:
            return []  # the common case after an ack: credit came back, nothing new waits
        self.skip_retained(log.start_offset)
        self._admit_joiners()
        if not self.members:
            return []
        plans = Plans()
        if self.settings.key_affinity:
            self._dispatch_keyed_all(log, plans, max_bytes)
            return plans.all
        if self.pending:
            self._dispatch_pending(log, plans)
        self._dispatch_new(log, plans, max_bytes)
        return plans.all

    def dispatch_or_nothing(self, log: TopicLog) -> list[Delivery]:
        """``dispatch``, or, if it raises midway (a batch that cannot be read), no change at all.

        The chunks it planned are dropped and the group's position and pending redeliveries are
        as before, so nothing is lost or counted as a delivery; the error is raised for the
        caller to contain. Chunk ids only grow: the new ones are those from the first id taken.
        """
        self.skip_retained(log.start_offset)  # what retention deleted stays skipped, whatever happens next
        self._release_waiting(self.clock())  # before the copy: a failed dispatch only adds to ``waiting``
        first_id, next_offset, pending, rr = next(_chunk_ids), self.next_offset, list(self.pending), self._rr
        dead, first_wait = list(self.dead), next(_wait_ids)
        try:
            return self.dispatch(log)
        except Exception:
            for chunk in [c for c in self.chunks.values() if c.id > first_id]:
                self._drop_chunk(chunk)
            self.next_offset, self.pending, self._rr, self.dead = next_offset, pending, rr, dead
            if self.waiting and max(w[1] for w in self.waiting) > first_wait:
                self.waiting = [w for w in self.waiting if w[1] < first_wait]
                heapq.heapify(self.waiting)
                self._count_waiting_keys()
            raise

    def _members_with_credit(self, avoid: bytes = b"") -> Iterator[Member]:
        """Members in round-robin order, the one to avoid last."""
        n = len(self.members)
        order = [self.members[(self._rr + i) % n] for i in range(n)]
        order.sort(key=lambda m: m.key == avoid)  # stable: keeps the rotation
        for member in order:
            if member.available > 0:
                yield member

    def _advance_rr(self, member: Member) -> None:
        self._rr = (self.members.index(member) + 1) % len(self.members)

    def _dispatch_new(self, log: TopicLog, plans: Plans, max_bytes: int) -> None:
        limit = log.visible_offset
        while self.next_offset < limit:
            member = next(self._members_with_credit(), None)
            if member is None:
                return
            batches = log.read(self.next_offset, max_bytes=max_bytes, max_messages=member.available)
            if not batches:
                return
            self._give(member, batches, limit, plans)

    def _give(self, member: Member, batches: list[Batch], limit: int, plans: Plans) -> None:
        """One member takes whole batches from ``next_offset`` while it has credit."""
        take = min(member.available, member.batch_size)
        entries: list[Entry] = []
        for batch in batches:
            first = max(self.next_offset, batch.base_offset)
            end = min(batch.next_offset, first + take, limit)
            if end <= first:
                break
            if batch.body[0] == TIMED_MARK and self._timed(batch, first, min(batch.next_offset, limit), 0, 0):
                self.next_offset = min(batch.next_offset, limit)  # held back or expired: later batches flow
                continue
            entries.append(slice_entry(batch, first, end, 1))
            take -= end - first
            self.next_offset = end
            if take <= 0 or len(entries) >= MAX_ENTRIES:
                break
        if entries:  # a gap in the log before or between the batches is passed, never held by the member
            self._record(member, _covered(entries), 1, entries, plans)
            self._advance_rr(member)

    def _record(
        self,
        member: Member,
        ranges: list[Range],
        deliveries: int,
        entries: list[Entry],
        plans: Plans,
        first_ms: int = 0,
    ) -> None:
        deadline = self.clock() + self.settings.ack_timeout_ms / 1000
        chunk = self._add_chunk(member, ranges, deliveries, deadline)
        chunk.appended_ms = entries[0].batch.timestamp_ms if entries else 0
        chunk.first_ms = first_ms or int(time.time() * 1000)  # once per chunk, not per message
        for entry in entries:
            entry.first_ms = chunk.first_ms
        plans.add(member, entries, chunk)

    def _add_chunk(
        self, member: Member, ranges: list[Range], deliveries: int, deadline: float, *, count_in_flight: bool = True
    ) -> Chunk:
        chunk = Chunk(next(_chunk_ids), member, ranges, deliveries, deadline)
        self.chunks[chunk.id] = chunk
        member.chunks[chunk.id] = chunk
        if count_in_flight:
            member.in_flight += chunk.size
        heapq.heappush(self._leases, (deadline, chunk.id))
        return chunk

    def _dispatch_pending(self, log: TopicLog, plans: Plans) -> None:
        now = self.clock()
        still: list[Pending] = []  # not due, or dead: kept as they are
        due: list[Pending] = []
        for p in self.pending:
            (still if p.not_before > now or p.dead else due).append(p)
        for item in sorted(due, key=lambda p: p.ranges[0][0]):
            remaining = self._redeliver(log, item, plans)
            if remaining:
                still.append(
                    Pending(remaining, item.deliveries, item.not_before, item.last_error, item.avoid, item.first_ms)
                )
        self.pending = still

    def _redeliver(self, log: TopicLog, item: Pending, plans: Plans) -> list[Range]:
        ranges = [r for r in item.ranges if r[1] > log.start_offset]
        ranges = [(max(a, log.start_offset), b) for a, b in ranges]  # retention took the rest
        while ranges:  # each turn takes at least one offset: it ends
            member = next(self._members_with_credit(item.avoid), None)
            if member is None:
                break
            taken, ranges = _take_prefix(ranges, min(member.available, member.batch_size))
            found = (e for a, b in taken for e in self._entries_due(log, a, b, item))
            entries = list(itertools.islice(found, MAX_ENTRIES + 1))  # read no further than one DELIVER holds
            if len(entries) > MAX_ENTRIES:  # many small batches: the rest goes in the next DELIVER
                taken, rest = _split_at(taken, entries[MAX_ENTRIES].first)
                ranges = rest + ranges
                entries = entries[:MAX_ENTRIES]
            if entries:  # offsets of a gap in the log (lost to a power cut) are skipped: nothing to hold
                self._record(member, _covered(entries), item.deliveries + 1, entries, plans, item.first_ms)
                self._advance_rr(member)
        return ranges

    def _entries_due(self, log: TopicLog, start: int, end: int, item: Pending) -> Iterator[Entry]:
        """``entries_for`` the redelivery of ``item``, less timed batches not due yet or expired (``_timed``)."""
        for batch in _batches_between(log, start, end):
            first, last = max(start, batch.base_offset), min(end, batch.next_offset)
            if batch.body[0] == TIMED_MARK and self._timed(batch, first, last, item.deliveries, item.first_ms):
                continue
            yield slice_entry(batch, first, last, item.deliveries + 1)

    # --- delayed and expiring batches -----------------------------------------------------

    def _timed(
        self, batch: Batch, first: int, end: int, deliveries: int, first_ms: int, blocked: set[Any] | None = None
    ) -> bool:
        """``[first, end)`` of a timed batch, about to be delivered: True if it is not, because it is not due
        yet (held back in ``waiting`` until its not-before time, its delivery not counted) or expired (a dead
        letter, reason ``expired``). False for a batch without times, or due and unexpired: deliver it.

        Called only for a body marked timed (``TIMED_MARK``): other batches pay one byte compare. Key
        affinity (``blocked`` given): a held batch's keys are blocked, so later messages of those keys wait
        behind it, as behind a delayed redelivery.
        """
        times = batch_times(batch.body)
        if times is None:
            return False
        not_before, expires = times
        now_ms = self.wall_ms()
        if expires and now_ms >= expires:
            self.dead.append(DeadLetter([(first, end)], deliveries, EXPIRED, False, b"", first_ms, expired=True))
            return True
        if not_before <= now_ms:
            return False
        keys = None
        if blocked is not None:
            records = unpack_records(batch.body)
            keys = frozenset(r[0] for r in records[first - batch.base_offset : end - batch.base_offset])
            blocked |= keys
        due = self.clock() + (not_before - now_ms) / 1000
        self._wait(Pending([(first, end)], deliveries, due, WAITING, b"", first_ms, keys=keys))
        return True

    def _wait(self, item: Pending) -> None:
        """Hold ``item`` back until its ``not_before`` (in ``waiting``, the heap a dispatch looks at the top of)."""
        heapq.heappush(self.waiting, (item.not_before, next(_wait_ids), item))
        if item.keys:
            self._waiting_keys.update(item.keys)

    def _release_waiting(self, now: float) -> None:
        """Held-back batches now due join ``pending``: delivered (or found expired) like any redelivery."""
        while self.waiting and self.waiting[0][0] <= now:
            item = heapq.heappop(self.waiting)[2]
            counts = self._waiting_keys
            for key in item.keys or ():
                if counts[key] > 1:
                    counts[key] -= 1
                else:
                    counts.pop(key, None)  # no batch holds it any more: later messages of it flow
            if item.ranges:
                self.pending.append(item)

    def _count_waiting_keys(self) -> None:
        self._waiting_keys = Counter(k for w in self.waiting for k in (w[2].keys or ()))

    # --- key affinity ------------------------------------------------------------------

    def owner(self, key: bytes | None) -> Member:
        """Rendezvous hashing: a key stays with its member while that member lives."""
        if key is None:
            key = b""
        return max(self.members, key=lambda m: hash((key, m.key)))

    def _dispatch_keyed_all(self, log: TopicLog, plans: Plans, max_bytes: int) -> None:
        """Key affinity: redeliveries and new messages in offset order, each key behind its own.

        A message whose key has an earlier message waiting for a delayed
        redelivery waits too (held, never delivered, so never counted); other
        keys flow. Waiting items are walked range by range in offset order
        across items, so a chunk split by a partial nack or IN_PROGRESS never
        sends a key's later message ahead of an earlier one.
        """
        now = self.clock()
        if self._waiting_keys_stale:  # key affinity came on while batches waited: which keys do they hold?
            for _due, _id, waiting in self.waiting:
                self._keys_of(log, waiting)
            self._count_waiting_keys()
            self._waiting_keys_stale = False
        blocked: set[Any] = set(self._waiting_keys)  # later messages of a held-back batch's keys wait behind it
        out: list[Pending] = []
        due: list[Pending] = []
        for item in self.pending:
            if item.dead:
                out.append(item)  # a dead letter waiting for its topic: never delivered again
            elif item.not_before > now:
                blocked |= self._keys_of(log, item)
                out.append(item)
            else:
                due.append(item)
        segments: list[tuple[int, int, Pending]] = []
        for item in due:
            if item.keys is not None and item.keys <= blocked:  # all of it waits: no need to read it
                item.held = True
                out.append(item)
            else:
                segments += [(a, b, item) for a, b in item.ranges]
        segments.sort(key=_segment_start)
        kept: dict[int, tuple[Pending, list[Range], bool]] = {}  # id(item) -> item, kept ranges, by credit
        stopped = False
        for a, b, item in segments:
            keep = kept.setdefault(id(item), (item, [], False))
            if stopped:
                keep[1].append((a, b))
                kept[id(item)] = (item, keep[1], True)
                continue
            held: list[int] = []
            stop = self._route_range(log, max(a, log.start_offset), b, item, plans, blocked, held)
            keep[1].extend(to_ranges(held))
            if stop is not None:
                keep[1].append((stop, b))
                kept[id(item)] = (item, keep[1], True)
                stopped = True  # a member ran out of credit: order beats throughput, the rest waits
        for item, ranges, by_credit in kept.values():
            ranges = normalize(ranges)
            if ranges:
                out.append(
                    Pending(
                        ranges,
                        item.deliveries,
                        item.not_before,
                        item.last_error,
                        item.avoid,
                        item.first_ms,
                        held=not by_credit,
                        keys=item.keys,
                    )
                )
        self.pending = out
        if not stopped:
            self._dispatch_keyed(log, plans, max_bytes, blocked)

    def _keys_of(self, log: TopicLog, item: Pending) -> frozenset[Any]:
        """The keys of a pending item's messages, read from the log once."""
        if item.keys is None:
            keys: set[Any] = set()
            for start, end in item.ranges:
                start = max(start, log.start_offset)
                for batch in _batches_between(log, start, end):
                    records = unpack_records(batch.body)
                    first, last = max(start, batch.base_offset), min(end, batch.next_offset)
                    keys.update(r[0] for r in records[first - batch.base_offset : last - batch.base_offset])
            item.keys = frozenset(keys)
        return item.keys

    def _route_range(
        self, log: TopicLog, start: int, end: int, item: Pending, plans: Plans, blocked: set[Any], held: list[int]
    ) -> int | None:
        """Route ``[start, end)`` of a waiting item; the offset where credit ran out, or None."""
        for batch in _batches_between(log, start, end):
            first, last = max(start, batch.base_offset), min(batch.next_offset, end)
            stopped = self._route_keyed(batch, first, last, item.deliveries + 1, plans, blocked, held, item.first_ms)
            if stopped is not None:
                return stopped
        return None

    def _dispatch_keyed(self, log: TopicLog, plans: Plans, max_bytes: int, blocked: set[Any]) -> None:
        limit = log.visible_offset
        held: list[int] = []
        while self.next_offset < limit:
            batches = log.read(self.next_offset, max_bytes=max_bytes)
            if not batches or not self._give_keyed(batches, limit, plans, blocked, held):
                break
        if held:  # new messages behind a waiting message of their key: delivered with it, uncounted till then
            keys = frozenset(blocked)  # a superset of their keys
            self.pending.append(Pending(to_ranges(held), 0, self.clock(), "", b"", 0, held=True, keys=keys))

    def _give_keyed(self, batches: list[Batch], limit: int, plans: Plans, blocked: set[Any], held: list[int]) -> bool:
        """Route each message to its key's owner, in offset order, until one lacks credit."""
        for batch in batches:
            end = min(batch.next_offset, limit)
            start = max(self.next_offset, batch.base_offset)
            stopped = self._route_keyed(batch, start, end, 1, plans, blocked, held)
            self.next_offset = max(self.next_offset, end if stopped is None else stopped)
            if stopped is not None:
                return False  # head-of-line: order beats throughput here
        return True

    def _route_keyed(
        self,
        batch: Batch,
        start: int,
        end: int,
        deliveries: int,
        plans: Plans,
        blocked: set[Any] | None = None,
        held: list[int] | None = None,
        first_ms: int = 0,
    ) -> int | None:
        """Plan ``[start, end)`` of a batch to its keys' owners; the offset where one ran out of credit, or None.

        Offsets whose key is in ``blocked`` go to ``held`` instead; a timed batch not due yet is held back
        whole (``_timed``), and its keys join ``blocked``.
        """
        if batch.body[0] == TIMED_MARK and self._timed(batch, start, end, deliveries - 1, first_ms, blocked):
            return None
        records = unpack_records(batch.body)
        keys = [record[0] for record in records]
        picked: dict[int, tuple[Member, list[int]]] = {}
        for offset in range(start, end):
            key = keys[offset - batch.base_offset]
            if blocked and key in blocked:
                assert held is not None
                held.append(offset)
                continue
            member = self.owner(key)
            _, offsets = picked.setdefault(id(member), (member, []))
            if member.available - len(offsets) <= 0:
                self._flush_keyed(batch, records, picked, deliveries, plans, first_ms)
                return offset
            offsets.append(offset)
            if len(offsets) >= MAX_LISTED_OFFSETS:
                self._flush_keyed(batch, records, picked, deliveries, plans, first_ms)
        self._flush_keyed(batch, records, picked, deliveries, plans, first_ms)
        return None

    def _flush_keyed(
        self,
        batch: Batch,
        records: Sequence[Any],
        picked: dict[int, tuple[Member, list[int]]],
        deliveries: int,
        plans: Plans,
        first_ms: int = 0,
    ) -> None:
        for member, offsets in picked.values():
            if offsets:
                # A slice of the body: a batch split over several entries is not sent whole with each.
                entry = slice_entry(batch, offsets[0], offsets[-1] + 1, deliveries, records)
                entry.offsets = list(offsets)
                self._record(member, to_ranges(offsets), deliveries, [entry], plans, first_ms)
                offsets.clear()  # recorded: the member's next offsets in this batch start a new entry

    # --- dead letters ------------------------------------------------------------------

    def take_dead(self, start: int = 0) -> list[DeadLetter]:
        """The dead letters to store; those below the log ``start`` are gone already (skipped)."""
        self.skip_retained(start)
        dead, self.dead = self.dead, []
        return dead


def _segment_start(segment: tuple[int, int, Pending]) -> int:
    return segment[0]


def _cut_below(held: Sequence[Pending | DeadLetter], start: int) -> int:
    """Remove every offset below ``start`` from each item's ranges; return how many went."""
    cut = 0
    for item in held:
        item.ranges, gone = subtract(item.ranges, [(0, start)])
        cut += gone
    return cut


def _take_prefix(ranges: list[Range], n: int) -> tuple[list[Range], list[Range]]:
    taken: list[Range] = []
    rest = list(ranges)
    while rest and n > 0:
        a, b = rest.pop(0)
        if b - a > n:
            taken.append((a, a + n))
            rest.insert(0, (a + n, b))
            n = 0
        else:
            taken.append((a, b))
            n -= b - a
    return taken, rest


def _overlaps(member: Member, ranges: list[Range]) -> list[tuple[Chunk, list[Range]]]:
    """Each of the member's chunks with the part of ``ranges`` (as a client sent them) that can touch it."""
    ranges = normalize(ranges)
    starts = [start for start, _ in ranges]
    found = []
    for chunk in list(member.chunks.values()):
        if chunk.ranges:
            part = window(ranges, starts, chunk.ranges[0][0], chunk.ranges[-1][1])
            if part:
                found.append((chunk, part))
    return found


def _split_at(ranges: list[Range], cut: int) -> tuple[list[Range], list[Range]]:
    """``ranges`` below ``cut`` and from ``cut`` on."""
    before = [(a, min(b, cut)) for a, b in ranges if a < cut]
    after = [(max(a, cut), b) for a, b in ranges if b > cut]
    return before, after


def _batches_between(log: TopicLog, start: int, end: int) -> Iterator[Batch]:
    """Stored batches holding ``[start, end)``; what retention deleted is not there to read."""
    offset = max(start, log.start_offset)
    while offset < end:
        batches = log.read(offset, max_bytes=1 << 20)
        if not batches:
            return
        for batch in batches:
            if batch.base_offset >= end:
                return
            yield batch
            offset = batch.next_offset


def _covered(entries: list[Entry]) -> list[Range]:
    """The offsets entries carry: what a member holds, without the gaps a power cut left in the log."""
    return normalize([(e.first, e.end) for e in entries])


def entries_for(log: TopicLog, start: int, end: int, deliveries: int) -> Iterator[Entry]:
    for batch in _batches_between(log, start, end):
        yield slice_entry(batch, max(start, batch.base_offset), min(end, batch.next_offset), deliveries)


def slice_entry(batch: Batch, first: int, end: int, deliveries: int, records: Sequence[Any] | None = None) -> Entry:
    """An entry for ``[first, end)`` of a batch; re-encode only a small slice.

    Forwarding the stored body costs nothing but bandwidth; when the slice is
    under half of a large batch, re-packing just the slice is cheaper.
    ``records``: the batch already unpacked, if the caller has it.
    """
    if batch.count > 16 and (end - first) * 2 < batch.count:
        if records is None:
            records = unpack_records(batch.body)
        body = pack_records(list(records[first - batch.base_offset : end - batch.base_offset]))
        batch = Batch(first, end - first, batch.timestamp_ms, body)
    return Entry(batch, first, end, deliveries)


def records_in(batch: Batch, ranges: list[Range]) -> list[tuple[int, Any]]:
    """(offset, record) pairs of a batch that fall inside ``ranges``."""
    records = msgpack.unpackb(batch.body, raw=True, use_list=False, strict_map_key=False)
    return [
        (offset, records[offset - batch.base_offset])
        for start, end in ranges
        for offset in range(max(start, batch.base_offset), min(end, batch.next_offset))
    ]
