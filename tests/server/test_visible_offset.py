"""A replication leader's high watermark caps what a group delivers (a unit test of groups.py)."""

from __future__ import annotations

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.wire.record import pack_records

from tests.helpers import FakeClock


@pytest.mark.parametrize("key_affinity", [False, True])
def test_a_group_delivers_nothing_past_the_high_watermark(key_affinity):
    clock = FakeClock(1000.0)
    log = MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"), clock=clock)
    group = Group("t", "g", GroupSettings(key_affinity=key_affinity), next_offset=0, clock=clock)
    group.join(Member(b"peer", 1, credit=100, batch_size=100))
    for _ in range(3):
        log.append(pack_records([(b"k", None, b"v"), (b"j", None, b"w")]), 2)
    log.set_high_watermark(2)

    first = [(e.first, e.end) for plan in group.dispatch(log) for e in plan.entries]
    log.set_high_watermark(6)
    then = [(e.first, e.end) for plan in group.dispatch(log) for e in plan.entries]

    assert first == [(0, 2)]
    assert then[0][0] == 2 and then[-1][1] == 6
