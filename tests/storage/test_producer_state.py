"""Idempotent producers: duplicates answered with their offsets, stale resends refused, gaps allowed."""

from __future__ import annotations

import pytest
from conveyor.broker.log.idempotence import ProducerState

from conveyor.errors import DuplicateSequence


def state_with(pid: int, sequences: range, *, count: int = 3, window: int = 8) -> ProducerState:
    state = ProducerState(window=window)
    for seq in sequences:
        state.record(pid, seq, seq * count, count)
    return state


def test_an_unknown_producer_is_new():
    assert ProducerState().check(1, 0, 3) is None


def test_a_resent_batch_is_answered_with_its_original_offset():
    state = state_with(7, range(4))
    assert state.check(7, 3, 3) == 9
    assert state.check(7, 1, 3) == 3


def test_the_next_sequence_is_new():
    assert state_with(7, range(4)).check(7, 4, 3) is None


def test_a_resend_with_a_different_count_is_refused():
    with pytest.raises(DuplicateSequence):
        state_with(7, range(4)).check(7, 3, 2)


def test_a_skipped_sequence_is_accepted():
    # A batch the broker refused for good never consumes a sequence: gaps are allowed.
    assert state_with(7, range(4)).check(7, 6, 3) is None


def test_a_sequence_missing_inside_the_window_is_stored_when_it_arrives():
    # Given sequences 0, 1 and 3 stored (2 failed and is being retried)
    state = state_with(7, range(2))
    state.record(7, 3, 100, 3)
    # Then 2 is new, and once stored it is answered like any other
    assert state.check(7, 2, 3) is None
    state.record(7, 2, 103, 3)
    assert state.check(7, 2, 3) == 103
    assert state.check(7, 3, 3) == 100


def test_the_window_forgets_the_lowest_sequence_first():
    state = ProducerState(window=2)
    state.record(7, 5, 0, 1)
    state.record(7, 9, 1, 1)
    state.record(7, 7, 2, 1)  # out of order: 5 is the one forgotten
    assert state.check(7, 9, 1) == 1
    assert state.check(7, 7, 1) == 2
    with pytest.raises(DuplicateSequence):
        state.check(7, 5, 1)


def test_a_sequence_older_than_the_window_is_refused():
    state = state_with(7, range(20), window=5)
    assert state.check(7, 15, 3) == 45  # oldest remembered
    with pytest.raises(DuplicateSequence):
        state.check(7, 14, 3)


def test_producers_are_independent():
    state = state_with(1, range(3))
    state.record(2, 0, 100, 1)
    assert state.check(2, 1, 1) is None
    assert state.check(1, 3, 3) is None
    assert state.check(2, 0, 1) == 100


def test_least_recently_seen_producers_are_forgotten_past_the_limit():
    state = ProducerState(max_producers=2)
    state.record(1, 0, 0, 1)
    state.record(2, 0, 1, 1)
    state.record(1, 1, 2, 1)  # 1 is now the most recent
    state.record(3, 0, 3, 1)
    assert len(state) == 2
    assert state.check(2, 0, 1) is None  # forgotten: treated as new
    assert state.check(1, 1, 1) == 2


def test_truncate_forgets_batches_cut_from_the_log():
    # Given producer 7 stored sequences 0..3 at offsets 0, 3, 6, 9
    state = state_with(7, range(4))
    # When the log is cut at offset 6
    state.truncate(6)
    # Then sequence 2 can be sent again as new, and 1 is still a duplicate
    assert state.check(7, 2, 3) is None
    assert state.check(7, 1, 3) == 3


def test_truncate_below_every_batch_forgets_the_producer():
    state = state_with(7, range(4))
    state.truncate(0)
    assert len(state) == 0
    assert state.check(7, 99, 3) is None
