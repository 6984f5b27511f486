"""The decisions both producers make the same way when following a leader (``broker/client/leadership.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.broker.client.leadership import (
    LEADER_POLL,
    LEADERSHIP_ERRORS,
    Suspects,
    epochs_led_by,
    held_back,
    resends_due,
    window,
)
from conveyor.broker.net.metadata import ClusterView, PartitionInfo

from conveyor.errors import FencedLeaderEpoch, NotEnoughReplicas, NotLeader, RequestTimeout, UnknownLeaderEpoch

A, B = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"


@dataclass
class Batch:
    topic: str
    seq: int


def view(leaders: dict[str, tuple[str, int]]) -> ClusterView:
    """A METADATA answer from ``a`` where each topic has the (node, epoch) given."""
    topics = {
        topic: {0: PartitionInfo(node, None, epoch, ("a", "b"), ("a", "b"), False)}
        for topic, (node, epoch) in leaders.items()
    }
    return ClusterView(A, "a", "a", {"a": A, "b": B}, topics)


def test_the_answers_that_send_a_producer_to_ask_who_leads() -> None:
    assert set(LEADERSHIP_ERRORS) == {NotLeader, NotEnoughReplicas, FencedLeaderEpoch, UnknownLeaderEpoch}
    assert not issubclass(RequestTimeout, LEADERSHIP_ERRORS)


def test_one_batch_at_a_time_while_probing_and_none_new_while_a_resend_is_pending() -> None:
    assert window(probing=True, limit=8) == 1
    assert window(probing=False, limit=8) == 8
    assert not held_back(0, window(True, 8), resend_pending=False)
    assert held_back(1, window(True, 8), resend_pending=False)
    assert not held_back(7, window(False, 8), resend_pending=False)
    assert held_back(8, window(False, 8), resend_pending=False)
    assert held_back(0, window(False, 8), resend_pending=True)


def test_resends_of_a_topic_go_together_in_sequence_order() -> None:
    pending = {1: Batch("t", 2), 2: Batch("u", 0), 3: Batch("t", 0), 4: Batch("t", 1)}
    assert resends_due(pending, {"t"}) == [(3, Batch("t", 0)), (4, Batch("t", 1)), (1, Batch("t", 2))]
    assert [key for key, _ in resends_due(pending)] == [3, 4, 1, 2]
    assert resends_due(pending, set()) == []


def test_the_epochs_a_broker_leads_in_a_metadata_answer() -> None:
    answer = view({"t": ("a", 3), "u": ("b", 5), "v": ("a", 1)})
    assert epochs_led_by(answer, A) == {"t": 3, "v": 1}
    assert epochs_led_by(answer, B) == {"u": 5}
    assert epochs_led_by(None, A) == {}


def test_a_suspect_leader_gets_no_batch_while_still_named_at_the_epoch_it_hung_up_at() -> None:
    suspects = Suspects()
    assert not suspects.hold(A, "t", view({"t": ("a", 3)}), now=0.0, patience=5.0)
    suspects.hung_up(A, view({"t": ("a", 3)}), now=10.0)
    assert suspects
    assert suspects.hold(A, "t", view({"t": ("a", 3)}), now=11.0, patience=5.0)
    assert not suspects.hold(B, "t", view({"t": ("b", 4)}), now=11.0, patience=5.0)  # the next leader
    assert not suspects.hold(A, "u", view({"u": ("a", 1)}), now=11.0, patience=5.0)  # a topic it did not lead


def test_a_suspect_elected_again_at_a_newer_epoch_is_written_to_at_once() -> None:
    suspects = Suspects()
    suspects.hung_up(A, view({"t": ("a", 3)}), now=10.0)
    assert not suspects.hold(A, "t", view({"t": ("a", 5)}), now=10.5, patience=5.0)


def test_a_suspect_still_named_after_the_request_timeout_is_tried_again() -> None:
    suspects = Suspects()
    suspects.hung_up(A, view({"t": ("a", 3)}), now=10.0)
    assert suspects.hold(A, "t", view({"t": ("a", 3)}), now=14.9, patience=5.0)
    assert not suspects.hold(A, "t", view({"t": ("a", 3)}), now=15.0, patience=5.0)
    assert not suspects  # forgotten: the next batch goes there too


def test_a_suspect_that_answers_is_cleared() -> None:
    suspects = Suspects()
    suspects.hung_up(A, view({"t": ("a", 3)}), now=10.0)
    suspects.hung_up(B, view({"u": ("b", 2)}), now=10.0)
    suspects.heard_from(A)
    assert not suspects.hold(A, "t", view({"t": ("a", 3)}), now=10.1, patience=5.0)
    assert suspects.epochs == {(B, "u"): 2}
    suspects.heard_from(B)
    assert not suspects


def test_metadata_is_asked_again_once_per_poll_while_a_leader_is_suspect() -> None:
    suspects = Suspects()
    assert not suspects.poll_due(100.0)  # nobody suspect: no asking
    suspects.hung_up(A, view({"t": ("a", 3)}), now=100.0)
    assert suspects.poll_due(100.0)
    assert not suspects.poll_due(100.0 + LEADER_POLL / 2)
    assert suspects.poll_due(100.0 + LEADER_POLL)
