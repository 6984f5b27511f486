"""A zombie controller cannot write: every controller txn is fenced by the controller key's create revision.

The spike saw a stopped controller, once resumed, act on a queued NODE_GONE
event as if it were still controller. Here the old controller's lease runs
out, another node takes over, and the old one then runs its duties with its
stale epoch: each write fails on the fence, it learns it was deposed, and
the partition record is what the new controller left.
"""

from __future__ import annotations

import pytest
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.controller import Controller, Deposed
from conveyor.broker.cluster.etcd import Etcd
from conveyor.broker.cluster.keys import Keys, NodeRecord, PartitionState, TopicPartition
from conveyor.broker.cluster.view import ClusterView

from tests.cluster.cluster_harness import Backend, backend_fixture, wait_for  # noqa: F401  (the fixture)

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
