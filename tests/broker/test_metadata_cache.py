"""``Metadata`` and ``ClusterView`` without a broker: routing decisions from a METADATA answer."""

from __future__ import annotations

from typing import Any

import pytest
from conveyor.broker.client.metadata import ClusterView, Metadata
from conveyor.broker.config.addresses import broker_addresses

from conveyor.errors import ConfigError, MalformedFrame, NotLeader

A, B, C = "tcp://h1:5555", "tcp://h2:5555", "tcp://h3:5555"


def partition(leader: str | None, addr: str | None, *, offline: bool = False) -> dict[str, Any]:
    return {
        "leader": leader,
        "leader_addr": addr,
        "leader_epoch": 3,
        "replicas": ["a", "b", "c"],
        "isr": ["a", "b"],
        "offline": offline,
    }


def answer(**topics: dict[str, Any]) -> dict[str, Any]:
    return {
        "node": "b",
        "controller": "a",
        "nodes": {"a": A, "b": "tcp://0.0.0.0:5555", "c": C},
        "topics": {name: {"partitions": {"0": p}} for name, p in topics.items()},
    }


def test_a_leader_is_reached_at_its_advertised_address_and_the_answering_node_where_it_was_asked():
    view = ClusterView.from_header(B, answer(orders=partition("a", A), audit=partition("b", "tcp://0.0.0.0:5555")))
    assert view.leader_address("orders") == A
    assert view.leader_address("audit") == B, "the node that answered binds 0.0.0.0: reach it where it was asked"


def test_an_unknown_topic_goes_to_the_node_that_answered_and_an_offline_one_nowhere():
    view = ClusterView.from_header(B, answer(down=partition(None, None, offline=True)))
    assert view.leader_address("new-topic") == B
    assert view.leader_address("down") is None


def test_an_answer_of_another_shape_is_malformed():
    with pytest.raises(MalformedFrame, match="leader_epoch"):
        ClusterView.from_header(B, answer(orders={**partition("a", A), "leader_epoch": "3"}))


def listed(**topics: dict[str, Any]) -> Metadata:
    metadata = Metadata([A, B, C])
    metadata.view = ClusterView.from_header(B, answer(**topics))
    return metadata


def test_not_leader_with_an_address_routes_there_at_once_without_asking():
    metadata = listed(orders=partition("a", A))
    metadata.not_leader("orders", 0, NotLeader("moved", leader="c", leader_addr=C, leader_epoch=4))
    assert metadata.leader_for("orders") == C
    assert metadata.refreshes == 0


def test_an_offline_partition_is_not_leader_until_a_leader_is_named():
    metadata = listed(orders=partition(None, None, offline=True))
    with pytest.raises(NotLeader) as raised:
        metadata.leader_for("orders")
    assert raised.value.retriable


def test_a_lost_broker_is_asked_last(monkeypatch):
    metadata = listed(orders=partition("a", A))
    asked: list[list[str]] = []

    def ask(addresses: list[str], *args: Any, **kwargs: Any) -> ClusterView:
        asked.append(list(addresses))
        return ClusterView.from_header(C, answer(orders=partition("c", C)))

    monkeypatch.setattr("conveyor.broker.client.metadata.ask_metadata", ask)
    metadata.lost(A)
    assert metadata.leader_for("orders") == C
    assert asked[0][-1] == A and set(asked[0]) == {A, B, C}


def test_one_address_never_asks_unless_a_broker_points_elsewhere():
    metadata = Metadata(A)
    metadata.lost(A)
    assert metadata.leader_for("orders") == A
    assert (metadata.refreshes, metadata.following) == (0, False)


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        (A, (A,)),
        (f"{A}, {B},{A}", (A, B)),
        ([A, C], (A, C)),
    ],
)
def test_bootstrap_lists(given: Any, parsed: tuple[str, ...]):
    assert broker_addresses(given) == parsed


@pytest.mark.parametrize("given", ["", "h1:5555", [A, "tcp://h2"]])
def test_a_bootstrap_list_with_a_bad_address_is_a_config_error(given: Any):
    with pytest.raises(ConfigError):
        broker_addresses(given)
