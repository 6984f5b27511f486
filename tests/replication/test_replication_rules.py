"""The leader's replication decisions, without a broker: HW, the caught-up rule, ISR changes, diverging logs."""

from __future__ import annotations

import pytest
from conveyor.broker.cluster.keys import PartitionState
from conveyor.broker.log.epochs import LeaderEpochCache
from conveyor.broker.server.partition_status import describe_led
from conveyor.broker.server.partitions import Role, role_for
from conveyor.broker.server.replica import EARLY_FETCH_BYTES, early_fetch
from conveyor.broker.server.replication import (
    IsrChange,
    PartitionLeader,
    caught_up_time,
    check_epoch,
    diverging,
    high_watermark,
    lagging,
    may_advance,
    rejoining,
    truncation_offset,
)

from conveyor.errors import FencedLeaderEpoch, NotEnoughReplicas, UnknownLeaderEpoch

# --- HW arithmetic ---------------------------------------------------------------------------


def test_hw_is_the_smallest_durable_end_over_the_isr() -> None:
    assert high_watermark({"a": 100, "b": 80, "c": 95}, {"a", "b", "c"}, 0) == 80


def test_hw_ignores_replicas_out_of_the_isr() -> None:
    assert high_watermark({"a": 100, "b": 80, "c": 5}, {"a", "b"}, 0) == 80


def test_hw_never_moves_back() -> None:
    assert high_watermark({"a": 100, "b": 40}, {"a", "b"}, 60) == 60


def test_an_isr_member_never_heard_from_holds_hw_at_its_start() -> None:
    assert high_watermark({"a": 100}, {"a", "b"}, 0) == 0


def test_hw_moves_only_with_enough_in_sync_replicas() -> None:
    assert may_advance(2, 2)
    assert not may_advance(1, 2)


# --- the caught-up rule (Kafka's lastCaughtUpTime) -----------------------------------------------


def test_a_fetch_at_the_leaders_end_is_caught_up_now() -> None:
    assert caught_up_time(100, 50.0, leader_end=100, previous_fetch=40.0, end_at_previous_fetch=90, last=10.0) == 50.0


def test_a_fetch_that_reached_the_end_of_the_previous_fetch_was_caught_up_then() -> None:
    got = caught_up_time(95, 50.0, leader_end=100, previous_fetch=40.0, end_at_previous_fetch=90, last=10.0)
    assert got == 40.0


def test_a_fetch_behind_both_ends_leaves_the_time_where_it_was() -> None:
    assert caught_up_time(80, 50.0, leader_end=100, previous_fetch=40.0, end_at_previous_fetch=90, last=10.0) == 10.0


def test_followers_not_caught_up_within_the_lag_are_lagging() -> None:
    caught = {"b": 90.0, "c": 99.0}
    assert lagging(caught, {"a", "b", "c"}, "a", now=100.0, lag_max=5.0) == ["b"]
    assert lagging(caught, {"a", "c"}, "a", now=100.0, lag_max=5.0) == []


def test_a_replica_rejoins_once_durable_to_hw_and_to_the_epoch_start() -> None:
    durable = {"b": 50, "c": 70}
    assert rejoining(durable, ("a", "b", "c"), {"a"}, hw=60, epoch_start=40) == ["c"]
    assert rejoining(durable, ("a", "b", "c"), {"a"}, hw=30, epoch_start=60) == ["c"]
    assert rejoining(durable, ("a", "b", "c"), {"a", "c"}, hw=10, epoch_start=0) == ["b"]


# --- epochs --------------------------------------------------------------------------------------


def test_a_request_with_this_nodes_epoch_or_none_passes() -> None:
    check_epoch(None, 3)
    check_epoch(3, 3)


def test_a_newer_epoch_fences_this_node_and_an_older_one_is_unknown() -> None:
    with pytest.raises(FencedLeaderEpoch):
        check_epoch(4, 3)
    with pytest.raises(UnknownLeaderEpoch):
        check_epoch(2, 3)


def cache(*entries: tuple[int, int]) -> LeaderEpochCache:
    return LeaderEpochCache(entries)


LEADER = cache((1, 0), (3, 100), (4, 150))  # epoch 1 from 0, 3 from 100, 4 from 150; the log ends at 180


def leader_answer(last_epoch: int, offset: int) -> dict[str, int] | None:
    return diverging(LEADER.end_offset_for(last_epoch, 180), last_epoch, offset)


