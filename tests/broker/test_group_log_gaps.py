"""A group passes a gap in the log: offsets a power cut took are never held by a member.

After a power cut under ``fsync=none`` a log can skip offsets it knows existed
(``FileLog._continue_after_loss``: a group had committed past its new end). A
member once held a chunk covering the gap although nothing in it was sent: the
group's committed offset stayed behind the gap until the lease ran out (30 s by
default), then the same empty chunk was handed out again.
"""

from __future__ import annotations

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.wire.record import pack_records

from tests.helpers import FakeClock


def gap_log(tmp_path, clock) -> FileLog:
    """Offsets 0..4, a gap 5..9 (a group had committed 10 before the cut), then 10..14."""
    config = TopicConfig()
    log = FileLog("t", tmp_path / "t", config, fsync=FsyncPolicy("batch"), clock=clock)
    log.append(pack_records([[None, None, f"a{i}"] for i in range(5)]), 5)
    log.sync()
    log.close()
    log = FileLog("t", tmp_path / "t", config, fsync=FsyncPolicy("batch"), clock=clock, committed={"g": 10})
    log.append(pack_records([[None, None, f"b{i}"] for i in range(5)]), 5)
    log.sync()
    return log


def delivered(plans) -> list[int]:
    return [o for plan in plans for e in plan.entries for o in range(e.first, e.end)]


def test_new_messages_after_a_gap_leave_nothing_held_in_it(tmp_path):
    clock = FakeClock(1000.0)
    log = gap_log(tmp_path, clock)
    group = Group("t", "g", GroupSettings(), next_offset=3, clock=clock)
    member = Member(b"p", 1, credit=100, batch_size=100)
    group.join(member)
    got = []
    for _ in range(3):  # each read stays within a segment: a few dispatches reach the end
        got += delivered(group.dispatch(log))
    assert got == [3, 4, 10, 11, 12, 13, 14]
    assert member.in_flight == len(got), "the member holds only what it was sent"
    group.settle(member, [(3, 5), (10, 15)])
    assert group.committed_offset == 15, "acking what was sent settles the group: the gap is passed"
    log.close()


def test_redeliveries_across_a_gap_leave_nothing_held_in_it(tmp_path):
    clock = FakeClock(1000.0)
    log = gap_log(tmp_path, clock)
    group = Group("t", "g", GroupSettings(), next_offset=15, clock=clock)
    group.restore([[2, 13, 1, 0, 0, 0]], clock(), 0)  # unsettled before the cut, saved across it
    member = Member(b"p", 1, credit=100, batch_size=100)
    group.join(member)
    got = []
    for _ in range(3):
        got += delivered(group.dispatch(log))
    assert got == [2, 3, 4, 10, 11, 12]
    assert member.in_flight == len(got)
    group.settle(member, [(2, 5), (10, 13)])
    assert group.committed_offset == 15
    log.close()
