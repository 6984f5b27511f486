"""The lanes' key gate in-process (a unit test of one module): parking, release order, dead letters, ack policy."""

from __future__ import annotations

import threading

from conveyor.broker.client.subscription import DeadLettered
from conveyor.consumers.lanes import KeyGate, Report, Work
from conveyor.decorators.consumer import consumer
from conveyor.decorators.exceptions import Nack

from conveyor import Message


def msg(offset: int, key: str, attempt: int = 1) -> Message:
    return Message("t", offset, 0.0, key, {}, b"", attempt)


def run(c, gate: KeyGate, messages: list[Message], fail: set[int], dead: DeadLettered | None = None) -> list[int]:
    """Run a job through Work; the handler fails the offsets in ``fail`` (with a Nack); what it was called with."""
    report = Report(None)
    work = Work(c, gate, report, threading.Event())
    if dead is None:
        work.add(messages)
    else:
        work.dead_lettered(messages, dead)
    called = []
    while (unit := work.next()) is not None:
        called.append(unit[0].offset)
        work.done(unit, Nack(1.0) if unit[0].offset in fail else None, 0.0)
    return called


def handler(message):
    return None


def test_a_retried_keys_later_messages_park_and_run_after_it_in_order():
    c = consumer("t", key_ordered=True)(handler)
    gate = KeyGate()
    assert run(c, gate, [msg(0, "k"), msg(1, "k"), msg(2, "j"), msg(3, "k")], fail={0}) == [0, 2]
    assert run(c, gate, [msg(4, "k"), msg(5, "j")], fail=set()) == [5]
    assert gate.parked_count == 3
    assert run(c, gate, [msg(0, "k", attempt=2)], fail=set()) == [0, 1, 3, 4]
    assert gate.parked_count == 0 and not gate.blocked


def test_a_parked_message_that_fails_parks_the_rest_again():
    c = consumer("t", key_ordered=True)(handler)
    gate = KeyGate()
    run(c, gate, [msg(0, "k"), msg(1, "k"), msg(2, "k")], fail={0})
    assert run(c, gate, [msg(0, "k", 2)], fail={1}) == [0, 1]
    assert gate.blocked == {"k": 1} and [m.offset for m in gate.parked["k"]] == [2]
    assert run(c, gate, [msg(1, "k", 2)], fail=set()) == [1, 2]


def test_a_head_the_broker_dead_lettered_lets_its_key_go_on():
    c = consumer("t", key_ordered=True)(handler)
    gate = KeyGate()
    run(c, gate, [msg(0, "k"), msg(1, "k")], fail={0})
    assert run(c, gate, [msg(0, "k", 3)], fail=set(), dead=DeadLettered("nack", 3)) == [1]


def test_acked_early_nothing_waits_for_a_retry_that_never_comes():
    c = consumer("t", key_ordered=True, ack_policy="early")(handler)
    gate = KeyGate()
    assert run(c, gate, [msg(0, "k"), msg(1, "k")], fail={0}) == [0, 1]


def test_a_batch_with_a_returning_head_runs_it_alone_and_then_the_keys_parked_messages_in_order():
    c = consumer("t", key_ordered=True, batch=True, batch_size=2)(handler)
    gate = KeyGate()
    assert run(c, gate, [msg(0, "k"), msg(1, "j")], fail={0}) == [0]  # the whole batch is retried
    assert run(c, gate, [msg(2, "k"), msg(3, "k")], fail=set()) == []
    assert run(c, gate, [msg(0, "k", 2), msg(5, "k")], fail=set()) == [0, 2, 5]
    assert [m.offset for m in gate.parked.get("j", [])] == [] and gate.blocked == {"j": 1}
