"""The cluster's decisions: placement, election without unclean leaders, ISR rules, shutdown handoff, reassignment."""

from __future__ import annotations

import pytest
from conveyor.broker.cluster import decisions as d
from conveyor.broker.cluster.keys import PartitionState, TopicConfigRecord, TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from conveyor.errors import InvalidRequest, NotEnoughReplicas

NODES = ["a", "b", "c", "d", "e"]


def state(assignment: str, leader: str | None, epoch: int, isr: str) -> PartitionState:
    return PartitionState(tuple(assignment), leader, epoch, tuple(isr), leader is None)


# --- creation --------------------------------------------------------------


@pytest.mark.parametrize(("live", "rf", "min_insync"), [(1, 1, 1), (2, 2, 2), (3, 3, 2), (7, 3, 2)])
def test_the_cluster_default_is_three_copies_two_in_sync_or_fewer(live: int, rf: int, min_insync: int) -> None:
    assert d.replication_for(None, None, live) == (rf, min_insync)
    assert d.default_replication(None, None, live) == (rf, min_insync)
    assert d.default_min_insync(rf) == min_insync


def test_a_node_fills_in_its_own_defaults_and_leaves_the_checks_to_the_controller() -> None:
    # --default-replication-factor 2 --min-insync-replicas 1 on a node that sees five live nodes
    assert d.default_replication(None, None, 5, 2, 1) == (2, 1)
    assert d.default_replication(None, None, 1, 3, 2) == (1, 1)  # capped at the live nodes, then at the RF
    assert d.default_replication(3, None, 5, 2, 1) == (3, 1)  # what was asked stays
    assert d.default_replication(4, None, 3) == (4, 2)  # above the live nodes: the controller's to refuse
    assert d.default_replication(None, None, 0) == (None, None)  # no view yet: the controller's default


def test_an_alter_replaces_the_settings_given_and_keeps_the_rest() -> None:
    config = TopicConfigRecord(3, 2, {"retention_ms": "7d", "max_message_bytes": 1000})
    altered = d.altered_config(config, {"retention_ms": 60_000, "read_only": True})
    assert altered == TopicConfigRecord(3, 2, {"retention_ms": 60_000, "max_message_bytes": 1000, "read_only": True})
    assert config.settings == {"retention_ms": "7d", "max_message_bytes": 1000}  # the record is not changed


def test_a_replication_factor_above_the_live_nodes_is_refused() -> None:
    assert d.replication_for(2, None, 3) == (2, 2)
    assert d.replication_for(1, None, 3) == (1, 1)
    assert d.replication_for(3, 3, 3) == (3, 3)
    with pytest.raises(NotEnoughReplicas, match="4 > 3 live"):
        d.replication_for(4, None, 3)
    with pytest.raises(NotEnoughReplicas):
        d.replication_for(None, None, 0)
    with pytest.raises(InvalidRequest):
        d.replication_for(0, None, 3)
    with pytest.raises(InvalidRequest):
        d.replication_for(2, 3, 3)


def test_placement_starts_at_the_least_loaded_and_goes_round_robin() -> None:
    assert d.place(["c", "a", "b"], {}, 3) == ("a", "b", "c")
    assert d.place(["c", "a", "b"], {"a": 2, "b": 1, "c": 1}, 3) == ("b", "c", "a")
    assert d.place(["a", "b", "c", "d"], {"a": 1, "b": 1, "c": 1, "d": 0}, 2) == ("d", "a")
    with pytest.raises(NotEnoughReplicas):
        d.place(["a"], {}, 2)


@given(
    st.lists(st.sampled_from(NODES), min_size=1, unique=True),
    st.dictionaries(st.sampled_from(NODES), st.integers(0, 5)),
    st.integers(1, 5),
)
def test_placement_properties(nodes: list[str], load: dict[str, int], rf: int) -> None:
    if rf > len(nodes):
        with pytest.raises(NotEnoughReplicas):
            d.place(nodes, load, rf)
        return
    placed = d.place(nodes, load, rf)
    assert len(placed) == rf == len(set(placed))
    assert set(placed) <= set(nodes)
    assert load.get(placed[0], 0) == min(load.get(n, 0) for n in nodes)


def test_placing_topics_one_after_another_spreads_the_leaders() -> None:
    partitions: list[PartitionState] = []
    for _ in range(9):
        load = d.leader_load(partitions, "abc")
        partitions.append(d.new_partition(d.place("abc", load, 3)))
    assert d.leader_load(partitions, "abc") == {"a": 3, "b": 3, "c": 3}
    assert partitions[0] == PartitionState(("a", "b", "c"), "a", 1, ("a", "b", "c"), False)


# --- election --------------------------------------------------------------


