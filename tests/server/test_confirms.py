"""Confirms: a PUBLISH is confirmed once its batch is durable, and answered with the error of a sync that lost it."""

from __future__ import annotations

from typing import Any

from conveyor.broker.server.confirms import Confirm, Confirms
from conveyor.broker.wire.protocol import Command

from conveyor.errors import StorageIOError
from tests.server.server_fakes import Clock, FakeLog, Histogram, Sent


def confirms(sent: Sent, clock: Clock) -> tuple[Confirms, Histogram]:
    latency = Histogram()
    return Confirms(sent.send, sent.reply_error, latency, clock), latency


def confirm(log: Any, base: int, count: int, rid: int, received: float = 100.0) -> Confirm:
    return Confirm(b"p%d" % rid, rid, log, base, count, False, received)


def test_a_confirm_waits_until_its_batch_is_durable():
    # Given two appended batches of which only the first is synced
    sent, clock = Sent(), Clock(now=100.5)
    owed, latency = confirms(sent, clock)
    log = FakeLog("t", end_offset=5, durable_offset=2)
    owed.add(confirm(log, 0, 2, rid=1))
    owed.add(confirm(log, 2, 3, rid=2))
    # When the durable ones are sent
    owed.send_durable()
    # Then only the first is confirmed, with its offsets; the second waits
    ((peer, reply),) = sent.frames
    assert (peer, reply.command, reply.get("rid"), reply.get("base_offset"), reply.get("count")) == (
        b"p1",
        Command.PUBLISHED,
        1,
        0,
        2,
    )
    assert latency.observed == [0.5] and len(owed) == 1
    # And once the sync covers it, it goes too
    log.durable_offset = 5
    owed.send_durable()
    assert [r.get("rid") for _, r in sent.frames] == [1, 2] and not owed


def test_a_failed_sync_answers_every_waiting_confirm_with_its_error():
    sent = Sent()
    owed, _ = confirms(sent, Clock())
    owed.add(confirm(FakeLog("a", 1), 0, 1, rid=1))
    owed.add(confirm(FakeLog("b", 1), 0, 1, rid=2))
    owed.fail(StorageIOError("disk gone"))
    assert [(peer, rid) for peer, _name, rid in sent.errors] == [(b"p1", 1), (b"p2", 2)] and not owed


def test_a_log_cut_back_fails_only_the_confirms_it_no_longer_holds():
    # Given confirms on two logs, and a sync inside an append that cut log a back to offset 2
    sent = Sent()
    owed, _ = confirms(sent, Clock())
    cut, other = FakeLog("a", end_offset=2), FakeLog("b", end_offset=9)
    owed.add(confirm(cut, 0, 2, rid=1))  # still held
    owed.add(confirm(cut, 2, 3, rid=2))  # lost
    owed.add(confirm(other, 5, 4, rid=3))  # another log
    owed.fail(StorageIOError("sync failed"), cut_from=cut)
    assert [rid for _peer, _name, rid in sent.errors] == [2]
    assert [c.rid for c in owed.waiting] == [1, 3]


def test_confirms_of_a_deleted_topic_are_answered_unknown_topic():
    sent = Sent()
    owed, _ = confirms(sent, Clock())
    gone, kept = FakeLog("gone", 1), FakeLog("kept", 1)
    owed.add(confirm(gone, 0, 1, rid=1))
    owed.add(confirm(kept, 0, 1, rid=2))
    owed.topic_deleted("gone", {"kept": kept})
    assert sent.errors == [(b"p1", "UNKNOWN_TOPIC", 1)] and [c.rid for c in owed.waiting] == [2]


def test_a_high_watermark_holds_back_confirms_of_durable_batches():
    # Given a durable batch on a log whose replication leader has not seen it replicated
    sent = Sent()
    owed, _ = confirms(sent, Clock())
    log = FakeLog("t", end_offset=5, durable_offset=5, high_watermark=2)
    owed.add(confirm(log, 0, 2, rid=1))
    owed.add(confirm(log, 2, 3, rid=2))
    # When confirms are sent, only the batch below the high watermark goes
    owed.send_durable()
    assert [r.get("rid") for _, r in sent.frames] == [1]
    # And the rest once the high watermark passes it
    log.high_watermark = 5
    owed.send_durable()
    assert [r.get("rid") for _, r in sent.frames] == [1, 2] and not owed
