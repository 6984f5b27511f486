"""Consumer groups: who holds which offsets, and who gets the next batch.

No sockets here. A ``Group`` turns "the log grew" or "a member has credit"
into ``Delivery`` plans, and acks, nacks, lease expiry and departures into
state changes. In-flight work is tracked per delivered chunk as offset
ranges, never per message, so a whole-batch ack is O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from broker.ranges import Range, count, intersect, normalize, subtract, to_ranges, window
from broker.record import Batch, pack_records, unpack_records
from broker.storage import TopicLog


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


@dataclass(slots=True)
class Entry:
    """One batch (or a slice of one) inside a DELIVER."""

    batch: Batch
    first: int
    end: int
    deliveries: int
    offsets: list[int] | None = None  # a non-contiguous subset (key affinity)

    def header(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "b": self.batch.base_offset,
            "n": self.batch.count,
            "t": self.batch.timestamp_ms,
            "f": self.first,
            "e": self.end,
            "d": self.deliveries,
        }
        if self.offsets is not None:
            head["o"] = self.offsets
        return head


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


_chunk_ids = itertools.count(1)


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

    def apply_settings(self, settings: GroupSettings) -> None:
        """New settings from a newer subscription: leases and deliveries from now on follow them."""
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
            self._requeue(chunk.ranges, chunk.deliveries, now, reason, member.key)

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
        for chunk_ranges, deliveries in taken:
            counted = deliveries - 1 if release else deliveries
            self._requeue(chunk_ranges, counted, now + delay_ms / 1000, error, member.key)
        return sum(count(rs) for rs, _d in taken)

    def terminate(self, member: Member, ranges: list[Range], reason: str) -> int:
        taken = self._take(member, ranges)
        for chunk_ranges, deliveries in taken:
            self.dead.append(DeadLetter(chunk_ranges, deliveries, reason))
        return sum(count(rs) for rs, _d in taken)

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
                chunk = self._add_chunk(member, picked, chunk.deliveries, deadline, count_in_flight=False)
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
                self.pending.append(Pending(chunk.ranges, chunk.deliveries - 1, self.clock(), "", plan.member.key))

    def _take(self, member: Member, ranges: list[Range]) -> list[tuple[list[Range], int]]:
        """Remove ``ranges`` from the member's chunks, keeping their delivery counts."""
        taken: list[tuple[list[Range], int]] = []
        for chunk, asked in _overlaps(member, ranges):
            picked = intersect(chunk.ranges, asked)
            if picked:
                chunk.ranges, removed = subtract(chunk.ranges, picked)
                member.in_flight -= removed
                taken.append((picked, chunk.deliveries))
                if not chunk.ranges:
                    self._drop_chunk(chunk, keep_inflight=True)
        return taken

    def _drop_chunk(self, chunk: Chunk, *, keep_inflight: bool = False) -> None:
        self.chunks.pop(chunk.id, None)
        chunk.member.chunks.pop(chunk.id, None)
        if not keep_inflight:
            chunk.member.in_flight -= chunk.size

    def _requeue(self, ranges: list[Range], deliveries: int, not_before: float, error: str, avoid: bytes) -> None:
        if not ranges:
            return
        if deliveries >= self.settings.max_deliveries:
            self.dead.append(DeadLetter(ranges, deliveries, error))
            return
        self.pending.append(Pending(list(ranges), deliveries, not_before, error, avoid))

    # --- time ------------------------------------------------------------------------

    def expire_leases(self) -> int:
        """Redeliver chunks whose ack timeout passed; return how many messages."""
        now = self.clock()
        expired = 0
        while self._leases and self._leases[0][0] <= now:
            deadline, chunk_id = heapq.heappop(self._leases)
            chunk = self.chunks.get(chunk_id)
            if chunk is None or chunk.deadline != deadline:
                continue  # settled or renewed since
            expired += chunk.size
            self._drop_chunk(chunk)
            self._requeue(chunk.ranges, chunk.deliveries, now, "lease expired", chunk.member.key)
        return expired

    def next_deadline(self) -> float | None:
        while self._leases and self._leases[0][1] not in self.chunks:
            heapq.heappop(self._leases)
        times = [self._leases[0][0]] if self._leases else []
        times += [p.not_before for p in self.pending]
        return min(times) if times else None

    # --- offsets -------------------------------------------------------------------------

    @property
    def committed_offset(self) -> int:
        """The lowest offset not yet settled: where a restarted group resumes."""
        low = self.next_offset
        # list() copies atomically: the metrics thread reads this while the loop changes it.
        for chunk in list(self.chunks.values()):
            ranges = chunk.ranges
            if ranges:
                low = min(low, ranges[0][0])
        for pending in list(self.pending):
            if pending.ranges:
                low = min(low, pending.ranges[0][0])
        return low

    @property
    def in_flight(self) -> int:
        return sum(m.in_flight for m in list(self.members))

    @property
    def pending_messages(self) -> int:
        """Offsets waiting to be redelivered (nacked, expired, or dead letters that could not be stored)."""
        return sum(count(p.ranges) for p in list(self.pending))

    def reset(self, offset: int) -> None:
        """Move the group; in-flight and pending work is forgotten."""
        for chunk in list(self.chunks.values()):
            self._drop_chunk(chunk)
        self.pending.clear()
        self._leases.clear()
        self.next_offset = offset

    # --- dispatch ------------------------------------------------------------------------

    def dispatch(self, log: TopicLog, *, max_bytes: int = 1 << 20) -> list[Delivery]:
        """Plan deliveries for everything deliverable now, round-robin by credit."""
        if self.next_offset >= log.durable_offset and not self.pending and not self.joining:
            return []  # the common case after an ack: credit came back, nothing new waits
        self._admit_joiners()
        if not self.members:
            return []
        plans = Plans()
        if self.pending:
            self._dispatch_pending(log, plans)
        if self.settings.key_affinity:
            if not self.pending:
                self._dispatch_keyed(log, plans, max_bytes)
        else:
            self._dispatch_new(log, plans, max_bytes)
        return plans.all

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
        limit = log.durable_offset
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
        start = self.next_offset
        for batch in batches:
            first = max(self.next_offset, batch.base_offset)
            end = min(batch.next_offset, first + take, limit)
            if end <= first:
                break
            entries.append(slice_entry(batch, first, end, 1))
            take -= end - first
            self.next_offset = end
            if take <= 0 or len(entries) >= MAX_ENTRIES:
                break
        if entries:
            self._record(member, [(start, self.next_offset)], 1, entries, plans)
            self._advance_rr(member)

    def _record(self, member: Member, ranges: list[Range], deliveries: int, entries: list[Entry], plans: Plans) -> None:
        deadline = self.clock() + self.settings.ack_timeout_ms / 1000
        chunk = self._add_chunk(member, ranges, deliveries, deadline)
        chunk.appended_ms = entries[0].batch.timestamp_ms if entries else 0
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
        still: list[Pending] = []
        for item in sorted(self.pending, key=lambda p: p.ranges[0][0]):
            if item.not_before > now:
                still.append(item)
                continue
            remaining = self._redeliver(log, item, plans)
            if remaining:
                still.append(Pending(remaining, item.deliveries, item.not_before, item.last_error, item.avoid))
        self.pending = still

    def _redeliver(self, log: TopicLog, item: Pending, plans: Plans) -> list[Range]:
        ranges = [r for r in item.ranges if r[1] > log.start_offset]
        ranges = [(max(a, log.start_offset), b) for a, b in ranges]  # retention took the rest
        if self.settings.key_affinity:
            return self._redeliver_keyed(log, item, ranges, plans)
        while ranges:  # each turn takes at least one offset: it ends
            member = next(self._members_with_credit(item.avoid), None)
            if member is None:
                break
            taken, ranges = _take_prefix(ranges, min(member.available, member.batch_size))
            found = (e for a, b in taken for e in _entries_for(log, a, b, item.deliveries + 1))
            entries = list(itertools.islice(found, MAX_ENTRIES + 1))  # read no further than one DELIVER holds
            if len(entries) > MAX_ENTRIES:  # many small batches: the rest goes in the next DELIVER
                taken, rest = _split_at(taken, entries[MAX_ENTRIES].first)
                ranges = rest + ranges
                entries = entries[:MAX_ENTRIES]
            self._record(member, taken, item.deliveries + 1, entries, plans)
            self._advance_rr(member)
        return ranges

    # --- key affinity ------------------------------------------------------------------

    def owner(self, key: bytes | None) -> Member:
        """Rendezvous hashing: a key stays with its member while that member lives."""
        if key is None:
            key = b""
        return max(self.members, key=lambda m: hash((key, m.key)))

    def _dispatch_keyed(self, log: TopicLog, plans: Plans, max_bytes: int) -> None:
        limit = log.durable_offset
        while self.next_offset < limit:
            batches = log.read(self.next_offset, max_bytes=max_bytes)
            if not batches or not self._give_keyed(batches, limit, 1, plans):
                return

    def _give_keyed(self, batches: list[Batch], limit: int, deliveries: int, plans: Plans) -> bool:
        """Route each message to its key's owner, in offset order, until one lacks credit."""
        for batch in batches:
            end = min(batch.next_offset, limit)
            stopped = self._route_keyed(batch, max(self.next_offset, batch.base_offset), end, deliveries, plans)
            self.next_offset = max(self.next_offset, end if stopped is None else stopped)
            if stopped is not None:
                return False  # head-of-line: order beats throughput here
        return True

    def _route_keyed(self, batch: Batch, start: int, end: int, deliveries: int, plans: Plans) -> int | None:
        """Plan ``[start, end)`` of a batch to its keys' owners; the offset where one ran out of credit, or None."""
        records = unpack_records(batch.body)
        keys = [record[0] for record in records]
        picked: dict[int, tuple[Member, list[int]]] = {}
        for offset in range(start, end):
            member = self.owner(keys[offset - batch.base_offset])
            _, offsets = picked.setdefault(id(member), (member, []))
            if member.available - len(offsets) <= 0:
                self._flush_keyed(batch, records, picked, deliveries, plans)
                return offset
            offsets.append(offset)
            if len(offsets) >= MAX_LISTED_OFFSETS:
                self._flush_keyed(batch, records, picked, deliveries, plans)
        self._flush_keyed(batch, records, picked, deliveries, plans)
        return None

    def _flush_keyed(
        self,
        batch: Batch,
        records: Sequence[Any],
        picked: dict[int, tuple[Member, list[int]]],
        deliveries: int,
        plans: Plans,
    ) -> None:
        for member, offsets in picked.values():
            if offsets:
                # A slice of the body: a batch split over several entries is not sent whole with each.
                entry = slice_entry(batch, offsets[0], offsets[-1] + 1, deliveries, records)
                entry.offsets = list(offsets)
                self._record(member, to_ranges(offsets), deliveries, [entry], plans)
                offsets.clear()  # recorded: the member's next offsets in this batch start a new entry

    def _redeliver_keyed(self, log: TopicLog, item: Pending, ranges: list[Range], plans: Plans) -> list[Range]:
        for i, (start, end) in enumerate(ranges):
            for batch in _batches_between(log, start, end):
                first, last = max(start, batch.base_offset), min(batch.next_offset, end)
                stopped = self._route_keyed(batch, first, last, item.deliveries + 1, plans)
                if stopped is not None:
                    return [(stopped, end), *ranges[i + 1 :]]
        return []

    # --- dead letters ------------------------------------------------------------------

    def take_dead(self) -> list[DeadLetter]:
        dead, self.dead = self.dead, []
        return dead


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
    offset = start
    while offset < end:
        batches = log.read(offset, max_bytes=1 << 20)
        if not batches:
            return
        for batch in batches:
            if batch.base_offset >= end:
                return
            yield batch
            offset = batch.next_offset


def _entries_for(log: TopicLog, start: int, end: int, deliveries: int) -> Iterator[Entry]:
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
