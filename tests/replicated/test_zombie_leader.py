"""A zombie leader: SIGSTOP the leader for longer than its lease while a producer publishes, then SIGCONT.

Another node takes over with a higher epoch. The old leader, woken, must confirm
nothing it did not have replicated: its waiting confirms fail NOT_LEADER (the
producer resends them to the new leader), it cuts the tail only it held, and it
rejoins as a follower. The oracle then compares the three replicas' logs.
"""

from __future__ import annotations

import signal
import time

import pytest
import zmq
from conveyor.broker.client.admin import Admin
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode, error_from_header

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import NotLeader
from tests.helpers import wait_for
from tests.replicated.fault_checks import Load, check_replicas, dumped, leader_of, wait_in_sync
from tests.replicated.replica_logs import records
from tests.replication.cluster_helpers import batch

STOPPED_FOR = 6.0  # seconds: three times the 2 s lease, and longer than the producer's request timeout


def zombie_round(cluster: ClusterProcess, load: Load, round_: int) -> tuple[bytes, str]:
    """SIGSTOP the leader past its lease under the load, SIGCONT it, check it.

    Returns the value of the publish the zombie refused (no replica may hold it) and a line of timings.
    """
    leader, epoch = leader_of(cluster, "orders")
    others = [node for node in cluster.node_ids if node != leader]
    wait_for(lambda: len(load.confirm_times) > 200 * (round_ + 1), timeout=60, message="confirms before the stop")
    poison = f"sent-to-the-zombie-{round_}".encode()
    cluster.node(leader).signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        new_leader, new_epoch = leader_of(cluster, "orders", other_than=leader, asking=others)
        elected_after = time.monotonic() - stopped_at
        assert new_epoch > epoch
        # A publish the zombie finds waiting when it wakes: it must never be confirmed (nothing replicates it).
        direct = zmq.Context.instance().socket(zmq.DEALER)
        direct.setsockopt(zmq.LINGER, 0)
        direct.connect(cluster.address(leader))
        direct.send_multipart(commands.publish("orders", batch(poison), rid=1))
        time.sleep(max(0.0, STOPPED_FOR - (time.monotonic() - stopped_at)))  # the fault's length, not a wait
    finally:
        cluster.node(leader).signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    try:
        assert direct.poll(60_000), "the zombie answers the publish it found waiting"
        answer = decode(direct.recv_multipart())
    finally:
        direct.close()
    assert answer.command is Command.ERROR, f"the zombie confirmed a publish after losing leadership: {answer}"
    refused = error_from_header(answer.header)
    assert isinstance(refused, NotLeader), refused
    wait_for(lambda: load.confirmed_since(resumed_at) > 200, timeout=90, message="confirms after SIGCONT")
    rejoined = wait_in_sync(cluster, "orders", leader)
    rejoined_after = time.monotonic() - resumed_at
    assert rejoined.leader != leader or rejoined.leader_epoch > new_epoch
    first_new = min(t for t in load.confirm_times if t > stopped_at)
    return poison, (
        f"zombie {leader}: new leader {new_leader} epoch {new_epoch} seen {elected_after:.2f} s after SIGSTOP; "
        f"first confirm after the stop at {first_new - stopped_at:.2f} s; {leader} back in the ISR "
        f"{rejoined_after:.2f} s after SIGCONT; its waiting publish: {refused.name}"
    )


def zombies(cluster: ClusterProcess, rounds: int) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("orders", replication_factor=3, min_insync_replicas=2)
    leader_of(cluster, "orders")
    # A short request timeout: resends go to the new leader before SIGCONT. About 30,000 sends a round.
    load = Load(cluster, "orders", request_timeout_ms=3000, limit=100_000 * rounds).start()
    with dumped(cluster, lines=150):
        poisons, lines = zip(*(zombie_round(cluster, load, round_) for round_ in range(rounds)), strict=True)
    confirmed = load.finish()
    print("\n" + "\n".join(lines) + f"\nzombie: {len(confirmed)} confirmed")
    woke = [line.strip() for node in cluster.node_ids for line in cluster.node(node).output if "diverged" in line]
    print("zombie: " + "\nzombie: ".join(woke))
    cluster.stop()
    counts = check_replicas(cluster, "orders", confirmed)
    for node in cluster.node_ids:
        held = {value for _, value in records(cluster.node(node).data_dir, "orders")}
        assert not set(poisons) & held, f"{node} holds a publish a zombie refused"
    print(f"zombie: records per replica {counts}")


def test_a_zombie_leader_confirms_nothing_after_losing_leadership_and_rejoins(cluster: ClusterProcess) -> None:
    zombies(cluster, rounds=1)


@pytest.mark.soak
def test_soak_zombie_leaders_one_after_another(cluster: ClusterProcess) -> None:
    zombies(cluster, rounds=8)
