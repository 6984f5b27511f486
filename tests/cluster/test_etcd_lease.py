"""Leases against a real etcd: the keepalive thread, expiry after kill -9, revoke, and loss.

What etcd really does when it is down longer than the TTL (measured in the design spike and
asserted below): the holder's ``Lease`` reports ``lost`` once no refresh succeeded for a whole
TTL, but etcd itself renews every lease when it starts again, so the key is still there after
the restart and goes only one TTL later, since nobody refreshes it any more. A node that lost
its lease therefore acts as if its keys were gone, and revokes the old lease and grants a new one.
"""

from __future__ import annotations

import threading
import time

from conveyor.broker.cluster.etcd import Etcd, WatchEvent

from conveyor.etcd_process import EtcdProcess
from tests.cluster.etcd_helpers import Collected, start_holder
from tests.helpers import stays_false, wait_for

TTL = 2


class Losses:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.event = threading.Event()

    def __call__(self) -> None:
        self.calls.append(threading.current_thread().name)
        self.event.set()


def test_keepalive_keeps_the_key_for_three_ttls(etcd_client: Etcd) -> None:
    losses = Losses()
    lease = etcd_client.lease(TTL, on_lost=losses)
    etcd_client.put("/c/nodes/a", b"a", lease=lease.id)
    stays_false(lambda: etcd_client.get("/c/nodes/a") is None, 3 * TTL + 0.5, interval=0.2, message="key loss")
    assert not lease.lost.is_set() and losses.calls == []
    assert lease.refreshes >= 6
    lease.close()


def test_the_key_of_a_killed_holder_is_deleted_within_the_ttl(etcd: EtcdProcess, etcd_client: Etcd) -> None:
    collected = Collected()
    holder, lease_id, revision = start_holder(etcd.endpoint, "/c/nodes/b", TTL)
    etcd_client.watch("/c/nodes/", start_revision=revision + 1, on_event=collected.on_event, on_resync=print)
    killed = time.monotonic()
    holder.kill()
    holder.wait(30)
    assert collected.wait(1) == [("DELETE", "/c/nodes/b", b"")]
    took = time.monotonic() - killed
    # The last refresh came at most TTL/3 before the kill, and etcd sweeps expired leases every 0.5 s.
    assert took <= TTL + 1.5, f"the key went {took:.2f} s after kill -9 (TTL {TTL})"
    assert etcd_client.time_to_live(lease_id) == -1


def test_revoke_deletes_the_keys_at_once(etcd_client: Etcd) -> None:
    lease = etcd_client.lease(30, on_lost=Losses())
    etcd_client.put("/c/nodes/c", b"c", lease=lease.id)
    etcd_client.put("/c/controller", b"c", lease=lease.id)
    lease.revoke()
    assert etcd_client.get("/c/nodes/c") is None and etcd_client.get("/c/controller") is None
    assert not lease.lost.is_set()  # a revoke is not a loss
    lease.revoke()  # twice is harmless
    again = etcd_client.lease(30, on_lost=Losses())
    assert etcd_client._children == [again]  # the client forgets the ended one
    again.revoke()


def test_lost_when_etcd_says_the_lease_is_gone(etcd_client: Etcd) -> None:
    losses = Losses()
    lease = etcd_client.lease(TTL, on_lost=losses)
    etcd_client.revoke(lease.id)  # as if it had expired while this process was stopped
    assert lease.lost.wait(30)
    time.sleep(0.1)  # nothing to wait for: on_lost must not come twice
    assert losses.calls == [f"conveyor-lease-{lease.id:x}"]


def test_lost_when_etcd_is_paused_longer_than_the_ttl(etcd: EtcdProcess, etcd_client: Etcd) -> None:
    losses = Losses()
    lease = etcd_client.lease(TTL, on_lost=losses)
    etcd.pause()
    try:
        assert lease.lost.wait(30)
    finally:
        etcd.resume()
    assert len(losses.calls) == 1


def test_lost_when_etcd_is_down_longer_than_the_ttl_but_etcd_renews_the_lease(
    etcd: EtcdProcess, etcd_client: Etcd
) -> None:
    ttl = 4  # long enough that the renewed key is surely still there when the test looks, on a loaded box
    losses = Losses()
    lease = etcd_client.lease(ttl, on_lost=losses)
    etcd_client.put("/c/nodes/d", b"d", lease=lease.id)
    etcd.stop()
    assert lease.lost.wait(30) and len(losses.calls) == 1
    etcd.start()
    # etcd renewed the lease on its restart (by a whole TTL): the key is still there...
    kv = etcd_client.get("/c/nodes/d")
    assert kv is not None and kv.lease == lease.id
    # ...and nobody refreshes it now, so it goes one TTL later.
    deleted: list[WatchEvent] = []
    etcd_client.watch("/c/nodes/", start_revision=kv.mod_revision + 1, on_event=deleted.append, on_resync=print)
    wait_for(lambda: deleted, message="the key of the lost lease to go")
    assert [event.kind for event in deleted] == ["DELETE"]
    assert etcd_client.time_to_live(lease.id) == -1
