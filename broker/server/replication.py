"""The leader side of a replicated partition: what each follower has, the high watermark, the ISR.

A follower's FETCH says where its log ends (``offset``) and how far it is
durable (``durable``). The leader keeps a ``FollowerState`` per follower and
moves the high watermark to the smallest durable end over the in-sync
replicas, its own included: a confirm, a delivery or a consumer's FETCH
sees nothing above it, so whatever a client was told survives the loss of
any replica but the last in-sync one. HW moves only while the ISR has at
least ``min_insync_replicas`` members, and never backwards.

ISR changes are only *proposed* here (the cluster agent writes them to etcd
by CAS): an expansion counts at once (more members can only lower HW), a
shrink only once the agent reports it written, so a leader cut off from
etcd keeps waiting for the follower it can no longer drop.

The decisions are the pure functions at the top; ``PartitionLeader`` holds
the state of one partition and calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from conveyor.errors import FencedLeaderEpoch, NotEnoughReplicas, UnknownLeaderEpoch
from conveyor.names import split_log

log = logging.getLogger("conveyor.replication")

# --- the decisions (pure) ------------------------------------------------------------------


def caught_up_time(
    fetch_offset: int, now: float, *, leader_end: int, previous_fetch: float, end_at_previous_fetch: int, last: float
) -> float:
    """When the follower was last caught up, after a fetch at ``fetch_offset`` (Kafka's ``lastCaughtUpTime``).

    At the leader's end now: caught up now. At or past where the leader ended at the
    follower's previous fetch: caught up as of that fetch. Otherwise unchanged: a follower
    that keeps fetching but never reaches the end falls behind by the time it takes.
    """
    if fetch_offset >= leader_end:
        return now
    if fetch_offset >= end_at_previous_fetch:
        return max(last, previous_fetch)
    return last


def high_watermark(durable: Mapping[str, int], isr: Iterable[str], current: int) -> int:
    """The smallest durable end over the ``isr`` (every member must be in ``durable``); never below ``current``."""
    ends = [durable.get(node, 0) for node in isr]
    return max(current, min(ends)) if ends else current


def may_advance(isr_size: int, min_insync: int) -> bool:
    """HW moves (and PUBLISH is taken) only while enough replicas are in sync."""
    return isr_size >= min_insync


def lagging(
    last_caught_up: Mapping[str, float], isr: Iterable[str], leader: str, now: float, lag_max: float
) -> list[str]:
    """ISR followers not caught up within ``lag_max`` seconds: the shrink to propose."""
    return sorted(node for node in isr if node != leader and now - last_caught_up.get(node, now) > lag_max)


def rejoining(
    durable: Mapping[str, int], replicas: Iterable[str], isr: Iterable[str], hw: int, epoch_start: int
) -> list[str]:
    """Replicas out of the ISR whose durable end reached HW and the start of this leader's epoch."""
    members = set(isr)
    return sorted(node for node in replicas if node not in members and durable.get(node, -1) >= max(hw, epoch_start))


def check_epoch(theirs: int | None, mine: int) -> None:
    """A request naming another leader epoch than this node's view is refused (it carries none: no check).

    Newer: this node's view is stale (``FENCED_LEADER_EPOCH``); older: the sender's is (``UNKNOWN_LEADER_EPOCH``).
    """
    if theirs is None or theirs == mine:
        return
    if theirs > mine:
        raise FencedLeaderEpoch(f"leader epoch {theirs} is newer than this node's {mine}", leader_epoch=mine)
    raise UnknownLeaderEpoch(f"leader epoch {theirs} is older than this leader's {mine}", leader_epoch=mine)


def diverging(found: tuple[int, int], last_epoch: int | None, offset: int) -> dict[str, int] | None:
    """Where a follower at ``offset`` whose last batch has ``last_epoch`` must truncate to, or None.

    ``found`` is the leader's ``LeaderEpochCache.end_offset_for(last_epoch)``: the largest
    epoch it knows that is not newer, and where that epoch ended in its log. The logs
    agree up to the follower's end only when it is that very epoch and the follower
    does not go past its end; otherwise the follower holds batches the leader never had
    (KIP-101). A follower with no epoch (empty, or written outside a cluster) or one
    newer than anything the leader knows is not checked (the epoch checks fence that).
    """
    if not last_epoch or offset == 0:
        return None
    epoch, end = found
    if epoch < 0 or (epoch == last_epoch and offset <= end):
        return None
    return {"epoch": epoch, "end_offset": min(end, offset)}


def truncation_offset(answer: Mapping[str, int], own: tuple[int, int]) -> int:
    """Where a follower cuts its log on a ``diverging`` answer (KIP-279).

    ``own`` is the follower's own ``end_offset_for(answer["epoch"])``: its copy of that
    epoch may end before the leader's (it wrote a later epoch of its own from there),
    so it cuts at the smaller of the two ends.
    """
    own_epoch, own_end = own
    end = int(answer["end_offset"])
    return end if own_epoch < 0 else min(end, own_end)


# --- one led partition -------------------------------------------------------------------------


@dataclass(slots=True)
class FollowerState:
    """What the leader knows of one follower of one partition, from its FETCHes."""

    node: str
    fetch_offset: int = 0  # where its log ended at its last fetch
    durable: int = 0  # how far its log was durable at its last fetch
    last_fetch: float = 0.0
    end_at_last_fetch: int = 0  # the leader's end offset when that fetch came
    last_caught_up: float = 0.0


@dataclass(frozen=True, slots=True)
class IsrChange:
    """An ISR the leader wants written (by CAS, with its epoch): the agent reports back with ``isr_written``."""

    topic: str
    partition: int
    leader_epoch: int
    isr: tuple[str, ...]
    shrink: bool


Propose = Callable[[IsrChange], None]


@dataclass
class PartitionLeader:
    """The leader's state for one (topic, partition); the clock is the broker's monotonic one."""

    topic: str
    partition: int
    node: str
    epoch: int
    replicas: tuple[str, ...]
    isr: set[str]
    min_insync: int
    lag_max: float  # seconds: replica_lag_max_ms
    propose: Propose
    epoch_start: int = 0  # this leader's end offset when it took over
    hw: int = 0
    followers: dict[str, FollowerState] = field(default_factory=dict)
    pending: IsrChange | None = None  # proposed, not written yet
    written: set[str] = field(default_factory=set)  # the ISR etcd holds, as far as this leader knows

    def __post_init__(self) -> None:
        self.isr.add(self.node)
        self.written = set(self.isr)
        for node in self.replicas:
            if node != self.node:
                self.followers[node] = FollowerState(node)

    def on_fetch(self, node: str, offset: int, durable: int, leader_end: int, now: float) -> None:
        """Record a follower's FETCH (``leader_end``: this log's end offset as it came)."""
        state = self.followers.get(node)
        if state is None:
            state = self.followers[node] = FollowerState(node, last_caught_up=now)
        state.last_caught_up = caught_up_time(
            offset,
            now,
            leader_end=leader_end,
            previous_fetch=state.last_fetch,
            end_at_previous_fetch=state.end_at_last_fetch,
            last=state.last_caught_up,
        )
        state.fetch_offset = offset
        state.last_fetch = now
        state.end_at_last_fetch = leader_end
        self._durable(state, offset, durable)

    def on_report(self, node: str, offset: int, durable: int) -> None:
        """Record a follower's durable end, reported while its FETCH is parked (its fetch times stay)."""
        state = self.followers.get(node)
        if state is not None:
            self._durable(state, offset, durable)

    def _durable(self, state: FollowerState, offset: int, durable: int) -> None:
        state.durable = min(durable, offset)
        node = state.node
        if node not in self.isr and node in self.rejoin_candidates():
            self._propose(self.isr | {node}, shrink=False)
            self.isr.add(node)  # an expansion counts at once: it can only lower HW

    def rejoin_candidates(self) -> list[str]:
        durable = {n: s.durable for n, s in self.followers.items()}
        return rejoining(durable, self.replicas, self.isr, self.hw, self.epoch_start)

    def update_hw(self, leader_durable: int) -> bool:
        """Recompute HW from the ISR's durable ends (``leader_durable``: this node's); whether it moved."""
        if not may_advance(len(self.isr), self.min_insync):
            return False
        durable = {n: s.durable for n, s in self.followers.items()}
        durable[self.node] = leader_durable
        hw = high_watermark(durable, self.isr, self.hw)
        moved = hw > self.hw
        self.hw = hw
        return moved

    def check_lag(self, now: float) -> None:
        """Propose dropping the ISR followers that lag past ``lag_max`` (one proposal in flight at a time)."""
        if self.pending is not None:
            return
        late = lagging({n: s.last_caught_up for n, s in self.followers.items()}, self.isr, self.node, now, self.lag_max)
        if late:
            log.warning("%s/%d: followers %s lag; proposing to drop them", self.topic, self.partition, late)
            self._propose(self.isr - set(late), shrink=True)
        elif self.isr != self.written:  # a rejoin counted here that etcd refused or never got: write it again
            self._propose(set(self.isr), shrink=False, track=True)

    def follower_gone(self, node: str) -> None:
        """A follower's node left the cluster: propose dropping it now, not after ``lag_max``."""
        if node in self.isr and node != self.node and self.pending is None:
            self._propose(self.isr - {node}, shrink=True)

    def isr_written(self, isr: Iterable[str]) -> None:
        """The agent wrote an ISR (or etcd holds another one): it is the ISR from now on."""
        self.isr = set(isr) | {self.node}
        self.written = set(self.isr)
        self.pending = None

    def isr_refused(self) -> None:
        """The CAS failed (or etcd is away): the ISR stays as it was; a later check proposes again."""
        self.pending = None

    def check_publish(self) -> None:
        if not may_advance(len(self.isr), self.min_insync):
            name, number = split_log(self.topic)  # the log T#k is partition k of T
            raise NotEnoughReplicas(
                f"{name}/{number}: {len(self.isr)} in-sync replicas, {self.min_insync} needed",
                topic=name,
                partition=number,
                isr=sorted(self.isr),
                min_insync_replicas=self.min_insync,
            )

    def successor(self, leader_end: int) -> str | None:
        """An in-sync follower whose durable end reached ``leader_end`` (a controlled shutdown hands over to it)."""
        ready = [n for n, s in self.followers.items() if n in self.isr and s.durable >= leader_end]
        return min(ready) if ready else None

    def now_caught_up(self, now: float) -> None:
        """Every follower counts as caught up now (a new leadership starts their clocks)."""
        for state in self.followers.values():
            state.last_caught_up = now
            state.last_fetch = now

    def _propose(self, isr: set[str], *, shrink: bool, track: bool = False) -> None:
        """Hand an ISR to the agent; a shrink (or a rewrite, ``track``) is pending until it answers."""
        change = IsrChange(self.topic, self.partition, self.epoch, tuple(sorted(isr)), shrink)
        if shrink or track:
            self.pending = change
        self.propose(change)
