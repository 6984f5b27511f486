"""The controller: one node, elected through etcd, that makes the cluster's decisions real (design §3).

Every node campaigns by a put-if-absent of ``controller`` under its own
lease; the winner's key ``create_revision`` is the controller epoch. The
others stand by: the agent's watch sees the key go and campaigns again.

**Every write here is one txn that includes ``CREATE(controller) ==
my_create_revision``.** A controller that was stopped (SIGSTOP, a long GC,
a starved thread) and resumes with queued watch events therefore cannot act
on them: its txn fails, it learns it was deposed (``Deposed``) and stands
down. Partition records are written by CAS on their ``mod_revision``; on a
conflict the controller recomputes from the record etcd returned in the
same round trip.

The decisions are the pure functions of ``decisions.py``. This class runs on
the agent thread only, reads the agent's ``ClusterView`` and never waits for
its own writes: the watch brings them back like anyone else's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from functools import partial

from conveyor.broker.cluster import decisions as d
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.etcd import Compare, Etcd, KeyValue, Op, TxnResult
from conveyor.broker.cluster.keys import CreateRequest, Keys, PartitionState, RecordError, TopicPartition
from conveyor.broker.cluster.view import ClusterView, Versioned

from conveyor.errors import InvalidRequest, NotEnoughReplicas

log = logging.getLogger("conveyor.cluster")

CAS_TRIES = 8  # conflicts are rare (a leader's ISR proposal at the same moment); give up until the next event
TXN_PARTITIONS = 100  # partition records per txn: etcd refuses more than --max-txn-ops (128 by default) per txn


class Deposed(Exception):
    """A fenced write failed on the controller key: another node is controller (or none is)."""


class Controller:
    """Campaign and duties of one node; ``revision`` is its controller epoch, 0 while it is not controller."""

    def __init__(self, etcd: Etcd, keys: Keys, node_id: str) -> None:
        self.etcd = etcd
        self.keys = keys
        self.node_id = node_id
        self.revision = 0
        self.writes = 0  # successful fenced txns, for tests and metrics

    @property
    def active(self) -> bool:
        return self.revision != 0

    # --- campaign ----------------------------------------------------------

    def campaign(self, lease_id: int) -> bool:
        """Try to become controller under ``lease_id``; True when this node is controller now."""
        result = self.etcd.put_if_absent(self.keys.controller, k.encode_controller(self.node_id), lease=lease_id)
        if result.succeeded:
            self.revision = result.revision
            log.info("node %s is controller (epoch %d)", self.node_id, self.revision)
            return True
        held = _first(result)
        if held is not None and held.lease == lease_id and _controller_of(held) == self.node_id:
            self.revision = held.create_revision  # an earlier try won and its answer was lost
            return True
        self.revision = 0
        return False

    def resign(self) -> None:
        """Stop acting as controller (lease lost, deposed, closing); the key goes with the lease."""
        if self.revision:
            log.info("node %s is no longer controller (epoch %d)", self.node_id, self.revision)
        self.revision = 0

    def check(self, view: ClusterView) -> None:
        """Stand down at once when the watch shows the controller key is no longer this epoch's."""
        if self.active and view.controller_revision != self.revision and view.revision >= self.revision:
            self.resign()

    # --- duties ------------------------------------------------------------

    def repair_all(self, view: ClusterView) -> None:
        """The takeover pass, also run on every node join or leave: each partition as ``repair`` wants it."""
        live = view.live()
        for topic in sorted(view.deletes):
            self.delete_topic(view, topic)
        for tp in sorted(view.partitions):
            self.update_partition(view, tp, lambda state: d.repair(state, live))
        for topic in sorted(view.topics):
            self.fill_partitions(view, topic)
        for topic in sorted(view.creates):
            self.create_topic(view, topic)
        for node in sorted(view.shutdowns):
            self.shutdown(view, node)
        for tp in sorted(view.reassigns):
            self.reassign(view, tp)

    def create_topic(self, view: ClusterView, topic: str) -> None:
        """Config (with a new topic id) and partition 0 in one txn, guarded by the config's absence; a refusal
        is written into the request."""
        found = view.creates.get(topic)
        if found is None or found.value.refused is not None:
            return
        request_key = self.keys.create_request(topic)
        if topic in view.topics:
            self.fenced([Compare.modified(request_key, found.mod_revision)], [Op.delete(request_key)])
            return
        live, request, count = view.live(), found.value, found.value.partitions
        try:
            if request.assignment is not None:
                assignment = d.existing_assignment(request.assignment, live)
                rf, min_insync = len(assignment), d.default_min_insync(len(assignment))
                states = {p: d.new_partition(assignment, request.leader_epoch) for p in range(count)}
            else:
                rf, min_insync = d.replication_for(request.replication_factor, request.min_insync_replicas, len(live))
                placed = d.place_partitions(topic, range(count), view.partitions, live, rf)
                states = {p: d.new_partition(assignment) for p, assignment in placed.items()}
        except (NotEnoughReplicas, InvalidRequest) as exc:
            self._refuse(request_key, found, exc.code, exc.message)
            return
        config = k.TopicConfigRecord(rf, min_insync, dict(request.settings), uuid.uuid4().hex, count)
        first = dict(list(states.items())[:TXN_PARTITIONS])
        result = self.fenced(
            [Compare.absent(self.keys.topic_config(topic)), Compare.modified(request_key, found.mod_revision)],
            [
                Op.put(self.keys.topic_config(topic), k.encode_topic_config(config)),
                *self._partition_puts(topic, first),
                Op.delete(request_key),
            ],
        )
        if result.succeeded:
            leaders = ",".join(states[p].leader or "-" for p in sorted(states))
            log.info("created %s rf=%d min_insync=%d partitions=%d, leaders %s", topic, rf, min_insync, count, leaders)
            self._put_partitions(topic, {p: s for p, s in states.items() if p not in first})

    def fill_partitions(self, view: ClusterView, topic: str) -> None:
        """The partitions ``topic``'s config names and no record holds: placed and written.

        A topic of more than ``TXN_PARTITIONS`` partitions is created in several txns, and a
        controller may stop between them; partitions added to a topic are a config with a larger
        count. Either way the records missing are made here, on takeover and on each config change.
        """
        config = view.topics.get(topic)
        if config is None:
            return
        missing = d.missing_partitions(topic, config, view.partitions)
        if not missing:
            return
        try:
            placed = d.place_partitions(topic, missing, view.partitions, view.live(), config.replication_factor)
        except NotEnoughReplicas as exc:
            log.warning("%s: %d partitions wait for nodes: %s", topic, len(missing), exc)
            return
        self._put_partitions(topic, {p: d.new_partition(assignment) for p, assignment in placed.items()})
        log.info("%s: made partitions %s", topic, ",".join(map(str, missing)))

    def _partition_puts(self, topic: str, states: Mapping[int, PartitionState]) -> list[Op]:
        return [Op.put(self.keys.partition(TopicPartition(topic, p)), k.encode_partition(s)) for p, s in states.items()]

    def _put_partitions(self, topic: str, states: Mapping[int, PartitionState]) -> None:
        """Partition records of an existing topic, ``TXN_PARTITIONS`` per txn, each only where none is (a record
        someone else wrote, or a topic deleted meanwhile, is left alone: the next pass sees it)."""
        items = sorted(states.items())
        for start in range(0, len(items), TXN_PARTITIONS):
            chunk = dict(items[start : start + TXN_PARTITIONS])
            keys = [self.keys.partition(TopicPartition(topic, p)) for p in chunk]
            self.fenced(
                [Compare(self.keys.topic_config(topic), "CREATE", ">", 0), *map(Compare.absent, keys)],
                self._partition_puts(topic, chunk),
            )

    def delete_topic(self, view: ClusterView, topic: str) -> None:
        """The topic's partition records, then its config, its pending requests and the request, in one txn.

        The partitions go first: each replica's watch sees its partition end (it stops leading or
        following) before the config goes (it drops its files). The dead-letter topic
        ``<t>.dlq`` is a topic of its own and stays, as on a single node.
        """
        found = view.deletes.get(topic)
        if found is None:
            return
        request_key = self.keys.delete_request(topic)
        result = self.fenced(
            [Compare.modified(request_key, found.mod_revision)],
            [
                Op.delete(self.keys.topic(topic) + "partitions/", prefix=True),
                Op.delete(self.keys.topic_config(topic)),
                Op.delete(self.keys.reassign_requests_of(topic), prefix=True),
                Op.delete(request_key),
            ],
        )
        if result.succeeded:
            log.info("deleted %s (asked by %s)", topic, found.value.requester)

    def shutdown(self, view: ClusterView, node: str) -> None:
        """Move ``node``'s leaderships to live in-sync followers, take it out of every ISR, mark the request done."""
        found = view.shutdowns.get(node)
        if found is None or found.value.done:
            return
        live = view.live()
        successors = found.value.successors
        for tp in d.holds(view.partitions, node):
            handoff = partial(d.shutdown_handoff, node=node, live=live, prefer=successors.get(tp))
            self.update_partition(view, tp, handoff)
        key = self.keys.shutdown_request(node)
        done = k.ShutdownRequest(successors, done=True)
        self.fenced(
            [Compare.modified(key, found.mod_revision)], [Op.put(key, k.encode_shutdown(done), lease=found.lease)]
        )

    def reassign(self, view: ClusterView, tp: TopicPartition) -> None:
        """One step of a reassignment; the request is deleted once the assignment is the target."""
        found = view.reassigns.get(tp)
        if found is None:
            return
        key = self.keys.reassign_request(tp)
        state = view.partitions.get(tp)
        if state is None:
            log.warning("reassignment of %s dropped: no such partition", tp)
            self.fenced([Compare.modified(key, found.mod_revision)], [Op.delete(key)])
            return
        target, live = found.value.assignment, view.live()
        try:
            d.reassign_step(state, target, live)
        except InvalidRequest as exc:
            log.warning("reassignment of %s dropped: %s", tp, exc)
            self.fenced([Compare.modified(key, found.mod_revision)], [Op.delete(key)])
            return
        finished: list[bool] = []

        def decide(current: PartitionState) -> PartitionState:
            step, done = d.reassign_step(current, target, live)
            finished.append(done)
            return step

        if self.update_partition(view, tp, decide) and finished[-1]:
            done: list[Op] = [Op.delete(key)]
            config = view.topics.get(tp.topic)
            guard = [Compare.modified(key, found.mod_revision)]
            if config is not None:
                moved = d.reassigned_config(config, len(target), found.value.min_insync_replicas)
                if moved != config:  # guarded: an alter written since is kept (the config change retries this)
                    config_key = self.keys.topic_config(tp.topic)
                    guard.append(Compare.modified(config_key, view.topic_revisions.get(tp.topic, 0)))
                    done.insert(0, Op.put(config_key, k.encode_topic_config(moved)))
            if self.fenced(guard, done).succeeded:  # once: later watch events of this move find it gone
                log.info("reassignment of %s to %s done", tp, ",".join(target))

    # --- writes ------------------------------------------------------------

    def update_partition(
        self, view: ClusterView, tp: TopicPartition, decide: Callable[[PartitionState], PartitionState]
    ) -> bool:
        """CAS ``decide(state)`` onto the partition record; on a conflict decide again from etcd's record.

        True once the record is what ``decide`` wants (written, or already so).
        """
        state, mod = view.partitions.get(tp), view.partition_revisions.get(tp, 0)
        key = self.keys.partition(tp)
        for _ in range(CAS_TRIES):
            if state is None:
                return False
            wanted = decide(state)
            if wanted == state:
                return True
            result = self.fenced([Compare.modified(key, mod)], [Op.put(key, k.encode_partition(wanted))], [Op.get(key)])
            if result.succeeded:
                log.info("%s: %s", tp, _describe(state, wanted))
                return True
            current = result.ranges[-1] if result.ranges else []
            if not current:
                return False
            try:
                state, mod = k.decode_partition(key, current[0].value), current[0].mod_revision
            except RecordError as exc:
                log.error("%s", exc)
                return False
        log.warning("%s: gave up after %d CAS conflicts; the next event retries", tp, CAS_TRIES)
        return False

    def fenced(self, compare: list[Compare], success: list[Op], reads: list[Op] | None = None) -> TxnResult:
        """One txn guarded by this controller's epoch; ``Deposed`` when that guard is what failed.

        The failure branch reads the controller key first, then ``reads``, so
        ``result.ranges[1:]`` are the caller's records when another compare failed.
        """
        if not self.active:
            raise Deposed(f"node {self.node_id} is not controller")
        result = self.etcd.txn(
            [Compare.created(self.keys.controller, self.revision), *compare],
            success,
            [Op.get(self.keys.controller), *(reads or [])],
        )
        if result.succeeded:
            self.writes += 1
            return result
        holder = result.ranges[0] if result.ranges else []
        if not holder or holder[0].create_revision != self.revision:
            epoch = self.revision
            self.resign()
            raise Deposed(f"node {self.node_id}'s controller epoch {epoch} has ended")
        return result

    def _refuse(self, key: str, found: Versioned[CreateRequest], code: int, message: str) -> None:
        log.warning("create of %s refused: %s", key.rsplit("/", 1)[-1], message)
        refused = CreateRequest(
            found.value.requester,
            found.value.replication_factor,
            found.value.min_insync_replicas,
            found.value.settings,
            (code, message),
        )
        self.fenced([Compare.modified(key, found.mod_revision)], [Op.put(key, k.encode_create(refused))])


def _first(result: TxnResult) -> KeyValue | None:
    return result.ranges[0][0] if result.ranges and result.ranges[0] else None


def _controller_of(kv: KeyValue) -> str | None:
    try:
        return k.decode_controller(kv.key, kv.value)
    except RecordError:
        return None


def _describe(before: PartitionState, after: PartitionState) -> str:
    if after.leader != before.leader:
        return f"leader {before.leader} -> {after.leader} epoch {after.leader_epoch} isr {list(after.isr)}"
    return f"isr {list(before.isr)} -> {list(after.isr)}, assignment {list(after.assignment)}"
