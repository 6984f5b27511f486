"""The broker: one event loop around one ROUTER socket, a command table, and thin handlers.

Each pass reads every waiting message, appends all PUBLISH batches, syncs
once under the fsync policy (the group commit), then confirms and
dispatches; housekeeping (heartbeats, leases, delayed redeliveries, offset
commits, retention) runs on deadlines that set the poll timeout. Nothing
polls on a timer for work: an append triggers dispatch in the same pass.

As in the zguide's Majordomo broker, the loop is small and the state lives
in small classes: ``Peers`` (liveness), ``Confirms`` (fsync, then confirm),
``FetchWaits`` (long-poll FETCH), ``GroupTable`` (the groups), ``Dispatcher``
(deliveries and timers), ``DeadLetters`` and the health checks.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.log.topic_log import TopicLog
from conveyor.broker.net.transport import NOBLOCK, recv_frames, send_frames
from conveyor.broker.net.wakeup import drain
from conveyor.broker.server import admin
from conveyor.broker.server.admission import Admission
from conveyor.broker.server.confirms import Confirm, Confirms
from conveyor.broker.server.containment import Containment
from conveyor.broker.server.dead_letters import DeadLetters
from conveyor.broker.server.dispatcher import Dispatcher
from conveyor.broker.server.fetch_waits import FetchWaits
from conveyor.broker.server.group_table import GroupTable
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.server.health import LoopTimes, broker_health, broker_live, broker_ready
from conveyor.broker.server.limits import TopicLimits
from conveyor.broker.server.metadata import MetadataProvider, SingleNodeMetadata, metadata_reply
from conveyor.broker.server.metrics_state import cluster_snapshot, state_snapshot
from conveyor.broker.server.mirror import Mirror
from conveyor.broker.server.partition_logs import log_for
from conveyor.broker.server.partitions import Partitions, check_client_topic
from conveyor.broker.server.peers import Peers
from conveyor.broker.server.startup import bind_router, open_mirror, open_store
from conveyor.broker.server.subscription_fields import check_dead_letter_topic, checked_credit, group_settings
from conveyor.broker.server.topology import RegistryWatch
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, Frame, decode, request_id
from conveyor.broker.wire.protocol import field as hfield
from conveyor.broker.wire.protocol import ranges as hranges
from conveyor.broker.wire.record import NO_PRODUCER
from conveyor.monitoring.http import MetricsServer
from conveyor.monitoring.metrics import (
    BrokerMetrics,
    ClusterCollector,
    HealthCollector,
    NullMetrics,
    StateCollector,
)
from prometheus_client import CollectorRegistry

from conveyor.errors import ConveyorError, InvalidRequest, TooManyOpenFiles
from conveyor.names import partition_log, split_log
from conveyor.version import __version__

if TYPE_CHECKING:
    from conveyor.broker.server.cluster_node import ClusterNode
    from conveyor.broker.server.group_log import DeliveryGate
    from conveyor.broker.server.group_roles import GroupRoles

log = logging.getLogger("conveyor.broker")

READ_BURST = 4096  # messages read per pass before the group commit
# Creating a topic (and its group) is the costliest thing a request can ask of a pass: a pass that
# created this many ends its reads there, so the confirms and deliveries of others are not held
# behind a burst of thousands of creations (the rest is read in the next pass, at once).
CREATIONS_PER_PASS = 64


class Broker:
    def __init__(self, settings: BrokerSettings, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.clock: Callable[[], float] = time.monotonic
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.metrics: Any = BrokerMetrics(self.registry) if settings.metrics else NullMetrics()
        self.containment = Containment(self.metrics.internal_errors, clock=self.clock)
        if settings.metrics:
            self.registry.register(StateCollector(lambda: state_snapshot(self)))
            if settings.cluster:
                self.registry.register(ClusterCollector(lambda: cluster_snapshot(self)))
        self.registry.register(HealthCollector(self.health))
        self.store: Store = open_store(settings, self.metrics)
        # The loop's sets, shared with the small classes: work follows what changed, never the number
        # of topics or groups.
        self.to_dispatch: set[Group] = set()  # groups to dispatch this pass
        self.appended: set[str] = set()  # topics appended to since the last group commit
        self._moved: set[Group] = set()  # groups whose committed offset may have changed since the last commit
        self.groups = GroupTable(
            self.store,
            defaults=self._group_defaults,
            max_groups=settings.max_groups,
            metrics=self.metrics,
            to_dispatch=self.to_dispatch,
            clock=self.clock,
        )
        self.peers = Peers(self.clock, self.to_dispatch, self.metrics.redelivered_messages)
        self.confirms = Confirms(self._send, self._reply_error, self.metrics.publish_seconds, self.clock)
        self.fetches = FetchWaits(
            self.store,
            self._send,
            self._reply_error,
            self.clock,
            max_wait_ms=settings.max_fetch_wait_ms,
            max_batch_bytes=settings.max_batch_bytes,
        )
        self.dispatcher = Dispatcher(
            self.store,
            self.groups,
            self.peers,
            to_dispatch=self.to_dispatch,
            moved=self._moved,
            send=self._send,
            metrics=self.metrics,
            containment=self.containment,
            clock=self.clock,
        )
        self.dead_letters = DeadLetters(
            self.store,
            self.groups,
            to_dispatch=self.to_dispatch,
            appended=self.appended,
            moved=self._moved,
            send=self._send,
            on_cut=self._fail_confirms,
            metrics=self.metrics,
            containment=self.containment,
            clock=self.clock,
        )
        self.running = False
        self.endpoint = ""
        self.metrics_server: MetricsServer | None = None
        self._next_housekeeping = 0.0
        self._next_commit = 0.0
        self.loop_times = LoopTimes(last_pass=self.clock())
        self.poller = zmq.Poller()
        self.mirror: Mirror | None = None
        self.partitions: Partitions | None = None  # this node's replicated partitions (cluster mode only)
        self.gate: DeliveryGate | None = None  # cluster mode: deliveries wait for their group-state record
        self.group_roles: GroupRoles | None = None  # cluster mode: groups follow their topic's leadership
        self.cluster: ClusterNode | None = None  # the etcd side of cluster mode (--cluster)
        self._next_partitions_tick: float | None = None
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        self.registry_watch: RegistryWatch | None = None
        self._next_mirror_tick = 0.0
        self.topic_limits = TopicLimits(settings.max_topics, settings.auto_create_rate, clock=self.clock)
        self.topic_limits.refresh(len(self.store.logs))
        self.admission = Admission(
            self.store,
            self.peers,
            self.topic_limits,
            auto_create=settings.auto_create_topics,
            client_rate=settings.auto_create_client_rate,
            max_message_bytes=settings.max_message_bytes,
            clock=self.clock,
        )
        self.groups.load()
        # Who leads what, for METADATA: "me" here; a cluster node replaces it with its etcd view.
        self.metadata: MetadataProvider = SingleNodeMetadata(
            settings.node,
            lambda: self.endpoint,
            lambda: self.store.logs.keys(),
            lambda t: self.store.partition_count(t),
        )

    def _group_defaults(self) -> GroupSettings:
        return GroupSettings(max_deliveries=self.settings.max_deliveries, ack_timeout_ms=self.settings.ack_timeout_ms)

    @property
    def max_batch_bytes(self) -> int:
        return self.settings.max_batch_bytes

    # --- setup -------------------------------------------------------------------

    def bind(self) -> str:
        self.ctx = zmq.Context()
        self.socket, self.security = bind_router(self.ctx, self.settings, self.metrics)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.mirror, self.registry_watch = open_mirror(self.settings, self, self.stop_wake)
        if self.settings.cluster:
            self.cluster = self._join_cluster()
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

    def _join_cluster(self) -> ClusterNode:
        """Cluster mode: roles come from etcd through the agent, and METADATA answers from its view."""
        from conveyor.broker.server.cluster_node import ClusterNode

        partitions = self.replicate(self.settings.node_id, lag_max_ms=self.settings.replica_lag_max_ms)
        node = ClusterNode(self, partitions, self.settings, version=__version__)
        self.fetches.partition_count = node.partition_count
        self.fetches.missing = node.check_held
        node.agent.check_node_id()  # before anything serves: a live node's id is refused
        self.metadata = node
        return node

    def replicate(self, node_id: str, **options: Any) -> Partitions:
        """Take part in replication as ``node_id``: roles are then set through the returned ``Partitions``.

        Confirms and readers from then on see a replicated partition only up to its high
        watermark, and PUBLISH/SUBSCRIBE go to its leader only. ``options`` go to ``Partitions``.
        """
        self.partitions = Partitions(self, node_id, clock=self.clock, **options)
        self.fetches.replicas = self.partitions
        self._next_partitions_tick = self.clock()
        self._replicate_groups(self.partitions)
        return self.partitions

    def _replicate_groups(self, partitions: Partitions) -> None:
        """Consumer groups follow leadership: built from the group log on leading, gated on its HW."""
        from conveyor.broker.server.group_log import DeliveryGate
        from conveyor.broker.server.group_roles import GroupRoles

        roles = self.group_roles = GroupRoles(self, partitions)
        self.gate = DeliveryGate(self.store, roles, clock=self.clock)
        roles.gate = self.gate
        self.dispatcher.gate = self.gate
        self.dead_letters.gate = self.gate
        partitions.on_lead = roles.lead
        partitions.on_step_down = roles.step_down
        self.groups.clear()  # groups.json's groups come back when this node leads their topic

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread in its next pass (from any thread: the cluster agent, a test)."""
        self._soon.append(fn)
        self.stop_wake()

    def fail_confirms_of(self, topic: str, exc: ConveyorError) -> None:
        """Answer the confirms waiting on ``topic`` with ``exc`` (this node no longer leads it)."""
        self.confirms.fail_topic(exc, topic)

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
        if self.cluster is not None:
            self.cluster.start()
        try:
            while self.running:
                events = dict(poller.poll(self._poll_timeout_ms()))
                started = time.perf_counter()
                self.loop_times.last_pass = self.clock()
                if self.socket in events:
                    self._read_burst()
                if wake_r.fileno() in events:
                    drain(wake_r)
                while self._soon:
                    with self.containment.guard("call_soon"):
                        self._soon.popleft()()
                if self.mirror is not None:
                    with self.containment.guard("mirror"):
                        self._mirror_pass(events)
                if self.cluster is not None:
                    with self.containment.guard("cluster"):
                        self.cluster.pump()
                        if self.cluster.shutdown.requested and self.cluster.shutdown_step(self.clock()):
                            self.running = False  # handed off (or out of time): stop after this pass
                if self.partitions is not None:
                    with self.containment.guard("replication"):
                        self._replication_pass(events)
                self._after_reads()
                self.metrics.loop_seconds.observe(time.perf_counter() - started)
        finally:
            self._shutdown()
            if install_signals:
                signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()

    def stop(self) -> None:
        """Ask the loop to stop after this pass; safe from signal handlers and threads.

        A cluster node first hands what it leads to in-sync followers (a controlled
        shutdown, bounded in time) and stops once that is done; a second call stops at once.
        """
        if self.cluster is not None and self.running and not self.cluster.shutdown.requested:
            self.cluster.shutdown.requested = True
        else:
            self.running = False
        with contextlib.suppress(AttributeError, OSError):
            self._wake.send(b"x")

    def _read_burst(self) -> None:
        sock = self.socket
        admission = self.admission
        admission.creations = 0
        for _ in range(READ_BURST):
            frames = recv_frames(sock)
            if frames is None:
                return
            self._handle(frames)
            if admission.creations >= CREATIONS_PER_PASS:
                return

    def _after_reads(self) -> None:
        now = self.clock()
        timer = self.dispatcher.timers.next_due()  # a lease expiry or a delayed (re)delivery: go at its time, not
        if now >= self._next_housekeeping or (timer is not None and now >= timer):  # at the next housekeeping
            self._housekeeping(now)
        self.dead_letters.handle()
        self.appended.update(self.store.finish_creations())  # new topics now durable: confirm, deliver, serve
        if self.partitions is not None:
            for topic in self.appended:  # followers' FETCHes leave before this node's fsync: the two overlap
                self.fetches.wake(topic)
        # self.confirms: a pass that only answered resent (duplicate) batches still owes their confirms.
        if self.appended or self.confirms or self.store.next_sync_due() is not None:
            with self.containment.guard("group_commit"):
                self._group_commit()
        self.dispatcher.run()

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

    def _replication_pass(self, events: dict[Any, int]) -> None:
        partitions = self.partitions
        assert partitions is not None
        retry = partitions.on_events(events)
        now = self.clock()
        due = self._next_partitions_tick
        if retry is not None and (due is None or retry < due):
            due = self._next_partitions_tick = retry  # an error answer: fetch again then, not at the planned tick
        if due is None or now >= due:
            self._next_partitions_tick = partitions.tick(now)

    def _poll_timeout_ms(self) -> int:
        deadlines = [self._next_housekeeping, self.dispatcher.timers.next_due(), self.fetches.next_deadline()]
        if self.mirror is not None:
            deadlines.append(self._next_mirror_tick)
        if self.partitions is not None:
            deadlines.append(self._next_partitions_tick)
        if self.cluster is not None and self.cluster.shutdown.requested:
            deadlines.append(self.clock() + 0.05)  # a controlled shutdown checks its progress and deadline
        deadlines.append(self.store.next_sync_due())
        return max(0, int((min(d for d in deadlines if d is not None) - self.clock()) * 1000) + 1)

    def _group_commit(self) -> None:
        """One fsync for everything appended this pass, then the deliveries, then the confirms."""
        started = time.perf_counter()
        synced: list[TopicLog] = []
        if self.partitions is not None:
            # What followers' FETCHes moved a high watermark over this pass is already durable here:
            # it goes now, not after this pass's own fsync (of appends it does not depend on).
            self.dispatcher.run()
            self._send_confirms()
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
        self.loop_times.fsync_seconds = time.perf_counter() - started
        self.metrics.fsync_seconds.observe(self.loop_times.fsync_seconds)
        self.appended.update(synced_log.name for synced_log in synced)
        if self.partitions is not None:
            self.partitions.after_sync(self.appended)  # HW may move with this node's durable end
        for topic in self.appended:
            self.fetches.wake(topic)
            self.to_dispatch.update(self.groups.of_topic(topic))
        self.appended.clear()
        self.dispatcher.run()  # deliveries before confirms: what consumers wait for leaves first
        self._send_confirms()

    def _send_confirms(self) -> None:
        self.confirms.send_durable()
        self.dead_letters.settle_durable()

    def _fail_confirms(self, exc: ConveyorError, cut_from: TopicLog | None = None) -> None:
        """Answer waiting confirms with ``exc`` (all, or those ``cut_from`` lost); cut dead letters go back."""
        self.confirms.fail(exc, cut_from)
        self.dead_letters.cut()

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
            self.peers.gone(peer, "unreachable")
            return False
        self.peers.sent(peer)
        return True

    def _reply_error(self, peer: bytes, exc: ConveyorError, rid: Any = None) -> None:
        self.metrics.protocol_errors.labels(str(exc.code), exc.name).inc()
        if isinstance(exc, TooManyOpenFiles):
            self.metrics.descriptors_exhausted.inc()
        self._send(peer, commands.error(exc, rid))

    # --- the command table and its handlers --------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        rid = None
        try:
            frame = decode(body, max_batch_bytes=self.settings.max_batch_bytes)
            rid = frame.header.get("rid")
            self.peers.touch(peer)
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
        return None  # touching the peer already counted it

    def _on_bye(self, peer: bytes, frame: Frame) -> None:
        self.peers.gone(peer, "member_gone")

    def _on_publish(self, peer: bytes, frame: Frame) -> None:
        received = self.clock()
        topic = log_for(self.store, frame, self.partition_count)  # partition k of T: the log T#k (T for 0)
        leader_epoch = None  # a single node writes batches without an epoch (magic 1)
        if self.partitions is not None:
            leader_epoch = self.partitions.check_publish(topic)  # NOT_LEADER, NOT_ENOUGH_REPLICAS: nothing appended
        producer_id = hfield(frame, "pid", int, NO_PRODUCER)
        sequence = hfield(frame, "seq", int, -1)
        if producer_id != NO_PRODUCER and sequence < 0:
            raise InvalidRequest("an idempotent PUBLISH needs seq >= 0", field="seq")
        body = bytes(frame.payload[0])
        count = self.admission.validate(body)
        log_ = self.admission.topic_for_write(topic, peer)
        started = time.perf_counter()
        try:
            result = log_.append(body, count, producer_id=producer_id, sequence=sequence, leader_epoch=leader_epoch)
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
        rid = frame.get("rid")
        partitions = self.partition_count(split_log(topic)[0])  # told in the confirm: producers learn added ones
        self.confirms.add(Confirm(peer, rid, log_, result.base_offset, count, result.duplicate, received, partitions))

    def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has: its topic.json's count, or in a cluster its config record's."""
        if self.cluster is not None:
            return self.cluster.partition_count(topic)
        return self.store.partition_count(topic)

    def _partition_logs(self, topic: str) -> list[str]:
        return [partition_log(topic, number) for number in range(self.partition_count(topic))]

    def check_topic_room(self, topic: str, logs: int = 1) -> None:
        self.admission.check_room(topic, logs)

    def _on_subscribe(self, peer: bytes, frame: Frame) -> None:
        topic = log_for(self.store, frame, self.partition_count)  # a member subscribes to each partition apart
        name = check_name(hfield(frame, "group", str), "group")
        sub_id = hfield(frame, "sub", int)
        if self.partitions is not None:
            check_client_topic(topic)
            self.partitions.check_leader(topic)
        credit = checked_credit(hfield(frame, "credit", int, self.settings.default_credit), self.settings.max_credit)
        batch_size = max(1, min(hfield(frame, "batch_size", int, credit), credit))
        known = self.peers[peer]
        if sub_id in known.members:  # before anything changes: a refused SUBSCRIBE sets nothing
            raise InvalidRequest(f"subscription {sub_id} already exists on this connection", field="sub")
        check_dead_letter_topic(frame, topic)
        if (topic, name) not in self.groups:
            self.groups.check_room(topic, name)  # before the topic is made for it
        if topic not in self.store.logs:
            self.admission.topic_for_write(topic, peer)  # subscribing first is normal: create it
        group = self.groups.get((topic, name))
        if group is None:
            settings = group_settings(frame, self._group_defaults())
            group = self.groups.create(topic, name, frame.get("start", "earliest"), settings)
        else:
            self.groups.apply_settings(group, group_settings(frame, group.settings), peer)
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
                partitions=count if (count := self.partition_count(topic)) > 1 else None,  # in a cluster: its record's
            ),
        )

    def _member(self, peer: bytes, frame: Frame) -> tuple[Group, Member]:
        return self.peers.subscription(peer, hfield(frame, "sub", int))

    def _on_unsubscribe(self, peer: bytes, frame: Frame) -> None:
        group, member = self._member(peer, frame)
        self.peers[peer].members.pop(member.sub_id, None)
        self.peers.leave(group, member, "member_gone")

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
        member.credit = checked_credit(hfield(frame, "credit", int), self.settings.max_credit, minimum=0)  # 0: paused
        member.batch_size = max(1, min(hfield(frame, "batch_size", int, member.batch_size), member.credit))
        self.to_dispatch.add(group)

    def _on_fetch(self, peer: bytes, frame: Frame) -> None:
        self.fetches.fetch(peer, frame)

    def _on_admin(self, peer: bytes, frame: Frame) -> None:
        op, rid = hfield(frame, "op", str), frame.get("rid")
        if self.partitions is not None and op in admin.GROUP_OPS:
            topic = hfield(frame, "topic", str)
            if not any(self.partitions.leader_of(name) for name in self._partition_logs(topic)):
                self.partitions.check_group_admin(topic)  # leads none of its partitions: NOT_LEADER
        if self.cluster is not None and self.cluster.handles(op):
            self.cluster.admin(op, frame.header, lambda answer: self._admin_answer(peer, rid, answer))
            return
        self._send(peer, commands.result(rid, admin.run(self, op, frame.header)))

    def _admin_answer(self, peer: bytes, rid: Any, answer: Any) -> None:
        """An ADMIN answered later (the controller created the topic): a result, or the error."""
        if isinstance(answer, ConveyorError):
            self._reply_error(peer, answer, rid)
        else:
            self._send(peer, commands.result(rid, answer))

    def _on_metadata(self, peer: bytes, frame: Frame) -> None:
        view = self.metadata.metadata(hfield(frame, "topics", list, None))
        self._send(peer, metadata_reply(frame.get("rid"), view))

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
        Command.METADATA: _on_metadata,
    }

    # --- what ADMIN and the mirror call ----------------------------------------------------

    def topic_deleted(self, topic: str) -> None:
        """After an ADMIN delete: whatever waited on the topic is answered, and its metric series go."""
        self.fetches.wake(topic)  # parked fetches: UNKNOWN_TOPIC
        self.confirms.topic_deleted(topic, self.store.logs)
        self.dead_letters.topic_deleted()
        self.metrics.forget_topic(topic)
        if self.group_roles is not None:
            self.group_roles.applied.pop(topic, None)  # a group log deleted: one made again is read from its start

    def group_deleted(self, topic: str, name: str) -> None:
        self.metrics.forget_group(topic, name)
        if self.gate is not None:
            self.gate.forget(topic, name)  # a deleted group stays deleted after a failover

    def reset_topic(self, topic: str, offset: int, *, event: str | None = None) -> None:
        """Empty a topic's log at ``offset`` (a mirror's resync or refresh); its groups start there again."""
        self.store.topic(topic).reset_to(offset)
        self.groups.reset_topic(topic, offset)
        if event:
            self.announce(topic, event, offset)

    def grow_topic(self, topic: str, partitions: int) -> None:
        """A mirrored topic has more partitions upstream: the same here (logs, groups, count, EVENT)."""
        admin.grow_topic(self, topic, partitions)

    def announce(self, topic: str, event: str, offset: int, *, partitions: int | None = None) -> None:
        """Tell every subscriber of ``topic`` (an EVENT: RESET or READY; PARTITIONS with the new count)."""
        for group in self.groups.of_topic(topic):
            for member in group.members + group.joining:
                self._send(member.peer, commands.event(member.sub_id, topic, event, offset, partitions=partitions))
        log.info("topic %s: %s at offset %d%s", topic, event, offset, f" ({partitions} partitions)" * bool(partitions))

    # --- liveness and time ----------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        interval = self.settings.heartbeat_ms / 1000
        # Offsets are committed here: come back in time for --offsets-commit-ms too.
        self._next_housekeeping = now + min(interval, 0.25, max(0.01, self.settings.offsets_commit_ms / 1000))
        with self.containment.guard("heartbeats"):
            self._heartbeats(now, interval)
        for group in self.dispatcher.timers.due(now, self.groups.live):
            with self.containment.guard("leases", topic=group.topic, group=group.name):
                expired = group.expire_leases()
                if expired:
                    self.metrics.redelivered_messages.labels(group.topic, group.name, "lease_expired").inc(expired)
                self.to_dispatch.add(group)  # due redeliveries go out; dispatch sets the group's next timer
        with self.containment.guard("fetch_expiry"):
            self.fetches.expire(now)
        self.dispatcher.retries_due(now)
        if now >= self._next_commit:
            self._next_commit = now + self.settings.offsets_commit_ms / 1000
            with self.containment.guard("offsets_commit"):
                self._commit_offsets()
            with self.containment.guard("retention"):
                self.groups.skip_retained(self.store.apply_retention())

    def _heartbeats(self, now: float, interval: float) -> None:
        gone, owed = self.peers.sweep(now, interval, self.settings.liveness)
        for identity in gone:
            self.peers.gone(identity, "member_gone")
        for identity in owed:
            self._send(identity, commands.heartbeat())

    def _commit_offsets(self, *, every: bool = False) -> None:
        """Commit the offsets of the groups that may have moved (``every``: all of them)."""
        moved = list(self.groups.values()) if every else [*self._moved, *(w.group for w in self.dead_letters.writes)]
        self._moved.clear()
        if self.group_roles is not None:
            self.group_roles.apply_followed()  # a follower's groups.json follows the leader's group log
        self.groups.commit(moved, self.dead_letters.dying())

    # --- shutdown and health ----------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop taking work, make everything durable, say goodbye."""
        for identity in self.peers.subscribers():
            self._send(identity, commands.bye("broker shutting down"))
        self.fetches.shutdown()
        try:
            self.store.sync(force=True)
            self._send_confirms()
            self._commit_offsets(every=True)
        finally:
            self.store.close()
            if self.mirror is not None:
                self.mirror.close()
            if self.partitions is not None:
                self.partitions.close()
            if self.cluster is not None:
                self.cluster.close(revoke=self.cluster.shutdown.requested)  # handed off: the key goes now
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
