"""Delayed and expiring batches in one ``Group``, in-process (a unit test of one module; the real broker is in
``tests/broker/test_delayed_messages.py``).

A memory log, a clock moved by hand for the group's monotonic time and the same clock (in ms) as its wall
clock: a timed batch is held back, uncounted, while later batches flow; it goes when its time comes; an
expired one is a dead letter with reason ``expired``; with key affinity, later messages of its key wait.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.wire.delivery_times import (
    EXPIRED,
    EXPIRES,
    NOT_BEFORE,
    batch_times,
    message_times,
    pack_timed_records,
    time_headers,
)
from conveyor.broker.wire.record import pack_records, unpack_records, validate_body

from conveyor.errors import InvalidDeliveryTime, InvalidRequest
from tests.helpers import FakeClock


class Setup:
    def __init__(self, *, key_affinity: bool = False) -> None:
        self.clock = FakeClock(1_000.0)
        self.log = MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"), clock=self.clock)
        settings = GroupSettings(max_deliveries=5, ack_timeout_ms=60_000, key_affinity=key_affinity)
        self.group = Group("t", "g", settings, next_offset=0, clock=self.clock)
        self.group.wall_ms = lambda: int(self.clock.now * 1000)
        self.member = Member(b"peer", 1, credit=100, batch_size=100)
        self.group.join(self.member)

    @property
    def now_ms(self) -> int:
        return int(self.clock.now * 1000)

    def publish(self, keys: list[bytes | None], *, not_before: int = 0, expires: int = 0) -> None:
        if not_before or expires:
            headers = time_headers((not_before, expires), None)
            body = pack_timed_records([(k, headers, b"v") for k in keys])
        else:
            body = pack_records([(k, None, b"v") for k in keys])
        self.log.append(body, len(keys))

    def delivered(self) -> list[tuple[int, int]]:
        """(offset, deliveries) of what one dispatch sends."""
        out = []
        for plan in self.group.dispatch(self.log):
            for entry in plan.entries:
                offsets = entry.offsets if entry.offsets is not None else range(entry.first, entry.end)
                out += [(offset, entry.deliveries) for offset in offsets]
        return out


def test_a_timed_body_is_a_plain_batch_body_whose_times_the_first_byte_announces():
    headers = time_headers((1_000, 9_000), {"a": "b"})
    body = pack_timed_records([(b"k", headers, b"v"), (None, headers, b"w")])
    assert body[0] == 0xDD and validate_body(body, max_message_bytes=1 << 20) == 2
    assert [r[1][NOT_BEFORE] for r in unpack_records(body)] == ["1000", "1000"]
    assert batch_times(body) == (1_000, 9_000)
    assert batch_times(pack_records([(b"k", headers, b"v")])) is None, "no mark: not timed, headers or not"
    huge = b"\xdd" + (1).to_bytes(4, "big") + pack_records([(b"k", None, b"v")])[1:]
    assert batch_times(huge) is None, "the 32-bit form alone (a plain writer's huge batch) is no times"


def test_message_times_round_to_the_window_and_refuse_what_cannot_be_kept():
    now = 1_000_000
    assert message_times(now) is None
    assert message_times(now, delay=1.5, window_ms=5) == (1_001_500, 0)
    assert message_times(now, delay=timedelta(milliseconds=1), window_ms=5) == (1_000_005, 0), "up, never early"
    assert message_times(now, ttl=0.0121, window_ms=5) == (0, 1_000_010), "down, never late"
    when = datetime.fromtimestamp(1_002.5)
    assert message_times(now, not_before=when) == (1_002_500, 0)
    assert message_times(now, not_before=999.0) is None, "a not_before in the past holds nothing"
    for bad in [
        {"delay": -1},
        {"delay": float("nan")},
        {"delay": "30"},
        {"delay": True},
        {"ttl": 0},
        {"ttl": -timedelta(seconds=1)},
        {"delay": 5, "not_before": 2_000.0},
        {"delay": 10, "ttl": 5},
    ]:
        with pytest.raises(InvalidDeliveryTime) as caught:
            message_times(now, **bad)
        assert isinstance(caught.value, InvalidRequest) and caught.value.code == 208, bad


def test_a_delayed_batch_is_held_back_uncounted_while_later_batches_flow():
    s = Setup()
    s.publish([b"a", b"b"], not_before=s.now_ms + 30_000)
    s.publish([b"c"])
    assert s.delivered() == [(2, 1)], "the later batch is not blocked"
    assert s.group.next_offset == 3 and s.group.committed_offset == 0, "held back, not acked"
    assert s.group.next_deadline() == pytest.approx(s.clock.now + 30.0), "a timer for the real deadline"
    s.clock.advance(29.0)
    assert s.delivered() == []
    s.clock.advance(1.0)
    assert s.delivered() == [(0, 1), (1, 1)], "its first delivery, counted once"


def test_the_hold_survives_a_restart_through_the_saved_state():
    s = Setup()
    s.publish([b"a"], not_before=s.now_ms + 30_000)
    assert s.delivered() == []
    rows = s.group.saved_state(s.clock.now, s.now_ms)["unsettled"]
    assert rows == [[0, 1, 0, 0, s.now_ms + 30_000, 0]]
    again = Setup()
    again.log = s.log  # the same log, a new group (a restarted broker's) on a clock 5 s on
    again.clock.now = s.clock.now + 5
    again.group.next_offset = 1
    again.group.restore(rows, again.clock.now, again.now_ms)
    assert len(again.group.waiting) == 1 and not again.group.pending, "back in the heap, due at the saved time"
    assert again.delivered() == []
    again.clock.advance(25.0)
    assert again.delivered() == [(0, 1)]


def test_after_a_restart_a_keyed_group_still_holds_later_messages_behind_a_restored_wait():
    s = Setup(key_affinity=True)
    s.publish([b"k"], not_before=s.now_ms + 30_000)
    assert s.delivered() == []
    rows = s.group.saved_state(s.clock.now, s.now_ms)["unsettled"]
    again = Setup(key_affinity=True)
    again.log = s.log
    again.clock.now = s.clock.now
    again.group.next_offset = 1
    again.group.restore(rows, again.clock.now, again.now_ms)
    again.log.append(pack_records([(b"k", None, b"v"), (b"j", None, b"v")]), 2)
    assert again.delivered() == [(2, 1)], "k's later message waits behind the restored one; j flows"
    again.clock.advance(30.0)
    assert again.delivered() == [(0, 1), (1, 1)]


def test_an_expired_batch_is_a_dead_letter_not_a_delivery():
    s = Setup()
    s.publish([b"a", b"b"], not_before=s.now_ms + 10_000, expires=s.now_ms + 20_000)
    s.publish([b"c"], expires=s.now_ms + 5_000)
    assert s.delivered() == [(2, 1)], "unexpired: delivered at once"
    s.clock.advance(21.0)  # the broker was late (down, say): past the expiry when it comes due
    assert s.delivered() == []
    dead = s.group.take_dead()
    assert [(d.ranges, d.reason, d.deliveries) for d in dead] == [([(0, 2)], EXPIRED, 0)]


def test_a_nacked_message_that_expires_meanwhile_is_dead_lettered_at_its_redelivery():
    s = Setup()
    s.publish([b"a"], expires=s.now_ms + 5_000)
    assert s.delivered() == [(0, 1)]
    s.group.nack(s.member, [(0, 1)], delay_ms=10_000)
    s.clock.advance(10.0)
    assert s.delivered() == []
    assert [(d.reason, d.deliveries) for d in s.group.take_dead()] == [(EXPIRED, 1)]


def test_key_affinity_later_messages_of_the_key_wait_behind_the_delayed_one():
    s = Setup(key_affinity=True)
    s.publish([b"k"], not_before=s.now_ms + 30_000)
    s.publish([b"k", b"j"])
    assert s.delivered() == [(2, 1)], "j flows; k's later message waits behind the delayed one"
    s.clock.advance(30.0)
    assert s.delivered() == [(0, 1), (1, 1)], "then both, in offset order, each counted once"
    assert not s.group.pending and not s.group.waiting


def test_held_batches_wait_apart_from_redeliveries_and_a_dispatch_looks_at_the_earliest_only():
    s = Setup(key_affinity=True)
    for i in range(50):
        s.publish([b"k%d" % (i % 5)], not_before=s.now_ms + 60_000 - i * 1000)
    s.publish([b"free"])
    assert s.delivered() == [(50, 1)]
    assert (len(s.group.waiting), s.group.pending) == (50, []), "nothing for a dispatch to walk"
    assert s.group.next_deadline() == pytest.approx(s.clock.now + 11.0), "the earliest: offset 49"
    assert s.group.committed_offset == 0 and s.group.pending_messages == 50
    s.publish([b"k4"])
    assert s.delivered() == [], "a later message of a held key waits"
    s.clock.advance(11.0)
    assert s.delivered() == [], "offset 49 (k4) is due, but k4's earlier batches still wait: key order"
    s.clock.advance(49.0)
    assert sorted(o for o, _ in s.delivered()) == [*range(50), 51]
    assert not s.group.waiting and not s.group.pending


def test_expires_header_of_a_delivered_message():
    headers = time_headers((0, 5_000), None)
    assert headers == {EXPIRES: "5000"}


class RandomRun:
    """Random publishes (timed or not), dispatches, acks, delayed nacks, departures and clock steps, each
    delivery checked: never before its not-before time, never at or after its expiry, per-key order with
    key affinity; in the end every offset is acked once or dead-lettered (expired after its expiry, or nacked
    past ``max_deliveries``)."""

    def __init__(self, seed: int, key_affinity: bool) -> None:
        import random

        self.rng = random.Random(seed)
        self.s = Setup(key_affinity=key_affinity)
        self.s.group.leave(self.s.member)
        self.keyed = key_affinity
        self.times: list[tuple[int, int]] = []  # per offset: (not_before_ms, expires_ms)
        self.keys: list[bytes | None] = []
        self.held: dict[int, list[int]] = {}  # id(member) -> offsets it holds, in delivery order
        self.members: list[Member] = []
        self.acked: set[int] = set()
        self.expired: set[int] = set()
        self.next_sub = 1
        self.join()

    def join(self) -> None:
        member = Member(b"p%d" % self.next_sub, self.next_sub, credit=self.rng.choice([1, 3, 50]), batch_size=50)
        self.next_sub += 1
        self.members.append(member)
        self.held[id(member)] = []
        self.s.group.join(member)

    def publish(self) -> None:
        keys = [self.rng.choice([b"a", b"b", b"c", None]) for _ in range(self.rng.randint(1, 4))]
        now = self.s.now_ms
        not_before = self.rng.choice([0, 0, now + self.rng.randint(1, 8) * 1000])
        expires = self.rng.choice([0, 0, max(not_before, now) + self.rng.randint(1, 6) * 1000])
        self.s.publish(keys, not_before=not_before, expires=expires)
        self.keys += keys
        self.times += [(not_before, expires)] * len(keys)

    def dispatch(self) -> None:
        now = self.s.now_ms
        plans = self.s.group.dispatch(self.s.log)
        for dead in self.s.group.take_dead():  # settled in this dispatch: an expired message lets its key go on
            assert dead.reason == EXPIRED or dead.deliveries >= self.s.group.settings.max_deliveries, dead
            for a, b in dead.ranges:
                for offset in range(a, b):
                    if dead.reason == EXPIRED:
                        assert self.times[offset][1] and now >= self.times[offset][1]
                    self.expired.add(offset)  # (or past max_deliveries: settled as a dead letter all the same)
        for plan in plans:
            mine = self.held[id(plan.member)]
            for entry in plan.entries:
                for offset in entry.offsets if entry.offsets is not None else range(entry.first, entry.end):
                    not_before, expires = self.times[offset]
                    assert now >= not_before, f"offset {offset} delivered {not_before - now} ms early"
                    assert not (expires and now >= expires), f"offset {offset} delivered expired"
                    assert offset not in self.acked and offset not in self.expired
                    if self.keyed:
                        key = self.keys[offset]
                        for earlier in range(offset):
                            if self.keys[earlier] == key and earlier not in self.acked | self.expired:
                                assert earlier in mine, f"key {key!r}: {offset} before {earlier}"
                    mine.append(offset)

    def settle(self, nack: bool) -> None:
        member = self.rng.choice(self.members)
        mine = self.held[id(member)]
        if not mine:
            return
        picked = mine[: self.rng.randint(1, len(mine))]
        ranges = [(o, o + 1) for o in picked]
        if nack:
            self.s.group.nack(member, ranges, delay_ms=self.rng.choice([0, 2000]))
        else:
            self.s.group.settle(member, ranges)
            self.acked.update(picked)
        del mine[: len(picked)]

    def leave(self) -> None:
        if len(self.members) > 1:
            member = self.members.pop(self.rng.randrange(len(self.members)))
            self.s.group.leave(member)
            del self.held[id(member)]

    def run(self, steps: int) -> None:
        for _ in range(steps):
            step = self.rng.random()
            if step < 0.3:
                self.publish()
            elif step < 0.5:
                self.settle(nack=False)
            elif step < 0.55:
                self.settle(nack=True)
            elif step < 0.58:
                self.leave()
            elif step < 0.61:
                self.join()
            else:
                self.s.clock.advance(self.rng.choice([0.0, 0.5, 1.5]))
            self.dispatch()
        for _ in range(1000):  # the end: time passes, every member acks what it holds (one a turn at credit 1)
            if len(self.acked) + len(self.expired) == len(self.keys):
                break
            self.s.clock.advance(1.0)
            for member in self.members:
                self.s.group.settle(member, [(o, o + 1) for o in self.held[id(member)]])
                self.acked.update(self.held[id(member)])
                self.held[id(member)] = []
            self.dispatch()
        assert len(self.acked) + len(self.expired) == len(self.keys), "something never came"
        assert not self.acked & self.expired


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_keep_times_key_order_and_lose_nothing(seed):
    RandomRun(seed, key_affinity=bool(seed % 2)).run(150)
