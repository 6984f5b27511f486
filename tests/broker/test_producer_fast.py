"""Producer fast paths: body encoding, cheap futures, send_many (proposed for tests/broker/)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time

import msgpack
import pytest
from conveyor.broker.client.futures import BatchState as _BatchState
from conveyor.broker.client.futures import OffsetFuture
from conveyor.broker.client.producer import Producer, _array_header, _encode_record
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.wire.record import pack_records, unpack_records, validate_body

from conveyor import Admin


@pytest.mark.parametrize("n", [0, 1, 15, 16, 255, 256, 65535, 65536, 70000])
def test_record_and_array_encoding_matches_pack_records(n):
    value = bytes(range(256)) * (n // 256) + bytes(n % 256)
    records = [(None, None, value), ("k", None, value), (b"k", {"a": "b"}, value)]
    expected = pack_records([(None, None, value), ("k", None, value), (b"k", {"a": "b"}, value)])
    ours = _array_header(3) + b"".join(_encode_record(v, k, h) for k, h, v in records)
    assert ours == expected
    assert validate_body(ours, max_message_bytes=1 << 20) == 3


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 65535, 65536])
def test_array_header(count):
    assert _array_header(count) == msgpack.packb([None] * count)[: len(_array_header(count))]
    assert msgpack.unpackb(_array_header(count) + b"\xc0" * count) == [None] * count


def test_str_and_object_values_carry_their_content_type():
    body = _array_header(2) + _encode_record("text", None, None) + _encode_record({"a": 1}, None, {"x": "y"})
    (_k1, h1, v1), (_k2, h2, v2) = unpack_records(body)
    assert h1 == {"content-type": "text/plain; charset=utf-8"} and v1 == b"text"
    assert h2 == {"x": "y", "content-type": "application/msgpack"} and msgpack.unpackb(v2) == {"a": 1}


def _batch(n: int) -> tuple[_BatchState, list[OffsetFuture]]:
    state = _BatchState()
    return state, [OffsetFuture(state, i) for i in range(n)]


def test_futures_resolve_together_with_offsets():
    state, futures = _batch(5)
    assert not any(f.done() for f in futures)
    assert all(isinstance(f, cf.Future) for f in futures)
    seen = []
    futures[2].add_done_callback(lambda f: seen.append(f.result()))
    state.resolve(100)
    assert [f.result(timeout=0) for f in futures] == [100, 101, 102, 103, 104]
    assert seen == [102]
    late = []
    futures[3].add_done_callback(lambda f: late.append(f.result()))  # already done: runs at once
    assert late == [103]
    assert "finished returned Offset" in repr(futures[0])


def test_failure_reaches_every_future_and_waiters():
    state, futures = _batch(3)
    errors = []
    futures[0].add_done_callback(lambda f: errors.append(f.exception()))
    t = threading.Timer(0.05, state.fail, args=(RuntimeError("boom"),))
    t.start()
    done, not_done = cf.wait(futures, timeout=5)
    assert len(done) == 3 and not not_done
    for f in futures:
        with pytest.raises(RuntimeError, match="boom"):
            f.result()
    assert isinstance(errors[0], RuntimeError)


def test_wait_and_as_completed_across_batches():
    s1, f1 = _batch(3)
    s2, f2 = _batch(2)
    threading.Timer(0.02, s1.resolve, args=(0,)).start()
    threading.Timer(0.06, s2.resolve, args=(3,)).start()
    got = [f.result() for f in cf.as_completed(f1 + f2, timeout=5)]
    assert sorted(got) == [0, 1, 2, 3, 4]
    s3, f3 = _batch(2)
    threading.Timer(0.02, s3.resolve, args=(10,)).start()
    done, _ = cf.wait(f3, return_when=cf.FIRST_COMPLETED, timeout=5)
    assert done and all(f.result() in (10, 11) for f in done)


def test_result_blocks_until_resolved():
    state, futures = _batch(2)
    with pytest.raises(cf.TimeoutError):
        futures[1].result(timeout=0.01)
    threading.Timer(0.02, state.resolve, args=(7,)).start()
    assert futures[1].result(timeout=5) == 8


def test_cancel_detaches_one_future_only():
    state, futures = _batch(3)
    assert futures[1].cancel()
    assert futures[1].cancelled()
    state.resolve(50)
    assert futures[1].cancelled()
    with pytest.raises(cf.CancelledError):
        futures[1].result()
    assert futures[0].result() == 50 and futures[2].result() == 52
    assert not futures[0].cancel()  # finished futures cannot be cancelled


def test_set_result_by_hand_is_its_own():
    state, futures = _batch(2)
    futures[0].set_result(99)
    state.resolve(0)
    assert futures[0].result() == 99 and futures[1].result() == 1


def test_send_and_send_many_end_to_end(conveyor_broker):
    values = [f"v{i}".encode() for i in range(2500)]
    with Producer(conveyor_broker.address, linger_ms=1, batch_size=700) as producer:
        singles = [producer.send("fast", v) for v in values[:10]]
        many = producer.send_many("fast", (v for v in values[10:]))
        keyed = producer.send_many("fast", ["a", {"b": 1}], key="k", headers={"h": "1"})
        producer.flush(timeout=20)
    offsets = [f.result() for f in singles + many + keyed]
    assert offsets == list(range(2502))
    with Admin(conveyor_broker.address) as admin:
        got = []
        while len(got) < 2502:
            got += admin.fetch("fast", len(got), 1000)
    assert [m.body for m in got[:2500]] == values
    assert got[2500].value == "a" and got[2501].value == {"b": 1}
    assert got[2501].key == "k" and got[2501].headers["h"] == "1"


def test_send_many_respects_the_byte_limit(conveyor_broker):
    values = [bytes([i % 256]) * 3000 for i in range(100)]
    with Producer(conveyor_broker.address, linger_ms=1, max_batch_bytes=10_000) as producer:
        futures = producer.send_many("big", values)
        futures.append(producer.send("big", b"x" * 20_000))  # bigger than a batch: a batch of its own
        producer.flush(timeout=20)
    assert [f.result() for f in futures] == list(range(101))
    sub = Subscription("big", "g", address=conveyor_broker.address)
    try:
        got = []
        for _ in range(100):
            got += sub.receive(timeout=0.2)
            if len(got) >= 101:
                break
        assert [m.body for m in got] == [*values, b"x" * 20_000]
    finally:
        sub.close()


def test_closed_producer_refuses(conveyor_broker):
    producer = Producer(conveyor_broker.address)
    producer.close()
    with pytest.raises(RuntimeError):
        producer.send("t", b"x")
    with pytest.raises(RuntimeError):
        producer.send_many("t", [b"x"])


def test_batches_grow_while_max_in_flight_await_a_confirm():
    # Nothing listens here: the first batch never gets a confirm, so it holds the only slot.
    producer = Producer("tcp://127.0.0.1:9", linger_ms=1, max_in_flight=1, delivery_timeout_ms=2000)
    try:
        first = producer.send("t", b"first")
        time.sleep(0.05)
        later = [producer.send("t", b"x") for _ in range(5)]
        for _ in range(5):
            time.sleep(0.01)
            later.append(producer.send("t", b"y"))
        time.sleep(0.05)
        assert len(producer._io.in_flight) == 1
        assert not producer._io.queued
        assert producer._buffers["t"].count == 10  # one growing batch, not ten small ones waiting
        assert not first.done() and not any(f.done() for f in later)
    finally:
        with contextlib.suppress(TimeoutError):
            producer.close(timeout=3)
    with pytest.raises(Exception):  # noqa: B017 - the delivery timeout fails every future
        first.result(timeout=5)


def test_waiting_races_with_settling():
    # The batch's Condition is created on first use; a waiter that arrives while the
    # batch settles must never miss the wake-up.
    got: list[int] = []
    called: list[int] = []
    for i in range(300):
        state, (future,) = _batch(1)
        waiter = threading.Thread(target=lambda f=future: got.append(f.result(timeout=5)))
        waiter.start()
        if i % 2:
            future.add_done_callback(lambda f: called.append(f.result()))
        if i % 3 == 0:
            time.sleep(0.0005)
        state.resolve(i)
        if i % 2 == 0:
            future.add_done_callback(lambda f: called.append(f.result()))
        waiter.join(5)
        assert not waiter.is_alive()
    assert sorted(got) == list(range(300))
    assert sorted(called) == list(range(300))
