"""``conveyor.testing``: what a user's tests get from Conveyor (the fixtures and the broker process)."""

from __future__ import annotations

import pytest

import conveyor.testing
from conveyor import Admin, Producer, pytest_plugin


def test_the_fixtures_are_importable_from_conveyor_testing():
    from conveyor.testing import conveyor_broker, conveyor_broker_factory

    assert (conveyor_broker, conveyor_broker_factory) == (
        pytest_plugin.conveyor_broker,
        pytest_plugin.conveyor_broker_factory,
    )
    assert {"BrokerProcess", "conveyor_broker", "conveyor_broker_factory"} <= set(conveyor.testing.__all__)
    with pytest.raises(AttributeError):
        conveyor.testing.no_such_fixture  # noqa: B018


def test_the_plugins_fixture_starts_a_real_broker(conveyor_broker):
    with Producer(conveyor_broker.address) as producer:
        assert producer.send("orders", {"id": 1}).result(timeout=30) == 0
    with Admin(conveyor_broker.address) as admin:
        assert admin.fetch("orders", 0, 10)[0].value == {"id": 1}
