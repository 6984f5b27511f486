"""The cluster model: three agents in one process on one etcd, as the spike's nodes were.

Registration, one controller, topic creation, failover when a leader's lease
runs out, controller takeover, controlled shutdown, ISR proposals and
reassignment. The same tests run on the real etcd (``EtcdProcess``) once the
wrapper is installed, else on the in-memory stand-in.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.broker.cluster.agent import ClusterAgent
from conveyor.broker.cluster.events import (
    ControllerChanged,
    IsrAnswer,
    NodesChanged,
    ReassignAnswer,
    Registered,
    ShutdownAnswer,
    TopicCreated,
)
from conveyor.broker.cluster.keys import Keys, PartitionState, TopicPartition

from conveyor.errors import NotEnoughReplicas
from tests.cluster.cluster_harness import Backend, Node, backend_fixture, settings, started, wait_for  # noqa: F401

TP = TopicPartition("orders", 0)
KEYS = Keys("test")


def make(backend: Backend, node_id: str, lease_ms: int = 1000) -> ClusterAgent:
    return backend.agent(node_id, lease_ms)


def controller_of(nodes: list[Node]) -> Node:
    return wait_for(lambda: next((n for n in nodes if n.agent.is_controller), None), what="a controller")


def partition(node: Node, check: Callable[[PartitionState], bool] = lambda s: True) -> PartitionState:
    def ok() -> PartitionState | None:
        state = node.agent.snapshot().partitions.get(TP)
        return state if state is not None and check(state) else None

    return wait_for(ok, what=f"{TP} on {node.agent.node_id}")


def create(node: Node, rf: int | None = None) -> TopicCreated:
    request_id = node.agent.create_topic("orders", rf)
    return wait_for(lambda: next((e for e in node.of(TopicCreated) if e.request_id == request_id), None), what="create")


def test_three_nodes_register_and_elect_one_controller(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
            assert node.of(Registered)
            assert any(len(e.nodes) == 3 for e in node.of(NodesChanged))
        ctl = controller_of(nodes)
        assert sum(n.agent.is_controller for n in nodes) == 1
        for node in nodes:
            wait_for(lambda node=node: node.agent.snapshot().controller == ctl.agent.node_id, what="controller seen")
            assert node.of(ControllerChanged)[-1].me == (node is ctl)


def test_a_topic_is_created_with_rf_3_at_epoch_1(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        asker = nodes[1]
        answer = create(asker)
        assert answer.error is None and answer.config is not None
        assert (answer.config.replication_factor, answer.config.min_insync_replicas) == (3, 2)
        for node in nodes:
            state = partition(node)
            assert sorted(state.assignment) == ["a", "b", "c"]
            assert state.leader == state.assignment[0] and state.leader_epoch == 1 and state.isr == state.assignment
        assert create(asker).config == answer.config  # asking again finds it


def test_a_replication_factor_above_the_live_nodes_is_refused(backend: Backend) -> None:
    with started([make(backend, n) for n in "ab"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 2, what="2 nodes")
        controller_of(nodes)
        answer = create(nodes[0], rf=3)
        assert isinstance(answer.error, NotEnoughReplicas)
        assert create(nodes[0], rf=2).error is None  # the refused request was cleared


def test_the_leader_s_lease_ends_and_an_isr_member_leads_at_epoch_2(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        create(nodes[0])
        first = partition(nodes[0])
        leader = next(n for n in nodes if n.agent.node_id == first.leader)
        leader.agent.close()  # keepalive stops, nothing revoked: like a crash
        survivors = [n for n in nodes if n is not leader]
        for node in survivors:
            state = partition(node, lambda s: s.leader_epoch == 2)
            assert state.leader in first.isr and state.leader != first.leader
            assert first.leader not in state.isr


def test_the_controller_s_lease_ends_and_another_takes_over_and_repairs(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        old = controller_of(nodes)
        create(nodes[0])
        partition(nodes[0])
        old.agent.close()
        rest = [n for n in nodes if n is not old]
        new = controller_of(rest)
        assert new is not old
        wait_for(lambda: any(e.me for e in new.of(ControllerChanged)), what="ControllerChanged(me)")
        state = partition(new, lambda s: old.agent.node_id not in s.isr)
        assert state.leader != old.agent.node_id


def test_isr_proposals_are_a_cas_by_the_leader_at_its_epoch(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        create(nodes[0])
        state = partition(nodes[0])
        leader = next(n for n in nodes if n.agent.node_id == state.leader)
        wait_for(lambda: TP in leader.agent.snapshot().partitions, what="leader's view")
        mod = leader.agent.snapshot().partition_revisions[TP]
        smaller = tuple(n for n in state.isr if n != state.assignment[2])

        def answer(request_id: int) -> IsrAnswer:
            return wait_for(lambda: next((e for e in leader.of(IsrAnswer) if e.request_id == request_id), None))

        won = answer(leader.agent.propose_isr(TP, smaller, 1, mod))
        assert won.ok and won.state is not None and won.state.isr == smaller and won.mod_revision > mod
        stale = answer(leader.agent.propose_isr(TP, state.isr, 1, mod))
        assert not stale.ok and stale.state is not None
        wrong_epoch = answer(leader.agent.propose_isr(TP, state.isr, 7, won.mod_revision))
        assert not wrong_epoch.ok and wrong_epoch.error is not None
        follower = next(n for n in nodes if n.agent.node_id != state.leader)
        follower_id = follower.agent.propose_isr(TP, state.isr, 1, won.mod_revision)
        not_leader = wait_for(lambda: next((e for e in follower.of(IsrAnswer) if e.request_id == follower_id), None))
        assert not not_leader.ok and not_leader.error is not None
        wait_for(lambda: leader.agent.snapshot().partition_revisions[TP] == won.mod_revision, what="the view")
        back = answer(leader.agent.propose_isr(TP, state.isr, 1))  # on the agent's current record
        assert back.ok and back.state is not None and back.state.isr == state.isr


def test_controlled_shutdown_moves_leadership_before_the_key_goes(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        create(nodes[0])
        state = partition(nodes[0])
        leader = next(n for n in nodes if n.agent.node_id == state.leader)
        successor = state.assignment[2]
        request_id = leader.agent.request_shutdown({TP: successor})
        wait_for(lambda: any(e.request_id == request_id for e in leader.of(ShutdownAnswer)), what="shutdown done")
        moved = partition(leader, lambda s: s.leader_epoch == 2)
        assert moved.leader == successor and leader.agent.node_id not in moved.isr
        leader.agent.close(revoke=True)
        other = next(n for n in nodes if n is not leader)
        wait_for(lambda: leader.agent.node_id not in other.agent.snapshot().nodes, timeout=5, what="key revoked")
        assert partition(other).leader_epoch == 2  # no second election


def test_a_reassignment_adds_a_follower_then_drops_an_old_replica(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        create(nodes[0])
        state = partition(nodes[0])
        with started([make(backend, "d")]) as (d,):
            wait_for(lambda: len(d.agent.snapshot().nodes) == 4, what="d joined")
            target = (*state.assignment[1:], "d")
            request_id = nodes[0].agent.reassign(TP, target)
            wait_for(lambda: any(e.request_id == request_id for e in nodes[0].of(ReassignAnswer)))
            step1 = partition(nodes[0], lambda s: "d" in s.assignment)
            assert "d" not in step1.isr and step1.leader == state.leader
            leader = next(n for n in nodes if n.agent.node_id == state.leader)
            wait_for(lambda: leader.agent.snapshot().partitions.get(TP) == step1)
            mod = leader.agent.snapshot().partition_revisions[TP]
            leader.agent.propose_isr(TP, (*step1.isr, "d"), step1.leader_epoch, mod)  # d caught up
            done = partition(nodes[0], lambda s: s.assignment == target)
            assert set(done.isr) == set(target) and done.leader in target
            assert done.leader_epoch == state.leader_epoch + 1  # the old leader left


def test_a_topic_registered_with_its_data_is_rf_1_on_its_node_until_reassigned_to_three(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        controller_of(nodes)
        b = nodes[1]
        request_id = b.agent.create_topic("orders", 1, 1, {"retention_ms": 1000}, existing=(("b",), 4))
        created = wait_for(lambda: next((e for e in b.of(TopicCreated) if e.request_id == request_id), None))
        assert created.error is None and created.config is not None
        assert (created.config.replication_factor, created.config.min_insync_replicas) == (1, 1)
        assert partition(b) == PartitionState(("b",), "b", 4, ("b",))  # b leads its data, after its last epoch

        b.agent.reassign(TP, ("b", "a", "c"), min_insync_replicas=2)
        step1 = partition(b, lambda s: len(s.assignment) == 3)
        assert step1.isr == ("b",) and step1.leader == "b"
        mod = b.agent.snapshot().partition_revisions[TP]
        b.agent.propose_isr(TP, ("b", "a", "c"), 4, mod)  # both caught up
        done = partition(b, lambda s: s.assignment == ("b", "a", "c") and set(s.isr) == {"a", "b", "c"})
        assert (done.leader, done.leader_epoch) == ("b", 4)
        config = wait_for(lambda: (c := b.agent.snapshot().topics.get("orders")) and c.replication_factor == 3 and c)
        assert config.min_insync_replicas == 2 and dict(config.settings) == {"retention_ms": 1000}
        wait_for(lambda: TP not in b.agent.view.reassigns, what="the request deleted")


def test_a_topic_registered_with_its_data_needs_its_node_live(backend: Backend) -> None:
    with started([make(backend, n) for n in "ab"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 2, what="2 nodes")
        controller_of(nodes)
        request_id = nodes[0].agent.create_topic("orders", 1, 1, existing=(("z",), 1))
        answer = wait_for(lambda: next((e for e in nodes[0].of(TopicCreated) if e.request_id == request_id), None))
        assert isinstance(answer.error, NotEnoughReplicas)
