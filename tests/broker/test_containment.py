"""An exception inside one unit of the broker's loop work is contained: logged, counted, shown, survived.

The faults are injected in-process (a bug cannot be provoked from outside on
purpose); the broker runs its real loop on a thread, with real clients over
TCP. The poison batches and frames that used to reach these paths from
outside are in test_poison_batches.py and test_fuzz.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import conveyor.broker.server.dead_letters as dead_letters_module
import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server import admin as admin_ops
from conveyor.broker.server.broker import Broker
from conveyor.broker.server.fetch_waits import FetchWaits
from conveyor.broker.server.groups import Group
from prometheus_client import CollectorRegistry

from conveyor import Admin, Producer
from conveyor.errors import ConveyorError, TopicLimit
from tests.helpers import stays_false, wait_for


class Live:
    def __init__(self, broker: Broker, address: str) -> None:
        self.broker = broker
        self.address = address

    def internal_errors(self, where: str) -> float:
        return self.broker.registry.get_sample_value("conveyor_internal_errors_total", {"where": where}) or 0.0

    def round_trip(self, topic: str, group: str = "g", count: int = 3) -> list[int]:
        """Publish ``count`` messages and receive (and ack) them in a fresh group."""
        with Producer(self.address, linger_ms=1) as producer:
            offsets = [f.result(timeout=30) for f in [producer.send(topic, f"m{i}") for i in range(count)]]
        got: list[int] = []
        with Subscription(topic, group, address=self.address) as sub:
            wait_for(lambda: _receive_into(sub, got) >= offsets[-1] + 1, timeout=30)
        return got

    def traffic(self, topic: str) -> None:
        """Publish and subscribe without waiting for deliveries (a faulty unit may hold them back)."""
        with Producer(self.address, linger_ms=1) as producer:
            for future in [producer.send(topic, f"m{i}") for i in range(3)]:
                future.result(timeout=30)
        with Subscription(topic, "g", address=self.address) as sub:
            sub.receive(timeout=0.2)
        # Leases are looked at when one comes due: hold one past a short ack timeout.
        with Subscription(topic, "short-lease", address=self.address, ack_timeout_ms=100) as sub:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                sub.receive(timeout=0.1)


def _receive_into(sub: Subscription, got: list[int]) -> int:
    batch = sub.receive(timeout=0.05)
    sub.ack(batch)
    got.extend(m.offset for m in batch)
    return len(got)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    settings = BrokerSettings(bind="tcp://127.0.0.1:*", data_dir=str(tmp_path / "data"), metrics_port=-1)
    broker = Broker(settings, registry=CollectorRegistry())
    address = broker.bind()
    thread = threading.Thread(target=broker.serve_forever, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    assert wait_for(lambda: broker.running, timeout=30)
    yield Live(broker, address)
    broker.stop()
    thread.join(30)
    assert not thread.is_alive(), "the broker's loop ended cleanly"


def failing(times: int, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, except that its first ``times`` calls raise."""
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= times:
            raise RuntimeError(f"injected fault {calls['n']}")
        return original(*args, **kwargs)

    return wrapper


UNITS = {
    "heartbeats": (Broker, "_heartbeats"),
    "leases": (Group, "expire_leases"),
    "fetch_expiry": (FetchWaits, "expire"),
    "offsets_commit": (Broker, "_commit_offsets"),
    "retention": (Store, "apply_retention"),
    "group_commit": (Broker, "_group_commit"),
    "dispatch": (Group, "dispatch"),
}


@pytest.mark.parametrize("where", sorted(UNITS))
def test_an_exception_in_a_unit_of_loop_work_is_contained(live: Live, monkeypatch: pytest.MonkeyPatch, where: str):
    # Given a broker that serves (and a group that exists, so per-group units run)
    assert live.round_trip("before") == [0, 1, 2]
    # When that unit of its loop raises, a few times
    owner, name = UNITS[where]
    monkeypatch.setattr(owner, name, failing(3, getattr(owner, name)))
    live.traffic("during")  # publishing and subscribing make every unit run
    assert wait_for(lambda: live.internal_errors(where) >= 1, timeout=30), f"no {where} error was counted"
    # Then the broker still serves, and says what happened
    assert live.round_trip("after") == [0, 1, 2]
    report = live.broker.health()
    assert report["status"] == "DEGRADED", report
    check = report["checks"]["internal_errors"]
    assert check["status"] == "DEGRADED" and where in check["recent"], check
    assert "RuntimeError: injected fault" in check["recent"][where]["error"]


def test_a_group_whose_dispatch_always_raises_does_not_stop_the_others(live: Live, monkeypatch: pytest.MonkeyPatch):
    dispatch = Group.dispatch

    def poisoned(self: Group, log: Any) -> Any:
        if self.topic == "poisoned":
            raise RuntimeError("injected: this group's dispatch always fails")
        return dispatch(self, log)

    monkeypatch.setattr(Group, "dispatch", poisoned)
    with Producer(live.address, linger_ms=1) as producer:
        producer.send("poisoned", b"x").result(timeout=30)
    with Subscription("poisoned", "g", address=live.address) as stuck:
        assert live.round_trip("fine") == [0, 1, 2]
        assert stuck.receive(timeout=0.2) == []
        check = live.broker.health()["checks"]["internal_errors"]
        assert "topic=poisoned group=g" in check["recent"]["dispatch"]["context"], check
    assert live.round_trip("fine-later") == [0, 1, 2]


