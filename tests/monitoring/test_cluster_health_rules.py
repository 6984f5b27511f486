"""The cluster's health rules, metrics rows and ``cluster status`` layout, each on one module's state.

The same rules run for real in tests/replicated/test_cluster_operations.py
(three brokers, one killed); here each case is set up directly.
"""

from __future__ import annotations

from typing import Any

from conveyor.broker.cli.cluster_status import partition_state, status_lines
from conveyor.broker.client.cluster_status import combine
from conveyor.broker.client.metadata import ClusterView, PartitionInfo
from conveyor.broker.server.health import replication_check
from conveyor.broker.server.partition_status import describe_led, follower_lag
from conveyor.broker.server.replication import FollowerState, PartitionLeader
from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY
from conveyor.monitoring.metrics import CLUSTER_COUNTERS, CLUSTER_GAUGES, ClusterCollector
from prometheus_client import CollectorRegistry, generate_latest


class Leading:
    """What ``replication_check`` reads of ``Partitions``: the partitions this node leads."""

    def __init__(self, *leaders: PartitionLeader) -> None:
        self.leading = {(leader.topic, leader.partition): leader for leader in leaders}


def leader(topic: str, isr: set[str], min_insync: int = 2) -> PartitionLeader:
    return PartitionLeader(topic, 0, "n1", 3, ("n1", "n2", "n3"), set(isr), min_insync, 10.0, lambda change: None)


def test_every_replica_in_sync_is_healthy() -> None:
    found = replication_check(Leading(leader("orders", {"n1", "n2", "n3"})))  # type: ignore[arg-type]
    assert found == {"status": HEALTHY, "led": 1}


def test_an_under_replicated_partition_is_degraded() -> None:
    found = replication_check(Leading(leader("orders", {"n1", "n2"})))  # type: ignore[arg-type]
    assert found["status"] == DEGRADED
    assert found["under_replicated"] == {
        "orders/0": {"isr": ["n1", "n2"], "replicas": ["n1", "n2", "n3"], "min_insync_replicas": 2}
    }
    assert "below_min_insync" not in found


def test_below_min_insync_is_unhealthy_whatever_else_is_degraded() -> None:
    partitions = Leading(leader("orders", {"n1", "n2"}), leader("strict", {"n1", "n2"}, min_insync=3))
    found = replication_check(partitions)  # type: ignore[arg-type]
    assert found["status"] == UNHEALTHY and found["below_min_insync"] == ["strict/0"]
    assert sorted(found["under_replicated"]) == ["orders/0", "strict/0"]


def test_nothing_led_is_healthy() -> None:
    assert replication_check(Leading())["status"] == HEALTHY  # type: ignore[arg-type]


def test_follower_lag_is_zero_at_the_end_and_grows_from_when_it_was_last_caught_up() -> None:
    state = FollowerState("n2", fetch_offset=100, last_caught_up=50.0)
    assert follower_lag(state, 100, 80.0) == (0, 0.0)
    assert follower_lag(state, 130, 80.0) == (30, 30.0)


def test_a_led_partition_describes_each_follower() -> None:
    led = leader("orders", {"n1", "n2"})
    led.hw = 90
    led.followers["n2"] = FollowerState("n2", fetch_offset=100, durable=100, last_caught_up=10.0)
    led.followers["n3"] = FollowerState("n3", fetch_offset=40, durable=40, last_caught_up=10.0)
    found = describe_led(led, 100, 25.0)
    assert found["isr"] == ["n1", "n2"] and found["high_watermark"] == 90 and found["under_replicated"] is True
    assert [(f["node"], f["in_isr"], f["lag_messages"], f["lag_seconds"]) for f in found["followers"]] == [
        ("n2", True, 0, 0.0),
        ("n3", False, 60, 15.0),
    ]


def test_a_replica_moved_away_is_no_longer_described_as_a_follower() -> None:
    led = leader("orders", {"n1", "n2"})
    led.replicas = ("n1", "n2")  # reassigned away from n3, same leader and epoch: its state stays behind
    found = describe_led(led, 100, 25.0)
    assert [f["node"] for f in found["followers"]] == ["n2"] and found["under_replicated"] is False


def test_the_cluster_collector_exposes_every_family_even_empty() -> None:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: {"conveyor_partition_leader_changes": [(("orders", "0"), 2.0)]}))
    text = generate_latest(registry).decode()
    for name in CLUSTER_GAUGES:
        assert f"# TYPE {name} gauge" in text, name
    for name in CLUSTER_COUNTERS:
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text, name
    assert registry.get_sample_value("conveyor_partition_leader_changes_total", {"topic": "orders", "partition": "0"})


def view(isr: tuple[str, ...] = ("n1", "n2")) -> ClusterView:
    partition = PartitionInfo("n1", "tcp://a", 4, ("n1", "n2", "n3"), isr, False)
    return ClusterView("tcp://a", "n1", "n1", {"n1": "tcp://a", "n2": "tcp://b"}, {"orders": {0: partition}})


def leader_row(**changes: Any) -> dict[str, Any]:
    row = describe_led(leader("orders", {"n1", "n2"}), 10, 0.0)
    return {**row, **changes}


def test_status_joins_metadata_and_the_leaders_detail_and_names_dead_nodes() -> None:
    answers = {"n1": {"node": "n1", "cluster": True, "partitions": [leader_row()]}, "n2": {"partitions": []}}
    status = combine(view(), answers, {})
    assert status["mode"] == "cluster" and status["controller"] == "n1"
    assert [(n["id"], n["alive"], n["address"]) for n in status["nodes"]] == [
        ("n1", True, "tcp://a"),
        ("n2", True, "tcp://b"),
        ("n3", False, None),
    ]
    (partition,) = status["partitions"]
    assert partition["epoch"] == 3  # the leader's own answer wins over METADATA's (4 here, to tell them apart)
    assert partition["min_insync_replicas"] == 2 and partition["end_offset"] == 10
    assert partition_state(partition) == "under-replicated"
    lines = status_lines(status)
    assert lines[0] == "cluster: 2 of 3 nodes alive, controller n1 (asked tcp://a)"
    assert any(line.startswith("n3") and "not registered in etcd" in line for line in lines)
    assert "1 partition(s), 1 under-replicated" in lines


def test_an_unreachable_leader_leaves_metadata_only_with_its_error() -> None:
    status = combine(view(), {"n2": {"partitions": []}}, {"n1": "[BROKER_UNAVAILABLE] no answer"})
    (partition,) = status["partitions"]
    assert partition["high_watermark"] is None and partition["error"] == "[BROKER_UNAVAILABLE] no answer"
    assert partition_state(partition) == "no detail"
    assert status["nodes"][0]["error"] == "[BROKER_UNAVAILABLE] no answer"


def test_a_stale_leaders_answer_is_not_taken_for_the_new_leaders() -> None:
    status = combine(view(), {"n2": {"partitions": [leader_row(leader="n2")]}}, {})
    assert status["partitions"][0]["high_watermark"] is None
