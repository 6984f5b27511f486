"""The leader-epoch cache: Kafka's LeaderEpochFileCache cases, KIP-101/KIP-279 divergence, and the saved file."""

from __future__ import annotations

import json

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.epochs import EPOCHS_FILE, EpochEntry, LeaderEpochCache, load_entries
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig, TopicLog
from conveyor.broker.wire.record import pack_records

from tests.storage.storage_helpers import file_log

UNDEFINED = (-1, -1)
BODY = pack_records([(None, None, b"v")])


def cache(*pairs: tuple[int, int]) -> LeaderEpochCache:
    return LeaderEpochCache(pairs)


# --- the cache (after Kafka's LeaderEpochFileCacheTest) ---------------------------------------


def test_an_assigned_epoch_ends_at_the_log_end_while_it_is_the_latest():
    epochs = cache((2, 10))
    assert epochs.entries == [EpochEntry(2, 10)]
    assert epochs.end_offset_for(2, 11) == (2, 11)


def test_a_repeated_epoch_keeps_its_first_start_offset():
    epochs = cache((2, 6))
    assert not epochs.assign(2, 7)
    assert not epochs.assign(2, 6)
    assert epochs.entries == [(2, 6)]


def test_the_same_epoch_at_an_earlier_offset_replaces_it():
    epochs = cache((1, 11))
    assert epochs.assign(1, 10)
    assert epochs.entries == [(1, 10)]


def test_an_older_epoch_ends_where_the_next_begins():
    epochs = cache((1, 5), (1, 6), (2, 7))
    assert epochs.entries == [(1, 5), (2, 7)]
    assert epochs.end_offset_for(1, 100) == (1, 7)


def test_an_unlisted_epoch_answers_the_largest_older_epoch_and_where_it_ended():
    epochs = cache((1, 10), (3, 13), (5, 17))
    assert epochs.end_offset_for(2, 20) == (1, 13)
    assert epochs.end_offset_for(3, 20) == (3, 17)
    assert epochs.end_offset_for(4, 20) == (3, 17)
    assert epochs.end_offset_for(5, 20) == (5, 20)


def test_an_epoch_older_than_every_listed_one_ends_where_the_first_begins():
    assert cache((5, 256)).end_offset_for(4, 300) == (4, 256)
    # epoch 0 (outside a cluster) is implicit: it ends where the first leader epoch begins
    assert cache((1, 40)).end_offset_for(0, 300) == (0, 40)


def test_epoch_0_of_a_log_never_replicated_ends_at_the_log_end():
    assert cache().end_offset_for(0, 12) == (0, 12)
    assert cache().latest_epoch == 0


@pytest.mark.parametrize("epoch", [-1, 7])
def test_a_negative_epoch_or_one_newer_than_all_is_undefined(epoch):
    assert cache((2, 5), (4, 9)).end_offset_for(epoch, 20) == UNDEFINED
    assert cache().end_offset_for(max(epoch, 1), 20) == UNDEFINED


def test_an_older_epoch_assigned_later_removes_the_entries_it_conflicts_with():
    epochs = cache((2, 6), (3, 8), (4, 11))
    assert epochs.assign(3, 9)
    assert epochs.entries == [(2, 6), (3, 9)]
    assert epochs.assign(5, 7)  # an earlier start than listed entries: they go
    assert epochs.entries == [(2, 6), (5, 7)]


def test_epoch_0_is_never_listed():
    epochs = cache()
    assert not epochs.assign(0, 5)
    assert epochs.entries == []
    with pytest.raises(ValueError):
        epochs.assign(-1, 0)


@pytest.mark.parametrize(
    ("end", "kept"),
    [(12, [(2, 6), (3, 8), (4, 11)]), (11, [(2, 6), (3, 8)]), (9, [(2, 6), (3, 8)]), (8, [(2, 6)]), (0, [])],
)
def test_truncate_from_end_forgets_epochs_starting_at_or_after_the_cut(end, kept):
    epochs = cache((2, 6), (3, 8), (4, 11))
    epochs.truncate_from_end(end)
    assert epochs.entries == kept


@pytest.mark.parametrize(
    ("start", "kept"),
    [
        (5, [(2, 6), (3, 8), (4, 11)]),
        (6, [(2, 6), (3, 8), (4, 11)]),
        (8, [(3, 8), (4, 11)]),
        (9, [(3, 9), (4, 11)]),
        (11, [(4, 11)]),
        (12, [(4, 12)]),
    ],
)
def test_truncate_from_start_keeps_the_epoch_holding_the_new_start(start, kept):
    epochs = cache((2, 6), (3, 8), (4, 11))
    epochs.truncate_from_start(start)
    assert epochs.entries == kept


