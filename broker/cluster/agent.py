"""The ``conveyor-cluster`` thread of a node: its lease, its registration, its view, and the controller campaign.

All of a node's etcd I/O runs here (design §3), so the broker's loop never
blocks on etcd:

* the loop calls the request methods (``create_topic``, ``delete_topic``,
  ``alter_topic``, ``propose_isr``, ``request_shutdown``, ``reassign``); each queues the request, returns a
  request id at once, and its answer comes back later as an event;
* the agent puts ``ClusterEvent``s on ``events`` and calls ``wake`` (the
  loop's wake-up pipe), and the loop drains them with ``poll()``.

Start: grant a lease (keepalive every TTL/3 on the wrapper's thread), put
``nodes/<id>`` under it (taking over a key a previous run left), read the
whole cluster prefix with one range, watch it from that revision + 1, and
campaign for controller. The watch, the lease and the loop's requests all
feed one inbox, handled in order on this thread. An etcd error never ends the
thread: the step is retried after a short backoff, and the view is whatever
the watch last delivered.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from conveyor.broker.cluster import decisions as d
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.controller import CAS_TRIES, Controller, Deposed
from conveyor.broker.cluster.etcd import NOT_FOUND, Compare, Etcd, EtcdError, Lease, Op, Watch, WatchEvent
from conveyor.broker.cluster.events import (
    ClusterEvent,
    ClusterSettings,
    ControllerChanged,
    IsrAnswer,
    LeaseLost,
    NodesChanged,
    PartitionChanged,
    ReassignAnswer,
    Registered,
    Request,
    ShutdownAnswer,
    TopicAltered,
    TopicChanged,
    TopicCreated,
    TopicDeleted,
)
from conveyor.broker.cluster.keys import (
    CreateRequest,
    DeleteRequest,
    Keys,
    NodeRecord,
    ReassignRequest,
    ShutdownRequest,
    TopicPartition,
)
from conveyor.broker.cluster.view import Change, ClusterSnapshot, ClusterView

from conveyor.errors import (
    ClusterError,
    ConveyorError,
    FencedLeaderEpoch,
    InvalidRequest,
    NotLeader,
    UnknownTopic,
    error_for_code,
)

log = logging.getLogger("conveyor.cluster")

RETRY_MIN = 0.1  # seconds between tries of a step etcd refused, doubling up to RETRY_MAX
RETRY_MAX = 2.0


@dataclass(frozen=True)
class _WatchItem:
    event: WatchEvent


@dataclass(frozen=True)
class _Resync:
    revision: int


@dataclass(frozen=True)
class _LeaseEnded:
    lease_id: int


_STOP = object()


class ClusterAgent:
    """One node's link to the cluster. Build it, ``start()`` it, ``poll()`` its events, ``close()`` it."""

    def __init__(
        self,
        settings: ClusterSettings,
        wake: Callable[[], None] = lambda: None,
        *,
        etcd: Etcd | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.keys = Keys(settings.cluster_name)
        self.node_id = settings.node_id
        self.wake = wake
        self.clock = clock
        self._owns_etcd = etcd is None
        self.etcd = etcd or Etcd(
            list(settings.endpoints),
            timeout=settings.etcd_timeout,
            ca=settings.etcd_ca,
            cert=settings.etcd_cert,
            key=settings.etcd_key,
            user=settings.etcd_user,
            password=settings.etcd_password,
        )
        self.events: queue.SimpleQueue[ClusterEvent] = queue.SimpleQueue()
        self.view = ClusterView(self.keys)
        self.controller = Controller(self.etcd, self.keys, self.node_id)
        self.registered = threading.Event()  # set while the node's key is in etcd under a live lease
        self.lease: Lease | None = None
        self._given_up: list[int] = []  # leases counted lost, to revoke once registered again
        self._recovering = False  # the lease was lost: registering again after an etcd outage (or a stop)
        self._settle_until = 0.0  # until then, a controller leaves node changes alone (the others come back)
        self.watch: Watch | None = None
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _snapshot
        self._snapshot = self.view.snapshot()
        self._thread = threading.Thread(target=self._run, name="conveyor-cluster", daemon=True)
        self._creates: dict[str, list[int]] = {}  # topic -> request ids waiting for its config
        self._deletes: dict[str, list[int]] = {}  # topic -> request ids waiting for its records to go
        self._shutdowns: list[int] = []
        self._started_ms = int(clock() * 1000)
        self._retry_at: float | None = None
        self._backoff = RETRY_MIN
        self._pending_steps: set[str] = set()  # register | load | campaign | repair
        self._last_controller: tuple[str | None, bool] = (None, False)
        self._revoke = False

    # --- the loop's side ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self, *, revoke: bool = False, timeout: float = 10.0) -> None:
        """Stop the thread. ``revoke`` ends the lease now (controlled shutdown: the node's key goes at once);
        without it the lease runs out after its TTL, as after a crash."""
        self._revoke = revoke
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def poll(self) -> list[ClusterEvent]:
        """Every event queued so far, without blocking."""
        found: list[ClusterEvent] = []
        while True:
            try:
                found.append(self.events.get_nowait())
            except queue.Empty:
                return found

    def snapshot(self) -> ClusterSnapshot:
        """The view as of the last event handed out (safe from any thread; METADATA answers from it)."""
        with self._lock:
            return self._snapshot

    @property
    def is_controller(self) -> bool:
        return self.controller.active

    def create_topic(
        self,
        topic: str,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        settings: Mapping[str, object] | None = None,
        *,
        existing: tuple[tuple[str, ...], int] | None = None,
        partitions: int = 1,
    ) -> int:
        """Ask the controller for ``topic`` (``None``: the cluster default); answered by ``TopicCreated``.

        ``existing`` = (assignment, leader epoch): the topic's data is on those nodes already (a
        single-node directory joining), so they hold it, the first leading from that epoch.
        """
        nodes, epoch = existing if existing is not None else ((), 0)
        return self._request(
            "create",
            topic=topic,
            replication_factor=replication_factor,
            min_insync_replicas=min_insync_replicas,
            settings=dict(settings or {}),
            nodes=tuple(nodes),
            leader_epoch=epoch,
            partitions=partitions,
        )

    def delete_topic(self, topic: str) -> int:
        """Ask the controller to delete ``topic``'s records; answered by ``TopicDeleted`` once they are gone.

        Each replica then drops its partition and files when its watch sees the config go.
        """
        return self._request("delete", topic=topic)

    def alter_topic(self, topic: str, settings: Mapping[str, object], *, partitions: int = 1) -> int:
        """Merge ``settings`` into ``topic``'s config record (a CAS, retried on a conflict); answered by
        ``TopicAltered``. Every node applies the record from its ``TopicChanged``, now or when it starts.
        ``partitions`` above the record's count raises it (partitions added: the controller makes them).

        Not a controller request: nothing is decided but the record itself, and the CAS on its
        ``mod_revision`` orders it against every other write of the config (create, reassignment, delete).
        """
        return self._request("alter", topic=topic, settings=dict(settings), partitions=partitions)

    def propose_isr(
        self, tp: TopicPartition, isr: tuple[str, ...], leader_epoch: int, expected_mod_revision: int | None = None
    ) -> int:
        """CAS a new ISR on ``tp`` as its leader at ``leader_epoch``; answered by ``IsrAnswer``.

        The record must name this node leader at that epoch and still be the one
        at ``expected_mod_revision`` (from the last ``PartitionChanged``). With
        ``None`` it is the agent's current record: simpler for the caller, but a
        change the loop has not seen yet (the controller dropping a gone follower)
        is then overwritten by this ISR, which can only hold HW back until the
        leader shrinks again, never lose a confirmed batch.
        """
        return self._request(
            "isr", tp=tp, nodes=tuple(isr), leader_epoch=leader_epoch, mod_revision=expected_mod_revision
        )

    def request_shutdown(self, successors: Mapping[TopicPartition, str] | None = None) -> int:
        """Ask the controller to move this node's leaderships (``successors``: the caught-up follower per
        partition, preferred when still in sync); answered by ``ShutdownAnswer`` once it has."""
        return self._request("shutdown", successors=dict(successors or {}))

    def reassign(self, tp: TopicPartition, assignment: tuple[str, ...], min_insync_replicas: int | None = None) -> int:
        """Store a reassignment of ``tp`` for the controller; answered by ``ReassignAnswer`` once stored.

        ``min_insync_replicas`` becomes the topic's once the move is done (None: kept, at most the new RF).
        Every replica named must be a registered node.
        """
        return self._request("reassign", tp=tp, nodes=tuple(assignment), min_insync_replicas=min_insync_replicas)

    def _request(self, kind: str, **fields: Any) -> int:
        request = Request(next(self._ids), kind, **fields)
        self._inbox.put(request)
        return request.request_id

    def _emit(self, event: ClusterEvent) -> None:
        self.events.put(event)
        self.wake()

    # --- the thread ---------------------------------------------------------

    def _run(self) -> None:
        self._pending_steps = {"register", "load", "campaign"}
        while True:
            if self._pending_steps and (self._retry_at is None or self.clock() >= self._retry_at):
                self._steps()
            timeout = None if not self._pending_steps else max(0.0, (self._retry_at or 0.0) - self.clock())
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                continue
            if item is _STOP:
                break
            try:
                self._handle(item)
            except Exception:  # one bad item must not end the thread that keeps the lease
                log.exception("cluster agent: %r failed", item)
        self._stop()

    def _steps(self) -> None:
        """The start-up steps still to do, in order; an etcd error leaves the rest for the next try."""
        try:
            if "register" in self._pending_steps:
                self._register()
                self._pending_steps.discard("register")
            if "load" in self._pending_steps:
                self._load()
                self._pending_steps.discard("load")
            if "campaign" in self._pending_steps:
                self._campaign()
                self._pending_steps.discard("campaign")
            if "repair" in self._pending_steps:
                if self._settling():
                    self._retry_at = self._settle_until
                    return
                self._as_controller(lambda: self.controller.repair_all(self.view))
                self._pending_steps.discard("repair")
            self._backoff = RETRY_MIN
            self._retry_at = None
        except EtcdError as exc:
            self._retry_at = self.clock() + self._backoff
            log.warning("cluster agent: etcd: %s; retrying in %.1f s", exc, self._backoff)
            self._backoff = min(RETRY_MAX, self._backoff * 2)

    def check_node_id(self, wait: Callable[[float], None] = time.sleep) -> None:
        """At start: ``ClusterError`` when another live node holds this node's id.

        A restart finds the key its previous run left (same address, or a lease about
        to end) and takes it over. A key under another address is waited out for a
        TTL and etcd's expiry sweep: still there under the same lease, it is a live
        node's, and registering over it would send its clients here and drop it from
        its in-sync sets when this node exits. Unreachable etcd: the agent's retries judge.
        """
        key = self.keys.node(self.node_id)
        try:
            held = self.etcd.get(key)
            if held is None or k.decode_node(key, self.node_id, held.value).advertise == self.settings.advertise:
                return
            wait(self.settings.lease_seconds + 1.0)
            again = self.etcd.get(key)
        except (EtcdError, ValueError):
            return
        if again is not None and again.lease == held.lease and again.lease:
            other = k.decode_node(key, self.node_id, again.value).advertise
            raise ClusterError(
                f"--node-id {self.node_id} is in use: a live node at {other} is registered under it in etcd; "
                "give every node its own id",
                field="node_id",
            )

    def _register(self) -> None:
        if self.lease is None or self.lease.lost.is_set():
            if self.lease is not None:
                self.lease.close()
                self._given_up.append(self.lease.id)  # revoked once the node key is under the new one
            box: dict[str, int] = {}
            self.lease = self.etcd.lease(
                self.settings.lease_seconds, on_lost=lambda: self._inbox.put(_LeaseEnded(box.get("id", 0)))
            )
            box["id"] = self.lease.id
        record = NodeRecord(
            self.node_id,
            self.settings.advertise,
            self.settings.metrics,
            self.settings.version,
            self._started_ms,
            self.settings.curve_public,
        )
        try:
            self.etcd.put(self.keys.node(self.node_id), k.encode_node(record), lease=self.lease.id)
        except EtcdError as exc:
            if exc.fields.get("grpc_code") == NOT_FOUND:  # etcd dropped the lease before the keepalive said so
                self._on_lease_lost(self.lease.id)
                self.lease.close()
                self.lease = None
            raise
        self.etcd.put_if_absent(self.keys.meta, k.encode_meta())
        self._revoke_given_up()
        if self._recovering:
            self._recovering = False
            self._settle_until = self.clock() + self.settings.lease_seconds + RETRY_MAX
        self.registered.set()
        if "load" not in self._pending_steps:
            self._emit(Registered(self.node_id, self.lease.id, self.view.revision))

    def _settling(self) -> bool:
        """Just back from a lost lease: the other nodes' keys may be missing only because etcd was away.

        A frozen etcd expires every lease when it resumes, and every node registers
        again, each at its next retry. A controller that repaired at once would see
        the late ones as gone, move their partitions and shrink ISRs to itself; it
        waits until each had a TTL and a retry to come back. A node that never lost
        its lease (a plain kill -9 of another node) does not wait.
        """
        return self.clock() < self._settle_until

    def _revoke_given_up(self) -> None:
        """End the leases this node gave up as lost, now that its key is under a new one.

        etcd renews every lease when it restarts: after an outage longer than the TTL a
        given-up lease lives on for one more TTL, and with it the controller key of a node
        that resigned when it counted the lease lost. Left alone, the cluster would have
        no working controller for that long; revoked, the key goes now and a campaign follows.
        """
        while self._given_up:
            try:
                self.etcd.revoke(self._given_up[0])
            except EtcdError as exc:
                log.warning("lease %x: not revoked (%s); it runs out on its own", self._given_up[0], exc)
            self._given_up.pop(0)

    def _load(self) -> None:
        """One range read of the whole cluster prefix, then the watch from the revision after it."""
        kvs, revision = self.etcd.get_prefix(self.keys.prefix)
        changes = self.view.load(kvs, revision)
        if self.watch is None:
            self.watch = self.etcd.watch(
                self.keys.prefix,
                start_revision=revision + 1,
                on_event=lambda event: self._inbox.put(_WatchItem(event)),
                on_resync=lambda rev: self._inbox.put(_Resync(rev)),
            )
        self._publish(changes)
        assert self.lease is not None
        self._emit(Registered(self.node_id, self.lease.id, revision))

    def _campaign(self) -> None:
        if self.lease is None or self.controller.active or self.view.controller is not None:
            return
        if self.controller.campaign(self.lease.id):
            self._pending_steps.add("repair")
            self._announce_controller()

    def _as_controller(self, duty: Callable[[], None]) -> None:
        if not self.controller.active:
            return
        try:
            duty()
        except Deposed as exc:
            log.warning("%s", exc)
            self._announce_controller()

    def _handle(self, item: object) -> None:
        if isinstance(item, _WatchItem):
            self._on_watch(item.event)
        elif isinstance(item, _Resync):
            self._pending_steps.add("load")
            self._steps()
        elif isinstance(item, _LeaseEnded):
            self._on_lease_lost(item.lease_id)
        elif isinstance(item, Request):
            try:
                self._answer(item)
            except EtcdError as exc:
                self._emit(_failed(item, exc))

    def _on_watch(self, event: WatchEvent) -> None:
        change = self.view.apply(event.kind, event.kv)
        if change is None:
            return
        self._publish([change])
        if change.kind == "node" and change.node_id == self.node_id and change.deleted and self.registered.is_set():
            log.warning("node %s: its key was deleted; registering again", self.node_id)
            self._pending_steps.add("register")
        if change.kind == "controller" and self.view.controller is None:
            self._pending_steps.add("campaign")
        try:
            self._duties(change)
        except EtcdError as exc:
            log.warning("controller: etcd: %s; a repair pass follows", exc)
            self._pending_steps.add("repair")
            self._retry_at = self._retry_at or self.clock() + self._backoff
        if self._pending_steps and self._retry_at is None:
            self._steps()

    def _duties(self, change: Change) -> None:
        """What the controller does about one change it saw on the watch."""
        self.controller.check(self.view)
        if change.kind == "controller":
            self._announce_controller()
        if not self.controller.active:
            return
        view, ctl = self.view, self.controller
        if change.kind == "node" and self._settling():
            self._pending_steps.add("repair")  # once the nodes the outage cut off had time to register again
            self._retry_at = max(self._retry_at or 0.0, self._settle_until)
        elif change.kind == "node":
            self._as_controller(lambda: ctl.repair_all(view))
        elif change.kind == "create" and not change.deleted:
            self._as_controller(lambda: ctl.create_topic(view, change.topic))
        elif change.kind == "delete" and not change.deleted:
            self._as_controller(lambda: ctl.delete_topic(view, change.topic))
        elif change.kind == "config":
            topic = change.topic
            self._as_controller(lambda: ctl.fill_partitions(view, topic))  # partitions added, or a create cut short
            for tp in [tp for tp in view.reassigns if tp.topic == topic]:
                # a reassignment's config write lost to an alter: again
                self._as_controller(partial(ctl.reassign, view, tp))
        elif change.kind == "shutdown" and not change.deleted:
            self._as_controller(lambda: ctl.shutdown(view, change.node_id))
        elif change.kind in ("reassign", "partition") and change.tp in view.reassigns:
            tp = change.tp
            self._as_controller(lambda: ctl.reassign(view, tp))

    def _on_lease_lost(self, lease_id: int) -> None:
        if self.lease is None or lease_id not in (0, self.lease.id):
            return
        log.warning("node %s lost its lease %x; registering again", self.node_id, lease_id)
        self.registered.clear()
        self._recovering = True
        self.controller.resign()
        self._announce_controller()
        self._emit(LeaseLost(lease_id))
        self._pending_steps |= {"register", "campaign"}
        self._retry_at = None

    # --- events to the loop -------------------------------------------------

    def _publish(self, changes: list[Change]) -> None:
        """Turn view changes into events, and answer the requests they settle."""
        with self._lock:
            self._snapshot = self.view.snapshot()
        nodes_changed = False
        for change in changes:
            if change.kind == "node":
                nodes_changed = True
            elif change.kind == "controller":
                self._announce_controller()
            elif change.kind == "config":
                config = self.view.topics.get(change.topic)
                self._emit(TopicChanged(change.topic, config))
                if config is not None:
                    for request_id in self._creates.pop(change.topic, []):
                        self._emit(TopicCreated(request_id, change.topic, config))
                else:
                    self._answer_deletes(change.topic)
            elif change.kind == "delete" and change.deleted:
                self._answer_deletes(change.topic)  # done, or the topic was gone already
            elif change.kind == "partition" and change.tp is not None:
                tp = change.tp
                self._emit(PartitionChanged(tp, self.view.partitions.get(tp), self.view.partition_revisions.get(tp, 0)))
            elif change.kind == "create" and not change.deleted:
                self._on_create_answer(change.topic)
            elif change.kind == "shutdown" and change.node_id == self.node_id and not change.deleted:
                found = self.view.shutdowns.get(self.node_id)
                if found is not None and found.value.done:
                    for request_id in self._shutdowns:
                        self._emit(ShutdownAnswer(request_id))
                    self._shutdowns.clear()
        if nodes_changed:
            self._emit(NodesChanged(self._snapshot.nodes))

    def _announce_controller(self) -> None:
        me = self.controller.active
        current = (self.node_id if me else self.view.controller, me)
        if current != self._last_controller:
            self._last_controller = current
            self._emit(ControllerChanged(*current))

    def _answer_deletes(self, topic: str) -> None:
        for request_id in self._deletes.pop(topic, []):
            self._emit(TopicDeleted(request_id, topic))

    def _on_create_answer(self, topic: str) -> None:
        """A refused create: tell every waiting request, and the asker removes the request."""
        found = self.view.creates.get(topic)
        if found is None or found.value.refused is None:
            return
        code, message = found.value.refused
        for request_id in self._creates.pop(topic, []):
            self._emit(TopicCreated(request_id, topic, None, error_for_code(code)(message, topic=topic)))
        if found.value.requester == self.node_id:
            key = self.keys.create_request(topic)
            try:
                self.etcd.txn([Compare.modified(key, found.mod_revision)], [Op.delete(key)])
            except EtcdError as exc:
                log.warning("could not remove the refused request %s: %s", key, exc)

    # --- the loop's requests ------------------------------------------------

    def _answer(self, request: Request) -> None:
        if request.kind == "create":
            self._create(request)
        elif request.kind == "isr":
            self._propose_isr(request)
        elif request.kind == "shutdown":
            self._request_shutdown(request)
        elif request.kind == "reassign":
            self._reassign(request)
        elif request.kind == "delete":
            self._delete(request)
        elif request.kind == "alter":
            self._alter(request)

    def _create(self, request: Request) -> None:
        topic = request.topic
        config = self.view.topics.get(topic)
        if config is not None:
            self._emit(TopicCreated(request.request_id, topic, config))
            return
        ask = CreateRequest(
            self.node_id,
            request.replication_factor,
            request.min_insync_replicas,
            request.settings,
            assignment=request.nodes or None,
            leader_epoch=max(1, request.leader_epoch),
            partitions=request.partitions,
        )
        key = self.keys.create_request(topic)
        self._creates.setdefault(topic, []).append(request.request_id)
        for _ in range(2):
            result = self.etcd.put_if_absent(key, k.encode_create(ask))
            if result.succeeded:
                return
            held = result.ranges[0][0] if result.ranges and result.ranges[0] else None
            if held is None:
                continue
            try:
                refused = k.decode_create(key, held.value).refused is not None
            except k.RecordError:
                refused = True  # a damaged request would block the topic for ever
            if not refused:
                return  # someone asked already: this request waits for the same config
            self.etcd.txn([Compare.modified(key, held.mod_revision)], [Op.delete(key)])

    def _delete(self, request: Request) -> None:
        topic = request.topic
        if topic not in self.view.topics:
            self._emit(TopicDeleted(request.request_id, topic, UnknownTopic(f"no topic {topic}", topic=topic)))
            return
        self._deletes.setdefault(topic, []).append(request.request_id)
        self.etcd.put(self.keys.delete_request(topic), k.encode_delete(DeleteRequest(self.node_id)))

    def _alter(self, request: Request) -> None:
        topic, key = request.topic, self.keys.topic_config(request.topic)
        config, mod = self.view.topics.get(topic), self.view.topic_revisions.get(topic, 0)
        for _ in range(CAS_TRIES):
            if config is None:
                self._emit(
                    TopicAltered(request.request_id, topic, None, UnknownTopic(f"no topic {topic}", topic=topic))
                )
                return
            wanted = d.altered_config(config, request.settings, partitions=request.partitions)
            result = self.etcd.cas(key, k.encode_topic_config(wanted), mod)
            if result.succeeded:
                self._emit(TopicAltered(request.request_id, topic, wanted))
                return
            current = result.current
            config = k.decode_topic_config(key, current.value) if current is not None else None
            mod = current.mod_revision if current is not None else 0
        error = ClusterError(f"alter of {topic}: {CAS_TRIES} conflicting writes of its config; try again", topic=topic)
        self._emit(TopicAltered(request.request_id, topic, None, error))

    def _propose_isr(self, request: Request) -> None:
        tp = request.tp
        assert tp is not None
        state = self.view.partitions.get(tp)
        mod = self.view.partition_revisions.get(tp, 0)
        if state is None:
            self._emit(IsrAnswer(request.request_id, tp, False, None, 0, UnknownTopic(f"no partition {tp}")))
            return
        if state.leader != self.node_id or state.leader_epoch != request.leader_epoch:
            fence = FencedLeaderEpoch if state.leader_epoch > request.leader_epoch else NotLeader
            self._emit(
                IsrAnswer(
                    request.request_id,
                    tp,
                    False,
                    state,
                    mod,
                    fence(f"{tp}: leader {state.leader} at epoch {state.leader_epoch}"),
                )
            )
            return
        if request.mod_revision is not None and mod != request.mod_revision:
            self._emit(IsrAnswer(request.request_id, tp, False, state, mod))
            return
        wanted = replace(state, isr=tuple(n for n in state.assignment if n in set(request.nodes)))
        if self.node_id not in wanted.isr or not set(request.nodes) <= set(state.assignment):
            error = InvalidRequest(
                f"{tp}: isr {list(request.nodes)} must hold the leader, within {list(state.assignment)}"
            )
            self._emit(IsrAnswer(request.request_id, tp, False, state, mod, error))
            return
        key = self.keys.partition(tp)
        result = self.etcd.cas(key, k.encode_partition(wanted), mod)
        if result.succeeded:
            self._emit(IsrAnswer(request.request_id, tp, True, wanted, result.revision))
            return
        current = result.ranges[0][0] if result.ranges and result.ranges[0] else None
        if current is None:
            self._emit(IsrAnswer(request.request_id, tp, False, None, 0, UnknownTopic(f"no partition {tp}")))
            return
        self._emit(
            IsrAnswer(request.request_id, tp, False, k.decode_partition(key, current.value), current.mod_revision)
        )

    def _request_shutdown(self, request: Request) -> None:
        if self.lease is None:
            self._emit(ShutdownAnswer(request.request_id, NotLeader("not registered")))
            return
        self._shutdowns.append(request.request_id)
        value = k.encode_shutdown(ShutdownRequest(request.successors))
        self.etcd.put(self.keys.shutdown_request(self.node_id), value, lease=self.lease.id)

    def _reassign(self, request: Request) -> None:
        tp = request.tp
        assert tp is not None
        if tp not in self.view.partitions:
            self._emit(ReassignAnswer(request.request_id, tp, UnknownTopic(f"no partition {tp}")))
            return
        refused = _reassign_refusal(request.nodes, request.min_insync_replicas, self.view.nodes)
        if refused is not None:
            self._emit(ReassignAnswer(request.request_id, tp, refused))
            return
        ask = ReassignRequest(request.nodes, request.min_insync_replicas)
        self.etcd.put(self.keys.reassign_request(tp), k.encode_reassign(ask))
        self._emit(ReassignAnswer(request.request_id, tp))

    def _stop(self) -> None:
        self.controller.resign()
        if self.watch is not None:
            self.watch.close()
        if self.lease is not None:
            if self._revoke:
                try:
                    self.lease.revoke()
                except EtcdError as exc:
                    log.warning("lease revoke failed: %s (the key goes after its TTL)", exc)
            self.lease.close()
        self.registered.clear()
        if self._owns_etcd:
            self.etcd.close()


def _reassign_refusal(
    nodes: tuple[str, ...], min_insync: int | None, registered: Mapping[str, object]
) -> ConveyorError | None:
    """Why a reassignment cannot be stored: repeated or unknown replicas, or more in sync asked than replicas."""
    if not nodes or len(set(nodes)) != len(nodes):
        return InvalidRequest(f"replicas must be distinct and not empty, got {list(nodes)}", field="replicas")
    unknown = sorted(set(nodes) - set(registered))
    if unknown:
        return InvalidRequest(
            f"nodes {unknown} are not registered (live: {sorted(registered)}); start them first", field="replicas"
        )
    if min_insync is not None and not 1 <= min_insync <= len(nodes):
        return InvalidRequest(
            f"min_insync_replicas must be within 1..{len(nodes)}, got {min_insync}", field="min_insync_replicas"
        )
    return None


def _failed(request: Request, exc: ConveyorError) -> ClusterEvent:
    """The answer to a request etcd could not take."""
    if request.kind == "create":
        return TopicCreated(request.request_id, request.topic, None, exc)
    if request.kind == "isr":
        assert request.tp is not None
        return IsrAnswer(request.request_id, request.tp, False, None, 0, exc)
    if request.kind == "reassign":
        assert request.tp is not None
        return ReassignAnswer(request.request_id, request.tp, exc)
    if request.kind == "delete":
        return TopicDeleted(request.request_id, request.topic, exc)
    if request.kind == "alter":
        return TopicAltered(request.request_id, request.topic, None, exc)
    return ShutdownAnswer(request.request_id, exc)
