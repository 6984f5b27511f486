"""Appending a replicated batch: a follower or mirror stores the leader's offsets, producer ids, sequences and epochs.

Idempotence must survive a failover: the new leader's producer state is built from the
batches it replicated, exactly as from its own appends, is rebuilt from the headers when it
opens, and forgets what ``truncate_to`` cuts.
"""

from __future__ import annotations

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig, TopicLog
from conveyor.broker.wire.record import pack_records

from conveyor.errors import OffsetOutOfRange
from tests.storage.storage_helpers import file_log

BODY = pack_records([(None, None, b"a"), (None, None, b"b")])


def memory_log() -> MemoryLog:
    return MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"))


@pytest.fixture(params=["file", "memory"])
def make_log(request, tmp_path):
    return (lambda: file_log(tmp_path / "t")) if request.param == "file" else memory_log


def replicate(log: TopicLog, base: int, pid: int, seq: int, epoch: int) -> None:
    log.append(BODY, 2, producer_id=pid, sequence=seq, timestamp_ms=1000 + base, base_offset=base, leader_epoch=epoch)


def test_a_replicated_batch_keeps_the_leaders_offsets_and_header_fields(make_log):
    follower = make_log()
    replicate(follower, 0, 42, 0, 3)
    replicate(follower, 2, 42, 1, 3)
    follower.sync()

    got = [(b.base_offset, b.producer_id, b.sequence, b.leader_epoch, b.timestamp_ms) for b in follower.read(0)]
    assert got == [(0, 42, 0, 3, 1000), (2, 42, 1, 3, 1002)]


def test_a_resend_to_the_new_leader_is_answered_with_the_replicated_offsets(make_log):
    follower = make_log()
    replicate(follower, 0, 42, 0, 3)
    replicate(follower, 2, 42, 1, 3)

    # Promoted: the producer resends sequence 1 after the failover
    again = follower.append(BODY, 2, producer_id=42, sequence=1, leader_epoch=4)

    assert (again.base_offset, again.duplicate) == (2, True)
    assert follower.end_offset == 4


def test_the_replicated_producer_state_is_rebuilt_from_the_headers_on_open(tmp_path):
    follower = file_log(tmp_path / "t")
    replicate(follower, 0, 42, 0, 3)
    replicate(follower, 2, 42, 1, 3)
    follower.sync()
    follower.close()

    reopened = file_log(tmp_path / "t")
    again = reopened.append(BODY, 2, producer_id=42, sequence=1, leader_epoch=4)

    assert (again.base_offset, again.duplicate) == (2, True)


def test_truncate_to_forgets_the_cut_sequences(make_log):
    follower = make_log()
    replicate(follower, 0, 42, 0, 3)
    replicate(follower, 2, 42, 1, 3)

    follower.truncate_to(2)  # a diverging tail, cut
    again = follower.append(BODY, 2, producer_id=42, sequence=1, leader_epoch=4)

    assert (again.base_offset, again.duplicate) == (2, False)


def test_a_replicated_batch_must_follow_the_end(make_log):
    follower = make_log()
    with pytest.raises(OffsetOutOfRange):
        replicate(follower, 5, 42, 0, 3)


def test_visible_offset_is_the_durable_offset_unless_a_high_watermark_caps_it(make_log):
    log = make_log()
    log.append(BODY, 2)
    log.append(BODY, 2)
    log.sync()
    assert (log.durable_offset, log.visible_offset, log.high_watermark) == (4, 4, None)

    log.set_high_watermark(2)
    assert log.visible_offset == 2
    log.set_high_watermark(10)  # a high watermark never shows more than is durable here
    assert log.visible_offset == 4
    log.set_high_watermark(None)
    assert log.visible_offset == 4
