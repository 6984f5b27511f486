"""Mirroring topics from a parent broker, with the same offsets.

A child broker runs a ``Mirror`` inside its event loop: one DEALER socket to
the parent, one long-poll FETCH in flight per mirrored topic, each answer
appended locally at the offsets it has upstream, then the next FETCH. The
child's log is the only state: after a restart (its own or the parent's)
it fetches again from its durable end, so no offset is skipped or stored
twice. Mirrored topics are read-only for local producers. Several levels
chain: a child is a parent for the next level.

A partitioned topic is mirrored whole: each partition's log (``T#k``) is a
mirrored log of its own, fetched (``p`` = k) and appended at the parent's
offsets like a topic. Discovery reads each topic's partition count from the
parent's ``list_topics``; a count that grew (a new topic, or partitions added
upstream) grows the child's topic the way ``add_partitions`` does, so its
groups and subscribers get the new partitions too.

The parent may be a cluster: ``--upstream`` is then its bootstrap list
(``tcp://a:1,tcp://b:2``). The link asks METADATA with each topic
discovery (on the link itself: the loop never waits for it) and moves to
the leader of the first mirrored topic; a ``NOT_LEADER`` naming a leader
moves it at once; a silent link moves to the next bootstrap address and
asks again. The FETCH stays a consumer's, served up to the high watermark,
so offsets carry over unchanged. Topics led by other nodes are read from
the node the link is on, up to that replica's high watermark (one link per
leader is not done). One address works exactly as before: no METADATA.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import zmq
from conveyor.broker.config.addresses import broker_addresses
from conveyor.broker.log.data_dir import Store
from conveyor.broker.net.metadata import ClusterView
from conveyor.broker.server.fetcher import Fetcher
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import entries_from_wire
from conveyor.broker.wire.protocol import Command, Frame, error_from_header
from conveyor.broker.wire.record import Batch, pack_records, unpack_records
from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY

from conveyor.errors import ConveyorError
from conveyor.names import partition_log

log = logging.getLogger("conveyor.mirror")

NOT_LEADER_RETRY = 0.5  # seconds before a FETCH a cluster node did not serve (NOT_LEADER, UNKNOWN_TOPIC) goes again


class MirrorHost(Protocol):
    """What a mirror needs of the broker it runs in (the broker is one)."""

    @property
    def ctx(self) -> zmq.Context[Any]: ...  # its DEALER to the parent is made here
    @property
    def poller(self) -> zmq.Poller: ...  # the loop's poller: that DEALER is registered in it
    @property
    def store(self) -> Store: ...
    @property
    def metrics(self) -> Any: ...
    @property
    def appended(self) -> set[str]: ...  # topics appended to this pass: the group commit syncs and wakes them
    @property
    def max_batch_bytes(self) -> int: ...

    def reset_topic(self, topic: str, offset: int, *, event: str | None = None) -> None: ...
    def announce(self, topic: str, event: str, offset: int, *, partitions: int | None = None) -> None: ...
    def grow_topic(self, topic: str, partitions: int) -> None: ...  # as ADMIN add_partitions, without its checks


@dataclass(frozen=True)
class MirrorSettings:
    upstream: str
    patterns: tuple[str, ...]
    gap_policy: str = "resync"  # or "stop"
    lag_threshold: int = 10_000  # messages behind the parent before DEGRADED
    unreachable_after: float = 30.0  # seconds without the parent before UNHEALTHY
    fetch_wait_ms: int = 1000
    fetch_max_bytes: int = 4 << 20
    discover_every: float = 1.0


@dataclass
class TopicMirror:
    topic: str
    rid: int | None = None  # the FETCH in flight
    sent_at: float = 0.0
    parent_end: int = 0
    parent_start: int = 0
    last_append_ms: int = 0  # parent timestamp of the newest batch copied
    stopped: str = ""  # why mirroring stopped (gap policy "stop")
    refresh_target: int | None = None  # a refresh completes when the local end reaches it
    fetched_bytes: int = 0
    fetched_messages: int = 0
    retry_at: float = 0.0  # no FETCH before (a NOT_LEADER that named no leader: the cluster is electing one)
    unknown_at: float | None = None  # a cluster node answered UNKNOWN_TOPIC: METADATA asked since says if it is gone


@dataclass
class Mirror:
    host: MirrorHost
    settings: MirrorSettings
    clock: Callable[[], float] = time.monotonic
    topics: dict[str, TopicMirror] = field(default_factory=dict)
    link: Fetcher = field(init=False)
    _list_rid: int | None = None
    _next_discovery: float = 0.0
    _metadata_rid: int | None = None  # the METADATA in flight (a cluster upstream)
    _metadata_source: str = ""  # the address it was asked of
    _metadata_asked: float = 0.0  # when
    _rotate: bool = False  # the link was torn down: the next socket goes to the next bootstrap address

    def __post_init__(self) -> None:
        self.link = Fetcher(
            self.host.ctx,
            self.host.poller,
            self.bootstrap[0] if self.bootstrap else "",
            wait_ms=self.settings.fetch_wait_ms,
            max_batch_bytes=self.host.max_batch_bytes,
            on_reply=self._on_reply,
            on_connect=self._on_connect,
            on_reconnect=self._count_reconnect,
            clock=self.clock,
        )

    # --- the link to the parent (``fetcher.Fetcher``) ---------------------------------------

    @property
    def socket(self) -> zmq.Socket[Any] | None:
        return self.link.socket

    @property
    def reconnects(self) -> int:
        return self.link.reconnects

    @property
    def last_reply(self) -> float:
        return self.link.last_reply

    @property
    def down_since(self) -> float | None:
        return self.link.down_since

    @property
    def refused(self) -> str:
        return self.link.refused

    @property
    def bootstrap(self) -> tuple[str, ...]:
        """The upstream's addresses: one parent, or a cluster's bootstrap list (none while the registry names none)."""
        return broker_addresses(self.settings.upstream) if self.settings.upstream else ()

    @property
    def cluster(self) -> bool:
        """Whether the upstream is a cluster: the link follows leaders (several bootstrap addresses)."""
        return len(self.bootstrap) > 1

    def _on_connect(self) -> None:
        self._next_discovery = self.clock()
        self._list_rid = self._metadata_rid = None  # answers to the old socket's requests never come
        for mirror in self.topics.values():
            mirror.rid = None
        log.info("mirroring %s from %s", ", ".join(self.settings.patterns), self.link.address)

    def _count_reconnect(self) -> None:
        # A cluster's link, or one that followed a leader away from its one parent, tries the bootstrap list again.
        self._rotate = bool(self.bootstrap) and (self.cluster or self.link.address != self.bootstrap[0])
        self.host.metrics.mirror_reconnects.labels(self.settings.upstream).inc()

    def _move_to(self, address: str) -> None:
        """Fetch from ``address`` from now on (a cluster's leader); offsets carry over unchanged."""
        self.link.change_address(address)
        self._rotate = False

    def _next_address(self) -> str:
        """The bootstrap address after the link's (the first when the link is on a leader not in the list)."""
        known = self.bootstrap
        if self.link.address not in known:
            return known[0]
        return known[(known.index(self.link.address) + 1) % len(known)]

    def close(self) -> None:
        """Close the link to the parent (the broker is stopping)."""
        self.link.close()

    def change_upstream(self, address: str) -> None:
        """Follow a new parent (registry discovery); offsets carry over unchanged."""
        if address == self.settings.upstream:
            return
        self.settings = MirrorSettings(**{**self.settings.__dict__, "upstream": address})
        self._move_to(self.bootstrap[0])

    # --- the loop's hooks -------------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Housekeeping; returns when it wants to run again (clock seconds)."""
        if self._rotate and self.link.socket is None:
            self._rotate = False
            self.link.address = self._next_address()  # connected after the link's backoff
        come_back = self.link.tick(now)
        if come_back is not None:
            return come_back
        if now >= self._next_discovery and self._list_rid is None:
            self._list_rid = self._request(partial(commands.admin, "list_topics"))
            if self.cluster and self._metadata_rid is None:
                self._metadata_source = self.link.address
                self._metadata_rid = self._request(partial(commands.metadata, None))
                self._metadata_asked = now
            self._next_discovery = now + self.settings.discover_every
        for mirror in self.topics.values():
            if mirror.rid is None and not mirror.stopped and mirror.retry_at <= now:
                self._fetch(mirror)
        # Never a time in the past: the loop would spin instead of sleeping.
        return max(now + 0.01, min(self._next_discovery, now + 0.5))

    def on_readable(self) -> None:
        self.link.on_readable()

    def _on_reply(self, reply: Frame) -> None:
        rid = reply.get("rid")
        if rid is not None and rid == self._list_rid:
            self._list_rid = None
            if reply.command is Command.RESULT:
                self._discover(reply.get("result") or [])
            return
        if rid is not None and rid == self._metadata_rid:
            self._metadata_rid = None
            if reply.command is Command.METADATA_RESULT:
                self._on_metadata(reply)
            return
        mirror = next((m for m in self.topics.values() if m.rid == rid), None)
        if mirror is None:
            return  # an answer to a request from before a reconnect
        mirror.rid = None
        if reply.command is Command.FETCHED:
            mirror.unknown_at = None
            self._apply(mirror, reply)
        elif reply.command is Command.ERROR:
            self._on_error(mirror, error_from_header(reply.header))
        if not mirror.stopped and mirror.retry_at <= self.clock():
            self._fetch(mirror)

    # --- a cluster upstream: following the leader ---------------------------------------------

    def _on_metadata(self, reply: Frame) -> None:
        try:
            view = ClusterView.from_header(self._metadata_source, reply.header)
        except ConveyorError as exc:
            log.error("unusable METADATA answer from %s: %s", self._metadata_source, exc)
            return
        self._gone_upstream(view)
        topic = self._anchor(view)
        address = None if topic is None else view.leader_address(topic)
        if address is not None and address != self.link.address:
            log.info("mirror follows the leader of %s to %s", topic, address)
            self._move_to(address)

    def _gone_upstream(self, view: ClusterView) -> None:
        """Topics a cluster node did not know, and the cluster's METADATA asked since does not name: deleted."""
        for mirror in list(self.topics.values()):
            if (
                mirror.unknown_at is not None
                and mirror.unknown_at <= self._metadata_asked
                and mirror.topic not in view.topics
            ):
                self._stop_gone(mirror)

    def _stop_gone(self, mirror: TopicMirror) -> None:
        log.warning("topic %s is gone upstream; mirroring stops", mirror.topic)
        del self.topics[mirror.topic]
        mirror.stopped = "gone upstream"

    def _anchor(self, view: ClusterView) -> str | None:
        """The topic whose leader the link follows: the first mirrored one (the first the cluster has that matches)."""
        if self.topics:
            return min(self.topics)
        matching = sorted(t for t in view.topics if any(fnmatch.fnmatchcase(t, p) for p in self.settings.patterns))
        return matching[0] if matching else None

    def _not_leader(self, mirror: TopicMirror, exc: ConveyorError) -> None:
        """Go to the leader the answer names; without one, ask METADATA again and FETCH a little later.

        Only the first topic moves the link (it follows that topic's leader): two topics led by two nodes
        would otherwise pull it back and forth.
        """
        hint = exc.fields.get("leader_addr")
        first = mirror.topic == min(self.topics)
        if first and isinstance(hint, str) and hint and hint != self.link.address:
            log.info("mirror of %s: %s; following it to %s", mirror.topic, exc, hint)
            self._move_to(hint)
            return
        mirror.retry_at = self.clock() + NOT_LEADER_RETRY
        self._next_discovery = self.clock()

    # --- topics -------------------------------------------------------------------------------

    def _discover(self, described: list[dict[str, Any]]) -> None:
        for info in described:
            name = str(info.get("name", ""))
            if not any(fnmatch.fnmatchcase(name, p) for p in self.settings.patterns):
                continue
            parts = _partitions(info)
            if name not in self.topics:
                self._adopt(name, *parts[0])
            if len(parts) > self.host.store.partition_count(name):
                log.info("topic %s has %d partitions upstream; mirroring each", name, len(parts))
                self.host.grow_topic(name, len(parts))
            for number, (start, end) in enumerate(parts[1:], 1):
                if partition_log(name, number) not in self.topics:
                    self._adopt(partition_log(name, number), start, end)

    def _adopt(self, name: str, parent_start: int, parent_end: int) -> None:
        store = self.host.store
        if name not in store.logs:
            store.create_topic(name, read_only=True, extra={"mirror_of": self.settings.upstream})
        log_ = store.topic(name)
        if not log_.config.read_only:
            store.alter_topic(name, read_only=True, extra={"mirror_of": self.settings.upstream})
        if log_.end_offset == 0 and parent_start > 0:
            self.host.reset_topic(name, parent_start)  # the parent's retention already moved its start
        mirror = TopicMirror(name, parent_end=parent_end, parent_start=parent_start)
        self.topics[name] = mirror
        log.info("mirroring topic %s from offset %d (parent end %d)", name, log_.end_offset, parent_end)
        self._fetch(mirror)

    def _fetch(self, mirror: TopicMirror) -> None:
        if self.link.socket is None:
            return
        log_ = self.host.store.logs.get(mirror.topic)
        if log_ is None:
            return
        request = partial(
            commands.fetch,
            mirror.topic,
            log_.end_offset,
            max_messages=1_000_000,
            max_bytes=self.settings.fetch_max_bytes,
            wait_ms=self.settings.fetch_wait_ms,
        )
        mirror.rid = self._request(request)
        mirror.sent_at = self.clock()

    def _request(self, frames_for: Callable[..., list[Any]]) -> int | None:
        """Send ``frames_for(rid=...)`` (an encoder of ``broker/wire/commands.py``); its rid."""
        return self.link.request(frames_for)

    def _apply(self, mirror: TopicMirror, reply: Frame) -> None:
        """Append what the parent sent, at the parent's offsets, with its producer ids, sequences and epochs.

        A parent older than these FETCHED keys sends none: its batches are stored as not idempotent.
        """
        log_ = self.host.store.topic(mirror.topic)
        mirror.parent_end = int(reply.get("end_offset", mirror.parent_end))
        mirror.parent_start = int(reply.get("start_offset", mirror.parent_start))
        entries = entries_from_wire(reply.get("entries"))
        appended = 0
        for entry, body in zip(entries, reply.payload, strict=False):
            stored = Batch(
                entry.base_offset,
                entry.count,
                entry.timestamp_ms,
                bytes(body),
                entry.producer_id,
                entry.sequence,
                entry.leader_epoch,
            )
            batch = _from(stored, log_.end_offset)
            if batch is None:
                continue
            if batch.base_offset != log_.end_offset:
                self._gap(mirror, log_.end_offset, batch.base_offset)
                return
            log_.append(
                batch.body,
                batch.count,
                producer_id=batch.producer_id,
                sequence=batch.sequence,
                timestamp_ms=batch.timestamp_ms,
                base_offset=batch.base_offset,
                leader_epoch=batch.leader_epoch,
            )
            mirror.last_append_ms = batch.timestamp_ms
            mirror.fetched_bytes += len(batch.body)
            mirror.fetched_messages += batch.count
            self.host.metrics.mirror_fetched_bytes.labels(mirror.topic).inc(len(batch.body))
            self.host.metrics.mirror_fetched_messages.labels(mirror.topic).inc(batch.count)
            appended += 1
        if appended:
            self.host.appended.add(mirror.topic)
        if not entries and log_.end_offset < mirror.parent_start:
            self._gap(mirror, log_.end_offset, mirror.parent_start)
        self._check_refresh(mirror, log_.end_offset)

    def _on_error(self, mirror: TopicMirror, exc: ConveyorError) -> None:
        if exc.name == "OFFSET_OUT_OF_RANGE":
            start = int(exc.fields.get("start_offset", mirror.parent_start))
            log_ = self.host.store.topic(mirror.topic)
            self._gap(mirror, log_.end_offset, start)
        elif exc.name == "SHUTTING_DOWN":
            self.link.down_since = self.link.down_since or self.clock()  # the parent is going away
        elif exc.name == "NOT_LEADER":
            self._not_leader(mirror, exc)
        elif exc.name == "UNKNOWN_TOPIC" and self.cluster:
            # A node without a replica of the topic knows nothing of it; or the cluster deleted it: the
            # METADATA asked now tells (``_gone_upstream``). Meanwhile the FETCH goes again a little later.
            log.info("%s does not hold %s; fetching it again later", self.link.address, mirror.topic)
            now = self.clock()
            mirror.unknown_at = mirror.unknown_at if mirror.unknown_at is not None else now
            mirror.retry_at = now + NOT_LEADER_RETRY
            self._next_discovery = now
        elif exc.name in ("UNKNOWN_TOPIC", "UNKNOWN_PARTITION"):  # the topic was made again with fewer
            self._stop_gone(mirror)
        else:
            log.error("FETCH %s failed upstream: %s", mirror.topic, exc)

    def _gap(self, mirror: TopicMirror, local_end: int, parent_start: int) -> None:
        """The parent no longer has what comes next here (its retention moved on)."""
        self.host.metrics.mirror_gaps.labels(mirror.topic).inc()
        if self.settings.gap_policy == "stop":
            mirror.stopped = f"parent starts at {parent_start}, this log ends at {local_end}"
            log.error("mirror of %s stopped: %s", mirror.topic, mirror.stopped)
            return
        log.warning(
            "mirror of %s: parent starts at %d past local end %d; resyncing", mirror.topic, parent_start, local_end
        )
        self.host.reset_topic(mirror.topic, parent_start)

    # --- refresh (RESET / READY) -----------------------------------------------------------

    def refresh(self, topic: str) -> dict[str, Any]:
        """Drop the local copy and mirror the topic again from the parent's start (each partition's).

        A partitioned topic's answer is partition 0's, with each partition's under ``partitions``.
        """
        if topic not in self.topics:
            raise ConveyorError(f"{topic} is not a mirrored topic here", topic=topic)
        logs = (partition_log(topic, number) for number in range(self.host.store.partition_count(topic)))
        answers = [self._refresh_log(name) for name in logs if name in self.topics]
        return answers[0] if len(answers) == 1 else {**answers[0], "partitions": answers}

    def _refresh_log(self, topic: str) -> dict[str, Any]:
        mirror = self.topics[topic]
        mirror.stopped = ""
        mirror.refresh_target = max(mirror.parent_end, mirror.parent_start)
        self.host.reset_topic(topic, mirror.parent_start, event="RESET")
        mirror.rid = None
        self._fetch(mirror)
        self._check_refresh(mirror, self.host.store.topic(topic).end_offset)
        return {"topic": topic, "from": mirror.parent_start, "until": mirror.refresh_target}

    def _check_refresh(self, mirror: TopicMirror, local_end: int) -> None:
        if mirror.refresh_target is not None and local_end >= mirror.refresh_target:
            mirror.refresh_target = None
            self.host.announce(mirror.topic, "READY", local_end)

    # --- health and metrics ------------------------------------------------------------------

    def lag(self, mirror: TopicMirror) -> int:
        log_ = self.host.store.logs.get(mirror.topic)
        return 0 if log_ is None else max(0, mirror.parent_end - log_.end_offset)

    def status(self) -> str:
        now = self.clock()
        if self.refused:
            return UNHEALTHY  # refused by the parent: no retry will help until its keys or ours change
        # A long-poll FETCH is answered within its wait: a later answer is overdue.
        overdue_after = self.settings.fetch_wait_ms / 1000 + 0.5
        if self.down_since is not None or self.socket is None or now - self.last_reply > overdue_after:
            since = self.down_since if self.down_since is not None else self.last_reply + overdue_after
            return UNHEALTHY if now - since > self.settings.unreachable_after else DEGRADED
        if any(m.stopped for m in self.topics.values()):
            return UNHEALTHY
        if any(self.lag(m) > self.settings.lag_threshold for m in self.topics.values()):
            return DEGRADED
        return HEALTHY

    def health(self) -> dict[str, Any]:
        return {
            "upstream": self.settings.upstream,
            **({"fetching_from": self.link.address} if self.cluster else {}),
            "status": self.status(),
            "seconds_since_answer": round(self.clock() - self.last_reply, 3),
            "reconnects": self.reconnects,
            **({"error": self.refused} if self.refused else {}),
            "topics": {
                name: {"lag_messages": self.lag(m), "stopped": m.stopped or None, "refreshing": m.refresh_target}
                for name, m in list(self.topics.items())
            },
        }


def _partitions(info: dict[str, Any]) -> list[tuple[int, int]]:
    """``(start_offset, end_offset)`` of each partition of a topic the parent described (one: its own)."""
    rows = info.get("partitions")
    if not isinstance(rows, list) or not rows:  # a parent from before partitions
        return [(int(info.get("start_offset", 0)), int(info.get("end_offset", 0)))]
    # A cluster node describes only the partitions it leads: the count is ``partition_count``, and a
    # partition described by none starts at 0 here (its FETCH says where the parent's log starts).
    known = {int(row.get("partition", number)): row for number, row in enumerate(rows)}
    count = max(int(info.get("partition_count") or len(rows)), len(rows))
    bounds = {n: (int(row.get("start_offset", 0)), int(row.get("end_offset", 0))) for n, row in known.items()}
    return [bounds.get(number, (0, 0)) for number in range(count)]


def _from(batch: Batch, offset: int) -> Batch | None:
    """The part of ``batch`` at or after ``offset`` (re-encoded only when it must be cut).

    A cut batch is not the producer's batch any more: it keeps its epoch, not its producer id and sequence.
    """
    if batch.next_offset <= offset:
        return None
    if batch.base_offset >= offset:
        return batch
    records = unpack_records(batch.body)[offset - batch.base_offset :]
    cut = pack_records(list(records))
    return Batch(offset, len(records), batch.timestamp_ms, cut, leader_epoch=batch.leader_epoch)