def test_the_first_live_isr_member_in_assignment_order_leads_at_epoch_plus_one() -> None:
    before = state("abc", "a", 7, "abc")
    assert d.elect(before, {"b", "c"}) == state("abc", "b", 8, "bc")
    assert d.elect(before, {"c"}) == state("abc", "c", 8, "c")
    assert d.elect(state("abc", "a", 7, "ac"), {"b", "c"}) == state("abc", "c", 8, "c")


def test_no_unclean_election_the_partition_goes_offline_keeping_its_isr() -> None:
    before = state("abc", "a", 7, "a")
    offline = d.elect(before, {"b", "c"})
    assert offline == PartitionState(("a", "b", "c"), None, 8, ("a",), True)
    assert d.elect(offline, {"b", "c"}) is offline  # no epoch bump while nothing changes
    assert d.repair(offline, {"a", "b"}) == state("abc", "a", 9, "a")


def test_a_preferred_successor_wins_only_as_a_live_isr_member() -> None:
    before = state("abc", "a", 1, "abc")
    assert d.elect(before, {"b", "c"}, prefer="c").leader == "c"
    assert d.elect(state("abc", "a", 1, "ab"), {"b", "c"}, prefer="c").leader == "b"


def test_repair_drops_gone_followers_without_a_new_epoch() -> None:
    before = state("abc", "a", 3, "abc")
    assert d.repair(before, {"a", "c"}) == state("abc", "a", 3, "ac")
    assert d.repair(before, {"a", "b", "c"}) is before
    assert d.repair(state("abc", "a", 3, "a"), {"a"}) == state("abc", "a", 3, "a")


def _invariant(s: PartitionState) -> None:
    assert set(s.isr) <= set(s.assignment)
    assert s.offline == (s.leader is None)
    assert s.leader is None or s.leader in s.isr


partition_states = st.lists(st.sampled_from(NODES), min_size=1, max_size=5, unique=True).flatmap(
    lambda assignment: st.builds(
        lambda isr, epoch, leader_ix: PartitionState(
            tuple(assignment),
            isr[leader_ix % len(isr)] if isr else None,
            epoch,
            tuple(n for n in assignment if n in isr),
            not isr,
        ),
        st.lists(st.sampled_from(assignment), unique=True),
        st.integers(0, 1000),
        st.integers(0, 10),
    )
)
live_sets = st.frozensets(st.sampled_from(NODES))


@given(partition_states, live_sets)
def test_repair_keeps_the_invariants_and_never_leads_outside_the_isr(
    before: PartitionState, live: frozenset[str]
) -> None:
    after = d.repair(before, live)
    _invariant(after)
    assert set(after.isr) <= set(before.isr)
    if after.leader is not None:
        assert after.leader in live and after.leader in before.isr
    if after.leader != before.leader:
        assert after.leader_epoch == before.leader_epoch + 1
    else:
        assert after.leader_epoch == before.leader_epoch
    if after.offline:
        assert after.isr == before.isr and not (set(before.isr) & live)
    assert d.repair(after, live) == after  # a second pass changes nothing


@given(partition_states, st.lists(live_sets, max_size=6))
def test_epochs_only_grow_and_every_leader_came_from_the_isr(
    before: PartitionState, lives: list[frozenset[str]]
) -> None:
    current = before
    for live in lives:
        after = d.repair(current, live)
        assert after.leader_epoch >= current.leader_epoch
        if after.leader is not None and after.leader != current.leader:
            assert after.leader in current.isr
        current = after


# --- ISR on the leader -----------------------------------------------------


def test_caught_up_time_follows_kafka_s_rule() -> None:
    # fetch reaches the leader's end now: caught up now
    assert d.caught_up_time(100, 5_000, 100, 4_000, 90, 0) == 5_000
    # short of the end now, but past the end at the previous fetch: caught up as of then
    assert d.caught_up_time(95, 5_000, 100, 4_000, 90, 0) == 4_000
    # behind both: unchanged
    assert d.caught_up_time(80, 5_000, 100, 4_000, 90, 1_000) == 1_000
    # never moves back
    assert d.caught_up_time(95, 5_000, 100, 4_000, 90, 4_500) == 4_500


def test_a_follower_behind_for_longer_than_the_lag_limit_leaves_the_isr() -> None:
    assert not d.should_shrink(10_000, 0, 10_000)
    assert d.should_shrink(10_001, 0, 10_000)


def test_a_follower_rejoins_at_hw_and_past_the_epoch_start() -> None:
    assert d.may_expand(100, 100, 50)
    assert not d.may_expand(99, 100, 50)
    assert not d.may_expand(100, 90, 120)