def test_epoch_at_an_offset():
    epochs = cache((2, 6), (3, 8))
    assert [epochs.epoch_at(o) for o in (0, 5, 6, 7, 8, 100)] == [0, 0, 2, 2, 3, 3]


# --- divergence (KIP-101 and KIP-279), on real logs -------------------------------------------


def memory_log() -> MemoryLog:
    return MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"))


def write(log: TopicLog, epoch: int, n: int) -> None:
    for _ in range(n):
        log.append(BODY, 1, leader_epoch=epoch)


def reconcile(follower: TopicLog, leader: TopicLog) -> int:
    """What a follower does with the leader's answer (KIP-279): truncate to the lower of the leader's end of
    the epoch found and its own end of that epoch, then fetch on from there."""
    epoch, end = leader.epoch_end_offset(follower.last_epoch)
    if epoch == -1:
        target = leader.start_offset
    else:
        _mine, own_end = follower.epoch_end_offset(epoch)
        target = min(end, own_end if _mine != -1 else end, follower.end_offset)
    follower.truncate_to(target)
    return target


def test_kip_101_a_follower_with_an_unreplicated_tail_of_an_old_epoch_cuts_it():
    # The leader of epoch 1 wrote offsets 0..4 and died with 4 replicated to one follower only;
    # the other follower became leader of epoch 2 at offset 4.
    leader, follower = memory_log(), memory_log()
    write(leader, 1, 4)
    leader.assign_epoch(2)
    write(leader, 2, 2)
    write(follower, 1, 5)

    assert leader.epoch_end_offset(1) == (1, 4)
    assert reconcile(follower, leader) == 4
    assert follower.end_offset == 4 and follower.epochs.entries == [(1, 0)]


def test_kip_101_a_follower_behind_in_the_same_epoch_cuts_nothing():
    leader, follower = memory_log(), memory_log()
    write(leader, 1, 4)
    write(follower, 1, 3)
    assert reconcile(follower, leader) == 3


def test_kip_279_an_epoch_the_leader_never_saw_ends_where_the_leaders_next_epoch_began():
    # The follower led epoch 2 briefly and wrote offsets 2..4 that nobody replicated; epoch 3 began at 2.
    leader, follower = memory_log(), memory_log()
    write(leader, 1, 2)
    write(leader, 3, 2)
    write(follower, 1, 2)
    write(follower, 2, 3)

    assert leader.epoch_end_offset(2) == (1, 2)
    assert reconcile(follower, leader) == 2
    assert follower.epochs.entries == [(1, 0)] and follower.last_epoch == 1


def test_kip_279_several_unreplicated_epochs_are_cut_in_one_round():
    leader, follower = memory_log(), memory_log()
    write(leader, 1, 3)
    write(leader, 4, 3)
    write(follower, 1, 2)  # behind in epoch 1
    write(follower, 2, 2)
    write(follower, 3, 2)

    assert leader.epoch_end_offset(3) == (1, 3)
    assert reconcile(follower, leader) == 2  # its own epoch 1 ended at 2: the lower end wins


def test_a_single_node_log_joining_a_cluster_keeps_its_epoch_0_batches():
    leader, follower = memory_log(), memory_log()
    for log_ in (leader, follower):
        log_.append(BODY, 1)
        log_.append(BODY, 1)
    write(leader, 1, 2)
    assert leader.epoch_end_offset(0) == (0, 2)
    assert reconcile(follower, leader) == 2
    assert follower.end_offset == 2


# --- on a log ---------------------------------------------------------------------------------


@pytest.fixture(params=["file", "memory"])
def make_log(request, tmp_path):
    return (lambda: file_log(tmp_path / "t")) if request.param == "file" else memory_log


def test_appending_a_new_epoch_assigns_it_once(make_log):
    log = make_log()
    log.append(BODY, 1)
    write(log, 3, 2)
    log.append(BODY, 1)  # a magic 1 batch later (a node that left the cluster): epoch 0 is not listed
    write(log, 5, 1)
    assert log.epochs.entries == [(3, 1), (5, 4)] and log.last_epoch == 5


def test_truncate_to_cuts_the_epochs(make_log):
    log = make_log()
    write(log, 1, 2)
    write(log, 2, 2)
    log.truncate_to(2)
    assert log.epochs.entries == [(1, 0)]
    write(log, 3, 1)
    assert log.epochs.entries == [(1, 0), (3, 2)]


def test_reset_to_forgets_every_epoch(make_log):
    log = make_log()
    write(log, 1, 2)
    log.reset_to(10)
    assert log.epochs.entries == []
    write(log, 2, 1)
    assert log.epochs.entries == [(2, 10)]


