"""The agent under faults: etcd restarted under it, damaged records, and nodes killed with -9 in real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.agent import ClusterAgent
from conveyor.broker.cluster.etcd import Etcd, WatchEvent
from conveyor.broker.cluster.events import LeaseLost, TopicCreated
from conveyor.broker.cluster.keys import CreateRequest, Keys, PartitionState, TopicPartition

from tests.cluster.cluster_harness import Backend, Node, backend_fixture, settings, started, wait_for  # noqa: F401

TP = TopicPartition("orders", 0)
KEYS = Keys("test")


def make(backend: Backend, node_id: str, lease_ms: int = 2000) -> ClusterAgent:
    return backend.agent(node_id, lease_ms)


def create(node: Node, topic: str = "orders") -> TopicCreated:
    request_id = node.agent.create_topic(topic)
    return wait_for(lambda: next((e for e in node.of(TopicCreated) if e.request_id == request_id), None), what="create")


def state_on(node: Node, tp: TopicPartition = TP) -> PartitionState | None:
    return node.agent.snapshot().partitions.get(tp)


def test_after_an_etcd_restart_the_watches_resume_and_failover_still_works(backend: Backend) -> None:
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        create(nodes[0])
        first = wait_for(lambda: state_on(nodes[0]), what="the partition")
        backend.process.restart(kill=True, down_for=0.5)
        # A change made after the restart reaches every view: the watches came back.
        create(nodes[1], "after-restart")
        for node in nodes:
            wait_for(lambda node=node: state_on(node, TopicPartition("after-restart", 0)), what="watch resumed")
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes again")
        leader = next(n for n in nodes if n.agent.node_id == first.leader)
        before = wait_for(lambda: state_on(nodes[0]), what="the partition")
        leader.agent.close()
        for node in (n for n in nodes if n is not leader):
            moved = wait_for(
                lambda node=node: (s := state_on(node)) and s.leader_epoch > before.leader_epoch and s,
                what="a new leader after the restart",
            )
            assert moved.leader != first.leader and moved.leader in before.isr


def test_a_damaged_record_is_skipped_and_the_agent_goes_on(backend: Backend) -> None:
    raw = backend.client()
    with started([make(backend, n) for n in "ab"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 2, what="2 nodes")
        raw.put(KEYS.partition(TopicPartition("broken", 0)), b"{not json")
        raw.put(KEYS.node("zz"), b'{"advertise": 5}')
        raw.put(KEYS.prefix + "topics/x/unknown", b"{}")
        assert create(nodes[0]).error is None  # the same watch stream goes on
        for node in nodes:
            wait_for(lambda node=node: state_on(node), what="the good partition")
            assert KEYS.partition(TopicPartition("broken", 0)) in node.agent.view.damaged
            assert "zz" not in node.agent.snapshot().nodes
            assert node.agent._thread.is_alive()


def test_losing_the_lease_registers_again_under_a_new_one(backend: Backend) -> None:
    with started([make(backend, "a", lease_ms=1000)]) as (node,):
        wait_for(lambda: node.agent.registered.is_set(), what="registered")
        lease = node.agent.lease
        assert lease is not None
        backend.client().revoke(lease.id)  # as when etcd expires it: the keepalive hears it is gone
        lost = wait_for(lambda: node.of(LeaseLost), what="LeaseLost")
        assert lost[0].lease_id == lease.id
        wait_for(lambda: node.agent.lease is not None and node.agent.lease.id != lease.id, what="a new lease")
        wait_for(lambda: "a" in node.agent.snapshot().nodes and node.agent.registered.is_set(), what="back")
        wait_for(lambda: node.agent.is_controller, what="controller again")


def test_after_etcd_was_away_longer_than_the_lease_the_old_lease_is_revoked_on_registering_again(
    backend: Backend,
) -> None:
    """etcd renews every lease when it restarts, so the lease the node gave up would live on for a TTL more,
    and with it the controller key of a node that resigned: no controller for that long after the outage."""
    with started([make(backend, "a", lease_ms=3000)]) as (node,):
        wait_for(lambda: node.agent.is_controller, what="controller")
        old = node.agent.lease
        assert old is not None
        backend.process.restart(down_for=4.0)  # longer than the lease: the node counts it lost
        wait_for(lambda: node.of(LeaseLost), what="LeaseLost")
        wait_for(
            lambda: node.agent.registered.is_set() and node.agent.lease is not None and node.agent.lease.id != old.id,
            what="registered under a new lease",
        )
        assert backend.client().time_to_live(old.id) == -1  # revoked, not left to run out
        wait_for(lambda: node.agent.is_controller, what="controller again, under the new lease")


def test_after_a_frozen_etcd_the_new_controller_waits_for_the_nodes_to_register_again(backend: Backend) -> None:
    """A frozen etcd expires every lease when it resumes. The first node back becomes controller; if it
    repaired at once it would see the others as gone, move the leader and shrink the ISR to itself."""
    with started([make(backend, n) for n in "abc"]) as nodes:
        for node in nodes:
            wait_for(lambda node=node: len(node.agent.snapshot().nodes) == 3, what="3 nodes")
        create(nodes[0])
        before = wait_for(lambda: state_on(nodes[0]), what="the partition")
        leases = {node.agent.node_id: node.agent.lease.id for node in nodes if node.agent.lease is not None}
        backend.process.pause()
        try:
            for node in nodes:
                wait_for(lambda node=node: node.of(LeaseLost), what="every node counts its lease lost")
            time.sleep(6.0)  # the fault's length: the nodes' retries spread out, as in a long outage
        finally:
            backend.process.resume()

        def settled() -> bool:
            agents = [node.agent for node in nodes]
            back = all(
                a.registered.is_set() and a.lease is not None and a.lease.id != leases[a.node_id] for a in agents
            )
            controllers = [a for a in agents if a.is_controller]
            return back and len(controllers) == 1 and "repair" not in controllers[0]._pending_steps

        wait_for(settled, what="every node registered again and the controller's repair pass done")
        for node in nodes:
            after = state_on(node)
            assert after is not None and (after.leader, after.leader_epoch, after.isr) == (
                before.leader,
                before.leader_epoch,
                before.isr,
            ), after


# --- real processes, kill -9 -------------------------------------------------

NODE_SCRIPT = """
import sys, threading
from conveyor.broker.cluster.agent import ClusterAgent
from conveyor.broker.cluster.events import ClusterSettings, Registered
endpoint, node, lease_ms = sys.argv[1], sys.argv[2], int(sys.argv[3])
woken = threading.Event()
settings = ClusterSettings((endpoint,), node, "tcp://127.0.0.1:1", cluster_name="test", lease_ms=lease_ms)
agent = ClusterAgent(settings, wake=woken.set)
agent.start()
while not any(isinstance(e, Registered) for e in agent.poll()):
    woken.wait()
    woken.clear()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class Observer:
    """A watch of the cluster prefix in the test process, stamping when each event arrived."""

    seen: list[tuple[float, WatchEvent]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, event: WatchEvent) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), event))

    def first(
        self, key: str, kind: str, check: Callable[[WatchEvent], bool] | None = None, after: float = 0.0
    ) -> float | None:
        with self.lock:
            for at, event in self.seen:
                wanted = at >= after and event.kv.key == key and event.kind == kind
                if wanted and (check is None or check(event)):
                    return at
        return None


