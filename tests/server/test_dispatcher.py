"""Group timers: one wake-up per group at its earliest deadline; stale and deleted groups are skipped."""

from __future__ import annotations

from conveyor.broker.server.dispatcher import GroupTimers


class Timed:
    """A group as the timers see it: its next lease expiry or delayed redelivery."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def next_deadline(self) -> float | None:
        return self.deadline


def test_a_group_wakes_once_at_its_earliest_deadline():
    timers = GroupTimers()
    group = Timed(5.0)
    timers.schedule(group)  # type: ignore[arg-type]
    group.deadline = 7.0
    timers.schedule(group)  # type: ignore[arg-type]  # later than the one set: nothing new
    group.deadline = 3.0
    timers.schedule(group)  # type: ignore[arg-type]  # earlier: it wakes then
    assert timers.next_due() == 3.0
    assert timers.due(2.9, lambda g: True) == []
    assert timers.due(5.0, lambda g: True) == [group]  # the 5.0 entry is stale: still one wake-up
    assert timers.next_due() is None


def test_a_group_with_nothing_timed_sets_no_timer_and_a_deleted_one_is_not_due():
    timers = GroupTimers()
    idle, deleted = Timed(None), Timed(1.0)
    timers.schedule(idle)  # type: ignore[arg-type]
    timers.schedule(deleted)  # type: ignore[arg-type]
    assert timers.due(2.0, lambda g: g is not deleted) == []
    assert timers.next_due() is None
