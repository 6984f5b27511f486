"""Dead letters are settled once their topic holds them durably, and go back unsettled when that write is lost."""

from __future__ import annotations

from typing import Any

from conveyor.broker.server.containment import Containment
from conveyor.broker.server.dead_letters import DeadLetters, DeadWrite
from conveyor.broker.server.group_table import GroupIndex
from conveyor.broker.server.groups import DeadLetter, Group, GroupSettings
from conveyor.monitoring.metrics import NullMetrics

from tests.server.server_fakes import Clock, FakeLog, Sent


class FakeStore:
    def __init__(self, *logs: FakeLog) -> None:
        self.logs: dict[str, Any] = {log.name: log for log in logs}


def dead_letters(store: FakeStore, groups: GroupIndex) -> tuple[DeadLetters, set[Group], set[Group]]:
    to_dispatch: set[Group] = set()
    moved: set[Group] = set()
    letters = DeadLetters(
        store,  # type: ignore[arg-type]
        groups,
        to_dispatch=to_dispatch,
        appended=set(),
        moved=moved,
        send=Sent().send,
        on_cut=lambda exc, log: None,
        metrics=NullMetrics(),
        containment=Containment(),
        clock=Clock(now=50.0),
    )
    return letters, to_dispatch, moved


def group_with(index: GroupIndex, topic: str = "t") -> Group:
    group = Group(topic, "g", GroupSettings(), next_offset=0, clock=Clock())
    index[(topic, "g")] = group
    return group


def test_a_dead_letter_is_settled_once_its_write_is_durable():
    dlq = FakeLog("t.dlq", end_offset=3, durable_offset=0)
    index = GroupIndex()
    group = group_with(index)
    letters, _, moved = dead_letters(FakeStore(dlq), index)
    letters.writes.append(DeadWrite(group, DeadLetter([(0, 3)], 5, "boom"), dlq, end=3))  # type: ignore[arg-type]
    assert letters.dying() == {group: [letters.writes[0].letter]}
    letters.settle_durable()
    assert letters.writes and not moved  # not durable yet: still unsettled
    dlq.durable_offset = 3
    letters.settle_durable()
    assert not letters.writes and moved == {group}


def test_a_dead_letter_cut_back_or_whose_topic_went_is_redelivered():
    # Given two dead-letter writes: one a failed sync cut back, one into a topic then deleted
    cut, gone = FakeLog("a.dlq", end_offset=1), FakeLog("b.dlq", end_offset=9)
    index = GroupIndex()
    group_a, group_b = group_with(index, "a"), group_with(index, "b")
    store = FakeStore(cut, gone)
    letters, to_dispatch, _ = dead_letters(store, index)
    letters.writes.append(DeadWrite(group_a, DeadLetter([(0, 2)], 3, "x", first_ms=7), cut, end=2))  # type: ignore[arg-type]
    letters.writes.append(DeadWrite(group_b, DeadLetter([(4, 5)], 3, "y"), gone, end=9))  # type: ignore[arg-type]
    # When the cut is seen, and the other topic is deleted
    letters.cut()
    del store.logs["b.dlq"]
    letters.topic_deleted()
    # Then both go back to their groups, unsettled, to be delivered (and dead-lettered) again
    assert not letters.writes and to_dispatch == {group_a, group_b}
    (pending,) = group_a.pending
    assert (pending.ranges, pending.deliveries, pending.not_before, pending.first_ms) == ([(0, 2)], 3, 51.0, 7)


def test_dead_letters_made_after_the_pass_wrote_its_own_stay_queued_for_the_next_pass():
    # Given a group dispatched after the pass's dead letters were written, holding a new one: its member
    # was found gone (EHOSTUNREACH) while the loop sent confirms, and what it held went past max_deliveries
    from conveyor.broker.server.dispatcher import Dispatcher
    from conveyor.broker.server.peers import Peers

    index = GroupIndex()
    group = group_with(index)
    store = FakeStore(FakeLog("t", end_offset=2, durable_offset=2))
    to_dispatch: set[Group] = {group}
    dispatcher = Dispatcher(
        store,  # type: ignore[arg-type]
        index,
        Peers(Clock(), to_dispatch, None),
        to_dispatch=to_dispatch,
        moved=set(),
        send=Sent().send,
        metrics=NullMetrics(),
        containment=Containment(),
        clock=Clock(),
    )
    group.dead.append(DeadLetter([(1, 2)], 1, "member_gone", True))
    # When the pass ends with its dispatch
    dispatcher.run()
    # Then the group is still queued: the next pass's DeadLetters.handle writes the letter
    assert to_dispatch == {group}
    group.dead.clear()  # written
    dispatcher.run()
    assert to_dispatch == set(), "and then it leaves the set as any group"
