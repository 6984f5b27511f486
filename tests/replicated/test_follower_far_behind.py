"""A follower killed with -9 and restarted far behind, and ``min_insync_replicas`` enforced while it is away.

Two topics: ``bulk`` (RF 3, min_insync 2) takes 50,000 messages while the
follower is dead; ``strict`` (RF 3, min_insync 3) must refuse publishes with
NOT_ENOUGH_REPLICAS and confirm nothing until the follower is back in sync.
"""

from __future__ import annotations

import time

import pytest
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.producer import Producer
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import error_from_header

from conveyor.cluster_process import ClusterProcess
from conveyor.errors import NotEnoughReplicas
from tests.helpers import wait_for
from tests.replicated.fault_checks import check_replicas, leader_of, partition, wait_in_sync
from tests.replication.cluster_helpers import batch, request

BEHIND = 50_000  # messages published while the follower is dead


def test_a_follower_restarted_far_behind_catches_up_and_min_insync_3_confirms_nothing_without_it(
    cluster: ClusterProcess,
) -> None:
    with Admin(cluster.bootstrap) as admin:
        admin.create_topic("bulk", replication_factor=3, min_insync_replicas=2)
        admin.create_topic("strict", replication_factor=3, min_insync_replicas=3)
    bulk_leader, _ = leader_of(cluster, "bulk")
    strict_leader, _ = leader_of(cluster, "strict")
    victim = next(node for node in cluster.node_ids if node not in (bulk_leader, strict_leader))
    live = [node for node in cluster.node_ids if node != victim]
    with Producer(cluster.bootstrap) as producer:
        producer.send("strict", b"before").result(60)
        producer.send("bulk", b"before").result(60)

    cluster.node(victim).kill()
    killed_at = time.monotonic()
    for topic in ("bulk", "strict"):
        wait_for(
            lambda t=topic: (p := partition(cluster, t, live)) is not None and victim not in p.isr,
            timeout=60,
            message=f"{victim} out of the in-sync set of {topic}",
        )
    shrunk_after = time.monotonic() - killed_at

    # A raw PUBLISH to the leader: refused, retriable, nothing appended.
    answer = request(cluster.address(strict_leader), commands.publish("strict", batch(b"refused"), rid=1))
    refused = error_from_header(answer.header)
    assert isinstance(refused, NotEnoughReplicas) and refused.code == 602 and refused.retriable, refused
    # A producer with a short delivery timeout fails with the same class.
    short = Producer(cluster.bootstrap, delivery_timeout_ms=1500, request_timeout_ms=1000)
    with pytest.raises(NotEnoughReplicas):
        short.send("strict", b"too-soon").result(30)
    short.close()

    # A patient producer keeps sending to strict: none of these may be confirmed while the follower is dead.
    patient = Producer(cluster.bootstrap, delivery_timeout_ms=300_000, linger_ms=1)
    confirm_times: list[float] = []
    waiting = []
    for i in range(20):
        future = patient.send("strict", f"strict-{i}".encode())
        future.add_done_callback(lambda f: f.exception() or confirm_times.append(time.monotonic()))
        waiting.append((f"strict-{i}".encode(), future))

    started = time.monotonic()
    with Producer(cluster.bootstrap, linger_ms=5, delivery_timeout_ms=180_000) as producer:
        futures = [(f"bulk-{i}".encode(), producer.send("bulk", f"bulk-{i}".encode())) for i in range(BEHIND)]
        producer.flush(180)
        bulk = {future.result(60): value for value, future in futures}
    published_in = time.monotonic() - started
    assert len(bulk) == BEHIND
    assert partition(cluster, "bulk", live).leader == bulk_leader  # nothing moved: the fault was a follower's
    assert not confirm_times, f"{len(confirm_times)} strict publishes confirmed below min_insync_replicas"
    assert not any(future.done() for _, future in waiting)

    restarted_at = time.monotonic()
    cluster.node(victim).restart(kill=True)  # kill: a no-op; restart retries while the port is still taken
    wait_in_sync(cluster, "bulk", victim)
    caught_up_after = time.monotonic() - restarted_at
    wait_in_sync(cluster, "strict", victim)
    strict = {future.result(120): value for value, future in waiting}  # confirms resume once it is back
    resumed_after = min(confirm_times) - restarted_at
    assert all(t > restarted_at for t in confirm_times)
    strict[patient.send("strict", b"after").result(60)] = b"after"
    patient.close()

    print(
        f"\nfollower: {victim} out of both ISRs {shrunk_after:.2f} s after kill -9; {BEHIND} published in "
        f"{published_in:.1f} s while it was dead; back in bulk's ISR {caught_up_after:.2f} s after restart; "
        f"strict confirms resumed {resumed_after:.2f} s after restart"
    )
    cluster.stop()
    print(f"follower: bulk records per replica {check_replicas(cluster, 'bulk', bulk)}")
    print(f"follower: strict records per replica {check_replicas(cluster, 'strict', strict)}")
