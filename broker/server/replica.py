"""The follower side of replicated partitions: fetch from each leader, append at its offsets, report durable.

A node follows some partitions; their leaders are other nodes. It keeps one
``Fetcher`` (one DEALER) per leader node and one long-poll replica FETCH in
flight per partition, naming itself, the leader epoch it follows, the epoch
of its last batch and how far its log is durable. An answer is appended at
the leader's offsets with the batch's producer id and sequence, so that a
producer's resend after a failover is still recognised here. A small answer
(``EARLY_FETCH_BYTES``) that brought this log to the leader's end is followed at once by the next FETCH,
which waits at the leader while this node syncs (what the leader appends
meanwhile comes without waiting for the sync); after the broker's group
commit of that pass a ``report`` FETCH tells the leader the new durable end,
and its high watermark moves on it. Any other answer (catching up, or a
leader appending fast) is followed by one FETCH after the sync, reporting both. ``diverging``
in an answer means this log holds batches the leader never had: it is cut
there and fetched again. The last ``hw`` received is kept: a new leader
starts from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import zmq
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.server.fetcher import Fetcher
from conveyor.broker.server.replication import truncation_offset
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import entries_from_wire
from conveyor.broker.wire.protocol import Command, Frame, error_from_header

log = logging.getLogger("conveyor.replica")

# An answer at most this big that brought the log to the leader's end is followed by a FETCH at once,
# before the sync. A bigger one means the leader appends fast: fetching before the sync would only split
# the same data into more, smaller answers (more FETCHes and fsyncs per message), so it waits for the sync.
EARLY_FETCH_BYTES = 64 << 10
RETRY_AFTER = 0.5  # seconds before fetching again after an error answer (the agent may be moving roles)
# Answers a follower gets while leadership moves (a node restarting or taking over has not applied its
# own record yet, or has not made the log): expected for a moment, so logged at debug; at warning once
# they go on past ``QUIET_SECONDS`` in a row.
MOVING_ROLES = frozenset(
    {"NOT_LEADER", "UNKNOWN_TOPIC", "UNKNOWN_LEADER_EPOCH", "FENCED_LEADER_EPOCH", "SHUTTING_DOWN"}
)
QUIET_SECONDS = 5.0


class ReplicaHost(Protocol):
    """What the follower side needs of its broker (the broker is one)."""

    @property
    def ctx(self) -> zmq.Context[Any]: ...
    @property
    def poller(self) -> zmq.Poller: ...
    @property
    def store(self) -> Store: ...
    @property
    def appended(self) -> set[str]: ...  # topics appended to this pass: the group commit syncs them
    @property
    def max_batch_bytes(self) -> int: ...


@dataclass
class Followed:
    """One partition this node follows."""

    topic: str
    partition: int
    leader: str
    epoch: int
    hw: int = 0  # the leader's high watermark in its last answer
    rid: int | None = None  # the FETCH in flight
    due: bool = False  # an answer was applied: fetch again after this pass's sync
    retry_at: float | None = None  # an error answer: fetch again then
    reported_durable: int = 0  # the durable end the last FETCH told the leader
    fetched_batches: int = 0
    truncations: int = 0
    failing_since: float | None = None  # the first of the error answers in a row


@dataclass
class LeaderLink:
    """One leader node: its link and the partitions this node follows from it."""

    fetcher: Fetcher
    partitions: dict[tuple[str, int], Followed] = field(default_factory=dict)


class Replicas:
    """Every partition this node follows, grouped by leader node."""

    def __init__(
        self,
        host: ReplicaHost,
        node_id: str,
        *,
        wait_ms: int = 500,
        max_bytes: int = 4 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.node_id = node_id
        self.wait_ms = wait_ms
        self.max_bytes = max_bytes
        self.clock = clock
        self.links: dict[str, LeaderLink] = {}
        self.quiet_seconds = QUIET_SECONDS
        self._retry: float | None = None  # the earliest retry the answers read in this pass asked for
        # CURVE keys to fetch from a leader node (cluster mode with CURVE sets it); None: the process's.
        self.keys_for: Callable[[str], ClientKeys | None] = lambda leader: None

    # --- roles ------------------------------------------------------------------------------

    def follow(self, topic: str, partition: int, *, leader: str, address: str, epoch: int, hw: int = 0) -> None:
        """Start (or go on) following ``leader`` at ``address`` for this partition."""
        previous = self.unfollow(topic, partition)
        link = self.links.get(leader)
        if link is None:
            link = self.links[leader] = LeaderLink(self._fetcher(leader, address))
        else:
            link.fetcher.change_address(address)
        followed = Followed(topic, partition, leader, epoch, hw=max(hw, previous.hw if previous else 0))
        link.partitions[(topic, partition)] = followed
        self._fetch(link, followed)

    def unfollow(self, topic: str, partition: int) -> Followed | None:
        """Stop following this partition; what was known of it (None if it was not followed)."""
        for leader, link in list(self.links.items()):
            followed = link.partitions.pop((topic, partition), None)
            if followed is not None:
                if not link.partitions:
                    link.fetcher.close()
                    del self.links[leader]
                return followed
        return None

    def followed(self, topic: str, partition: int) -> Followed | None:
        for link in self.links.values():
            found = link.partitions.get((topic, partition))
            if found is not None:
                return found
        return None

    def close(self) -> None:
        for link in self.links.values():
            link.fetcher.close()
        self.links.clear()

    # --- the loop's hooks ---------------------------------------------------------------------

    def on_events(self, events: dict[Any, int]) -> float | None:
        """Read the leaders' answers; when the earliest retry they asked for is due (None: none asked).

        The loop ticks by then: the tick it planned before may be a whole silence timeout away,
        and a follower that waits that long after a NOT_LEADER holds back its leader's HW.
        """
        self._retry = None
        for link in list(self.links.values()):
            if link.fetcher.socket is not None and link.fetcher.socket in events:
                link.fetcher.on_readable()
        return self._retry

    def _retry_at(self, followed: Followed, when: float) -> None:
        followed.retry_at = when
        self._retry = when if self._retry is None else min(self._retry, when)

    def tick(self, now: float) -> float | None:
        """Connect, reconnect, retry; when it wants to run again (None: only on an answer)."""
        wanted: list[float] = []
        for link in list(self.links.values()):
            come_back = link.fetcher.tick(now)
            if come_back is not None:
                wanted.append(come_back)
                continue
            wanted.append(link.fetcher.silence_deadline())
            for followed in link.partitions.values():
                if followed.retry_at is not None and now >= followed.retry_at:
                    followed.retry_at = None
                    self._fetch(link, followed)
                elif followed.retry_at is not None:
                    wanted.append(followed.retry_at)
                elif followed.rid is None and not followed.due:
                    self._fetch(link, followed)
        return min(wanted) if wanted else None

    def after_sync(self, synced: set[str] | frozenset[str] = frozenset()) -> None:
        """The group commit is done: fetch again for every answer applied this pass, reporting the durable end.

        Under ``interval:MS`` the sync may come in a later pass, while the next FETCH is
        already parked at the leader with the older durable end: a FETCH made durable by
        this sync (``synced``) is sent again, so the leader learns it now rather than at
        its next append or wait. The answer to the older one is then ignored.
        """
        for link in self.links.values():
            for followed in link.partitions.values():
                if followed.due:
                    followed.due = False
                    if followed.rid is None:
                        self._fetch(link, followed)
                    else:
                        self._report(link, followed)  # its FETCH is parked at the leader already
                elif followed.rid is not None and followed.topic in synced:
                    log_ = self.host.store.logs.get(followed.topic)
                    if log_ is not None and log_.durable_offset > followed.reported_durable:
                        self._report(link, followed)

    # --- fetching -------------------------------------------------------------------------------

    def _fetcher(self, leader: str, address: str) -> Fetcher:
        fetcher = Fetcher(
            self.host.ctx,
            self.host.poller,
            address,
            wait_ms=self.wait_ms,
            max_batch_bytes=self.host.max_batch_bytes,
            on_reply=partial(self._on_reply, leader),
            on_connect=partial(self._on_connect, leader),
            clock=self.clock,
            name=f"leader {leader}",
            keys=partial(self.keys_for, leader),
        )
        fetcher.connect()
        return fetcher

    def _on_connect(self, leader: str) -> None:
        link = self.links.get(leader)
        if link is not None:
            for followed in link.partitions.values():
                followed.rid = None  # answers to the old socket's requests never come
                followed.due = False

    def _fetch(self, link: LeaderLink, followed: Followed) -> None:
        rid = self._request(link, followed)
        if rid is not None:
            followed.rid = rid

    def _report(self, link: LeaderLink, followed: Followed) -> None:
        """Tell the leader this log's durable end; no answer comes (the FETCH in flight gets one)."""
        self._request(link, followed, report=True)

    def _request(self, link: LeaderLink, followed: Followed, *, report: bool = False) -> int | None:
        log_ = self.host.store.logs.get(followed.topic)
        if log_ is None or link.fetcher.socket is None:
            return None
        request = partial(
            commands.fetch,
            followed.topic,
            log_.end_offset,
            max_messages=1_000_000,
            max_bytes=self.max_bytes,
            wait_ms=self.wait_ms,
            replica=self.node_id,
            leader_epoch=followed.epoch,
            last_epoch=log_.last_epoch or None,  # from the log's leader-epoch cache
            durable=log_.durable_offset,
            report=report or None,
        )
        rid = link.fetcher.request(request)
        followed.reported_durable = log_.durable_offset
        return rid

    def _on_reply(self, leader: str, reply: Frame) -> None:
        link = self.links.get(leader)
        if link is None:
            return
        rid = reply.get("rid")
        followed = next((f for f in link.partitions.values() if f.rid == rid and rid is not None), None)
        if followed is None:
            return  # an answer to a request from before a reconnect or a role change
        followed.rid = None
        log_ = self.host.store.logs.get(followed.topic)
        if log_ is None:
            return
        if reply.command is Command.ERROR:
            exc = error_from_header(reply.header)
            if exc.name == "OFFSET_OUT_OF_RANGE" and "start_offset" in exc.fields:
                self._restart_at(followed, log_, int(exc.fields["start_offset"]))
                self._fetch(link, followed)
                return
            now = self.clock()
            followed.failing_since = followed.failing_since if followed.failing_since is not None else now
            moving = exc.name in MOVING_ROLES and now - followed.failing_since < self.quiet_seconds
            level = logging.DEBUG if moving else logging.WARNING
            log.log(level, "replica FETCH %s/%d from %s: %s", followed.topic, followed.partition, leader, exc)
            self._retry_at(followed, now + RETRY_AFTER)
            return
        if reply.command is not Command.FETCHED:
            return
        followed.failing_since = None
        if reply.get("hw") is not None:
            followed.hw = int(reply.get("hw"))
            log_.set_high_watermark(followed.hw)  # a new leader starts from it; readers here see up to it
        diverging = reply.get("diverging")
        if diverging:
            before = (log_.end_offset, log_.last_epoch)
            own = log_.epoch_end_offset(int(diverging["epoch"]))
            self._truncate(followed, log_, truncation_offset(diverging, own))
            if (log_.end_offset, log_.last_epoch) == before:  # nothing changed: asking again at once would spin
                log.warning(
                    "%s/%d: DIVERGING changed nothing here; asking again later", followed.topic, followed.partition
                )
                self._retry_at(followed, self.clock() + RETRY_AFTER)
                return
            self._fetch(link, followed)
            return
        if self._apply(followed, log_, reply):
            self.host.appended.add(followed.topic)
            followed.due = True  # report (or fetch) again once the group commit has made it durable
            if early_fetch(log_.end_offset, int(reply.get("end_offset", 0)), sum(map(len, reply.payload))):
                self._fetch(link, followed)  # caught up: the next FETCH waits at the leader during the sync
        else:
            self._fetch(link, followed)

    def _apply(self, followed: Followed, log_: TopicLog, reply: Frame) -> bool:
        """Append the answer's batches at the leader's offsets; whether anything was appended."""
        leader_start = int(reply.get("start_offset", 0))
        if log_.end_offset < leader_start and not reply.payload:
            self._restart_at(followed, log_, leader_start)
        appended = False
        for entry, body in zip(entries_from_wire(reply.get("entries")), reply.payload, strict=False):
            if entry.base_offset + entry.count <= log_.end_offset:
                continue  # already here
            if entry.base_offset < log_.end_offset:
                # This log's tail cuts a batch of the leader's: it is not the leader's tail.
                self._truncate(followed, log_, entry.base_offset)
            elif entry.base_offset > log_.end_offset:
                self._restart_at(followed, log_, entry.base_offset)
            log_.append(
                bytes(body),
                entry.count,
                timestamp_ms=entry.timestamp_ms,
                base_offset=entry.base_offset,
                producer_id=entry.producer_id,
                sequence=entry.sequence,
                leader_epoch=entry.leader_epoch or None,
            )
            followed.fetched_batches += 1
            appended = True
        return appended

    def _truncate(self, followed: Followed, log_: TopicLog, offset: int) -> None:
        log.warning(
            "%s/%d: log diverged from leader %s; truncating %d -> %d",
            followed.topic,
            followed.partition,
            followed.leader,
            log_.end_offset,
            offset,
        )
        log_.truncate_to(offset)  # its leader-epoch cache is cut with it
        followed.truncations += 1

    def _restart_at(self, followed: Followed, log_: TopicLog, start: int) -> None:
        """The leader no longer holds what comes next here (retention): start again at its start."""
        if start != log_.end_offset:
            tp = f"{followed.topic}/{followed.partition}"
            log.warning("%s: leader starts at %d; this log restarts there", tp, start)
            log_.reset_to(start)


def early_fetch(end: int, leader_end: int, answer_bytes: int) -> bool:
    """Whether to fetch again before the sync: a small answer brought this log (``end``) to the leader's end.

    Catching up, more is waiting and the FETCH after the sync gets it; after a big answer the leader
    appends fast, and an early FETCH would only split the same data into more, smaller answers.
    """
    return end >= leader_end and answer_bytes <= EARLY_FETCH_BYTES
