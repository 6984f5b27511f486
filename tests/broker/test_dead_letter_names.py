"""Derived names always fit the name pattern, and a dead letter that cannot be written is retried slowly.

A 197-200-character topic made ``<topic>.dlq`` longer than the 200-character
limit: the broker tried (and failed) to dead-letter every second, for ever,
holding the group. Derived names are now ``<topic>.dlq`` when that fits, and
a shortened form with a SHA-256 suffix otherwise; ``@consumer``'s default
group name (``module.qualname``) goes through the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.log.data_dir import check_name

from conveyor import Admin, Producer, consumer
from conveyor.errors import UnknownTopic
from conveyor.names import MAX_NAME, dead_letter_topic, fit_name
from conveyor.testing import BrokerProcess
from tests.helpers import stays_false, wait_for


@pytest.mark.parametrize("length", [1, 100, 196, 197, 198, 199, 200])
def test_a_dead_letter_topic_name_always_fits(length):
    topic = ("t" * length)[:length]
    name = dead_letter_topic(topic)
    assert check_name(name) == name and len(name) <= MAX_NAME
    if length + len(".dlq") <= MAX_NAME:
        assert name == f"{topic}.dlq", "a name that fits is kept as it always was"
    else:
        assert name.endswith(".dlq") and name.startswith(topic[:150])
    assert dead_letter_topic(topic) == name, "the same topic always gets the same name"


def test_long_topics_that_differ_only_at_the_end_get_different_dead_letter_topics():
    a, b = "x" * 199 + "a", "x" * 199 + "b"
    assert dead_letter_topic(a) != dead_letter_topic(b)
    assert dead_letter_topic(a, "mine") == "mine", "a configured dead-letter topic is used as it is"


@pytest.mark.parametrize("base", ["a.b.<locals>.handler", "é", ".", "..", "x" * 300, "a b", ""])
def test_fit_name_makes_a_valid_name_of_anything(base):
    name = fit_name(base)
    assert check_name(name) == name
    assert fit_name(base) == name


def test_the_default_group_of_a_nested_consumer_is_a_valid_name():
    def make():
        @consumer("orders")
        def handle(message):
            return None

        return handle

    group = make().group
    assert check_name(group, "group") == group
    assert group.startswith(f"{__name__}.test_the_default_group_of_a_nested_consumer_is_a_valid_name._locals_.")

    @consumer("orders", group="explicit")
    def named(message):
        return None

    assert named.group == "explicit"


def test_a_module_level_default_group_name_is_unchanged():
    assert fit_name("app.handlers.handle") == "app.handlers.handle"


def _end(admin: Admin, topic: str) -> int:
    try:
        return admin.describe_topic(topic)["end_offset"]
    except UnknownTopic:
        return -1


def _receive(sub: Subscription) -> list:
    got: list = []
    assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or got, timeout=30)
    return got


@pytest.mark.parametrize("length", [197, 200])
def test_a_topic_at_the_name_limit_dead_letters(tmp_path, length):
    topic = "t" * length
    with BrokerProcess(tmp_path / "data") as broker:
        with Producer(broker.address) as producer:
            producer.send(topic, b"doomed").result(timeout=30)
        with Subscription(topic, "g", address=broker.address) as sub:
            sub.term(_receive(sub), reason="bad")
            with Admin(broker.address) as admin:
                dlq = dead_letter_topic(topic)
                assert wait_for(lambda: _end(admin, dlq) == 1, timeout=30), "the dead letter was not written"
                assert [m.body for m in admin.fetch(dlq, 0, 10)] == [b"doomed"]
                assert wait_for(lambda: admin.describe_group(topic, "g")["committed_offset"] == 1, timeout=30)
        assert broker.metric("conveyor_dead_letter_failures_total") == 0
        assert not [line for line in broker.output if "dead-lettering" in line]


def test_a_stored_dead_letter_topic_that_is_no_valid_name_does_not_lock_the_group_out(tmp_path):
    # Given a group whose stored dead-letter topic is not a valid name (a hand-edited groups.json)
    data = tmp_path / "data"
    with BrokerProcess(data) as broker:
        with Producer(broker.address) as producer:
            producer.send("t", b"doomed").result(timeout=30)
        with Subscription("t", "g", address=broker.address) as sub:
            _receive(sub)  # the group exists (and is stored at shutdown)
    groups = Path(data, "topics", "t", "groups.json")
    state = json.loads(groups.read_text())
    state["g"]["dead_letter_topic"] = "not a valid name!"
    groups.write_text(json.dumps(state))
    with BrokerProcess(data) as broker:
        # When a consumer of the group terminates the message
        with Subscription("t", "g", address=broker.address) as sub:
            sub.term(_receive(sub), reason="bad")
            # Then the broker said what it did and dead-lettered it to the default topic
            with Admin(broker.address) as admin:
                assert wait_for(lambda: _end(admin, "t.dlq") == 1, timeout=30)
        assert wait_for(lambda: any("stored dead_letter_topic refused" in line for line in broker.output), 10), (
            broker.output
        )


def test_a_dead_letter_that_cannot_be_written_is_counted_kept_and_retried_slowly(tmp_path):
    with BrokerProcess(tmp_path / "data") as broker:
        # Given a dead-letter topic that refuses writes
        with Admin(broker.address) as admin:
            admin.create_topic("t.dlq", read_only=True)
        with Producer(broker.address) as producer:
            producer.send("t", b"doomed").result(timeout=30)
        # When a consumer terminates the message
        with Subscription("t", "g", address=broker.address) as sub:
            sub.term(_receive(sub), reason="bad")
            # Then the failure is counted with its reason and logged,
            failures = 'reason="read_only_topic"'
            assert wait_for(lambda: broker.metric("conveyor_dead_letter_failures_total", failures) == 1, timeout=30)
            # not retried every second, and the message is kept: not settled, waiting to come again
            stays_false(lambda: broker.metric("conveyor_dead_letter_failures_total") > 1, 3, message="a retry")
            with Admin(broker.address) as admin:
                group = admin.describe_group("t", "g")
            assert (group["committed_offset"], group["pending_redelivery"]) == (0, 1), group
        lines = [line for line in broker.output if "dead-lettering t/g" in line]
        assert len(lines) == 1 and "in 30 s" in lines[0], lines