def test_shrink_and_expand_keep_the_leader_and_the_assignment_order() -> None:
    s = state("abc", "b", 2, "abc")
    assert d.shrink_isr(s, "a") == state("abc", "b", 2, "bc")
    assert d.shrink_isr(s, "b") is s
    assert d.expand_isr(state("abc", "b", 2, "b"), "a") == state("abc", "b", 2, "ab")
    assert d.expand_isr(s, "z") is s


# --- controlled shutdown ---------------------------------------------------


def test_shutdown_hands_leadership_to_a_live_isr_member_and_leaves_the_isr() -> None:
    s = state("abc", "a", 4, "abc")
    assert d.shutdown_handoff(s, "a", {"a", "b", "c"}) == state("abc", "b", 5, "bc")
    assert d.shutdown_handoff(s, "a", {"a", "b", "c"}, prefer="c") == state("abc", "c", 5, "bc")
    assert d.shutdown_handoff(s, "b", {"a", "b", "c"}) == state("abc", "a", 4, "ac")
    alone = state("abc", "a", 4, "a")
    assert d.shutdown_handoff(alone, "a", {"a", "b", "c"}) is alone  # nobody in sync to take it


def test_what_a_shutdown_must_move() -> None:
    parts = {
        TopicPartition("t", 0): state("abc", "a", 1, "abc"),
        TopicPartition("u", 0): state("abc", "b", 1, "bc"),
        TopicPartition("v", 0): state("bc", "b", 1, "bc"),
    }
    assert d.led_by(parts, "a") == [TopicPartition("t", 0)]
    assert d.holds(parts, "c") == [TopicPartition("t", 0), TopicPartition("u", 0), TopicPartition("v", 0)]


# --- reassignment ----------------------------------------------------------


def test_reassignment_adds_followers_then_leaves_the_old_replicas_once_in_sync() -> None:
    live = {"a", "b", "c", "d"}
    s = state("abc", "a", 3, "abc")
    step1, done = d.reassign_step(s, ("b", "c", "d"), live)
    assert not done and step1 == state("bcda", "a", 3, "abc")
    assert d.reassign_step(step1, ("b", "c", "d"), live) == (step1, False)  # d not in sync yet
    synced = d.expand_isr(step1, "d")
    step2, done = d.reassign_step(synced, ("b", "c", "d"), live)
    assert done and step2 == state("bcd", "b", 4, "bcd")  # a left; b leads at epoch + 1
    assert d.reassign_step(step2, ("b", "c", "d"), live) == (step2, True)


def test_reassignment_keeping_the_leader_keeps_the_epoch() -> None:
    s = state("ab", "a", 3, "ab")
    step1, _ = d.reassign_step(s, ("a", "c"), {"a", "b", "c"})
    step2, done = d.reassign_step(d.expand_isr(step1, "c"), ("a", "c"), {"a", "b", "c"})
    assert done and step2 == state("ac", "a", 3, "ac")


def test_reassignment_to_rf_1_from_a_single_node_dir() -> None:
    s = state("a", "a", 1, "a")
    step1, _ = d.reassign_step(s, ("a", "b", "c"), {"a", "b", "c"})
    assert step1 == state("abc", "a", 1, "a")
    s2 = d.expand_isr(d.expand_isr(step1, "b"), "c")
    assert d.reassign_step(s2, ("a", "b", "c"), {"a", "b", "c"}) == (state("abc", "a", 1, "abc"), True)


def test_a_topic_registered_with_its_data_keeps_its_replicas_and_starts_after_its_last_epoch() -> None:
    assert d.existing_assignment(("a",), {"a", "b"}) == ("a",)
    assert d.new_partition(("a",), 3) == state("a", "a", 3, "a")
    assert d.new_partition(("a",), 0) == state("a", "a", 1, "a")
    with pytest.raises(NotEnoughReplicas):
        d.existing_assignment(("c",), {"a", "b"})  # the node holding the data is not live
    with pytest.raises(InvalidRequest):
        d.existing_assignment(("a", "a"), {"a"})


def test_a_finished_reassignment_sets_the_topics_rf_and_the_asked_min_insync() -> None:
    one = TopicConfigRecord(1, 1, {"retention_ms": 1000})
    assert d.reassigned_config(one, 3, 2) == TopicConfigRecord(3, 2, {"retention_ms": 1000})
    assert d.reassigned_config(one, 3, None) == TopicConfigRecord(3, 1, {"retention_ms": 1000})
    assert d.reassigned_config(TopicConfigRecord(3, 2), 1, None) == TopicConfigRecord(1, 1)  # at most the new RF


def test_a_reassignment_needs_distinct_replicas() -> None:
    with pytest.raises(InvalidRequest):
        d.reassign_step(state("ab", "a", 1, "ab"), ("a", "a"), {"a"})
    with pytest.raises(InvalidRequest):
        d.reassign_step(state("ab", "a", 1, "ab"), (), {"a"})


