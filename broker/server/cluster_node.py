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
again until the partition has a leader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

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
    TopicChanged,
    TopicCreated,
)
from conveyor.broker.cluster.keys import TopicConfigRecord, TopicPartition
from conveyor.broker.config.addresses import etcd_members
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store, check_name
from conveyor.broker.net.security import ClientKeys, ServerSecurity
from conveyor.broker.server.cluster_roles import ClusterRoles
from conveyor.broker.server.group_log import is_group_log
from conveyor.broker.server.metadata import ClusterMetadata, PartitionMetadata
from conveyor.broker.server.partitions import Partitions

from conveyor.errors import ConfigError, InvalidRequest, TopicExists, UnknownTopic

CLUSTER_ADMIN = {
    "create_topic": "",
    "reassign_topic": "",
    "delete_topic": "delete it on every node with the cluster stopped, or wait for cluster topic deletion",
    "alter_topic": "topic settings are fixed at creation in a cluster for now",
}

log = logging.getLogger("conveyor.cluster")


class ClusterHost(Protocol):
    """What the cluster side needs of its broker."""

    @property
    def store(self) -> Store: ...
    @property
    def security(self) -> ServerSecurity | None: ...  # CURVE on the broker's socket, if any

    def stop_wake(self) -> None: ...


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
        """
        asked = [topic for topic in sorted(self.host.store.logs) if not topic.startswith("__")]
        return [topic for topic in asked if self._register_local(topic)]

    def _register_local(self, topic: str) -> bool:
        """Ask for ``topic`` with this node's data (RF 1, this node leading); False if known or asked already."""
        log_ = self.host.store.logs.get(topic)
        if log_ is None or topic in self.configs or topic in self._creating:
            return False
        epoch = log_.last_epoch + 1
        self._creating.add(topic)
        self.agent.create_topic(topic, 1, 1, log_.config.settings(), existing=((self.node_id,), epoch))
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
            self.configs.pop(event.topic, None)
        else:
            self.configs[event.topic] = event.config

    def _on_partition(self, event: PartitionChanged) -> None:
        """Before the roles act on a record: this node's replica log exists, with the topic's settings."""
        if event.state is not None:
            self._creating.discard(event.tp.topic)
            if self.node_id in event.state.assignment:
                self._ensure_log(event.tp.topic)

    def _on_created(self, event: TopicCreated) -> None:
        answer = self._answers.pop(event.request_id, None)
        if event.error is not None:
            self._creating.discard(event.topic)
            log.warning("topic %s was not created: %s", event.topic, event.error)
        if answer is not None:
            answer(event.error if event.error is not None else _described(event.topic, event.config))

    def _ensure_log(self, topic: str) -> None:
        store = self.host.store
        if topic not in store.logs:
            config = self.configs.get(topic)
            store.create_topic(topic, dict(config.settings) if config else None)

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
        start) is registered with its data, never placed anew on nodes that lack it.
        """
        if self.settings.auto_create_topics:
            self.want_topic(topic)

    def want_topic(self, topic: str) -> None:
        """Ask the controller for ``topic`` unless known or asked already (``auto_create`` without the
        setting: a dead-letter topic is made whatever ``--auto-create-topics`` says, as on a single node)."""
        if topic in self.configs or topic in self._creating or is_group_log(topic):
            return
        if topic in self.host.store.logs:
            self._register_local(topic)
            return
        self._creating.add(topic)
        self.agent.create_topic(topic, *self.replication(None, None))

    def replication(self, rf: int | None, min_insync: int | None) -> tuple[int | None, int | None]:
        """A new topic's replicas and in-sync minimum: what was asked, else this node's defaults
        (``--default-replication-factor`` capped at the registered nodes, ``--min-insync-replicas``
        capped at the replicas). An RF asked above the live nodes is the controller's to refuse."""
        live = len(self.agent.snapshot().nodes)
        if rf is None:
            rf = max(1, min(self.settings.default_replication_factor, live)) if live else None
        if min_insync is None and rf is not None:
            min_insync = min(self.settings.min_insync_replicas, rf)
        return rf, min_insync

    # --- ADMIN in a cluster ------------------------------------------------------------------------

    def handles(self, op: str) -> bool:
        """The ADMIN ops that change what the cluster holds: they go through the controller, not this node."""
        return op in CLUSTER_ADMIN

    def admin(self, op: str, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """Run a cluster ADMIN op; ``answer`` gets the result or a ``ConveyorError``, now or once etcd answered."""
        if op == "reassign_topic":
            self.reassign(header, answer)
            return
        if op != "create_topic":
            answer(InvalidRequest(f"{op} is not supported on a cluster yet: {CLUSTER_ADMIN[op]}", field="op"))
            return
        name = header.get("topic")
        topic = check_name(name if isinstance(name, str) else "")
        config = dict(header.get("config") or {})
        rf = _count(config.pop("replication_factor", None), "replication_factor")
        min_insync = _count(config.pop("min_insync_replicas", None), "min_insync_replicas")
        if rf is not None and min_insync is not None and min_insync > rf:
            raise ConfigError(f"min_insync_replicas {min_insync} is above replication_factor {rf}", topic=topic)
        self.host.store.defaults.with_settings(config)  # a bad setting is refused here, before etcd
        if topic in self.configs:
            raise TopicExists(f"topic {topic} exists", topic=topic)
        request = self.agent.create_topic(topic, *self.replication(rf, min_insync), config)
        self._creating.add(topic)
        self._answers[request] = answer

    def reassign(self, header: Mapping[str, Any], answer: Callable[[Any], None]) -> None:
        """``topics reassign``: store the move for the controller; answered once etcd holds it.

        The controller then adds the new replicas as followers, and once every one of them
        is in sync drops the old ones (electing a new leader if the leader is among them).
        The topic's dead-letter topic (``<t>.dlq``), when the cluster has one, moves with it to
        the same replicas: dead letters are written only where both are led by the same node.
        """
        name = header.get("topic")
        topic = check_name(name if isinstance(name, str) else "")
        if topic not in self.configs:
            raise UnknownTopic(f"topic {topic} is not known to the cluster", topic=topic)
        replicas = tuple(header.get("replicas") or ())
        min_insync = _count(header.get("min_insync_replicas"), "min_insync_replicas")
        tp = TopicPartition(topic, 0)
        started: dict[str, Any] = {"name": topic, "partition": tp.partition, "replicas": list(replicas)}
        dead = topic + DEAD_LETTER_SUFFIX
        if not topic.endswith(DEAD_LETTER_SUFFIX) and dead in self.configs:
            moved = self.agent.reassign(TopicPartition(dead, 0), replicas, min_insync)
            self._answers[moved] = partial(_log_refusal, dead)
            started["dead_letter_topic"] = dead
        request = self.agent.reassign(tp, replicas, min_insync)
        self._answers[request] = lambda error: answer(error if error is not None else {**started, "state": "started"})

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


def _log_refusal(topic: str, error: Any) -> None:
    if error is not None:
        log.warning("reassignment of %s not stored: %s", topic, error)


def _count(value: Any, name: str) -> int | None:
    """A replica count from an ADMIN request: absent (the cluster default) or 1-255."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ConfigError(f"{name} must be an integer from 1 to 255, not {value!r}", field=name)
    return value


def _described(topic: str, config: TopicConfigRecord | None) -> dict[str, Any]:
    """What ``create_topic`` answers in a cluster: the record the controller wrote."""
    if config is None:
        return {"name": topic}
    return {
        "name": topic,
        "replication_factor": config.replication_factor,
        "min_insync_replicas": config.min_insync_replicas,
        "config": dict(config.settings),
    }