def start_node(endpoint: str, node: str, lease_ms: int = 2000) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, endpoint, node, str(lease_ms)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the node says it registered (or dies)
    assert line.strip() == "ready", f"node {node} did not start"
    return proc


@pytest.fixture
def processes() -> Iterator[dict[str, subprocess.Popen[str]]]:
    procs: dict[str, subprocess.Popen[str]] = {}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def kill_the_leader(
    raw: Etcd, observer: Observer, procs: dict[str, subprocess.Popen[str]], tp: TopicPartition = TP
) -> tuple[float, float]:
    """kill -9 the partition's leader; (seconds from the kill, from its key's DELETE) to the record naming another."""
    kv = raw.get(KEYS.partition(tp))
    assert kv is not None
    before = k.decode_partition(kv.key, kv.value)
    assert before.leader is not None
    killed_at = time.monotonic()
    os.kill(procs[before.leader].pid, signal.SIGKILL)
    procs[before.leader].wait(30)

    def elected(event: WatchEvent) -> bool:
        return k.decode_partition(event.kv.key, event.kv.value).leader_epoch == before.leader_epoch + 1

    moved_at = wait_for(lambda: observer.first(KEYS.partition(tp), "PUT", elected, killed_at), what="a new leader")
    gone_at = observer.first(KEYS.node(before.leader), "DELETE", after=killed_at)
    assert gone_at is not None and gone_at <= moved_at
    after = k.decode_partition(kv.key, raw.get(KEYS.partition(tp)).value)  # type: ignore[union-attr]
    assert after.leader in before.isr and after.leader != before.leader
    return moved_at - killed_at, moved_at - gone_at


def test_a_leader_killed_with_9_is_replaced_from_the_isr(
    backend: Backend, processes: dict[str, subprocess.Popen[str]]
) -> None:
    raw = backend.client()
    observer = Observer()
    raw.watch(KEYS.prefix, start_revision=1, on_event=observer, on_resync=lambda revision: None)
    endpoint = backend.endpoints[0]
    for node in "abc":
        processes[node] = start_node(endpoint, node)
    wait_for(lambda: len(raw.get_prefix(KEYS.nodes)[0]) == 3, what="3 nodes")
    raw.put(KEYS.create_request("orders"), k.encode_create(CreateRequest("test")))
    wait_for(lambda: raw.get(KEYS.partition(TP)), what="the topic")
    total, reaction = kill_the_leader(raw, observer, processes)
    print(f"failover: kill -9 -> new record {total:.2f} s; key DELETE -> new record {reaction * 1000:.0f} ms")
    wait_for(lambda: len(raw.get_prefix(KEYS.nodes)[0]) == 2, what="2 nodes")


def test_a_key_left_by_a_previous_run_is_taken_over(backend: Backend) -> None:
    raw = backend.client()
    old_lease = raw.grant(600)  # the previous run's lease, still alive for minutes
    raw.put(KEYS.node("a"), b'{"advertise": "tcp://old:1"}', lease=old_lease)
    with started([make(backend, "a", lease_ms=1000)]) as (node,):
        wait_for(lambda: node.agent.registered.is_set(), what="registered")
        kv = raw.get(KEYS.node("a"))
        assert kv is not None and node.agent.lease is not None
        assert kv.lease == node.agent.lease.id and b"old" not in kv.value
    # closed without revoking: the key goes with the new lease's short TTL, not the old one's
    wait_for(lambda: raw.get(KEYS.node("a")) is None, what="the key to go after the new lease's TTL")


def test_a_create_asked_before_any_controller_is_done_by_the_first_one(backend: Backend) -> None:
    raw = backend.client()
    raw.put(KEYS.create_request("orders"), k.encode_create(CreateRequest("someone", 1)))
    with started([make(backend, "a")]) as (node,):
        state = wait_for(lambda: state_on(node), what="the partition")
        assert state == PartitionState(("a",), "a", 1, ("a",))
        wait_for(lambda: raw.get(KEYS.create_request("orders")) is None, what="the request consumed")