def test_a_follower_within_its_epoch_does_not_diverge() -> None:
    assert leader_answer(3, 120) is None
    assert leader_answer(3, 150) is None
    assert leader_answer(4, 180) is None


def test_a_follower_past_the_end_of_its_epoch_here_truncates_to_it() -> None:
    # KIP-101: the follower wrote offsets 100..119 as epoch 1's leader, which this leader never had.
    assert leader_answer(1, 120) == {"epoch": 1, "end_offset": 100}


def test_a_follower_with_an_epoch_this_leader_never_had_truncates_where_its_own_copy_of_the_one_before_ends() -> None:
    # It led epoch 2 (which nobody else saw) from offset 90 and wrote up to 130.
    answer = leader_answer(2, 130)
    assert answer == {"epoch": 1, "end_offset": 100}
    follower = cache((1, 0), (2, 90))
    assert truncation_offset(answer, follower.end_offset_for(1, 130)) == 90  # KIP-279: its own end of epoch 1
    after = diverging(LEADER.end_offset_for(1, 180), 1, 90)
    assert after is None  # then the logs agree


def test_a_follower_older_than_the_cache_truncates_to_its_first_offset() -> None:
    assert diverging(cache((3, 100)).end_offset_for(1, 180), 1, 120) == {"epoch": 1, "end_offset": 100}


def test_a_follower_without_an_epoch_an_empty_log_or_a_newer_epoch_is_not_checked() -> None:
    assert leader_answer(0, 120) is None
    assert diverging((-1, -1), None, 120) is None
    assert leader_answer(4, 0) is None
    assert leader_answer(9, 200) is None  # newer than the leader: the epoch checks fence it


def test_a_follower_without_its_own_copy_of_the_epoch_cuts_at_the_leaders_end() -> None:
    assert truncation_offset({"epoch": 1, "end_offset": 100}, (-1, -1)) == 100


# --- one partition's leader ------------------------------------------------------------------------


def leader(min_insync: int = 2, isr: tuple[str, ...] = ("a", "b", "c")) -> tuple[PartitionLeader, list[IsrChange]]:
    proposed: list[IsrChange] = []
    state = PartitionLeader("t", 0, "a", 5, ("a", "b", "c"), set(isr), min_insync, 10.0, proposed.append)
    state.now_caught_up(0.0)
    return state, proposed


def test_hw_follows_the_slowest_durable_follower_and_this_nodes_own_durable_end() -> None:
    state, _ = leader()
    state.on_fetch("b", 100, 100, leader_end=100, now=1.0)
    assert not state.update_hw(100)  # c has reported nothing
    state.on_fetch("c", 100, 60, leader_end=100, now=1.0)
    assert state.update_hw(100) and state.hw == 60
    state.on_fetch("c", 100, 100, leader_end=100, now=2.0)
    assert state.update_hw(90) and state.hw == 90  # this node's own sync is behind


def test_a_followers_durable_end_never_counts_past_its_fetch_offset() -> None:
    state, _ = leader(isr=("a", "b"))
    state.on_fetch("b", 50, 80, leader_end=100, now=1.0)
    state.update_hw(100)
    assert state.hw == 50


def test_a_report_moves_a_followers_durable_end_but_not_its_fetch_times() -> None:
    state, _ = leader(isr=("a", "b"))
    state.on_fetch("b", 100, 60, leader_end=100, now=1.0)  # its FETCH, parked while it syncs
    state.on_report("b", 100, 100)
    assert state.update_hw(100) and state.hw == 100
    follower = state.followers["b"]
    assert (follower.fetch_offset, follower.last_fetch, follower.end_at_last_fetch) == (100, 1.0, 100)
    state.on_report("b", 90, 100)  # never past where its log ends
    assert follower.durable == 90


def test_a_follower_fetches_before_its_sync_only_after_a_small_answer_that_reached_the_leaders_end() -> None:
    assert early_fetch(100, 100, 2_000)  # caught up at 5,000 msg/s: the next batch must not wait for the sync
    assert not early_fetch(90, 100, 2_000)  # catching up: the FETCH after the sync gets the rest
    assert not early_fetch(100, 100, EARLY_FETCH_BYTES + 1)  # a fast leader: no splitting into small answers


