"""Cluster mode: what etcd says drives this node's roles, and the roles' requests go back to etcd.

The ``ClusterAgent`` (``broker/cluster/agent.py``) runs on its own thread and
queues what changed; once per loop pass ``ClusterNode.pump`` applies it on the
loop's thread: a partition record naming this node leader makes it lead at
that epoch, one naming another leader makes it follow (``Partitions``), and
the in-sync set a leader wants written goes to the agent as a CAS whose
answer comes back as an event. The loop never waits for etcd.

Auto-created topics (a PUBLISH or SUBSCRIBE to a topic the cluster does not
know) go to the controller like ``conveyor topics create``: the request is
answered NOT_LEADER (retriable, no leader yet) and the client asks METADATA
again until the partition has a leader. With auto-create off it is answered
UNKNOWN_TOPIC, as a single node answers.

``topics delete`` goes to the controller, which removes the topic's records;
``topics alter`` is a CAS of the topic's config record. Every node acts on
what its watch then shows: a config gone drops the topic here as a single
node's delete does (its groups, its group log, its files; not ``<t>.dlq``,
a topic of its own), and a config changed is applied to the local log, at
once or when the node starts again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from conveyor.broker.cluster import decisions as d
from conveyor.broker.cluster.agent import ClusterAgent
from conveyor.broker.cluster.decisions import DEAD_LETTER_SUFFIX
from conveyor.broker.cluster.events import (
    ClusterEvent,
    ClusterSettings,
    ControllerChanged,
    LeaseLost,
    PartitionChanged,
    ReassignAnswer,
    Registered,
    ShutdownAnswer,
    TopicAltered,
    TopicChanged,
    TopicCreated,
    TopicDeleted,
)
from conveyor.broker.cluster.keys import TopicConfigRecord, TopicPartition
from conveyor.broker.config.addresses import etcd_members
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import altered, check_name
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.net.security import ClientKeys, ServerSecurity
from conveyor.broker.server import admin as admin_ops
from conveyor.broker.server.admin import AdminHost
from conveyor.broker.server.cluster_roles import ClusterRoles
from conveyor.broker.server.group_log import group_log_name, is_group_log
from conveyor.broker.server.metadata import ClusterMetadata, PartitionMetadata
from conveyor.broker.server.partition_logs import check_growth
from conveyor.broker.server.partitions import Partitions, check_client_topic
from conveyor.broker.wire.partitioning import unknown_partition

from conveyor.errors import ConfigError, ConveyorError, NotEnoughReplicas, NotLeader, TopicExists, UnknownTopic
from conveyor.names import partition_log, split_log

CLUSTER_ADMIN = frozenset({"create_topic", "reassign_topic", "delete_topic", "alter_topic", "add_partitions"})
TOPIC_ID = "cluster_topic_id"  # in a replica's topic.json ``extra``: which topic of that name it holds

log = logging.getLogger("conveyor.cluster")


class ClusterHost(AdminHost, Protocol):
    """What the cluster side needs of its broker: what ADMIN needs (a topic is deleted and described here
    as a single node does it), and more."""

    @property
    def security(self) -> ServerSecurity | None: ...  # CURVE on the broker's socket, if any

    def stop_wake(self) -> None: ...

    def announce(self, topic: str, event: str, offset: int, *, partitions: int | None = None) -> None: ...


def cluster_settings(settings: BrokerSettings, version: str = "", curve_public: str = "") -> ClusterSettings:
    """The agent's settings from the broker's ``--cluster`` flags."""
    password = None
    if settings.etcd_password_file:
        try:
            with open(settings.etcd_password_file, encoding="utf-8") as f:
                password = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--etcd-password-file {settings.etcd_password_file}: {exc.strerror}") from None
    scheme = "https" if settings.etcd_ca or settings.etcd_cert else "http"
    metrics = f"http://{settings.metrics_bind}:{settings.metrics_port}" if settings.metrics_port > 0 else ""
    return ClusterSettings(
        endpoints=tuple(f"{scheme}://{member}" for member in etcd_members(settings.cluster)),
        node_id=settings.node_id,
        advertise=settings.advertise or settings.bind,
        cluster_name=settings.cluster_name,
        metrics=metrics,
        version=version,
        curve_public=curve_public,
        lease_ms=settings.cluster_lease_ms,
        etcd_ca=settings.etcd_ca or None,
        etcd_cert=settings.etcd_cert or None,
        etcd_key=settings.etcd_key or None,
        etcd_user=settings.etcd_user or None,
        etcd_password=password,
    )


@dataclass
class ControlledShutdown:
    """Where a controlled shutdown is (Kafka's): stop appending, let a follower catch up, hand off, stop.

    ``DRAIN_SECONDS`` bounds the wait for a caught-up follower and
    ``HANDOFF_SECONDS`` the wait for the controller to move the leaderships; past
    them the node stops anyway (its partitions then fail over when its lease ends).
    """

    requested: bool = False
    started: float | None = None
    asked: float | None = None  # when the controller was asked
    request: int | None = None
    answered: bool = False


DRAIN_SECONDS = 5.0
HANDOFF_SECONDS = 5.0


class ClusterNode:
    """One node's part in the cluster: the agent's events in, role changes and ISR proposals out."""

    def __init__(
        self,
        host: ClusterHost,
        partitions: Partitions,
        settings: BrokerSettings,
        *,
        agent: ClusterAgent | None = None,
        version: str = "",
    ) -> None:
        self.host = host
        self.partitions = partitions
        self.settings = settings
        self.node_id = settings.node_id
        self.security = host.security
        curve_public = self.security.public.decode() if self.security is not None else ""
        self.agent = agent or ClusterAgent(cluster_settings(settings, version, curve_public), wake=host.stop_wake)
        self.roles = ClusterRoles(self.agent, partitions)
        self.configs: dict[str, TopicConfigRecord] = {}
        self.controller: str | None = None
        self.registered = False
        self._creating: set[str] = set()
        self._joined = False  # local topics were checked against the cluster's (first registration)
        self._leftovers: set[str] = set()  # copies of cluster topics the cluster no longer has (said once)
        self._answers: dict[int, Callable[[Any], None]] = {}  # ADMIN requests waiting for the controller
        self.shutdown = ControlledShutdown()
        partitions.propose = self.roles.propose
        if self.security is not None:
            # Replication uses CURVE as clients do: a follower fetches with the broker's own certificate,
            # and a leader lets in its own public key (brokers sharing one certificate). Brokers with
            # certificates of their own put each other's public key in --curve-authorized-keys.
            self.security.authorize_peers({self.security.public})
            partitions.replicas.keys_for = self._leader_keys
        partitions.on_unknown = self.auto_create
        self._handlers: dict[type[ClusterEvent], Callable[[Any], None]] = {
            Registered: self._on_registered,
            LeaseLost: self._on_lease_lost,
            ControllerChanged: self._on_controller,
            TopicChanged: self._on_topic,
            PartitionChanged: self._on_partition,
            TopicCreated: self._on_created,
            ReassignAnswer: self._on_reassign_stored,
            TopicDeleted: self._on_deleted,
            TopicAltered: self._on_altered,
            ShutdownAnswer: self._on_shutdown_answer,
        }

    def start(self) -> None:
        self.agent.start()

    def close(self, *, revoke: bool = False) -> None:
        self.agent.close(revoke=revoke)

    def _leader_keys(self, leader: str) -> ClientKeys | None:
        """CURVE keys to fetch from ``leader``: this broker's certificate, and the key its node record advertises."""
        if self.security is None:
            return None
        record = self.agent.snapshot().nodes.get(leader)
        server = record.curve_public.encode() if record is not None and record.curve_public else None
        return self.security.peer_keys(server)

    # --- events from the agent (on the loop's thread) -----------------------------------------

    def pump(self) -> None:
        """Apply everything the agent queued since the last pass."""
        for event in self.agent.poll():
            handler = self._handlers.get(type(event))
            if handler is not None:
                handler(event)
            self.roles.handle(event)  # partition records, nodes and ISR answers set this node's roles

    def _on_registered(self, event: Registered) -> None:
        self.registered = True
        log.info("node %s registered (lease %x, revision %d)", event.node_id, event.lease_id, event.revision)
        if not self._joined:  # at start only: a registration again after a lost lease finds nothing new
            self._joined = True
            self.register_local_topics()

    def register_local_topics(self) -> list[str]:
        """Topics this node's directory holds that the cluster does not know: ask the controller for them.

        This is how a single-node data directory joins a cluster (design §7): each such topic
        becomes replication factor 1 on this node, which leads it from the epoch after its
        log's last one (1 for batches written outside a cluster, which read as epoch 0),
        keeping its data and offsets. ``conveyor topics reassign`` then adds replicas. The
        agent's view is loaded when it says ``Registered``, so ``configs`` holds every topic
        the cluster knows; internal logs (``__`` names) follow their topic and are left out.
        A replica of a cluster topic (its ``topic.json`` names a topic id) that the cluster no
        longer has was deleted while this node was away, or etcd lost it: it is neither
        registered nor served, and its files stay until ``topics delete`` is sent to this node
        (data is never deleted because a record is missing; only a different topic id under
        the same name, which etcd holds, drops a copy by itself).
        """
        logs = sorted(self.host.store.logs)
        asked = [topic for topic in logs if not topic.startswith("__") and not split_log(topic)[1]]
        return [topic for topic in asked if self._register_local(topic)]

    def _register_local(self, topic: str) -> bool:
        """Ask for ``topic`` with this node's data (RF 1, this node leading); False if known or asked already."""
        log_ = self.host.store.logs.get(topic)
        if log_ is None or topic in self.configs or topic in self._creating:
            return False
        if self._cluster_copy(topic):  # a replica of a cluster topic, not a single node's data
            if self._joined and topic not in self._leftovers:  # the view is loaded: the cluster lacks it
                self._leftovers.add(topic)
                log_.set_high_watermark(log_.start_offset)  # a consumer FETCH here reads none of it
                log.warning(
                    "topic %s: this node holds a copy of a cluster topic the cluster no longer has (deleted while "
                    "this node was away?): not registered; `conveyor topics delete %s --broker <this node>` removes it",
                    topic,
                    topic,
                )
            return False
        count = self.host.store.partition_count(topic)
        epoch = max(held.last_epoch for held in self.host.store.partition_logs(topic)) + 1
        self._creating.add(topic)
        existing = ((self.node_id,), epoch)
        self.agent.create_topic(topic, 1, 1, log_.config.settings(), existing=existing, partitions=count)
        log.info(
            "local topic %s (offsets %d-%d) is not in the cluster: registering it on %s, epoch %d",
            topic,
            log_.start_offset,
            log_.end_offset,
            self.node_id,
            epoch,
        )
        return True

    def _on_lease_lost(self, event: LeaseLost) -> None:
        # Leadership follows the partition records only: a record naming another leader takes a
        # partition away. Until then this node keeps serving, and its HW cannot pass its ISR's.
        self.registered = False
        log.warning("lease %x lost: registering again", event.lease_id)

    def _on_controller(self, event: ControllerChanged) -> None:
        self.controller = event.controller

    def _on_topic(self, event: TopicChanged) -> None:
        if event.config is None:
            if self.configs.pop(event.topic, None) is not None or event.topic in self.host.store.logs:
                self.drop_topic(event.topic)
        else:
            self._set_config(event.topic, event.config)
            if self._stale(event.topic, event.config.topic_id):
                log.warning("topic %s: the copy here is of an earlier topic of that name: dropping it", event.topic)
                self.drop_topic(event.topic)  # the partition record makes it again, empty, if this node holds it
            self._apply_settings(event.topic, event.config)

    def _set_config(self, topic: str, config: TopicConfigRecord) -> None:
        before = self.configs.get(topic)
        self.configs[topic] = config
        if before is not None and config.partitions > before.partitions:
            self._grown(topic, config.partitions)

    def _grown(self, topic: str, partitions: int) -> None:
        """Partitions were added: partition 0's leader tells its subscribers, who subscribe to the new ones
        at their leaders (a group starts a partition added later at its earliest offset)."""
        if self.partitions.leader_of(topic) is not None:
            self.host.announce(topic, "PARTITIONS", 0, partitions=partitions)

    def _stale(self, topic: str, topic_id: str) -> bool:
        """This node's copy of ``topic`` belongs to another topic of that name (deleted while it was away)."""
        ids = {self.host.store.logs[name].config.extra.get(TOPIC_ID) for name in self.held(topic)}
        return bool(topic_id) and any(held and held != topic_id for held in ids)

    def held(self, topic: str) -> list[str]:
        """The logs of ``topic``'s partitions this node holds (``T``, ``T#k``), partition 0 last."""
        names = [name for name in self.host.store.logs if split_log(name)[0] == topic]
        return sorted(names, key=lambda name: -split_log(name)[1])

    def drop_topic(self, topic: str) -> None:
        """The cluster deleted ``topic``: drop it here as a single node's delete does.

        First what a single node's delete does (its groups go with their subscriptions, waiting
        confirms and fetches get UNKNOWN_TOPIC, its files go), so no client is sent to look for
        another leader; then its partition roles stop, and its group log ``__groups.<topic>``
        goes. ``<topic>.dlq`` is a topic of its own and stays.
        """
        self._creating.discard(topic)
        self._leftovers.discard(topic)
        store = self.host.store
        for name in self.held(topic):
            admin_ops.delete_log(self.host, name)
        roles = list(self.partitions.leading) + list(self.partitions.following)
        for tp in [tp for tp in roles if split_log(tp[0])[0] == topic]:
            self.partitions.stop(*tp)
        for name in [name for name in store.logs if is_group_log(name) and split_log(name)[0] == group_log_name(topic)]:
            store.delete_topic(name)
            self.host.topic_deleted(name)
        log.info("topic %s deleted from this node", topic)

    def _apply_settings(self, topic: str, config: TopicConfigRecord) -> None:
        """The cluster's settings of ``topic`` on this node's log (an alter, here or while it was down),
        and its topic id (a copy from before topic ids, or registered from a single node's data)."""
        for name in self.held(topic):
            log_ = self.host.store.logs[name]
            extra = _extra(config, topic, split_log(name)[1])
            if log_.config.with_settings(config.settings, extra=extra) == log_.config:
                continue
            before = log_.config.settings()
            try:
                self.host.store.alter_topic(name, config.settings, extra=extra)
            except ConveyorError as exc:  # a setting this node refuses (another version): the rest stays as it was
                log.warning("topic %s: the cluster's settings not applied here: %s", name, exc)
                continue
            after = log_.config.settings()
            changed = {setting: value for setting, value in after.items() if before.get(setting) != value}
            if changed:  # not only the topic id written
                log.info("topic %s: settings changed: %s", name, changed)

    def _on_partition(self, event: PartitionChanged) -> None:
        """Before the roles act on a record: this node's replica log exists, with the topic's settings."""
        if event.state is not None:
            self._creating.discard(event.tp.topic)
            if self.node_id in event.state.assignment:
                self._ensure_log(event.tp.topic, event.tp.partition)

    def _on_created(self, event: TopicCreated) -> None:
        answer = self._answers.pop(event.request_id, None)
        if event.error is not None:
            self._creating.discard(event.topic)
            log.warning("topic %s was not created: %s", event.topic, event.error)
        if answer is not None:
            answer(
                event.error
                if event.error is not None
                else _described(event.topic, event.config, self.host.store.defaults)
            )

    def _on_deleted(self, event: TopicDeleted) -> None:
        answer = self._answers.pop(event.request_id, None)
        if answer is not None:
            answer(event.error if event.error is not None else {"deleted": event.topic})

    def _on_altered(self, event: TopicAltered) -> None:
        answer = self._answers.pop(event.request_id, None)
        if event.config is not None:  # applied now, so the answer shows it (the watch brings it again)
            self._set_config(event.topic, event.config)
            self._apply_settings(event.topic, event.config)
        if answer is None:
            return
        if event.error is not None:
            answer(event.error)
        elif event.topic in self.host.store.logs:
            answer(admin_ops.describe_topic(self.host, event.topic))
        else:
            answer(_described(event.topic, event.config, self.host.store.defaults))

    def _ensure_log(self, topic: str, partition: int = 0) -> None:
        store = self.host.store
        name = partition_log(topic, partition)
        if name not in store.logs:
            config = self.configs.get(topic)
            extra = _extra(config, topic, partition) if config is not None else None
            store.create_topic(name, dict(config.settings) if config else None, extra=extra)

    def check_held(self, log_name: str) -> None:
        """A read of a partition this node holds no copy of: ``NOT_LEADER`` naming its leader when the cluster
        has it (a client given one node's address finds the partition there), else nothing (UNKNOWN_TOPIC)."""
        topic, number = split_log(log_name)
        if topic not in self.configs:
            return
        snapshot = self.agent.snapshot()
        state = snapshot.partitions.get(TopicPartition(topic, number))
        leader = state.leader if state is not None else None
        record = snapshot.nodes.get(leader) if leader else None
        hint = {"leader": leader, "leader_addr": record.advertise} if record is not None else {}
        raise NotLeader(f"{topic}/{number} is not held by {self.node_id}", topic=topic, partition=number, **hint)

    def partition_count(self, topic: str) -> int:
        """How many partitions the cluster says ``topic`` has (this node may hold none of them)."""
        config = self.configs.get(topic)
        return config.partitions if config is not None else self.host.store.partition_count(topic)

    # --- controlled shutdown -------------------------------------------------------------------

    def shutdown_step(self, now: float) -> bool:
        """One step of a controlled shutdown; True once the node may stop.

        Appends to led partitions stop at once (NOT_LEADER: clients ask METADATA
        again); when every led partition has an in-sync follower holding its whole
        log durably (or after ``DRAIN_SECONDS``) the controller is asked to move the
        leaderships to them; the node stops when it leads nothing more (or after
        ``HANDOFF_SECONDS``). Without a registration there is nobody to hand off to.
        """
        state, partitions = self.shutdown, self.partitions
        if state.started is None:
            state.started = now
            partitions.draining = True
            log.info("controlled shutdown: handing %d led partitions off", len(partitions.leading))
        if not partitions.leading or not self.registered:
            return True
        if state.asked is None:
            successors = partitions.successors()
            # A group log moves with its topic; a partition with no other in-sync member has nobody to wait for.
            topics = [tp for tp, led in partitions.leading.items() if not is_group_log(tp[0]) and len(led.isr) > 1]
            if any(tp not in successors for tp in topics) and now - state.started < DRAIN_SECONDS:
                return False
            state.asked = now
            state.request = self.agent.request_shutdown(
                {TopicPartition(topic, number): node for (topic, number), node in successors.items()}
            )
            return False
        if state.answered:  # the controller moved what it could: what is still led here had nobody to go to
            return True
        if now - state.asked >= HANDOFF_SECONDS:
            left = len(partitions.leading)
            log.warning("controlled shutdown: %d partitions still led after %.0f s", left, HANDOFF_SECONDS)
            return True
        return False

    def _on_shutdown_answer(self, event: ShutdownAnswer) -> None:
        if event.request_id == self.shutdown.request:
            self.shutdown.answered = True
            if event.error is not None:
                log.warning("controlled shutdown: %s", event.error)

    # --- requests to the agent --------------------------------------------------------------------

    def auto_create(self, topic: str) -> None:
        """A client named a topic the cluster does not know: ask the controller for it (once at a time).

        A topic this node's directory holds already (a client faster than the registration at
        start) is registered with its data, never placed anew on nodes that lack it. With
        ``--no-auto-create-topics`` a topic the cluster does not have is UNKNOWN_TOPIC.
        """
        if split_log(topic)[1]:
            return  # a partition past 0 is made with its topic, never on its own
        if self.settings.auto_create_topics:
            self.want_topic(topic)
        elif not self._known(topic):
            raise UnknownTopic(f"no topic {topic} (auto-create is off)", topic=topic)  # as a single node says

    def _known(self, topic: str) -> bool:
        """The cluster has ``topic``, or is making it, or this node holds it; or it is the dead-letter
        topic of a topic the cluster has (made through the controller when a first message dies,
        whatever ``--auto-create-topics`` says: its subscribers wait for it with NOT_LEADER)."""
        source = topic.removesuffix(DEAD_LETTER_SUFFIX)
        return (
            topic in self.configs
            or (source != topic and source in self.configs)
            or topic in self.agent.snapshot().topics
            or topic in self._creating
            or (topic in self.host.store.logs and not self._cluster_copy(topic))
            or is_group_log(topic)
        )

    def want_topic(self, topic: str) -> None:
        """Ask the controller for ``topic`` unless known or asked already (``auto_create`` without the
        setting: a dead-letter topic is made whatever ``--auto-create-topics`` says, as on a single node)."""
        topic = split_log(topic)[0]  # a dead-letter topic's partition: the topic, with its source's count
        source = self.configs.get(topic.removesuffix(DEAD_LETTER_SUFFIX))
        count = source.partitions if source is not None and topic.endswith(DEAD_LETTER_SUFFIX) else 1
        held = self.configs.get(topic)
        if held is not None and held.partitions < count and topic not in self._creating:
            self._creating.add(topic)  # once: the grown config's TopicChanged (or an error) ends it
            request = self.agent.alter_topic(topic, {}, partitions=count)  # a shared or older DLQ: as many partitions
            self._answers[request] = partial(self._grown_dead_letters, topic)
            return
        if topic in self.configs or topic in self._creating or is_group_log(topic):
            return
        if topic in self.host.store.logs and not self._cluster_copy(topic):
            self._register_local(topic)  # a single node's data: kept, this node leading it
            return
        self._creating.add(topic)
        # a copy left here is dropped for it
        self.agent.create_topic(topic, *self.replication(None, None), partitions=count)

    def _grown_dead_letters(self, topic: str, answer: Any) -> None:
        self._creating.discard(topic)
        if isinstance(answer, ConveyorError):
            log.warning("dead-letter topic %s not grown: %s", topic, answer)

    def _cluster_copy(self, topic: str) -> bool:
        """This node's log of ``topic`` is a replica of a cluster topic (its ``topic.json`` names a topic id)."""
        log_ = self.host.store.logs.get(topic)
        return log_ is not None and bool(log_.config.extra.get(TOPIC_ID))

    def replication(self, rf: int | None, min_insync: int | None) -> tuple[int | None, int | None]:
        """A new topic's replicas and in-sync minimum: what was asked, else this node's defaults
        (``--default-replication-factor``, ``--min-insync-replicas``; ``decisions.default_replication``)."""
        live = len(self.agent.snapshot().nodes)
        settings = self.settings
        return d.default_replication(
            rf, min_insync, live, settings.default_replication_factor, settings.min_insync_replicas
        )

    # --- ADMIN in a cluster ------------------------------------------------------------------------

    def handles(self, op: str) -> bool:
        """The ADMIN ops that change what the cluster holds: they go through the controller, not this node."""
        return op in CLUSTER_ADMIN

    def admin(self, op: str, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """Run a cluster ADMIN op; ``answer`` gets the result or a ``ConveyorError``, now or once etcd answered."""
        ops = {
            "create_topic": self.create,
            "reassign_topic": self.reassign,
            "delete_topic": self.delete,
            "alter_topic": self.alter,
            "add_partitions": self.add_partitions,
        }
        ops[op](header, answer)

    def create(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics create``: checked here (settings, RF, TOPIC_EXISTS), then made by the controller."""
        topic = _topic_of(header)
        check_client_topic(topic)
        partitions = header.get("partitions", 1)  # 1-1024: the ADMIN schema checked it
        config = dict(header.get("config") or {})
        rf = _count(config.pop("replication_factor", None), "replication_factor")
        min_insync = _count(config.pop("min_insync_replicas", None), "min_insync_replicas")
        if rf is not None and min_insync is not None and min_insync > rf:
            raise ConfigError(f"min_insync_replicas {min_insync} is above replication_factor {rf}", topic=topic)
        self.host.store.defaults.with_settings(config)  # a bad setting is refused here, before etcd
        if topic in self.configs:
            raise TopicExists(f"topic {topic} exists", topic=topic)
        request = self.agent.create_topic(topic, *self.replication(rf, min_insync), config, partitions=partitions)
        self._creating.add(topic)
        self._answers[request] = answer

    def delete(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics delete``: the controller removes the topic's records; answered once they are gone
        (this node has dropped its copy by then; the others drop theirs as their watch sees it)."""
        topic = _topic_of(header)
        if topic not in self.configs and topic in self._leftovers and topic in self.host.store.logs:
            self._leftovers.discard(topic)
            self.drop_topic(topic)  # a copy the cluster no longer has: only this node's files
            answer({"deleted": topic})
            return
        if topic not in self.configs:
            raise UnknownTopic(f"no topic {topic}", topic=topic)
        request = self.agent.delete_topic(topic)
        self._answers[request] = answer

    def alter(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics alter``: checked here as a single node checks it, then written into the topic's config record."""
        topic = _topic_of(header)
        record = self.configs.get(topic)
        if record is None:
            raise UnknownTopic(f"no topic {topic}", topic=topic)
        changes = header.get("config")
        if not changes:
            raise ConfigError(
                f"alter_topic {topic}: no settings given (config is a map of setting to value)", topic=topic
            )
        if not isinstance(changes, Mapping):
            raise ConfigError(f"alter_topic {topic}: config must be a map of setting to value", topic=topic)
        log_ = self.host.store.logs.get(topic)
        current = log_.config if log_ is not None else self.host.store.defaults.with_settings(record.settings)
        altered(topic, current, changes)  # the same checks and errors as a single node's alter
        request = self.agent.alter_topic(topic, dict(changes))
        self._answers[request] = answer

    def add_partitions(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics alter --partitions N``: the new total goes into the topic's config record (a CAS); the
        controller then places and writes the new partitions' records, as for a create.

        Its dead-letter topic, when the cluster has one, grows with it first, so partition k's
        dead letters keep going to partition k. Partition 0's leader tells its subscribers
        (EVENT ``PARTITIONS``) when its watch shows the new count.
        """
        topic = _topic_of(header)
        record = self.configs.get(topic)
        if record is None:
            raise UnknownTopic(f"no topic {topic}", topic=topic)
        asked = header.get("partitions")
        wanted = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
        check_growth(topic, record.partitions, wanted)
        live = len(self.agent.snapshot().nodes)
        if live < record.replication_factor:  # as a create: never partitions with fewer replicas than the topic's
            raise NotEnoughReplicas(
                f"topic {topic}: {record.replication_factor} replicas per partition, {live} nodes live",
                topic=topic,
                requested=record.replication_factor,
                live=live,
            )
        dead = self.configs.get(topic + DEAD_LETTER_SUFFIX)
        if dead is not None and dead.partitions < wanted:
            self._answers[self.agent.alter_topic(topic + DEAD_LETTER_SUFFIX, {}, partitions=wanted)] = partial(
                _log_refusal, topic + DEAD_LETTER_SUFFIX
            )
        self._answers[self.agent.alter_topic(topic, {}, partitions=wanted)] = answer

    def reassign(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics reassign``: store the move for the controller; answered once etcd holds it.

        The controller then adds the new replicas as followers, and once every one of them
        is in sync drops the old ones (electing a new leader if the leader is among them).
        The topic's dead-letter topic (``<t>.dlq``), when the cluster has one, moves with it to
        the same replicas: dead letters are written only where both are led by the same node.
        """
        topic = _topic_of(header)
        if topic not in self.configs:
            raise UnknownTopic(f"topic {topic} is not known to the cluster", topic=topic)
        replicas = tuple(header.get("replicas") or ())
        min_insync = _count(header.get("min_insync_replicas"), "min_insync_replicas")
        count = self.configs[topic].partitions
        asked = header.get("partition")
        if asked is not None and asked >= count:
            raise unknown_partition(topic, asked, count)
        numbers = [asked] if asked is not None else list(range(count))
        started: dict[str, Any] = {"name": topic, "partitions": numbers, "replicas": list(replicas)}
        if count == 1:
            started["partition"] = 0  # the answer of a topic of one partition, as before partitions
        states = self.agent.snapshot().partitions
        targets = {  # a whole topic: each partition's list turned so its leaders stay spread
            n: replicas
            if asked is not None or count == 1
            else d.spread_order(replicas, states.get(TopicPartition(topic, n)), n)
            for n in numbers
        }
        dead = topic + DEAD_LETTER_SUFFIX
        if not topic.endswith(DEAD_LETTER_SUFFIX) and dead in self.configs:
            for number in [n for n in numbers if n < self.configs[dead].partitions]:
                # the same order as its source partition: one node leads both, so dead letters are written
                moved = self.agent.reassign(TopicPartition(dead, number), targets[number], min_insync)
                self._answers[moved] = partial(_log_refusal, dead)
            started["dead_letter_topic"] = dead
        waiting = _Pending(len(numbers), lambda error: answer(error or {**started, "state": "started"}))
        for number in numbers:
            request = self.agent.reassign(TopicPartition(topic, number), targets[number], min_insync)
            self._answers[request] = waiting.answered

    def _on_reassign_stored(self, event: ReassignAnswer) -> None:
        answer = self._answers.pop(event.request_id, None)
        if answer is not None:
            answer(event.error)

    # --- METADATA ---------------------------------------------------------------------------------

    def metadata(self, topics: Sequence[str] | None) -> ClusterMetadata:
        """What this node knows of the cluster, from the agent's latest snapshot."""
        snapshot = self.agent.snapshot()
        nodes = {node: record.advertise for node, record in snapshot.nodes.items()}
        wanted = set(topics) if topics is not None else None
        answer: dict[str, dict[int, PartitionMetadata]] = {}
        for tp, state in snapshot.partitions.items():
            if wanted is not None and tp.topic not in wanted:
                continue
            answer.setdefault(tp.topic, {})[tp.partition] = PartitionMetadata(
                state.leader,
                nodes.get(state.leader) if state.leader else None,
                state.leader_epoch,
                tuple(state.assignment),
                tuple(state.isr),
                state.offline,
            )
        return ClusterMetadata(self.node_id, snapshot.controller, nodes, answer)


@dataclass
class _Pending:
    """One answer for several agent requests: the first error, or ``None`` once every one is stored."""

    left: int
    answer: Callable[[Any], None]

    def answered(self, error: Any) -> None:
        if self.left <= 0:
            return
        if error is not None:
            self.left = 0
            self.answer(error)
            return
        self.left -= 1
        if self.left == 0:
            self.answer(None)


def _log_refusal(topic: str, error: Any) -> None:
    if error is not None:
        log.warning("reassignment of %s not stored: %s", topic, error)


def _topic_of(header: Mapping[str, Any]) -> str:
    name = header.get("topic")
    return check_name(name if isinstance(name, str) else "")


def _count(value: Any, name: str) -> int | None:
    """A replica count from an ADMIN request: absent (the cluster default) or 1-255."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ConfigError(f"{name} must be an integer from 1 to 255, not {value!r}", field=name)
    return value


def _described(topic: str, config: TopicConfigRecord | None, defaults: TopicConfig) -> dict[str, Any]:
    """What ``create_topic`` answers in a cluster: a new topic's description in a single broker's shape
    (``partitions`` a row each, every setting), with the record's replication factor and in-sync minimum."""
    if config is None:
        return {"name": topic}
    empty = [{"partition": number, "start_offset": 0, "end_offset": 0} for number in range(config.partitions)]
    return {
        "name": topic,
        "partition_count": config.partitions,
        "partitions": empty,
        "start_offset": 0,
        "end_offset": 0,
        "replication_factor": config.replication_factor,
        "min_insync_replicas": config.min_insync_replicas,
        "config": defaults.with_settings(config.settings).settings(),
    }


def _extra(config: TopicConfigRecord, topic: str, partition: int) -> dict[str, Any]:
    """What a replica's ``topic.json`` records of the cluster topic: its id, and the partition count
    (partition 0, as a single node's) or the topic it is a partition of."""
    extra: dict[str, Any] = {TOPIC_ID: config.topic_id} if config.topic_id else {}
    if partition:
        extra["partition_of"] = topic
    elif config.partitions > 1:
        extra["partitions"] = config.partitions
    return extra
