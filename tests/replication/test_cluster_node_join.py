"""ClusterNode registers the topics its data directory holds and the cluster does not know (a stand-in agent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conveyor.broker.cluster.events import ClusterEvent, Registered, TopicChanged
from conveyor.broker.cluster.keys import TopicConfigRecord
from conveyor.broker.config.broker_settings import BrokerSettings
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.cluster_node import ClusterNode
from conveyor.broker.server.partition_logs import create_partitioned
from conveyor.broker.wire.record import pack_records

from conveyor.errors import UnknownTopic


@dataclass
class Agent:
    queued: list[ClusterEvent] = field(default_factory=list)
    creates: list[tuple[Any, ...]] = field(default_factory=list)

    def poll(self) -> list[ClusterEvent]:
        found, self.queued = self.queued, []
        return found

    def snapshot(self) -> Any:
        return SimpleNamespace(nodes={"n1": None}, topics={})  # one registered node: n1

    def create_topic(self, topic: str, *args: Any, existing: Any = None, partitions: int = 1) -> int:
        self.creates.append((topic, *args, existing, *([partitions] if partitions != 1 else [])))
        return len(self.creates)


def node_on(store: Store, agent: Agent, **options: Any) -> ClusterNode:
    host = SimpleNamespace(store=store, security=None, stop_wake=lambda: None)
    partitions = SimpleNamespace(replicas=SimpleNamespace())
    settings = BrokerSettings(node_id="n1", cluster="etcd://127.0.0.1:2379", **options)
    return ClusterNode(host, partitions, settings, agent=agent)  # type: ignore[arg-type]


def test_local_topics_unknown_to_the_cluster_are_registered_with_their_data_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "data")
    try:
        for topic in ("legacy", "known", "__internal"):
            store.create_topic(topic)
        create_partitioned(store, "split", 3)
        store.topic("legacy").append(pack_records([(None, {}, b"a"), (None, {}, b"b")]), 2)
        agent = Agent([TopicChanged("known", TopicConfigRecord(3, 2)), Registered("n1", 7, 10)])
        node = node_on(store, agent)
        node.pump()
        settings = store.topic("legacy").config.settings()
        assert agent.creates == [
            ("legacy", 1, 1, settings, (("n1",), 1)),  # RF 1 on n1, epoch 1
            ("split", 1, 1, settings, (("n1",), 1), 3),  # its partitions with it, never split#1 on its own
        ]

        agent.queued.append(Registered("n1", 8, 20))  # registered again after a lost lease: nothing new
        node.pump()
        node.auto_create("legacy")  # asked already
        assert len(agent.creates) == 2

        store.create_topic("early")  # held here, named by a client before the registration asked for it
        node.auto_create("early")
        node.auto_create("fresh")  # not held here: placed by the controller
        assert agent.creates[2:] == [
            ("early", 1, 1, store.topic("early").config.settings(), (("n1",), 1)),
            ("fresh", 1, 1, None),  # the node's defaults, capped at the one registered node
        ]
    finally:
        store.close()


def test_with_auto_create_off_a_topic_the_cluster_lacks_is_unknown_as_on_one_node(tmp_path: Path) -> None:
    store = Store(tmp_path / "data")
    try:
        agent = Agent([TopicChanged("orders", TopicConfigRecord(3, 2))])
        node = node_on(store, agent, auto_create_topics=False)
        node.pump()
        with pytest.raises(UnknownTopic, match="auto-create is off"):
            node.auto_create("deleted")  # a publish to it: UNKNOWN_TOPIC, not NOT_LEADER for ever
        node.auto_create("orders")  # known: NOT_LEADER names its leader
        node.auto_create("orders.dlq")  # made by the controller when a first message dies: wait for it
        assert agent.creates == []
    finally:
        store.close()