def test_a_new_leader_assigns_its_epoch_at_the_log_end_before_appending(make_log):
    log = make_log()
    write(log, 1, 3)
    log.assign_epoch(2)
    assert log.epoch_end_offset(1) == (1, 3) and log.last_epoch == 2


def test_a_single_node_log_writes_no_epochs_file(tmp_path):
    log = file_log(tmp_path / "t")
    log.append(BODY, 1)
    log.sync()
    log.close()
    file_log(tmp_path / "t").close()
    assert not (tmp_path / "t" / EPOCHS_FILE).exists()


def test_the_epochs_are_saved_and_read_back_on_open(tmp_path):
    log = file_log(tmp_path / "t")
    log.append(BODY, 1)
    write(log, 2, 2)
    write(log, 4, 1)
    log.sync()
    log.close()
    assert load_entries(tmp_path / "t" / EPOCHS_FILE) == [(2, 1), (4, 3)]
    assert file_log(tmp_path / "t").epochs.entries == [(2, 1), (4, 3)]


@pytest.mark.parametrize(
    "damage", ["missing", "not json", "wrong format", "out of order", "disagrees", "past the end", "empty"]
)
def test_a_missing_or_damaged_epochs_file_is_rebuilt_from_the_batch_headers(tmp_path, damage):
    log = file_log(tmp_path / "t")
    write(log, 2, 2)
    write(log, 4, 1)
    log.sync()
    log.close()
    path = tmp_path / "t" / EPOCHS_FILE
    written = {
        "not json": b"{nope",
        "wrong format": json.dumps({"format": 99, "epochs": [[2, 0], [4, 2]]}).encode(),
        "out of order": json.dumps({"format": 1, "epochs": [[4, 2], [2, 0]]}).encode(),
        "disagrees": json.dumps({"format": 1, "epochs": [[2, 0], [3, 1], [4, 2]]}).encode(),
        "past the end": json.dumps({"format": 1, "epochs": [[2, 0], [4, 2], [6, 3]]}).encode(),
        "empty": b"",
    }
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(written[damage])

    assert file_log(tmp_path / "t").epochs.entries == [(2, 0), (4, 2)]
    assert load_entries(path) == [(2, 0), (4, 2)]


def test_a_cut_tail_cuts_the_saved_epochs_on_open(tmp_path):
    log = file_log(tmp_path / "t")
    write(log, 2, 2)
    write(log, 4, 1)
    log.sync()
    size_before_epoch_4 = (tmp_path / "t" / "00000000000000000000.log").stat().st_size - (52 + len(BODY))
    log.close()
    with open(tmp_path / "t" / "00000000000000000000.log", "r+b") as f:
        f.truncate(size_before_epoch_4 + 10)  # a torn epoch 4 batch

    reopened = file_log(tmp_path / "t")

    assert reopened.end_offset == 2 and reopened.epochs.entries == [(2, 0)]
    assert load_entries(tmp_path / "t" / EPOCHS_FILE) == [(2, 0)]


def test_retention_moves_the_first_epoch_to_the_new_start(tmp_path):
    # Given epochs 1 and 2 over several segments, of which retention keeps only the newest
    config = {"segment_bytes": 1024, "retention_bytes": 0}
    log = file_log(tmp_path / "t", **config)
    big = pack_records([(None, None, b"x" * 300)])
    for epoch in (1, 1, 1, 1, 2, 2, 2):
        log.append(big, 1, leader_epoch=epoch)
    log.sync()
    # When retention drops the older segments
    log.apply_retention()
    # Then the epoch holding the new start begins there, and the file says so too
    assert log.start_offset > 0
    kept = [(1, log.start_offset), (2, 4)] if log.start_offset < 4 else [(2, log.start_offset)]
    assert log.epochs.entries == kept
    log.close()
    assert file_log(tmp_path / "t", **config).epochs.entries == kept


@pytest.mark.parametrize("make", [memory_log, lambda: None], ids=["memory", "file"])
def test_truncating_at_the_end_still_forgets_an_epoch_that_wrote_nothing(make, tmp_path):
    """A leader of epoch 2 that appended nothing, then a follower told to cut at its end: epoch 2 goes.

    The cut changes no batch, but the cache must lose the empty epoch, or the next replica FETCH names
    epoch 2 again, the leader (which never knew it) answers DIVERGING at the same offset, and so on.
    """
    log_ = make() or file_log(tmp_path)
    write(log_, 1, 10)
    log_.assign_epoch(2)  # it led at epoch 2, at the log end, and wrote nothing
    assert log_.last_epoch == 2
    log_.truncate_to(log_.end_offset)
    assert log_.last_epoch == 1 and log_.end_offset == 10
