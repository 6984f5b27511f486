"""METADATA from a real single-node broker, and the client's routing on a bootstrap list."""

from __future__ import annotations

from conveyor.broker.client.metadata import Metadata, ask_metadata
from conveyor.broker.net.requester import Requester
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command
from conveyor.broker.wire.schema import check_metadata_result

from conveyor import Admin
from tests.helpers import free_address


def test_a_single_node_broker_answers_metadata_as_the_only_node(conveyor_broker):
    # Given a broker with one topic
    with Admin(conveyor_broker.address) as admin:
        admin.create_topic("orders")
    # When a client asks METADATA of every topic, then of one it does not have
    with Requester(conveyor_broker.address) as requester:
        every = requester.call(commands.metadata)
        some = requester.call(lambda rid: commands.metadata(["orders", "missing"], rid=rid))
    # Then it answers itself as node, controller and leader at epoch 0, in the documented shape
    assert every.command is Command.METADATA_RESULT
    assert check_metadata_result(every.header) is None
    assert every.get("node") == "local" and every.get("controller") == "local"
    assert every.get("nodes") == {"local": conveyor_broker.address}
    assert every.get("topics") == {
        "orders": {
            "partitions": {
                "0": {
                    "leader": "local",
                    "leader_addr": conveyor_broker.address,
                    "leader_epoch": 0,
                    "replicas": ["local"],
                    "isr": ["local"],
                    "offline": False,
                }
            }
        }
    }
    # And a topic it does not know is left out
    assert set(some.get("topics")) == {"orders"}


def test_the_node_name_is_the_node_flag(conveyor_broker_factory):
    broker = conveyor_broker_factory(extra=["--node", "edge-1"])
    view = ask_metadata([broker.address])
    assert view.node == "edge-1" and view.nodes == {"edge-1": broker.address}


def test_a_bootstrap_list_whose_first_broker_is_dead_finds_the_live_one(conveyor_broker):
    # Given a bootstrap list that starts with an address nobody listens on
    metadata = Metadata([free_address(), conveyor_broker.address], stagger=0.2)
    # When a topic's leader is looked up
    leader = metadata.leader_for("anything")
    # Then the live broker answered, and it leads the topic (it will make it)
    assert leader == conveyor_broker.address
    assert metadata.view is not None and metadata.view.source == conveyor_broker.address


def test_one_address_is_used_without_asking(conveyor_broker):
    metadata = Metadata(conveyor_broker.address)
    assert metadata.leader_for("orders") == conveyor_broker.address
    assert metadata.refreshes == 0
