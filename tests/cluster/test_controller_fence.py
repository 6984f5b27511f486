"""A zombie controller cannot write: every controller txn is fenced by the controller key's create revision.

The spike saw a stopped controller, once resumed, act on a queued NODE_GONE
event as if it were still controller. Here the old controller's lease runs
out, another node takes over, and the old one then runs its duties with its
stale epoch: each write fails on the fence, it learns it was deposed, and
the partition record is what the new controller left.
"""

from __future__ import annotations

import threading

import pytest
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.controller import Controller, Deposed
from conveyor.broker.cluster.etcd import Etcd, WatchEvent
from conveyor.broker.cluster.events import LeaseLost, TopicCreated
from conveyor.broker.cluster.keys import Keys, NodeRecord, PartitionState, TopicPartition
from conveyor.broker.cluster.view import ClusterView

from tests.cluster.cluster_harness import Backend, backend_fixture, started, wait_for  # noqa: F401  (the fixture)

TP = TopicPartition("orders", 0)
KEYS = Keys("test")


def load(client: Etcd) -> ClusterView:
    view = ClusterView(KEYS)
    view.load(*client.get_prefix(KEYS.prefix))
    return view


def test_a_deposed_controller_s_writes_fail_on_the_fence(backend: Backend) -> None:
    a, b = backend.client(), backend.client()
    lease_a = a.lease(1, on_lost=lambda: None)
    lease_b = b.lease(30, on_lost=lambda: None)
    for node, client, lease in (("a", a, lease_a), ("b", b, lease_b), ("c", b, lease_b)):
        client.put(KEYS.node(node), k.encode_node(NodeRecord(node, "tcp://x:1")), lease=lease.id)
    state = PartitionState(("a", "b", "c"), "c", 1, ("a", "b", "c"))
    a.put(KEYS.partition(TP), k.encode_partition(state))
    zombie, standby = Controller(a, KEYS, "a"), Controller(b, KEYS, "b")
    assert zombie.campaign(lease_a.id) and not standby.campaign(lease_b.id)
    zombie_view = load(a)  # what the zombie knew when it stopped: c is alive

    lease_a.close()  # the zombie stops refreshing (SIGSTOP): its lease runs out, the key goes
    wait_for(lambda: a.get(KEYS.controller) is None, what="the zombie's controller key to expire")
    assert standby.campaign(lease_b.id)
    b.delete(KEYS.node("c"))  # c leaves: the new controller moves the leadership
    standby.repair_all(load(b))
    after = k.decode_partition("key", b.get(KEYS.partition(TP)).value)  # type: ignore[union-attr]
    assert after.leader == "b" and after.leader_epoch == 2

    # The zombie resumes with a queued event of its own (say, "b is gone") and a stale view.
    del zombie_view.nodes["b"]
    with pytest.raises(Deposed):
        zombie.repair_all(zombie_view)
    assert not zombie.active and zombie.writes == 0
    assert k.decode_partition("key", b.get(KEYS.partition(TP)).value) == after  # type: ignore[union-attr]
    lease_b.revoke()


def test_a_cas_conflict_is_decided_again_from_the_record_etcd_returns(backend: Backend) -> None:
    client = backend.client()
    lease = client.lease(30, on_lost=lambda: None)
    for node in "ab":
        client.put(KEYS.node(node), k.encode_node(NodeRecord(node, "tcp://x:1")), lease=lease.id)
    client.put(KEYS.partition(TP), k.encode_partition(PartitionState(("a", "b", "c"), "c", 4, ("a", "b", "c"))))
    controller = Controller(client, KEYS, "a")
    assert controller.campaign(lease.id)
    view = load(client)  # c leads at epoch 4 in this view...
    # ...but before the controller acts, the leader shrank its ISR to (b, c): a newer record.
    client.put(KEYS.partition(TP), k.encode_partition(PartitionState(("a", "b", "c"), "c", 4, ("b", "c"))))
    controller.repair_all(view)
    after = k.decode_partition("key", client.get(KEYS.partition(TP)).value)  # type: ignore[union-attr]
    assert after == PartitionState(("a", "b", "c"), "b", 5, ("b",))  # a was out of sync: b leads
    lease.revoke()


def test_a_stalled_controller_agent_resumes_and_its_queued_event_is_fenced(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """The spike's SIGSTOP case with agents: a node leaves while the controller is stopped, then its lease ends.

    On resuming, the zombie handles the queued NODE_GONE before it sees its own
    controller key go, so it acts as controller: the fence makes that write fail.
    """
    nodes = [backend.agent(n) for n in "abc"]
    with started(nodes) as running:
        for node in running:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        zombie = wait_for(lambda: next((n for n in running if n.agent.is_controller), None), what="a controller")
        request_id = zombie.agent.create_topic("orders")
        wait_for(lambda: any(e.request_id == request_id for e in zombie.of(TopicCreated)), what="the topic")
        wait_for(lambda: zombie.agent.snapshot().partitions.get(TP), what="the partition")
        victim, heir = (n for n in running if n is not zombie)

        gate = threading.Event()
        handle = zombie.agent._on_watch

        def stalled(event: WatchEvent) -> None:
            gate.wait(60)
            handle(event)

        zombie.agent._on_watch = stalled  # type: ignore[method-assign]  # SIGSTOP
        writes = zombie.agent.controller.writes
        victim.agent.close()  # a node leaves: its NODE_GONE queues up for the stopped controller
        wait_for(lambda: victim.agent.node_id not in heir.agent.snapshot().nodes, what="the victim's key to go")
        assert zombie.agent.lease is not None
        zombie.agent.lease.close()  # the stopped keepalive: the lease runs out and the controller key goes
        wait_for(lambda: heir.agent.is_controller, what="the heir to take over")
        settled = wait_for(
            lambda: (s := heir.agent.snapshot().partitions.get(TP)) and s.isr == (heir.agent.node_id,) and s,
            what="the new controller's repair",
        )
        assert settled.leader == heir.agent.node_id

        gate.set()  # SIGCONT
        wait_for(lambda: not zombie.agent.is_controller and zombie.of(LeaseLost), what="the zombie to stand down")
        wait_for(lambda: "controller epoch" in caplog.text, what="the fenced write")
        assert zombie.agent.controller.writes == writes
        assert heir.agent.snapshot().partitions[TP] == settled
        wait_for(lambda: zombie.agent.node_id in heir.agent.snapshot().nodes, what="the zombie registered again")
