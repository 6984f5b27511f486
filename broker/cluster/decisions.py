"""What the cluster decides, as pure functions of what etcd holds (design §3, §4, §7).

The controller and the partition leaders call these and write the result by
CAS; nothing here reads a clock, a socket or etcd, so every rule is tested on
its own. Two invariants hold for every state these functions return:

* the leader is a live member of the in-sync set, or the partition is offline
  with no leader (no unclean election: a replica outside the ISR may miss
  confirmed batches, so it never leads);
* the in-sync set is never emptied by an election: while a partition is
  offline its last ISR stays, so the first of them to come back can lead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Any

from conveyor.broker.cluster.keys import PartitionState, TopicConfigRecord, TopicPartition

from conveyor.errors import InvalidRequest, NotEnoughReplicas

DEFAULT_REPLICATION_FACTOR = 3
DEFAULT_MIN_INSYNC = 2


# --- topic creation --------------------------------------------------------


def default_min_insync(replication_factor: int) -> int:
    """Two copies before a confirm, or all of them below RF 2."""
    return min(DEFAULT_MIN_INSYNC, replication_factor)


def default_replication(
    requested_rf: int | None,
    requested_min_insync: int | None,
    live_nodes: int,
    default_rf: int = DEFAULT_REPLICATION_FACTOR,
    default_min_insync_replicas: int = DEFAULT_MIN_INSYNC,
) -> tuple[int | None, int | None]:
    """What was asked, else the defaults: ``default_rf`` capped at the live nodes (None with none live),
    ``default_min_insync_replicas`` capped at the RF. Nothing is checked here: a node fills in its
    own defaults (``--default-replication-factor``, ``--min-insync-replicas``) before it asks, and the
    controller checks what it is asked (``replication_for``)."""
    rf = requested_rf
    if rf is None and live_nodes > 0:
        rf = max(1, min(default_rf, live_nodes))
    min_insync = requested_min_insync
    if min_insync is None and rf is not None:
        min_insync = min(default_min_insync_replicas, rf)
    return rf, min_insync


def replication_for(requested_rf: int | None, requested_min_insync: int | None, live_nodes: int) -> tuple[int, int]:
    """(RF, min_insync) for a create: the default when not asked; an RF above the live nodes is refused."""
    if live_nodes < 1:
        raise NotEnoughReplicas("no live node to place the topic on", live=live_nodes)
    if requested_rf is not None and requested_rf < 1:
        raise InvalidRequest(f"replication factor must be >= 1, got {requested_rf}")
    if requested_rf is not None and requested_rf > live_nodes:
        raise NotEnoughReplicas(
            f"replication factor {requested_rf} > {live_nodes} live nodes", requested=requested_rf, live=live_nodes
        )
    rf, min_insync = default_replication(requested_rf, requested_min_insync, live_nodes)
    assert rf is not None and min_insync is not None  # live_nodes >= 1
    if requested_min_insync is not None and not 1 <= requested_min_insync <= rf:
        raise InvalidRequest(f"min_insync_replicas must be within 1..{rf}, got {requested_min_insync}")
    return rf, min_insync


def altered_config(config: TopicConfigRecord, settings: Mapping[str, Any], *, partitions: int = 1) -> TopicConfigRecord:
    """A topic's record after ``topics alter``: each setting given replaces its value, the others stay
    (as a single node's ``alter_topic`` does); replication factor and in-sync minimum are not settings.
    ``partitions`` above the record's count is partitions added (``add_partitions``)."""
    grown = max(config.partitions, partitions)  # partitions are only added: a count never goes down here
    return replace(config, settings={**config.settings, **settings}, partitions=grown)


def leader_load(partitions: Iterable[PartitionState], nodes: Iterable[str]) -> dict[str, int]:
    """How many partitions each of ``nodes`` leads (0 for those leading none)."""
    load = dict.fromkeys(nodes, 0)
    for state in partitions:
        if state.leader in load:
            load[state.leader] += 1
    return load


def place(nodes: Collection[str], load: Mapping[str, int], rf: int) -> tuple[str, ...]:
    """``rf`` distinct replicas, round-robin over the nodes in id order, from the least-loaded one.

    The first is the leader, so new leaderships go to the node leading the
    fewest (ties to the lowest id), and consecutive followers spread the copies.
    """
    if not 1 <= rf <= len(nodes):
        raise NotEnoughReplicas(f"cannot place {rf} replicas on {len(nodes)} nodes", requested=rf, live=len(nodes))
    ring = sorted(nodes)
    start = min(range(len(ring)), key=lambda i: (load.get(ring[i], 0), ring[i]))
    return tuple(ring[(start + i) % len(ring)] for i in range(rf))


DEAD_LETTER_SUFFIX = ".dlq"


def colocate(
    topic: str,
    partitions: Mapping[TopicPartition, PartitionState],
    live: Collection[str],
    rf: int,
    partition: int = 0,
) -> tuple[str, ...] | None:
    """``<t>.dlq`` partition k goes on its source's partition k's live replicas, its leader first; None otherwise.

    The source's leader writes its dead letters, which it can do only while it also
    leads the dead-letter topic: both start led by the same node, and an election
    (first of assignment ∩ ISR ∩ live) keeps them together while their ISRs agree.
    """
    if not topic.endswith(DEAD_LETTER_SUFFIX):
        return None
    source = partitions.get(TopicPartition(topic[: -len(DEAD_LETTER_SUFFIX)], partition))
    if source is None or source.leader is None or source.leader not in live:
        return None
    order = [source.leader] + [n for n in source.assignment if n != source.leader and n in live]
    return tuple(order[:rf]) if len(order) >= rf else None


def place_partitions(
    topic: str,
    numbers: Iterable[int],
    partitions: Mapping[TopicPartition, PartitionState],
    live: Collection[str],
    rf: int,
) -> dict[int, tuple[str, ...]]:
    """The replicas of each new partition ``numbers`` of ``topic``, its leaders spread over the live nodes.

    Each partition's leader is the node leading the fewest of this topic's partitions so far
    (those it had and those placed before it), then the fewest partitions of any topic: a
    topic's partitions take turns over the nodes (8 on 3 nodes: 3, 3 and 2 leaders) even when
    one node leads less of the other topics (one just restarted leads nothing), so a topic
    always gets every node's core. Its followers are the next nodes in id order. A dead-letter
    topic's partition k goes where its source's partition k is (``colocate``).
    """
    load = leader_load(partitions.values(), live)
    mine = leader_load([state for tp, state in partitions.items() if tp.topic == topic], live)
    placed: dict[int, tuple[str, ...]] = {}
    for number in numbers:
        assignment = colocate(topic, partitions, live, rf, number)
        if assignment is None:
            leader = min(sorted(live), key=lambda node: (mine[node], load[node]))
            assignment = place(live, {node: int(node != leader) for node in live}, rf)
        for counts in (load, mine):
            counts[assignment[0]] = counts.get(assignment[0], 0) + 1
        placed[number] = assignment
    return placed


def missing_partitions(
    topic: str, config: TopicConfigRecord, partitions: Mapping[TopicPartition, PartitionState]
) -> list[int]:
    """The partitions ``config`` says ``topic`` has and no record holds yet (a create written in
    several txns, or partitions added to the topic)."""
    return [p for p in range(config.partitions) if TopicPartition(topic, p) not in partitions]


def new_partition(assignment: tuple[str, ...], leader_epoch: int = 1) -> PartitionState:
    """A new partition: the first replica leads, at epoch 1 (epoch 0 is for batches written before clustering).

    A topic registered with its data (a single-node directory joining) may start later,
    past the last epoch its log already holds.
    """
    return PartitionState(assignment, assignment[0], max(1, leader_epoch), assignment, False)


def existing_assignment(assignment: tuple[str, ...], live: Collection[str]) -> tuple[str, ...]:
    """The replicas of a topic registered with its data: they hold it, so they must all be live and distinct."""
    if not assignment or len(set(assignment)) != len(assignment):
        raise InvalidRequest(f"an existing topic needs distinct replicas, got {list(assignment)}")
    gone = sorted(set(assignment) - set(live))
    if gone:
        raise NotEnoughReplicas(
            f"nodes {gone} holding the topic are not live", requested=len(assignment), live=len(live)
        )
    return assignment


# --- election and repair ---------------------------------------------------


def elect(state: PartitionState, live: Collection[str], *, prefer: str | None = None) -> PartitionState:
    """A new leader for a partition whose leader is gone: the first of assignment ∩ isr ∩ live.

    The new record has epoch + 1 and an ISR without the members that are not
    live. With no live ISR member the partition goes offline (epoch + 1, which
    fences the old leader, and the ISR kept). ``prefer`` wins when it is a
    live ISR member (controlled shutdown names the follower it saw caught up).
    """
    candidates = [n for n in state.assignment if n in state.isr and n in live]
    if prefer is not None and prefer in candidates:
        candidates = [prefer] + [n for n in candidates if n != prefer]
    if not candidates:
        if state.offline:
            return state
        return replace(state, leader=None, leader_epoch=state.leader_epoch + 1, offline=True)
    leader = candidates[0]
    isr = tuple(n for n in state.isr if n in live)
    return PartitionState(state.assignment, leader, state.leader_epoch + 1, isr, False)


def drop_gone_followers(state: PartitionState, live: Collection[str]) -> PartitionState:
    """The ISR without followers whose node key is gone (at once, so HW stalls one TTL, not ``replica_lag_max``)."""
    isr = tuple(n for n in state.isr if n == state.leader or n in live)
    return state if isr == state.isr else replace(state, isr=isr)


def repair(state: PartitionState, live: Collection[str]) -> PartitionState:
    """The state a controller writes for ``live`` nodes; ``state`` itself (the same object) when nothing changes.

    A gone or missing leader is replaced (``elect``); an offline partition is
    brought back when an ISR member returns; gone followers leave the ISR.
    """
    if state.offline or state.leader not in live:
        return elect(state, live)
    return drop_gone_followers(state, live)


# --- ISR, on the leader (design §4) -----------------------------------------


def caught_up_time(
    fetch_offset: int, now_ms: int, leader_end: int, previous_fetch_ms: int, end_at_previous_fetch: int, last_ms: int
) -> int:
    """A follower's new ``lastCaughtUpTime`` after a fetch (Kafka's rule).

    Caught up now if it asks for the leader's end; caught up as of its previous
    fetch if it asks for at least the end the leader had then; otherwise the
    time stays. It never moves back.
    """
    if fetch_offset >= leader_end:
        return max(last_ms, now_ms)
    if fetch_offset >= end_at_previous_fetch:
        return max(last_ms, previous_fetch_ms)
    return last_ms


def should_shrink(now_ms: int, last_caught_up_ms: int, lag_max_ms: int) -> bool:
    """A follower that has not caught up for ``replica_lag_max_ms`` leaves the ISR (no byte or message lag rule)."""
    return now_ms - last_caught_up_ms > lag_max_ms


def may_expand(durable_end: int, high_watermark: int, epoch_start_offset: int) -> bool:
    """A follower rejoins once it durably holds everything up to HW and the start of the current epoch."""
    return durable_end >= high_watermark and durable_end >= epoch_start_offset


def shrink_isr(state: PartitionState, follower: str) -> PartitionState:
    """The ISR without ``follower``; the leader never removes itself."""
    if follower == state.leader or follower not in state.isr:
        return state
    return replace(state, isr=tuple(n for n in state.isr if n != follower))


def expand_isr(state: PartitionState, follower: str) -> PartitionState:
    """The ISR with ``follower`` added, in assignment order; only a replica of the partition may join."""
    if follower in state.isr or follower not in state.assignment:
        return state
    members = set(state.isr) | {follower}
    return replace(state, isr=tuple(n for n in state.assignment if n in members))


# --- controlled shutdown (design §7) ----------------------------------------


def shutdown_handoff(
    state: PartitionState, node: str, live: Collection[str], prefer: str | None = None
) -> PartitionState:
    """The state once ``node`` is going down: leadership moved to another live ISR member, ``node`` out of the ISR.

    A leader with no other live in-sync member keeps the partition (it goes
    offline when the node's key goes, and comes back with it), so a shutdown
    never hands a partition to a replica that may lack confirmed batches.
    """
    others = [n for n in live if n != node]
    if state.leader == node:
        moved = elect(state, others, prefer=prefer)
        return state if moved.offline else moved
    return shrink_isr(state, node)


def led_by(partitions: Mapping[TopicPartition, PartitionState], node: str) -> list[TopicPartition]:
    """The partitions ``node`` leads, in order."""
    return sorted(tp for tp, state in partitions.items() if state.leader == node)


def holds(partitions: Mapping[TopicPartition, PartitionState], node: str) -> list[TopicPartition]:
    """The partitions where ``node`` leads or is in sync: what a controlled shutdown must move off it."""
    return sorted(tp for tp, state in partitions.items() if state.leader == node or node in state.isr)


# --- reassignment -----------------------------------------------------------


def reassign_step(state: PartitionState, target: tuple[str, ...], live: Collection[str]) -> tuple[PartitionState, bool]:
    """The next record of a reassignment to ``target``, and whether it is done.

    Step 1 adds the new replicas to the assignment (target first, then the old
    ones), out of the ISR: they join as followers and the leader adds them to
    the ISR once caught up. Step 2, once every target replica is in sync,
    shrinks the assignment and ISR to the target and, if the leader is not in
    it, elects the first live target member (epoch + 1). Done, the first target
    replica leads when it is a live in-sync member (the preferred leader: a
    reassignment to the same replicas in another order moves the leadership).
    """
    if not target or len(set(target)) != len(target):
        raise InvalidRequest(f"a reassignment needs distinct replicas, got {list(target)}")
    if state.assignment == target:
        return _preferred(state, live)
    if not set(target) <= set(state.assignment):
        assignment = target + tuple(n for n in state.assignment if n not in target)
        return replace(state, assignment=assignment), False
    if not set(target) <= set(state.isr):
        return state, False
    isr = tuple(n for n in target if n in state.isr)
    moved = replace(state, assignment=target, isr=isr)
    if state.leader in target and not state.offline:
        return _preferred(moved, live)
    elected = elect(replace(moved, leader=None, offline=False), live)
    if elected.offline:
        return state, False  # no live target member to lead yet: wait
    return elected, True


def spread_order(replicas: tuple[str, ...], state: PartitionState | None, partition: int) -> tuple[str, ...]:
    """The replica order for one partition when a whole topic moves to ``replicas``: its leader first when
    it stays (no leadership moves), else the list turned by the partition number, so the topic's leaders
    stay spread rather than all going to the first node named."""
    if state is not None and state.leader in replicas:
        return (state.leader, *(n for n in replicas if n != state.leader))
    turn = partition % len(replicas) if replicas else 0
    return replicas[turn:] + replicas[:turn]


def _preferred(state: PartitionState, live: Collection[str]) -> tuple[PartitionState, bool]:
    """A finished reassignment, led by its first replica if that one is a live in-sync member (epoch + 1)."""
    first = state.assignment[0]
    if state.offline or state.leader == first or first not in state.isr or first not in live:
        return state, True
    return elect(state, live, prefer=first), True


def reassigned_config(config: TopicConfigRecord, replicas: int, min_insync: int | None) -> TopicConfigRecord:
    """A topic's config once its partition holds ``replicas`` replicas: RF follows, and so does the asked
    ``min_insync_replicas`` (none asked: the old one, at most the new RF)."""
    wanted = min_insync if min_insync is not None else config.min_insync_replicas
    return replace(config, replication_factor=replicas, min_insync_replicas=max(1, min(wanted, replicas)))