@given(partition_states, st.lists(st.sampled_from(NODES), min_size=1, max_size=4, unique=True), live_sets)
def test_reassignment_steps_keep_the_invariants(
    before: PartitionState, target: list[str], live: frozenset[str]
) -> None:
    current = before
    for _ in range(4):
        after, done = d.reassign_step(current, tuple(target), live)
        _invariant(after)
        assert set(after.isr) <= set(current.isr)
        if after.leader is not None and after.leader != current.leader:
            assert after.leader in current.isr and after.leader_epoch == current.leader_epoch + 1
        if done:
            assert after.assignment == tuple(target)
            break
        current = after
        for n in after.assignment:  # followers catch up
            current = d.expand_isr(current, n) if current.leader is not None else current


def test_a_dead_letter_topic_goes_on_its_source_replicas_led_by_the_source_leader() -> None:
    source = PartitionState(("n1", "n2", "n3"), "n2", 4, ("n1", "n2", "n3"), False)
    partitions = {TopicPartition("orders", 0): source}
    assert d.colocate("orders.dlq", partitions, {"n1", "n2", "n3"}, 3) == ("n2", "n1", "n3")
    assert d.colocate("orders.dlq", partitions, {"n2", "n3"}, 2) == ("n2", "n3")
    assert d.colocate("orders.dlq", partitions, {"n2", "n3"}, 3) is None  # not enough live replicas: placed
    assert d.colocate("orders.dlq", partitions, {"n1", "n3"}, 2) is None  # the source's leader is gone
    assert d.colocate("orders", partitions, {"n1", "n2", "n3"}, 3) is None
    assert d.colocate("other.dlq", partitions, {"n1", "n2", "n3"}, 3) is None


def test_a_partitioned_topic_s_leaders_take_turns_over_the_nodes() -> None:
    busy = {TopicPartition("old", 0): PartitionState(("n1", "n2"), "n1", 1, ("n1", "n2"), False)}
    placed = d.place_partitions("orders", range(8), busy, {"n1", "n2", "n3"}, 2)
    leaders = [placed[p][0] for p in range(8)]
    assert leaders == ["n2", "n3", "n1", "n2", "n3", "n1", "n2", "n3"]  # n1 leads "old" already: it starts last
    counts = {node: leaders.count(node) + (node == "n1") for node in ("n1", "n2", "n3")}
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(len(set(assignment)) == 2 for assignment in placed.values())
    # A node that leads far less of the other topics (restarted) still gets only its share of this one
    crowded = {
        TopicPartition(f"t{i}", 0): PartitionState(("n1", "n2", "n3"), f"n{1 + i % 2}", 1, ("n1", "n2", "n3"), False)
        for i in range(10)
    }
    placed = d.place_partitions("orders", range(6), crowded, {"n1", "n2", "n3"}, 3)
    assert sorted(placed[p][0] for p in range(6)) == ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert placed[0][0] == "n3"  # the ties go to the least loaded first


def test_each_dead_letter_partition_goes_with_its_source_partition() -> None:
    source = {
        TopicPartition("orders", p): PartitionState(("n1", "n2", "n3"), leader, 1, ("n1", "n2", "n3"), False)
        for p, leader in enumerate(["n1", "n2", "n3", "n1"])
    }
    placed = d.place_partitions("orders.dlq", range(4), source, {"n1", "n2", "n3"}, 3)
    assert [placed[p][0] for p in range(4)] == ["n1", "n2", "n3", "n1"]


def test_the_partitions_a_config_names_and_etcd_lacks() -> None:
    config = TopicConfigRecord(1, 1, partitions=4)
    held = {TopicPartition("orders", p): PartitionState(("n1",), "n1", 1, ("n1",), False) for p in (0, 2)}
    assert d.missing_partitions("orders", config, held) == [1, 3]
    assert d.missing_partitions("orders", TopicConfigRecord(1, 1), held) == []


def test_a_reassignment_to_the_same_replicas_in_another_order_moves_the_leadership() -> None:
    state = PartitionState(("n1", "n2", "n3"), "n1", 4, ("n1", "n2", "n3"), False)
    moved, done = d.reassign_step(state, ("n3", "n1", "n2"), {"n1", "n2", "n3"})
    assert done and moved == PartitionState(("n3", "n1", "n2"), "n3", 5, ("n3", "n1", "n2"), False)
    assert d.reassign_step(moved, ("n3", "n1", "n2"), {"n1", "n2", "n3"}) == (moved, True)  # nothing more to do
    lagging = PartitionState(("n1", "n2", "n3"), "n1", 4, ("n1", "n2"), False)
    assert d.reassign_step(lagging, ("n1", "n2", "n3")[::-1], {"n1", "n2", "n3"})[0].leader == "n1"  # n3 not in sync