def test_a_lagging_follower_is_proposed_out_but_counts_until_the_change_is_written() -> None:
    state, proposed = leader()
    state.on_fetch("b", 100, 100, leader_end=100, now=15.0)
    state.on_fetch("c", 10, 10, leader_end=100, now=15.0)
    state.check_lag(now=20.0)
    assert proposed == [IsrChange("t", 0, 5, ("a", "b"), shrink=True)]
    state.update_hw(100)
    assert state.hw == 10  # c still in the ISR: HW waits for it
    state.check_lag(now=21.0)
    assert len(proposed) == 1  # one proposal at a time
    state.isr_written(("a", "b"))
    assert state.update_hw(100) and state.hw == 100


def test_a_refused_shrink_leaves_the_isr_and_is_proposed_again() -> None:
    state, proposed = leader()
    state.on_fetch("b", 100, 100, leader_end=100, now=15.0)
    state.check_lag(now=20.0)
    state.isr_refused()
    assert state.isr == {"a", "b", "c"}
    state.check_lag(now=21.0)
    assert len(proposed) == 2


def test_a_follower_that_catches_up_rejoins_at_once() -> None:
    state, proposed = leader(isr=("a", "b"))
    state.on_fetch("b", 100, 100, leader_end=100, now=1.0)
    state.update_hw(100)
    state.on_fetch("c", 50, 50, leader_end=100, now=1.0)
    assert "c" not in state.isr
    state.on_fetch("c", 100, 100, leader_end=100, now=2.0)
    assert "c" in state.isr
    assert proposed[-1] == IsrChange("t", 0, 5, ("a", "b", "c"), shrink=False)


def test_below_min_insync_hw_stays_and_publishes_are_refused() -> None:
    state, _ = leader(min_insync=3, isr=("a", "b"))
    state.on_fetch("b", 100, 100, leader_end=100, now=1.0)
    assert not state.update_hw(100)
    with pytest.raises(NotEnoughReplicas):
        state.check_publish()


def test_a_gone_follower_is_proposed_out_at_once() -> None:
    state, proposed = leader()
    state.follower_gone("c")
    assert proposed == [IsrChange("t", 0, 5, ("a", "b"), shrink=True)]


# --- roles from a partition record -------------------------------------------------------------------


def test_the_record_names_the_leader_its_followers_and_nobody_else() -> None:
    state = PartitionState(("a", "b", "c"), "a", 4, ("a", "b"))
    assert role_for(state, "a") is Role.LEADER
    assert role_for(state, "b") is Role.FOLLOWER
    assert role_for(state, "c") is Role.FOLLOWER  # out of the ISR, it fetches to get back in
    assert role_for(state, "d") is Role.NONE


def test_an_offline_or_deleted_partition_gives_no_role() -> None:
    assert role_for(PartitionState(("a", "b"), None, 4, (), offline=True), "a") is Role.NONE
    assert role_for(None, "a") is Role.NONE


def test_the_successor_is_an_in_sync_follower_holding_the_whole_log() -> None:
    state, _ = leader()
    state.on_fetch("b", 100, 90, leader_end=100, now=1.0)
    state.on_fetch("c", 100, 100, leader_end=100, now=1.0)
    assert state.successor(100) == "c"
    assert state.successor(101) is None
    described = describe_led(state, 120, 1.0)
    assert described["isr"] == ["a", "b", "c"]
    assert [(f["node"], f["fetch_offset"], f["durable_offset"], f["lag_messages"]) for f in described["followers"]] == [
        ("b", 100, 90, 20),
        ("c", 100, 100, 20),
    ]


def test_a_refused_expansion_is_proposed_again_until_etcd_holds_it() -> None:
    """The rejoin counted here at once, but etcd never got it (unreachable): the next check writes it again."""
    state, proposed = leader(isr=("a", "b"))
    state.on_fetch("b", 100, 100, leader_end=100, now=1.0)
    state.update_hw(100)
    state.on_fetch("c", 100, 100, leader_end=100, now=2.0)
    assert "c" in state.isr and len(proposed) == 1
    state.isr_refused()
    state.check_lag(now=3.0)
    assert proposed[-1] == IsrChange("t", 0, 5, ("a", "b", "c"), shrink=False) and len(proposed) == 2
    state.check_lag(now=3.5)
    assert len(proposed) == 2  # one proposal at a time
    state.isr_written(("a", "b", "c"))
    state.check_lag(now=4.0)
    assert len(proposed) == 2  # written: nothing more to say
