"""The keyed Group state machine in-process (a unit test of one module): key order as a checked invariant.

Random runs of publishes, dispatches, acks, delayed and immediate nacks,
partial IN_PROGRESS, departures, joins and lease expiry. Whenever the group
delivers a message of key k, every earlier message of k is settled or held
by the same member (delivered to it before); nothing waits forever; a
message held behind its key was not counted as a delivery.
"""

from __future__ import annotations

import random

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.wire.record import pack_records

from tests.helpers import FakeClock

KEYS = [b"a", b"b", b"c", None]


class Model:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clock = FakeClock(1000.0)
        self.log = MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"), clock=self.clock)
        settings = GroupSettings(max_deliveries=50, ack_timeout_ms=5000, key_affinity=True)
        self.group = Group("t", "g", settings, next_offset=0, clock=self.clock)
        self.keys: list[bytes | None] = []
        self.settled: set[int] = set()
        self.held: dict[int, list[int]] = {}  # id(member) -> offsets it holds, in delivery order
        self.members: list[Member] = []
        self.deliveries: dict[int, int] = {}
        self.nacked: dict[int, int] = {}  # offset -> counted nacks/expiries/departures
        self.next_sub = 1
        self.join()

    def join(self) -> None:
        member = Member(b"peer%d" % self.next_sub, self.next_sub, credit=self.rng.choice([2, 5, 50]), batch_size=50)
        self.next_sub += 1
        self.members.append(member)
        self.held[id(member)] = []
        self.group.join(member)

    def publish(self) -> None:
        records = [(self.rng.choice(KEYS), None, b"v") for _ in range(self.rng.randint(1, 6))]
        self.log.append(pack_records(records), len(records))
        self.keys += [r[0] for r in records]

    def dispatch(self) -> None:
        for plan in self.group.dispatch(self.log):
            mine = self.held[id(plan.member)]
            for entry in plan.entries:
                offsets = entry.offsets if entry.offsets is not None else range(entry.first, entry.end)
                for offset in offsets:
                    self.check_order(offset, mine)
                    assert entry.deliveries == self.deliveries.get(offset, 0) + 1, "a wait was counted"
                    self.deliveries[offset] = entry.deliveries
                    mine.append(offset)

    def check_order(self, offset: int, mine: list[int]) -> None:
        key = self.keys[offset]
        for earlier in range(offset):
            if self.keys[earlier] == key and earlier not in self.settled and earlier not in mine:
                raise AssertionError(f"offset {offset} of key {key!r} delivered while {earlier} is not settled")

    def pick(self, member: Member) -> list[int]:
        mine = self.held[id(member)]
        return sorted(self.rng.sample(mine, self.rng.randint(1, len(mine)))) if mine else []

    def step(self) -> None:
        op = self.rng.choice(["publish", "publish", "ack", "ack", "nack", "renew", "leave", "join", "tick", "expire"])
        live = [m for m in self.members if self.held[id(m)] or True]
        member = self.rng.choice(live) if live else None
        if op == "publish":
            self.publish()
        elif op == "ack" and member is not None:
            picked = self.pick(member)
            self.group.settle(member, [(o, o + 1) for o in picked])
            self.settled.update(picked)
            self.forget(member, picked)
        elif op == "nack" and member is not None:
            picked = self.pick(member)
            delay = self.rng.choice([0, 0, 500, 3000])
            self.group.nack(member, [(o, o + 1) for o in picked], delay_ms=delay)
            self.forget(member, picked)
        elif op == "renew" and member is not None:
            self.group.renew(member, [(o, o + 1) for o in self.pick(member)])
        elif op == "leave" and member is not None and len(self.members) > 1:
            self.group.leave(member)
            self.members.remove(member)
            del self.held[id(member)]
        elif op == "join" and len(self.members) < 4:
            self.join()
        elif op == "tick":
            self.clock.now += self.rng.choice([0.1, 1.0, 4.0])
        elif op == "expire":
            self.clock.now += 6.0
            expired = [(c.member, list(c.ranges)) for c in self.group.chunks.values() if c.deadline <= self.clock.now]
            self.group.expire_leases()
            for owner, ranges in expired:
                self.forget(owner, [o for a, b in ranges for o in range(a, b)])
        self.settle_dead()
        self.dispatch()

    def forget(self, member: Member, offsets: list[int]) -> None:
        mine = self.held.get(id(member))
        if mine is not None:
            gone = set(offsets)
            mine[:] = [o for o in mine if o not in gone]

    def settle_dead(self) -> None:
        for dead in self.group.take_dead():
            self.settled.update(o for a, b in dead.ranges for o in range(a, b))

    def finish(self) -> None:
        """Everyone acks everything, time passes: every message ends settled."""
        for _ in range(400):
            for member in self.members:
                mine = list(self.held[id(member)])
                self.group.settle(member, [(o, o + 1) for o in mine])
                self.settled.update(mine)
                self.forget(member, mine)
            self.clock.now += 1.0
            self.settle_dead()
            self.dispatch()
            if len(self.settled) == len(self.keys):
                return
        missing = sorted(set(range(len(self.keys))) - self.settled)
        raise AssertionError(f"never delivered: {missing[:20]} (pending {self.group.pending})")


@pytest.mark.parametrize("seed", range(300))
def test_a_key_is_delivered_in_order_through_nacks_renewals_departures_and_expiry(seed):
    model = Model(seed)
    for _ in range(80):
        model.step()
    model.finish()


def test_key_order_after_a_partial_renew_then_leave():
    """IN_PROGRESS on the middle of three messages of a key, then the member leaves: the next gets 0, 1, 2."""
    model = Model(0)
    model.log.append(pack_records([(b"k", None, b"v")] * 3), 3)
    model.keys += [b"k"] * 3
    first = model.members[0]
    first.credit = 10
    model.dispatch()
    model.group.renew(first, [(1, 2)])
    model.join()
    model.group.leave(first)
    model.members.remove(first)
    del model.held[id(first)]
    model.dispatch()
    assert model.held[id(model.members[0])] == [0, 1, 2]


def test_messages_held_behind_a_key_set_no_deadline_and_wait_uncounted():
    model = Model(0)
    model.log.append(pack_records([(b"k", None, b"v"), (b"j", None, b"v")]), 2)
    model.keys += [b"k", b"j"]
    member = model.members[0]
    member.credit = 10
    model.dispatch()
    model.group.nack(member, [(0, 1)], delay_ms=3000)
    model.group.settle(member, [(1, 2)])
    model.settled.add(1)
    model.held[id(member)] = []
    model.log.append(pack_records([(b"k", None, b"v"), (b"j", None, b"v")]), 2)
    model.keys += [b"k", b"j"]
    model.dispatch()
    assert model.held[id(member)] == [3], "j flows, k's 2 waits"
    assert model.group.next_deadline() == pytest.approx(model.clock.now + 3.0), "the wait sets no past deadline"
    assert not model.group.has_due(model.clock.now)
    model.clock.now += 3.0
    model.dispatch()
    assert model.held[id(member)] == [3, 0, 2]
    assert model.deliveries[2] == 1
