"""The broker: one event loop around one ROUTER socket.

Each pass reads every waiting message, appends all PUBLISH batches, syncs
once under the fsync policy (the group commit), then confirms and
dispatches; housekeeping (heartbeats, leases, delayed redeliveries, offset
commits, retention) runs on deadlines that set the poll timeout. Nothing
polls on a timer for work: an append triggers dispatch in the same pass.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.config.options import INT32_MAX, INT64_MAX
from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.log.topic_log import TopicConfig, TopicLog
from conveyor.broker.net.security import ServerSecurity, check_server_options
from conveyor.broker.net.transport import NOBLOCK, recv_frames, send_frames
from conveyor.broker.net.wakeup import drain
from conveyor.broker.server import admin
from conveyor.broker.server.containment import Containment
from conveyor.broker.server.dead_letters import dead_letter_body, dead_letter_topic
from conveyor.broker.server.dispatch_guard import dispatch_contained
from conveyor.broker.server.group_table import GroupIndex
from conveyor.broker.server.groups import (
    MAX_ENTRIES,
    DeadLetter,
    Delivery,
    Group,
    GroupSettings,
    Member,
    Pending,
    entries_for,
)
from conveyor.broker.server.health import broker_health, broker_live, broker_ready
from conveyor.broker.server.limits import TokenBucket, TopicLimits
from conveyor.broker.server.mirror import Mirror, MirrorSettings
from conveyor.broker.server.topology import RegistryWatch
from conveyor.broker.wire import commands
from conveyor.broker.wire.entry import DeliveryEntry
from conveyor.broker.wire.protocol import Command, Frame, decode, request_id
from conveyor.broker.wire.protocol import field as hfield
from conveyor.broker.wire.protocol import ranges as hranges
from conveyor.broker.wire.ranges import count as count_offsets
from conveyor.broker.wire.record import NO_PRODUCER, validate_body
from conveyor.monitoring.http import MetricsServer
from conveyor.monitoring.metrics import BrokerMetrics, HealthCollector, NullMetrics, StateCollector
from prometheus_client import CollectorRegistry

from conveyor.errors import (
    ConfigError,
    ConveyorError,
    GroupLimit,
    InvalidName,
    InvalidRequest,
    MessageTooLarge,
    NotSubscribed,
    OffsetOutOfRange,
    ReadOnlyTopic,
    ShuttingDown,
    TooManyOpenFiles,
    UnknownTopic,
)

log = logging.getLogger("conveyor.broker")

READ_BURST = 4096  # messages read per pass before the group commit
# Creating a topic (and its group) is the costliest thing a request can ask of a pass: a pass that
# created this many ends its reads there, so the confirms and deliveries of others are not held
# behind a burst of thousands of creations (the rest is read in the next pass, at once).
CREATIONS_PER_PASS = 64
# A dead letter that cannot be stored for a reason time will not fix (a mirrored, read-only dead-letter
# topic, an invalid name, a bug) is kept unsettled and tried again this slowly: never dropped, never
# retried every second.
DEAD_LETTER_RETRY_SECONDS = 30.0
DISPATCH_RETRY_SECONDS = (1.0, 30.0)  # first and longest wait before a group whose dispatch raised is tried again


@dataclass(slots=True)
class Peer:
    identity: bytes
    last_seen: float
    last_sent: float = 0.0
    members: dict[int, tuple[Group, Member]] = field(default_factory=dict)
    busy: list[tuple[Group, Member]] = field(default_factory=list)  # members whose last DELIVER bounced
    creations: TokenBucket | None = None  # its auto-create rate, made at its first auto-creation


@dataclass(slots=True)
class Confirm:
    peer: bytes
    rid: Any
    log: TopicLog
    base_offset: int
    count: int
    duplicate: bool
    received: float


@dataclass(slots=True)
class DeadWrite:
    """Dead letters appended to a dead-letter topic: settled once that append is durable."""

    group: Group
    letter: DeadLetter
    log: TopicLog
    end: int


@dataclass(slots=True)
class FetchWait:
    peer: bytes
    frame: Frame
    deadline: float
    offset: int  # answered once this offset is durable (or at the deadline)
    done: bool = False  # answered before its deadline (its heap entry is skipped)


class Broker:
    def __init__(self, settings: BrokerSettings, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.clock: Callable[[], float] = time.monotonic
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.metrics: Any = BrokerMetrics(self.registry) if settings.metrics else NullMetrics()
        self.containment = Containment(self.metrics.internal_errors, clock=self.clock)
        if settings.metrics:
            self.registry.register(StateCollector(self._state_snapshot))
        self.registry.register(HealthCollector(self.health))
        self.store: Store = Store(
            settings.data_dir,
            fsync=FsyncPolicy.parse(settings.fsync),
            defaults=TopicConfig(
                segment_bytes=settings.segment_bytes,
                retention_bytes=settings.retention_bytes,
                retention_ms=settings.retention_ms,
            ),
            quarantine=settings.quarantine,
            offsets_write_errors=self.metrics.offsets_write_errors,
            topic_config_errors=self.metrics.topic_config_errors,
            create_in_background=True,
        )
        self.groups: GroupIndex = GroupIndex()
        self.peers: dict[bytes, Peer] = {}
        self.confirms: list[Confirm] = []
        self.dead_writes: list[DeadWrite] = []
        self.fetch_waits: dict[str, list[FetchWait]] = defaultdict(list)
        # Per-pass work follows what changed, never the number of topics or groups: timers in
        # heaps (stale entries are skipped when they come up), groups whose offsets may have moved.
        self._timers: list[tuple[float, int, Group]] = []  # group lease expiries and delayed redeliveries
        self._timer_at: dict[Group, float] = {}  # each group's earliest entry in _timers
        self._fetch_deadlines: list[tuple[float, int, FetchWait]] = []
        self._seq = itertools.count()
        self._pass_creations = 0  # topics auto-created in this pass's reads
        self._moved: set[Group] = set()  # groups whose committed offset may have changed since the last commit
        self.appended: set[str] = set()
        self.to_dispatch: set[Group] = set()
        self.dispatch_retries: dict[Group, tuple[float, float]] = {}  # group -> (due, backoff)
        self.running = False
        self.endpoint = ""
        self.metrics_server: MetricsServer | None = None
        self._next_housekeeping = 0.0
        self._next_commit = 0.0
        self._last_pass = self.clock()
        self._last_fsync_seconds = 0.0
        self.poller = zmq.Poller()
        self.mirror: Mirror | None = None
        self.registry_watch: RegistryWatch | None = None
        self._next_mirror_tick = 0.0
        self.topic_limits = TopicLimits(settings.max_topics, settings.auto_create_rate, clock=self.clock)
        self.topic_limits.refresh(len(self.store.logs))
        self._load_groups()
        for topic in self.store:
            if topic.truncated_bytes:
                self.metrics.truncated_bytes.labels(topic.name).inc(topic.truncated_bytes)
            if topic.quarantined_segments:
                self.metrics.quarantined_segments.labels(topic.name).inc(topic.quarantined_segments)
            for lost in topic.lost_ranges:
                self.metrics.lost_offsets.labels(topic.name).inc(lost["end"] - lost["start"])

    # --- setup -------------------------------------------------------------------

    def _load_groups(self) -> None:
        for topic, groups in self.store.groups.items():
            for name, state in groups.items():
                self._make_group(topic, name, state)

    def _make_group(self, topic: str, name: str, state: dict[str, Any]) -> Group:
        log_ = self.store.topic(topic)
        settings = self._stored_group_settings(topic, name, state)
        offset = int(state.get("next_offset", state.get("committed_offset", log_.start_offset)))
        if offset > log_.end_offset:  # the log lost a tail the offsets file had seen (power cut, fsync=none)
            log.warning("group %s/%s: committed offset %d is past the log end %d", topic, name, offset, log_.end_offset)
            offset = log_.end_offset  # new messages will take those offsets again: deliver them
        group = Group(topic, name, settings, next_offset=offset, clock=self.clock)
        group.skipped_by_retention = int(state.get("skipped_by_retention", 0))
        group.on_skip = self._skipped_by_retention
        # What was unsettled when the broker stopped comes again with its delivery counts.
        group.restore(state.get("unsettled", []), self.clock(), int(time.time() * 1000))
        if group.dead:
            self.to_dispatch.add(group)  # dead letters are stored without waiting for a member
        group.skip_retained(log_.start_offset)  # retention ran past it while the broker was down
        self.groups[(topic, name)] = group
        return group

    def _stored_group_settings(self, topic: str, name: str, state: dict[str, Any]) -> GroupSettings:
        """A group's stored settings; one out of range (a hand-edited groups.json) is logged and the default used.

        The same bounds as a SUBSCRIBE's: a stored setting must never make a group
        dead-letter everything, expire every lease at once, or retry an impossible dead letter.
        """
        defaults = GroupSettings(
            max_deliveries=self.settings.max_deliveries, ack_timeout_ms=self.settings.ack_timeout_ms
        )
        values = {**defaults.to_dict(), **{k: state[k] for k in defaults.to_dict() if k in state}}
        bounds = {"max_deliveries": (1, INT64_MAX), "ack_timeout_ms": (1, INT32_MAX)}
        for key, (low, high) in bounds.items():
            if not low <= values[key] <= high:
                log.error(
                    "group %s/%s: stored %s %r is out of range [%d, %d]; using %r",
                    topic,
                    name,
                    key,
                    values[key],
                    low,
                    high,
                    getattr(defaults, key),
                )
                values[key] = getattr(defaults, key)
        if values["dead_letter_topic"]:
            try:
                check_name(values["dead_letter_topic"])
                if values["dead_letter_topic"] == topic:
                    raise InvalidName("it is the group's own topic: dead letters would loop back to the group")
            except InvalidName as exc:
                log.error("group %s/%s: stored dead_letter_topic refused (%s); using %s.dlq", topic, name, exc, topic)
                values["dead_letter_topic"] = ""
        return GroupSettings(**values)

    def _skipped_by_retention(self, group: Group, count: int) -> None:
        """A group moved past messages retention deleted before it got to them: say so, and count them."""
        log.warning(
            "group %s/%s: %d message(s) skipped: retention deleted them before the group got to them; "
            "it goes on from offset %d",
            group.topic,
            group.name,
            count,
            group.next_offset,
        )
        self.metrics.skipped_messages.labels(group.topic, group.name, "retention").inc(count)

    def _skip_retained(self, moved: list[TopicLog]) -> None:
        """After retention: a group below its log's new start goes on from there, members or not."""
        for log_ in moved:
            for group in self.groups.of_topic(log_.name):
                if group.skip_retained(log_.start_offset):
                    self.to_dispatch.add(group)

    def bind(self) -> str:
        self.ctx = zmq.Context()
        self.security: ServerSecurity | None = None
        s = self.settings
        check_server_options(s.curve_secret_key, s.curve_authorized_keys, s.curve_allow_any_client)
        if s.curve_secret_key:
            self.security = ServerSecurity(
                self.ctx,
                s.curve_secret_key,
                s.curve_authorized_keys,
                allow_any_client=s.curve_allow_any_client,
                failures=self.metrics.auth_failures,
            )
        sock = self.ctx.socket(zmq.ROUTER)
        if self.security is not None:
            self.security.apply(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, self.settings.sndhwm)
        sock.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_batch_bytes + 65536)
        try:
            sock.bind(self.settings.bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(
                f"cannot bind {self.settings.bind}: {exc.strerror} (another broker there? "
                "--bind takes tcp://HOST:PORT, port * for any free one)",
                bind=self.settings.bind,
            ) from None
        self.socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._setup_mirror()
        if self.settings.metrics_port >= 0:
            self.metrics_server = MetricsServer(
                self.registry,
                self.health,
                host=self.settings.metrics_bind,
                port=self.settings.metrics_port,
                live=lambda: broker_live(self),
                ready=lambda: broker_ready(self),
            ).start()
        return self.endpoint

    def _setup_mirror(self) -> None:
        s = self.settings
        patterns = tuple(p.strip() for p in s.mirror.split(",") if p.strip())
        if s.registry:
            self.registry_watch = RegistryWatch(
                s.registry, s.node, interval=s.registry_poll_ms / 1000, wake=self.stop_wake
            )
            upstream = self.registry_watch.read_parent() or s.upstream
        else:
            upstream = s.upstream
        if not (upstream or s.registry):
            return
        if s.mirror_gap_policy not in ("resync", "stop"):
            raise ConfigError("--mirror-gap-policy must be resync or stop")
        settings = MirrorSettings(
            upstream=upstream,
            patterns=patterns or ("*",),
            gap_policy=s.mirror_gap_policy,
            lag_threshold=s.mirror_lag_threshold,
            unreachable_after=s.mirror_unreachable_after_ms / 1000,
        )
        self.mirror = Mirror(self, settings)
        if not upstream:
            self.mirror.socket = None  # wait for the registry to name a parent

    def stop_wake(self) -> None:
        """Wake the loop from another thread (the registry watcher)."""
        with contextlib.suppress(AttributeError, OSError):
            self._wake.send(b"w")

    # --- the loop ----------------------------------------------------------------------

    def serve_forever(self, *, install_signals: bool = True, ready: Callable[[Broker], None] | None = None) -> None:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        if install_signals:
            signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        self._wake = wake_w
        self.store.creator.wake = self.stop_wake  # a topic made durable: confirm and deliver what it holds
        poller = self.poller
        poller.register(self.socket, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        if self.registry_watch is not None:
            self.registry_watch.start()
        self.running = True
        if ready:
            ready(self)
        if self.mirror is not None and self.mirror.settings.upstream:
            self._next_mirror_tick = self.clock()
        try:
            while self.running:
                events = dict(poller.poll(self._poll_timeout_ms()))
                started = time.perf_counter()
                self._last_pass = self.clock()
                if self.socket in events:
                    self._read_burst()
                if wake_r.fileno() in events:
                    drain(wake_r)
                if self.mirror is not None:
                    with self.containment.guard("mirror"):
                        self._mirror_pass(events)
                self._after_reads()
                self.metrics.loop_seconds.observe(time.perf_counter() - started)
        finally:
            self._shutdown()
            if install_signals:
                signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()

    def stop(self) -> None:
        """Ask the loop to stop after this pass; safe from signal handlers and threads."""
        self.running = False
        with contextlib.suppress(AttributeError, OSError):
            self._wake.send(b"x")

    def _read_burst(self) -> None:
        sock = self.socket
        self._pass_creations = 0
        for _ in range(READ_BURST):
            frames = recv_frames(sock)
            if frames is None:
                return
            self._handle(frames)
            if self._pass_creations >= CREATIONS_PER_PASS:
                return

    def _after_reads(self) -> None:
        now = self.clock()
        if now >= self._next_housekeeping:
            self._housekeeping(now)
        self._handle_dead_letters()
        self.appended.update(self.store.finish_creations())  # new topics now durable: confirm, deliver, serve
        # self.confirms: a pass that only answered resent (duplicate) batches still owes their confirms.
        if self.appended or self.confirms or self.store.next_sync_due() is not None:
            with self.containment.guard("group_commit"):
                self._group_commit()
        self._dispatch()

    def _mirror_pass(self, events: dict[Any, int]) -> None:
        mirror = self.mirror
        assert mirror is not None
        if self.registry_watch is not None:
            parent = self.registry_watch.parent
            if parent and parent != mirror.settings.upstream:
                mirror.change_upstream(parent)
        if mirror.socket is not None and mirror.socket in events:
            mirror.on_readable()
        now = self.clock()
        if now >= self._next_mirror_tick and (mirror.settings.upstream or mirror.socket is not None):
            self._next_mirror_tick = mirror.tick(now)

    def _poll_timeout_ms(self) -> int:
        now = self.clock()
        deadlines = [self._next_housekeeping]
        if self.mirror is not None:
            deadlines.append(self._next_mirror_tick)
        if self._timers:
            deadlines.append(self._timers[0][0])
        while self._fetch_deadlines and self._fetch_deadlines[0][2].done:
            heapq.heappop(self._fetch_deadlines)
        if self._fetch_deadlines:
            deadlines.append(self._fetch_deadlines[0][0])
        sync_due = self.store.next_sync_due()
        if sync_due is not None:
            deadlines.append(sync_due)
        return max(0, int((min(deadlines) - now) * 1000) + 1)

    # --- sending ---------------------------------------------------------------------

    def _send(self, peer: bytes, frames: list[Any]) -> bool:
        """Non-blocking send; EAGAIN means busy, EHOSTUNREACH means gone."""
        try:
            send_frames(self.socket, [peer, *frames], NOBLOCK)
        except zmq.Again:
            self.metrics.router_send_errors.labels("EAGAIN").inc()
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.metrics.router_send_errors.labels("EHOSTUNREACH").inc()
            self._peer_gone(peer, "unreachable")
            return False
        known = self.peers.get(peer)
        if known is not None:
            known.last_sent = self.clock()
        return True

    def _reply_error(self, peer: bytes, exc: ConveyorError, rid: Any = None) -> None:
        self.metrics.protocol_errors.labels(str(exc.code), exc.name).inc()
        if isinstance(exc, TooManyOpenFiles):
            self.metrics.descriptors_exhausted.inc()
        self._send(peer, commands.error(exc, rid))

    # --- dispatching commands -------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        rid = None
        try:
            frame = decode(body, max_batch_bytes=self.settings.max_batch_bytes)
            rid = frame.header.get("rid")
            self._touch(peer)
            handler = self._handlers.get(frame.command)
            if handler is None:
                raise InvalidRequest(f"{frame.command.name} is not a client command")
            handler(self, peer, frame)
        except ConveyorError as exc:
            self._reply_error(peer, exc, request_id(body) if rid is None else rid)
        except Exception as exc:  # the broker never dies of a client's bytes
            self.containment.record("request", exc, {"peer": peer.hex(), "command": self._command_name(body)})
            with self.containment.guard("request"):
                self._reply_error(peer, ConveyorError(f"internal error: {type(exc).__name__}"), rid)

    @staticmethod
    def _command_name(body: list[bytes]) -> str:
        with contextlib.suppress(Exception):
            return Command(body[1][0]).name
        return "?"

    def _touch(self, identity: bytes) -> Peer:
        peer = self.peers.get(identity)
        now = self.clock()
        if peer is None:
            peer = self.peers[identity] = Peer(identity, now)
        peer.last_seen = now
        if peer.busy:
            for group, member in peer.busy:
                if member.busy:
                    member.busy = False  # it talks, so it reads: try again
                    self.to_dispatch.add(group)
            peer.busy.clear()
        return peer

    def _on_hello(self, peer: bytes, frame: Frame) -> None:
        settings = self.settings
        self._send(
            peer,
            commands.welcome(
                frame.get("rid"),
                heartbeat_ms=settings.heartbeat_ms,
                liveness=settings.liveness,
                max_message_bytes=settings.max_message_bytes,
                max_batch_bytes=settings.max_batch_bytes,
                max_credit=settings.max_credit,
            ),
        )

    def _on_heartbeat(self, peer: bytes, frame: Frame) -> None:
        return None  # _touch already counted it

    def _on_bye(self, peer: bytes, frame: Frame) -> None:
        self._peer_gone(peer, "member_gone")

    # --- publish ---------------------------------------------------------------------

    def _on_publish(self, peer: bytes, frame: Frame) -> None:
        received = self.clock()
        topic = check_name(hfield(frame, "topic", str))
        producer_id = hfield(frame, "pid", int, NO_PRODUCER)
        sequence = hfield(frame, "seq", int, -1)
        if producer_id != NO_PRODUCER and sequence < 0:
            raise InvalidRequest("an idempotent PUBLISH needs seq >= 0", field="seq")
        body = bytes(frame.payload[0])
        count = self._validate(body)
        log_ = self._topic_for_write(topic, peer)
        started = time.perf_counter()
        try:
            result = log_.append(body, count, producer_id=producer_id, sequence=sequence)
        except ConveyorError as exc:
            self._fail_confirms(exc, cut_from=log_)  # a sync inside the append failed: the log was cut back
            raise
        self.metrics.append_seconds.observe(time.perf_counter() - started)
        counters = self.metrics.topic(topic)
        if result.duplicate:
            counters.duplicate_batches.inc()
        else:
            counters.published_messages.inc(count)
            counters.published_bytes.inc(len(body))
            counters.published_batches.inc()
            self.appended.add(topic)
        self.confirms.append(
            Confirm(peer, frame.get("rid"), log_, result.base_offset, count, result.duplicate, received)
        )

    def _validate(self, body: bytes) -> int:
        try:
            return validate_body(body, max_message_bytes=self.settings.max_message_bytes)
        except ConveyorError as exc:
            if "exceeds max" in exc.message:
                raise MessageTooLarge(
                    f"a message exceeds the limit of {self.settings.max_message_bytes} bytes",
                    limit=self.settings.max_message_bytes,
                ) from None
            raise

    def _topic_for_write(self, topic: str, peer: bytes | None = None) -> TopicLog:
        if topic not in self.store.logs:
            if not self.settings.auto_create_topics:
                raise UnknownTopic(f"no topic {topic} (auto-create is off)", topic=topic)
            self._admit_auto_create(topic, peer)
            self._pass_creations += 1
            self.store.create_topic(topic, background=True)  # no fsync here: see broker.creator
        log_ = self.store.topic(topic)
        if log_.config.read_only:
            raise ReadOnlyTopic(f"topic {topic} is read-only", topic=topic)
        return log_

    def _admit_auto_create(self, topic: str, identity: bytes | None) -> None:
        """TOPIC_LIMIT past the topic limit; RATE_LIMITED past the broker's or this connection's auto-create rate."""
        check_name(topic)
        self.topic_limits.check_room(len(self.store.logs), topic)
        peer = self.peers.get(identity) if identity is not None else None
        if peer is not None and peer.creations is None:
            peer.creations = TokenBucket(self.settings.auto_create_client_rate, self.clock)
        client = peer.creations if peer is not None and peer.creations is not None else TokenBucket(1e9)
        self.topic_limits.check_rate(topic, client)

    def check_topic_room(self, topic: str) -> None:
        """For ADMIN create_topic: the topic limit holds there too (its rate does not: an operator asks)."""
        self.topic_limits.check_room(len(self.store.logs), topic)

    def check_group_room(self, topic: str, name: str) -> None:
        if len(self.groups) >= self.settings.max_groups:
            raise GroupLimit(
                f"cannot create group {name} on {topic}: the broker holds {len(self.groups)} groups "
                f"(--max-groups {self.settings.max_groups})",
                topic=topic,
                group=name,
                limit=self.settings.max_groups,
            )

    def _group_commit(self) -> None:
        """One fsync for everything appended this pass, then the confirms."""
        started = time.perf_counter()
        synced: list[TopicLog] = []
        try:
            if self.store.fsync.mode == "interval":
                # A sync may come in a pass of its own, after the appends: it wakes what it made durable.
                synced = self.store.maybe_sync()
            else:
                self.store.sync(wait=False)  # the groups' files are written by the store's writer thread
        except ConveyorError as exc:
            log.error("group commit failed: %s", exc)
            self._fail_confirms(exc)
            return
        self._last_fsync_seconds = time.perf_counter() - started
        self.metrics.fsync_seconds.observe(self._last_fsync_seconds)
        self.appended.update(synced_log.name for synced_log in synced)
        for topic in self.appended:
            self._wake_fetches(topic)
            self.to_dispatch.update(self.groups.of_topic(topic))
        self.appended.clear()
        self._dispatch()  # deliveries before confirms: what consumers wait for leaves first
        self._send_confirms()

    def _send_confirms(self) -> None:
        now = self.clock()
        waiting: list[Confirm] = []
        for confirm in self.confirms:
            if confirm.base_offset + confirm.count > confirm.log.durable_offset:
                waiting.append(confirm)  # interval policy: not synced yet
                continue
            self.metrics.publish_seconds.observe(now - confirm.received)
            self._send(
                confirm.peer,
                commands.published(
                    confirm.rid,
                    confirm.log.name,
                    base_offset=confirm.base_offset,
                    count=confirm.count,
                    duplicate=confirm.duplicate,
                ),
            )
        self.confirms = waiting
        if self.dead_writes:
            stored = [w for w in self.dead_writes if w.end <= w.log.durable_offset]
            self._moved.update(w.group for w in stored)  # settled now: their offsets may commit
            self.dead_writes = [w for w in self.dead_writes if w.end > w.log.durable_offset]
            for write in stored:
                if write.letter.by_broker:
                    with self.containment.guard("dead_letter", topic=write.group.topic, group=write.group.name):
                        self._tell_dead_lettered(write)

    def _fail_confirms(self, exc: ConveyorError, cut_from: TopicLog | None = None) -> None:
        """Answer waiting confirms with ``exc``: all, or those of offsets ``cut_from`` no longer holds."""
        waiting: list[Confirm] = []
        for confirm in self.confirms:
            cut = confirm.log is cut_from and confirm.base_offset + confirm.count > confirm.log.end_offset
            if cut_from is None or cut:
                self._reply_error(confirm.peer, exc, confirm.rid)
            else:
                waiting.append(confirm)
        self.confirms = waiting
        for write in [w for w in self.dead_writes if w.end > w.log.end_offset]:  # cut: not dead-lettered after all
            self.dead_writes.remove(write)
            self._undead(write.group, write.letter)

    # --- subscriptions ------------------------------------------------------------------

    def _on_subscribe(self, peer: bytes, frame: Frame) -> None:
        topic = check_name(hfield(frame, "topic", str))
        name = check_name(hfield(frame, "group", str), "group")
        sub_id = hfield(frame, "sub", int)
        credit = self._credit(hfield(frame, "credit", int, self.settings.default_credit))
        batch_size = max(1, min(hfield(frame, "batch_size", int, credit), credit))
        known = self.peers[peer]
        if sub_id in known.members:  # before anything changes: a refused SUBSCRIBE sets nothing
            raise InvalidRequest(f"subscription {sub_id} already exists on this connection", field="sub")
        if hfield(frame, "dead_letter_topic", str, "") == topic:
            raise InvalidRequest(
                f"dead_letter_topic {topic} is the subscribed topic itself: a dead letter would be delivered "
                "to the group again, and again (name another topic, or leave it out for <topic>.dlq)",
                field="dead_letter_topic",
            )
        if (topic, name) not in self.groups:
            self.check_group_room(topic, name)  # before the topic is made for it
        if topic not in self.store.logs:
            self._topic_for_write(topic, peer)  # subscribing first is normal: create it
        group = self.groups.get((topic, name))
        if group is None:
            group = self._create_group(topic, name, frame)
        else:
            self._apply_settings(group, self._subscription_settings(frame, group.settings), peer)
        member = Member(peer, sub_id, credit, batch_size)
        group.join(member)
        known.members[sub_id] = (group, member)
        self.to_dispatch.add(group)
        log_ = self.store.topic(topic)
        self._send(
            peer,
            commands.subscribed(
                frame.get("rid"),
                sub_id,
                topic,
                name,
                committed_offset=group.committed_offset,
                end_offset=log_.end_offset,
                heartbeat_ms=self.settings.heartbeat_ms,
            ),
        )

    def _credit(self, credit: int, *, minimum: int = 1) -> int:
        if not minimum <= credit <= self.settings.max_credit:
            raise InvalidRequest(
                f"credit must be between {minimum} and {self.settings.max_credit}", limit=self.settings.max_credit
            )
        return credit

    def _create_group(self, topic: str, name: str, frame: Frame) -> Group:
        log_ = self.store.topic(topic)
        start = frame.get("start", "earliest")
        if topic in self.store.groups_quarantined and start != "earliest":
            # Its offsets were in the quarantined file: starting later could skip what it never acked.
            log.warning(
                "group %s/%s asks to start at %r, but %s's offsets file was quarantined and this may be an old "
                "group: starting at the log start instead (its messages are delivered again)",
                topic,
                name,
                start,
                topic,
            )
            start = "earliest"
        defaults = GroupSettings(
            max_deliveries=self.settings.max_deliveries, ack_timeout_ms=self.settings.ack_timeout_ms
        )
        settings = self._subscription_settings(frame, defaults)
        state = {"committed_offset": admin.resolve_position(log_, start), **settings.to_dict()}
        group = self._make_group(topic, name, state)
        self.store.save_group(topic, name, {**group.settings.to_dict(), "committed_offset": group.next_offset})
        return group

    def _subscription_settings(self, frame: Frame, current: GroupSettings) -> GroupSettings:
        """The group settings a SUBSCRIBE asks for; a field it leaves out keeps ``current``."""
        settings = GroupSettings(
            max_deliveries=hfield(frame, "max_deliveries", int, current.max_deliveries),
            ack_timeout_ms=hfield(frame, "ack_timeout_ms", int, current.ack_timeout_ms),
            dead_letter_topic=hfield(frame, "dead_letter_topic", str, current.dead_letter_topic),
            key_affinity=hfield(frame, "key_affinity", bool, current.key_affinity),
        )
        if settings.max_deliveries < 1:
            raise InvalidRequest("max_deliveries must be at least 1", field="max_deliveries")
        if settings.ack_timeout_ms < 1:
            raise InvalidRequest("ack_timeout_ms must be at least 1", field="ack_timeout_ms")
        if settings.dead_letter_topic:
            check_name(settings.dead_letter_topic)
        return settings

    def _apply_settings(self, group: Group, settings: GroupSettings, peer: bytes) -> None:
        """The newest subscription's settings are the group's (what a redeploy expects): apply, log, store."""
        changes = group.settings.changes(settings)
        if not changes:
            return
        log.warning(
            "group %s/%s: settings changed by a new subscription from %s: %s",
            group.topic,
            group.name,
            peer.hex(),
            ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()),
        )
        group.apply_settings(settings)
        group.settings_changed = {
            "at_ms": int(time.time() * 1000),
            "by": peer.hex(),
            "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()},
        }
        state = self.store.group(group.topic, group.name) or {}
        committed = state.get("committed_offset", group.committed_offset)
        self.store.save_group(group.topic, group.name, {**state, **settings.to_dict(), "committed_offset": committed})
        self.metrics.group_settings_changes.labels(group.topic, group.name).inc()
        self.to_dispatch.add(group)

    def _member(self, peer: bytes, frame: Frame) -> tuple[Group, Member]:
        sub_id = hfield(frame, "sub", int)
        found = self.peers[peer].members.get(sub_id)
        if found is None:
            raise NotSubscribed(f"no subscription {sub_id} on this connection; subscribe again", sub=sub_id)
        return found

    def _on_unsubscribe(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        self.peers[peer].members.pop(member.sub_id, None)
        self._leave(group, member, "member_gone")

    def _on_ack(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        before = member.in_flight
        touched = group.settle(member, hranges(frame))
        acked = before - member.in_flight
        if acked:
            self.metrics.group(group.topic, group.name).acked_messages.inc(acked)
            self.to_dispatch.add(group)
        now_ms = time.time() * 1000
        for chunk in touched:
            if not chunk.ranges and chunk.appended_ms:  # once per fully settled chunk, not per message
                latency = max(0.0, (now_ms - chunk.appended_ms) / 1000)
                self.metrics.group(group.topic, group.name).end_to_end_seconds.observe(latency)

    def _on_nack(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        delay = max(0, hfield(frame, "delay_ms", int, 0))
        error = str(frame.get("error") or "nack")
        release = bool(frame.get("release", False))
        count = group.nack(member, hranges(frame), delay_ms=delay, error=error, release=release)
        if count:
            self.metrics.nacked_messages.labels(group.topic, group.name).inc(count)
            reason = "released" if release else "nack"
            self.metrics.redelivered_messages.labels(group.topic, group.name, reason).inc(count)
            self.to_dispatch.add(group)

    def _on_in_progress(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        group.renew(member, hranges(frame))

    def _on_term(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        group.terminate(member, hranges(frame), str(frame.get("reason") or "terminated"))
        self.to_dispatch.add(group)

    def _on_credit(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        member.credit = self._credit(hfield(frame, "credit", int), minimum=0)  # 0 pauses the member
        member.batch_size = max(1, min(hfield(frame, "batch_size", int, member.batch_size), member.credit))
        self.to_dispatch.add(group)

    # --- delivering ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        groups, self.to_dispatch = self.to_dispatch, set()
        for group in groups:
            log_ = self.store.logs.get(group.topic)
            if log_ is None or self.groups.get((group.topic, group.name)) is not group:
                self.dispatch_retries.pop(group, None)
                continue
            retry = self.dispatch_retries.get(group) if self.dispatch_retries else None
            if retry is None or self.clock() >= retry[0]:  # a group paused after a failure waits for its retry
                self._dispatch_group(group, log_, retry)
            self._moved.add(group)
            self._schedule(group)

    def _dispatch_group(self, group: Group, log_: TopicLog, retry: tuple[float, float] | None) -> None:
        try:
            # A failed dispatch changes nothing; what lies before an unreadable batch is still delivered.
            plans, error = dispatch_contained(group, log_)
            for plan in plans:
                self._deliver(group, plan)
        except Exception as exc:
            error = exc
        if error is not None:  # contained to this group, which is tried again later
            self._dispatch_failed(group, error)
        elif retry is not None:
            del self.dispatch_retries[group]

    def _dispatch_failed(self, group: Group, exc: Exception) -> None:
        offset = exc.fields.get("offset", group.next_offset) if isinstance(exc, ConveyorError) else group.next_offset
        self.containment.record("dispatch", exc, {"topic": group.topic, "group": group.name, "offset": offset})
        name = exc.name if isinstance(exc, ConveyorError) else type(exc).__name__
        self.metrics.dispatch_errors.labels(group.topic, group.name, name).inc()
        self._retry_dispatch_later(group)

    def _retry_dispatch_later(self, group: Group) -> None:
        """A group whose dispatch raised is dispatched again after 1 s, doubling to 30 s while it fails."""
        _due, backoff = self.dispatch_retries.get(group, (0.0, DISPATCH_RETRY_SECONDS[0] / 2))
        backoff = min(backoff * 2, DISPATCH_RETRY_SECONDS[1])
        self.dispatch_retries[group] = (self.clock() + backoff, backoff)

    def _schedule(self, group: Group) -> None:
        """Make sure the loop wakes for the group's next lease expiry or delayed redelivery."""
        when = group.next_deadline()
        if when is None or self._timer_at.get(group, float("inf")) <= when:
            return  # nothing timed, or an earlier wake-up is already set (it schedules again)
        self._timer_at[group] = when
        heapq.heappush(self._timers, (when, next(self._seq), group))

    def _due_groups(self, now: float) -> list[Group]:
        """Pop the timers that are due: the groups (still live) that must look at their leases and delays."""
        due: dict[Group, None] = {}
        while self._timers and self._timers[0][0] <= now:
            when, _seq, group = heapq.heappop(self._timers)
            if self._timer_at.get(group) == when:
                del self._timer_at[group]
            if self.groups.get((group.topic, group.name)) is group:
                due[group] = None
        return list(due)

    def _deliver(self, group: Group, plan: Delivery) -> None:
        if plan.member.peer not in self.peers:
            return  # gone during this dispatch: leaving already put its offsets back
        if plan.member.busy:
            group.undeliver(plan)  # an earlier DELIVER of this dispatch bounced: keep the member's order
            return
        entries = plan.entries
        frames = commands.deliver(
            plan.member.sub_id, group.topic, [e.wire() for e in entries], [e.batch.body for e in entries]
        )
        if not self._send(plan.member.peer, frames):
            peer = self.peers.get(plan.member.peer)
            if peer is not None:
                plan.member.busy = True
                peer.busy.append((group, plan.member))
                group.undeliver(plan)
            return
        messages = sum(e.end - e.first if e.offsets is None else len(e.offsets) for e in entries)
        counters = self.metrics.group(group.topic, group.name)
        counters.delivered_messages.inc(messages)
        counters.delivered_bytes.inc(sum(len(e.batch.body) for e in entries))

    def _handle_dead_letters(self) -> None:
        # Every path that makes dead letters (nack, term, leave, lease expiry) also queues the group for dispatch.
        for group in [g for g in self.to_dispatch if g.dead]:
            if self.groups.get((group.topic, group.name)) is not group:
                continue
            source = self.store.logs.get(group.topic)
            for dead in group.take_dead(source.start_offset if source is not None else 0):
                if source is None:
                    continue
                try:
                    self._dead_letter(group, source, dead)
                except Exception as exc:  # never lost: kept unsettled and tried again, slowly
                    context = {"topic": group.topic, "group": group.name, "ranges": dead.ranges[:4]}
                    self.containment.record("dead_letter", exc, context)
                    failures = self.metrics.dead_letter_failures.labels(group.topic, group.name, "internal")
                    failures.inc(count_offsets(dead.ranges))
                    self._undead(group, dead, delay=DEAD_LETTER_RETRY_SECONDS)
            self.to_dispatch.add(group)

    def _dead_letter(self, group: Group, source: TopicLog, dead: DeadLetter) -> None:
        built = dead_letter_body(source, dead.ranges, group=group.name, deliveries=dead.deliveries, reason=dead.reason)
        if built is None:
            return
        name = dead_letter_topic(group.topic, group.settings.dead_letter_topic)
        if name in self.store.logs and self.store.logs[name].config.read_only:
            # A mirror holds the parent's offsets: a local append would make it a different log.
            log.error(
                "dead-lettering %s/%s: %s is mirrored from the parent and read-only here; give the group a "
                "local dead-letter topic (dead_letter_topic, @retry_policy(dead_letter=...)). Redelivering "
                "in %.0f s instead",
                group.topic,
                group.name,
                name,
                DEAD_LETTER_RETRY_SECONDS,
            )
            self.metrics.dead_letter_failures.labels(group.topic, group.name, "read_only_topic").inc(built[1])
            self._undead(group, dead, delay=DEAD_LETTER_RETRY_SECONDS)
            return
        try:
            target = self.store.get_or_create(name)
            result = target.append(built[0], built[1])
        except ConveyorError as exc:
            retriable = exc.retriable
            delay = 1.0 if retriable else DEAD_LETTER_RETRY_SECONDS
            log.error(
                "dead-lettering %s/%s into %s failed, redelivering in %.0f s instead: %s",
                group.topic,
                group.name,
                name,
                delay,
                exc,
            )
            if name in self.store.logs:  # a sync inside the append may have cut it back
                self._fail_confirms(exc, cut_from=self.store.logs[name])
            reason = "storage" if retriable else exc.name.lower()
            self.metrics.dead_letter_failures.labels(group.topic, group.name, reason).inc(built[1])
            self._undead(group, dead, delay=delay)
            return
        self.dead_writes.append(DeadWrite(group, dead, target, result.base_offset + result.count))
        self.appended.add(target.name)
        self.metrics.dead_lettered_messages.labels(group.topic, group.name).inc(built[1])

    def _tell_dead_lettered(self, write: DeadWrite) -> None:
        """Tell a member of the group (the one that had them last, if still there) the broker dead-lettered
        these messages past ``max_deliveries``, so the runner can call ``@error_handler`` for them.

        An EVENT ``DEAD_LETTERED`` carrying the messages as DELIVER entries do; best effort: with no
        member left, or a member not reading, nobody is told (the dead-letter topic holds them anyway).
        """
        group, letter = write.group, write.letter
        members = group.members + group.joining
        member = next((m for m in members if m.key == letter.member), members[0] if members else None)
        source = self.store.logs.get(group.topic)
        if member is None or source is None:
            return
        entries = [e for a, b in letter.ranges for e in entries_for(source, a, b, letter.deliveries)]
        for start in range(0, len(entries), MAX_ENTRIES):
            part = entries[start : start + MAX_ENTRIES]
            for entry in part:
                entry.first_ms = letter.first_ms
            frames = commands.dead_lettered(
                member.sub_id,
                group.topic,
                reason=letter.reason,
                deliveries=letter.deliveries,
                dead_letter_topic=write.log.name,
                entries=[e.wire() for e in part],
                bodies=[e.batch.body for e in part],
            )
            self._send(member.peer, frames)

    def _undead(self, group: Group, letter: DeadLetter, *, delay: float = 1.0) -> None:
        """Dead letters that could not be stored are not settled: redeliver them (and dead-letter them again)."""
        if self.groups.get((group.topic, group.name)) is group:
            group.pending.append(
                Pending(
                    list(letter.ranges),
                    letter.deliveries,
                    self.clock() + delay,
                    letter.reason,
                    first_ms=letter.first_ms,
                )
            )
            self.to_dispatch.add(group)

    # --- fetch ---------------------------------------------------------------------------

    def _on_fetch(self, peer: bytes, frame: Frame) -> None:
        topic = check_name(hfield(frame, "topic", str))
        log_ = self.store.topic(topic)
        offset = hfield(frame, "offset", int, log_.start_offset)
        wait_ms = max(0, min(hfield(frame, "wait_ms", int, 0), self.settings.max_fetch_wait_ms))
        if offset >= log_.durable_offset and wait_ms > 0:
            wait = FetchWait(peer, frame, self.clock() + wait_ms / 1000, offset)
            self.fetch_waits[topic].append(wait)
            heapq.heappush(self._fetch_deadlines, (wait.deadline, next(self._seq), wait))
            return
        self._answer_fetch(peer, frame, log_)

    def _answer_fetch(self, peer: bytes, frame: Frame, log_: TopicLog) -> None:
        """Answer a FETCH; a parked one too, which may find retention (or a resync) moved the start past it."""
        offset = hfield(frame, "offset", int, log_.start_offset)
        max_messages = max(1, hfield(frame, "max_messages", int, 10_000))
        max_bytes = max(1, min(hfield(frame, "max_bytes", int, 1 << 20), self.settings.max_batch_bytes))
        batches = []
        if offset < log_.durable_offset:
            try:
                batches = log_.read(offset, max_bytes=max_bytes, max_messages=max_messages)
            except OffsetOutOfRange as exc:
                self._reply_error(peer, exc, frame.get("rid"))
                return
            batches = [b for b in batches if b.base_offset < log_.durable_offset][:MAX_ENTRIES]  # fits a header
        entries = [
            DeliveryEntry(b.base_offset, b.count, b.timestamp_ms, max(offset, b.base_offset), b.next_offset)
            for b in batches
        ]
        self._send(
            peer,
            commands.fetched(
                frame.get("rid"),
                log_.name,
                start_offset=log_.start_offset,
                end_offset=log_.durable_offset,
                entries=entries,
                bodies=[b.body for b in batches],
            ),
        )

    def _wake_fetches(self, topic: str) -> None:
        """Answer the FETCHes parked on ``topic`` whose offset became durable; the others wait on.

        A FETCH is answered with durable data only: under ``interval:MS`` an append is not a reason to
        answer, the sync that follows it (perhaps in a later pass) is. A deleted topic answers them all.
        """
        log_ = self.store.logs.get(topic)
        ready: list[FetchWait] = []
        still: list[FetchWait] = []
        for wait in self.fetch_waits.pop(topic, []):
            # Answered: durable data to read, or nothing any more (retention, a resync, a deletion).
            answer = log_ is None or wait.offset < log_.durable_offset or wait.offset < log_.start_offset
            (ready if answer else still).append(wait)
        if still:
            self.fetch_waits[topic] = still
        for wait in ready:
            self._finish_fetch(topic, wait)

    def _expire_fetches(self, now: float) -> None:
        while self._fetch_deadlines and self._fetch_deadlines[0][0] <= now:
            _when, _seq, wait = heapq.heappop(self._fetch_deadlines)
            if wait.done:
                continue
            topic = wait.frame.get("topic")
            waits = self.fetch_waits.get(topic)
            if waits is not None:
                waits.remove(wait)
                if not waits:
                    del self.fetch_waits[topic]
            self._finish_fetch(topic, wait)

    def _finish_fetch(self, topic: str, wait: FetchWait) -> None:
        """Answer a parked fetch: what its topic holds now, or UNKNOWN_TOPIC if the topic was deleted."""
        wait.done = True
        log_ = self.store.logs.get(topic)
        if log_ is None:
            gone = UnknownTopic(f"no topic {topic} (deleted)", topic=topic)
            self._reply_error(wait.peer, gone, wait.frame.get("rid"))
        else:
            try:
                self._answer_fetch(wait.peer, wait.frame, log_)
            except ConveyorError as exc:  # an unreadable batch is this fetch's answer, not the group commit's end
                self._reply_error(wait.peer, exc, wait.frame.get("rid"))

    # --- deletions -----------------------------------------------------------------------

    def topic_deleted(self, topic: str) -> None:
        """After an ADMIN delete: whatever waited on the topic is answered, and its metric series go."""
        self._wake_fetches(topic)  # parked fetches: UNKNOWN_TOPIC
        gone = UnknownTopic(f"no topic {topic} (deleted)", topic=topic)
        waiting: list[Confirm] = []
        for confirm in self.confirms:
            if self.store.logs.get(confirm.log.name) is confirm.log:
                waiting.append(confirm)
            else:
                self._reply_error(confirm.peer, gone, confirm.rid)
        self.confirms = waiting
        for write in [w for w in self.dead_writes if self.store.logs.get(w.log.name) is not w.log]:
            self.dead_writes.remove(write)  # its dead-letter topic went: not settled, redelivered
            self._undead(write.group, write.letter)
        self.metrics.forget_topic(topic)

    def group_deleted(self, topic: str, name: str) -> None:
        self.metrics.forget_group(topic, name)

    # --- mirrored topics: resync and refresh ---------------------------------------------

    def reset_topic(self, topic: str, offset: int, *, event: str | None = None) -> None:
        """Empty a topic's log at ``offset``; its groups start there again."""
        log_ = self.store.topic(topic)
        log_.reset_to(offset)
        for group in self.groups.of_topic(topic):
            group.skip_retained(offset)  # the parent's retention deleted what came before
            group.reset(offset)
            self.store.save_group(topic, group.name, {**group.settings.to_dict(), "committed_offset": offset})
            self.to_dispatch.add(group)
        self.store.write_groups()
        if event:
            self.announce(topic, event, offset)

    def announce(self, topic: str, event: str, offset: int) -> None:
        """Tell every subscriber of ``topic`` (an EVENT: RESET or READY)."""
        for group in self.groups.of_topic(topic):
            for member in group.members + group.joining:
                self._send(member.peer, commands.event(member.sub_id, topic, event, offset))
        log.info("topic %s: %s at offset %d", topic, event, offset)

    # --- admin ----------------------------------------------------------------------------

    def _on_admin(self, peer: bytes, frame: Frame) -> None:
        op = hfield(frame, "op", str)
        result = admin.run(self, op, frame.header)
        self._send(peer, commands.result(frame.get("rid"), result))

    # --- liveness and time ----------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        interval = self.settings.heartbeat_ms / 1000
        # Offsets are committed here: come back in time for --offsets-commit-ms too.
        self._next_housekeeping = now + min(interval, 0.25, max(0.01, self.settings.offsets_commit_ms / 1000))
        with self.containment.guard("heartbeats"):
            self._heartbeats(now, interval)
        for group in self._due_groups(now):
            with self.containment.guard("leases", topic=group.topic, group=group.name):
                self._expire_leases(group, now)
        with self.containment.guard("fetch_expiry"):
            self._expire_fetches(now)
        for group, (due, _backoff) in list(self.dispatch_retries.items()):
            if due <= now:
                self.to_dispatch.add(group)
        if now >= self._next_commit:
            self._next_commit = now + self.settings.offsets_commit_ms / 1000
            with self.containment.guard("offsets_commit"):
                self._commit_offsets()
            with self.containment.guard("retention"):
                self._skip_retained(self.store.apply_retention())

    def _heartbeats(self, now: float, interval: float) -> None:
        dead_after = interval * self.settings.liveness
        for identity, peer in list(self.peers.items()):
            if now - peer.last_seen > dead_after:
                if peer.members:
                    log.info("peer %s missed its heartbeats: evicting", identity.hex())
                self._peer_gone(identity, "member_gone")
            elif peer.members and now - peer.last_sent >= interval:
                self._send(identity, commands.heartbeat())

    def _expire_leases(self, group: Group, now: float) -> None:
        expired = group.expire_leases()
        if expired:
            self.metrics.redelivered_messages.labels(group.topic, group.name, "lease_expired").inc(expired)
        self.to_dispatch.add(group)  # due redeliveries go out; dispatch sets the group's next timer

    def _commit_offsets(self, *, every: bool = False) -> None:
        """Stage the offsets of the groups that may have moved (``every``: all of them) and hand them to the writer."""
        moved = list(self.groups.values()) if every else [*self._moved, *(w.group for w in self.dead_writes)]
        self._moved = set()
        dying: dict[Group, list[DeadLetter]] = {}
        for write in self.dead_writes:  # settled only once the dead-letter topic holds them durably
            dying.setdefault(write.group, []).append(write.letter)
        now, now_ms = self.clock(), int(time.time() * 1000)  # due times are saved on the wall clock
        states = {
            (g.topic, g.name): g.saved_state(now, now_ms, dying.get(g, ()))
            for g in moved
            if self.groups.get((g.topic, g.name)) is g
        }
        self.store.commit_groups(states)
        try:
            self.store.write_groups(wait=False)  # two fsyncs and a rename: not on the event loop
        except ConveyorError as exc:
            log.error("committing group offsets failed: %s", exc)

    def _peer_gone(self, identity: bytes, reason: str) -> None:
        peer = self.peers.pop(identity, None)
        if peer is None:
            return
        for group, member in peer.members.values():
            self._leave(group, member, reason)

    def _leave(self, group: Group, member: Member, reason: str) -> None:
        held = member.in_flight
        group.leave(member, reason=reason)
        if held:
            self.metrics.redelivered_messages.labels(group.topic, group.name, reason).inc(held)
        self.to_dispatch.add(group)

    # --- shutdown and health ----------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop taking work, make everything durable, say goodbye."""
        for identity, peer in list(self.peers.items()):
            if peer.members:
                self._send(identity, commands.bye("broker shutting down"))
        for waits in self.fetch_waits.values():
            for wait in waits:
                self._reply_error(wait.peer, ShuttingDown("broker shutting down"), wait.frame.get("rid"))
        try:
            self.store.sync(force=True)
            self._send_confirms()
            self._commit_offsets(every=True)
        finally:
            self.store.close()
            if self.mirror is not None:
                self.mirror.close()
            if self.registry_watch is not None:
                self.registry_watch.stop()
            self.socket.close(linger=500)
            if self.security is not None:
                self.security.stop()
            self.ctx.term()
            if self.metrics_server:
                self.metrics_server.stop()

    def health(self) -> dict[str, Any]:
        return broker_health(self)

    def _state_snapshot(self) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        return admin.state_snapshot(self)

    _handlers: dict[Command, Callable[[Broker, bytes, Frame], None]] = {
        Command.HELLO: _on_hello,
        Command.HEARTBEAT: _on_heartbeat,
        Command.BYE: _on_bye,
        Command.PUBLISH: _on_publish,
        Command.SUBSCRIBE: _on_subscribe,
        Command.UNSUBSCRIBE: _on_unsubscribe,
        Command.ACK: _on_ack,
        Command.NACK: _on_nack,
        Command.IN_PROGRESS: _on_in_progress,
        Command.TERM: _on_term,
        Command.CREDIT: _on_credit,
        Command.FETCH: _on_fetch,
        Command.ADMIN: _on_admin,
    }