def test_a_group_whose_dispatch_raised_is_dispatched_again_without_new_traffic(
    live: Live, monkeypatch: pytest.MonkeyPatch
):
    # Given a message waiting and a dispatch that raises once
    with Producer(live.address, linger_ms=1) as producer:
        producer.send("once", b"x").result(timeout=30)
    monkeypatch.setattr(Group, "dispatch", failing(1, Group.dispatch))
    # When a member subscribes (the only event that makes the group dispatch)
    with Subscription("once", "g", address=live.address) as sub:
        got: list[Any] = []
        # Then the message still arrives: the group is tried again after a second
        assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or got, timeout=30)
        assert [m.offset for m in got] == [0]
    assert live.internal_errors("dispatch") == 1


def test_a_request_that_raises_gets_an_error_reply_and_is_counted(live: Live, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(admin_ops.OPS, "list_topics", failing(1_000, lambda b, h: []))
    with Admin(live.address) as admin:
        with pytest.raises(ConveyorError, match="internal error: RuntimeError"):
            admin.list_topics()
        admin.create_topic("x")
        assert admin.describe_topic("x")["end_offset"] == 0
    assert live.internal_errors("request") == 1
    assert "command=ADMIN" in live.broker.health()["checks"]["internal_errors"]["recent"]["request"]["context"]


def test_a_dead_letter_that_raises_is_kept_and_retried_slowly(live: Live, monkeypatch: pytest.MonkeyPatch):
    # Given dead-lettering that raises (once) and a 1 s retry instead of 30 s, to keep the test short
    monkeypatch.setattr(dead_letters_module, "DEAD_LETTER_RETRY_SECONDS", 1.0)
    monkeypatch.setattr(dead_letters_module, "dead_letter_body", failing(1, dead_letters_module.dead_letter_body))
    with Producer(live.address, linger_ms=1) as producer:
        producer.send("t", b"doomed").result(timeout=30)
    # When a consumer terminates the message
    with Subscription("t", "g", address=live.address) as sub:
        got: list[Any] = []
        assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or got, timeout=30)
        sub.term(got, reason="bad")
        # Then the failure is contained and counted, the message is not settled but comes again,
        assert wait_for(lambda: live.internal_errors("dead_letter") == 1, timeout=30)
        again: list[Any] = []
        assert wait_for(lambda: again.extend(sub.receive(timeout=0.05)) or again, timeout=30)
        assert [m.offset for m in again] == [0]
        # and it is dead-lettered when it dies again
        sub.term(again, reason="bad")
        with Admin(live.address) as admin:
            assert wait_for(lambda: _end(admin, "t.dlq") == 1, timeout=30), "the dead letter was not dropped"
            assert [m.value for m in admin.fetch("t.dlq", 0, 10)] == [b"doomed"]
            assert wait_for(lambda: admin.describe_group("t", "g")["committed_offset"] == 1, timeout=30)
    failures = live.broker.registry.get_sample_value(
        "conveyor_dead_letter_failures_total", {"topic": "t", "group": "g", "reason": "internal"}
    )
    assert failures == 1


def _end(admin: Admin, topic: str) -> int:
    try:
        return admin.describe_topic(topic)["end_offset"]
    except ConveyorError:
        return -1


def test_a_dead_letter_refused_for_good_is_counted_by_reason_and_retried_every_30_s(
    live: Live, monkeypatch: pytest.MonkeyPatch
):
    # Given a dead-letter topic the store refuses for a reason time will not fix
    get_or_create = Store.get_or_create

    def refuse(self: Store, name: str) -> Any:
        if name.endswith(".dlq"):
            raise TopicLimit(f"no room for {name}")
        return get_or_create(self, name)

    monkeypatch.setattr(Store, "get_or_create", refuse)
    with Producer(live.address, linger_ms=1) as producer:
        producer.send("t", b"doomed").result(timeout=30)
    with Subscription("t", "g", address=live.address) as sub:
        got: list[Any] = []
        assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or got, timeout=30)
        sub.term(got, reason="bad")
        labels = {"topic": "t", "group": "g", "reason": "topic_limit"}
        failures = live.broker.registry.get_sample_value
        assert wait_for(lambda: failures("conveyor_dead_letter_failures_total", labels) == 1, timeout=30)
        # Then it is kept for a retry in 30 s: not every second, not dropped
        stays_false(lambda: failures("conveyor_dead_letter_failures_total", labels) > 1, 3, message="a retry")
        group = live.broker.groups[("t", "g")]
        assert (group.committed_offset, group.pending_messages) == (0, 1)
        assert min(p.not_before for p in group.pending) - live.broker.clock() > 20
    assert live.internal_errors("dead_letter") == 0
