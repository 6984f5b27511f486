"""Long-poll FETCH: answered at once with durable data, else parked until a sync, a deletion or its deadline."""

from __future__ import annotations

from typing import Any

import pytest
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.fetch_waits import FetchWaits
from conveyor.broker.wire.protocol import Command, Frame
from conveyor.broker.wire.record import pack_records

from tests.server.server_fakes import Clock, Sent


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "data", fsync="none")
    yield store
    store.close()


def fetches(store: Store, sent: Sent, clock: Clock) -> FetchWaits:
    return FetchWaits(store, sent.send, sent.reply_error, clock, max_wait_ms=5000, max_batch_bytes=1 << 20)


def fetch(rid: int, offset: int, wait_ms: int = 0, topic: str = "t") -> Frame:
    header: dict[str, Any] = {"rid": rid, "topic": topic, "offset": offset, "wait_ms": wait_ms}
    return Frame(Command.FETCH, header)


def append(store: Store, topic: str, n: int) -> None:
    store.topic(topic).append(pack_records([(None, None, b"v")] * n), n)


def test_a_fetch_of_durable_offsets_is_answered_at_once(store):
    store.create_topic("t")
    append(store, "t", 3)
    sent = Sent()
    fetches(store, sent, Clock()).fetch(b"p", fetch(1, 1))
    ((peer, reply),) = sent.frames
    assert (peer, reply.command, reply.get("end_offset")) == (b"p", Command.FETCHED, 3)
    assert [(e["f"], e["e"]) for e in reply.get("entries")] == [(1, 3)]


def test_a_waiting_fetch_is_parked_until_its_offset_is_durable(store):
    # Given a FETCH at the log end that may wait
    store.create_topic("t")
    sent, clock = Sent(), Clock(now=10.0)
    waits = fetches(store, sent, clock)
    waits.fetch(b"p", fetch(1, 0, wait_ms=2000))
    assert sent.frames == [] and waits.next_deadline() == 12.0
    waits.wake("t")  # nothing durable past it yet: it waits on
    assert sent.frames == []
    # When a batch is appended (and durable) and the topic is woken
    append(store, "t", 2)
    waits.wake("t")
    # Then it is answered with that batch, and its deadline no longer counts
    ((_peer, reply),) = sent.frames
    assert reply.get("rid") == 1 and [e["n"] for e in reply.get("entries")] == [2]
    assert waits.next_deadline() is None


def test_a_parked_fetch_is_answered_empty_at_its_deadline(store):
    store.create_topic("t")
    sent, clock = Sent(), Clock(now=10.0)
    waits = fetches(store, sent, clock)
    waits.fetch(b"p", fetch(1, 0, wait_ms=1000))
    waits.expire(10.5)
    assert sent.frames == []
    waits.expire(11.0)
    ((_peer, reply),) = sent.frames
    assert (reply.command, reply.get("entries")) == (Command.FETCHED, []) and not waits.by_topic


def test_a_deleted_topic_answers_its_parked_fetches_unknown_topic_and_shutdown_answers_the_rest(store):
    store.create_topic("t")
    store.create_topic("u")
    sent = Sent()
    waits = fetches(store, sent, Clock())
    waits.fetch(b"p", fetch(1, 0, wait_ms=1000, topic="t"))
    waits.fetch(b"q", fetch(2, 0, wait_ms=1000, topic="u"))
    store.delete_topic("t")
    waits.wake("t")
    assert sent.errors == [(b"p", "UNKNOWN_TOPIC", 1)]
    waits.shutdown()
    assert sent.errors[1:] == [(b"q", "SHUTTING_DOWN", 2)]


def test_a_high_watermark_holds_back_what_a_fetch_sees(store):
    # Given three durable offsets of which a replication leader lets readers see one
    store.create_topic("t")
    append(store, "t", 1)
    append(store, "t", 2)
    store.topic("t").set_high_watermark(1)
    sent, clock = Sent(), Clock(now=10.0)
    waits = fetches(store, sent, clock)
    # When a FETCH reads from 0, and another waits at 1
    waits.fetch(b"p", fetch(1, 0))
    waits.fetch(b"p", fetch(2, 1, wait_ms=2000))
    # Then the first sees the batch below the high watermark, the other waits
    ((_peer, reply),) = sent.frames
    assert reply.get("end_offset") == 1 and [(e["b"], e["e"]) for e in reply.get("entries")] == [(0, 1)]
    waits.wake("t")
    assert len(sent.frames) == 1
    # And once the high watermark moves, the waiting one is answered
    store.topic("t").set_high_watermark(3)
    waits.wake("t")
    assert [e["b"] for e in sent.frames[1][1].get("entries")] == [1]
