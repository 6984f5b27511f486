"""``Group`` against a model: a hypothesis state machine drives the real consumer group in-process.

No sockets and no broker: the group is fed a memory log and a clock the test moves by hand, and
every step is checked against a small model of what the group owes its members. The rules are
what the broker does with a group (publish, dispatch, ack, nack with a delay, IN_PROGRESS, TERM,
lease expiry, members joining and leaving, credit changes), each followed by a dispatch as in the
broker's loop; the invariants are the delivery contract (docs/reliability.md):

- an offset is held by at most one member at a time, and never delivered again once acked;
- a member is never given more than its credit, and its in-flight count is what it holds;
- each delivery of an offset counts one more (``deliveries``), and none goes past ``max_deliveries``:
  an offset that comes back at the limit is dead-lettered instead;
- a nacked offset is not redelivered before its delay ends; an expired lease gives its offsets back;
- with key affinity, a message of a key is delivered only once every earlier message of that key
  is settled or held by the same member;
- in the end, once members ack what they get and time passes, every offset is acked or dead-lettered.

Deterministic (``derandomize``, no example database) and bounded, so it cannot flake in CI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.wire.record import pack_records
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.helpers import FakeClock

MAX_DELIVERIES = 2
ACK_TIMEOUT_MS = 5_000
KEYS = [b"a", b"b", b"c", None]
MAX_MEMBERS = 4
# Which of a member's offsets a rule picks: all of them (-1), or those whose bit is set.
MASKS = st.one_of(st.just(-1), st.integers(1, 2**12 - 1))


@dataclass
class Held:
    """What the model knows of one member: the offsets it holds, in the order it got them."""

    member: Member
    offsets: list[int] = field(default_factory=list)


class GroupModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000.0)
        self.log = MemoryLog("t", TopicConfig(storage="memory"), fsync=FsyncPolicy("none"), clock=self.clock)
        self.keys: list[bytes | None] = []  # the key of each offset published
        self.holders: list[Held] = []  # members, in the order they joined
        self.acked: set[int] = set()
        self.dead: set[int] = set()  # dead letters the group handed over
        self.due_dead: set[int] = set()  # offsets the model expects to be dead-lettered next
        self.deliveries: dict[int, int] = {}  # offset -> times delivered
        self.not_before: dict[int, float] = {}  # offset -> earliest redelivery (a delayed nack)
        self.deadline: dict[int, float] = {}  # offset in flight -> its lease's end
        self.next_peer = 0

    # --- set-up ---------------------------------------------------------------------------------------------

    @initialize(key_affinity=st.booleans(), credits=st.lists(st.sampled_from([1, 2, 5, 50]), min_size=1, max_size=3))
    def start(self, key_affinity: bool, credits: list[int]) -> None:
        settings_ = GroupSettings(
            max_deliveries=MAX_DELIVERIES, ack_timeout_ms=ACK_TIMEOUT_MS, key_affinity=key_affinity
        )
        self.group = Group("t", "g", settings_, next_offset=0, clock=self.clock)
        for credit in credits:
            self.join(credit)

    # --- what the broker does ---------------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def publish(self, keys: list[bytes | None]) -> None:
        self.log.append(pack_records([(key, None, b"v") for key in keys]), len(keys))
        self.keys += keys
        self.dispatch()

    def dispatch(self) -> None:
        """What the broker's loop does after every event: plan deliveries, each checked as it is made."""
        available = {id(h.member): h.member.available for h in self.holders}
        given: dict[int, int] = {}
        for plan in self.group.dispatch(self.log):
            held = self.holder(plan.member)
            for entry in plan.entries:
                offsets = entry.offsets if entry.offsets is not None else range(entry.first, entry.end)
                for offset in offsets:
                    self.delivered(held, offset, entry.deliveries)
                given[id(plan.member)] = given.get(id(plan.member), 0) + len(offsets)
        for member_id, n in given.items():
            assert n <= available[member_id], f"{n} messages given to a member with credit for {available[member_id]}"

    @precondition(lambda self: len(self.holders) < MAX_MEMBERS)
    @rule(credit=st.sampled_from([1, 2, 5, 50]))
    def join(self, credit: int) -> None:
        self.next_peer += 1
        member = Member(b"peer%d" % self.next_peer, self.next_peer, credit=credit, batch_size=min(credit, 10))
        self.holders.append(Held(member))
        self.group.join(member)
        self.dispatch()

    @precondition(lambda self: len(self.holders) > 1)
    @rule(who=st.integers(0, MAX_MEMBERS - 1))
    def leave(self, who: int) -> None:
        held = self.pick_member(who)
        self.group.leave(held.member)
        self.holders.remove(held)
        self.given_back(held, list(held.offsets), self.clock())
        self.dispatch()

    @rule(who=st.integers(0, MAX_MEMBERS - 1), credit=st.integers(0, 50))
    def change_credit(self, who: int, credit: int) -> None:
        held = self.pick_member(who)
        held.member.credit = credit
        held.member.batch_size = max(1, min(held.member.batch_size, credit))
        self.dispatch()

    @rule(who=st.integers(0, MAX_MEMBERS - 1), mask=MASKS)
    def ack(self, who: int, mask: int) -> None:
        held = self.pick_member(who)
        picked = self.pick_offsets(held, mask)
        self.group.settle(held.member, ranges(picked))
        self.acked.update(picked)
        self.forget(held, picked)
        self.dispatch()

    @rule(who=st.integers(0, MAX_MEMBERS - 1), mask=MASKS, delay_ms=st.sampled_from([0, 0, 500, 3000]))
    def nack(self, who: int, mask: int, delay_ms: int) -> None:
        held = self.pick_member(who)
        picked = self.pick_offsets(held, mask)
        now = self.clock()
        assert self.group.nack(held.member, ranges(picked), delay_ms=delay_ms) == len(picked)
        self.given_back(held, picked, now + delay_ms / 1000)
        self.dispatch()

    @rule(who=st.integers(0, MAX_MEMBERS - 1), mask=MASKS)
    def terminate(self, who: int, mask: int) -> None:
        held = self.pick_member(who)
        picked = self.pick_offsets(held, mask)
        assert self.group.terminate(held.member, ranges(picked), "bad") == len(picked)
        self.forget(held, picked)
        self.due_dead.update(picked)
        self.dispatch()

    @rule(who=st.integers(0, MAX_MEMBERS - 1), mask=MASKS)
    def in_progress(self, who: int, mask: int) -> None:
        held = self.pick_member(who)
        picked = self.pick_offsets(held, mask)
        assert self.group.renew(held.member, ranges(picked)) == len(picked)
        for offset in picked:
            self.deadline[offset] = self.clock() + ACK_TIMEOUT_MS / 1000
        self.dispatch()

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 3.0, ACK_TIMEOUT_MS / 1000]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.dispatch()

    @rule()
    def expire_leases(self) -> None:
        now = self.clock()
        expired = 0
        for held in list(self.holders):
            offsets = [o for o in held.offsets if self.deadline[o] <= now]
            self.given_back(held, offsets, now)
            expired += len(offsets)
        assert self.group.expire_leases() == expired
        self.dispatch()

    @rule()
    def store_dead_letters(self) -> None:
        for letter in self.group.take_dead():
            offsets = {o for a, b in letter.ranges for o in range(a, b)}
            assert offsets <= self.due_dead, f"dead-lettered {sorted(offsets - self.due_dead)} unexpectedly"
            self.due_dead -= offsets
            self.dead |= offsets

    # --- the model's bookkeeping ---------------------------------------------------------------------------

    def holder(self, member: Member) -> Held:
        return next(h for h in self.holders if h.member is member)

    def pick_member(self, who: int) -> Held:
        return self.holders[who % len(self.holders)]

    @staticmethod
    def pick_offsets(held: Held, mask: int) -> list[int]:
        """Some of what a member holds: bit i of ``mask`` picks its i-th offset (bit 11 the rest; -1 all)."""
        return sorted(o for i, o in enumerate(held.offsets) if mask >> min(i, 11) & 1)

    def delivered(self, held: Held, offset: int, deliveries: int) -> None:
        assert offset < len(self.keys), f"offset {offset} delivered before it was published"
        assert offset not in self.acked, f"offset {offset} delivered again after it was acked"
        assert offset not in self.dead | self.due_dead, f"offset {offset} delivered after it was dead-lettered"
        others = [h for h in self.holders if offset in h.offsets]
        assert not others, f"offset {offset} delivered while a member holds it"
        assert deliveries == self.deliveries.get(offset, 0) + 1, f"offset {offset}: delivery {deliveries} miscounted"
        assert deliveries <= MAX_DELIVERIES, f"offset {offset} delivered past max_deliveries"
        assert self.clock() >= self.not_before.get(offset, 0.0), f"offset {offset} redelivered before its delay"
        if self.group.settings.key_affinity:
            self.check_key_order(held, offset)
        self.deliveries[offset] = deliveries
        self.deadline[offset] = self.clock() + ACK_TIMEOUT_MS / 1000
        held.offsets.append(offset)

    def check_key_order(self, held: Held, offset: int) -> None:
        key = self.keys[offset]
        for earlier in range(offset):
            if self.keys[earlier] != key or earlier in self.acked | self.dead | self.due_dead:
                continue
            assert earlier in held.offsets, f"offset {offset} of key {key!r} delivered while {earlier} is unsettled"

    def given_back(self, held: Held, offsets: list[int], not_before: float) -> None:
        """Offsets a member gave back (nack, departure, lease expiry): redelivered later, or dead at the limit."""
        self.forget(held, offsets)
        for offset in offsets:
            if self.deliveries[offset] >= MAX_DELIVERIES:
                self.due_dead.add(offset)
            else:
                self.not_before[offset] = not_before

    def forget(self, held: Held, offsets: list[int]) -> None:
        gone = set(offsets)
        held.offsets = [o for o in held.offsets if o not in gone]
        for offset in gone:
            self.deadline.pop(offset, None)

    # --- invariants -------------------------------------------------------------------------------------------

    @invariant()
    def credit_and_in_flight_match_what_members_hold(self) -> None:
        for held in self.holders:
            member = held.member
            assert member.in_flight == len(held.offsets), (member.in_flight, held.offsets)
            assert member.available >= 0

    @invariant()
    def no_offset_is_held_twice(self) -> None:
        offsets = [o for h in self.holders for o in h.offsets]
        assert len(offsets) == len(set(offsets)), sorted(offsets)

    @invariant()
    def the_committed_offset_is_the_lowest_unsettled(self) -> None:
        settled = self.acked | self.dead | self.due_dead
        low = next((o for o in range(len(self.keys)) if o not in settled), len(self.keys))
        assert self.group.committed_offset <= low

    # --- the end: everything is acked or dead-lettered ----------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "group"):
            return
        for held in self.holders:
            held.member.credit = max(held.member.credit, 1)
        for _ in range(200):  # every turn: ack all, let time pass, dispatch; bounded
            for held in self.holders:
                picked = list(held.offsets)
                self.group.settle(held.member, ranges(picked))
                self.acked.update(picked)
                self.forget(held, picked)
            self.clock.advance(1.0)
            self.store_dead_letters()
            self.dispatch()
            if len(self.acked | self.dead) == len(self.keys) and not self.due_dead:
                break
        missing = sorted(set(range(len(self.keys))) - self.acked - self.dead)
        assert not missing, f"never acked nor dead-lettered: {missing[:20]}"
        assert not self.acked & self.dead, "an offset both acked and dead-lettered"
        assert self.group.committed_offset == len(self.keys)


def ranges(offsets: list[int]) -> list[tuple[int, int]]:
    return [(o, o + 1) for o in offsets]


GroupModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_group_keeps_its_delivery_contract = GroupModel.TestCase
