"""Power loss: everything written but not fsynced since the last sync is dropped.

The broker runs with ``CONVEYOR_FSIO_JOURNAL`` set: ``broker/log/syscalls.py`` journals
each file's size at every successful fsync/fdatasync, each directory's
listing at every directory fsync, and what a failed fsync left in doubt.
After a kill -9, ``simulate_power_loss`` cuts every file back to its last
synced size, removes names never made durable in their directory, restores
files renamed over without a directory sync, and zeroes ranges a failed
fsync left in doubt. Then the broker restarts on what is left.

With ``fsync=batch`` every confirmed message must survive. With
``fsync=none`` confirmed messages are lost (that is the policy: the test
counts them), but the broker must come back with a consistent log.
"""

from __future__ import annotations

import random
import time

import pytest
from conveyor.broker.log.syscalls import ENV_JOURNAL, simulate_power_loss

from conveyor import Admin, Producer
from tests.faults.fault_helpers import Load, consumers, drain_group, fetch_all, judge, judge_group, report, soak_seconds
from tests.helpers import wait_for

TOPIC = "power"
ACK_TIMEOUT_MS = 300_000  # a lease that cannot run out while the group catches up


def group_state(address: str, group: list) -> str:
    """What to look at when the group does not catch up: the broker's view and the members' errors."""
    with Admin(address) as admin:
        described = admin.describe_group(TOPIC, "g")
        end = admin.describe_topic(TOPIC)["end_offset"]
    errors = [e for c in group for e in c.errors][-5:]
    return f"the group did not catch up: end {end}, group {described}, member errors {errors}"


def power_loss_cycles(brokers, tmp_path, *, fsync: str, cycles: int, seconds: float, seed: int, name: str):
    rng = random.Random(seed)
    journal = tmp_path / "fsio.journal"
    broker = brokers.start(
        fsync=fsync,
        extra=["--heartbeat-ms", "500", "--segment-bytes", str(64 * 1024), "--ack-timeout-ms", str(ACK_TIMEOUT_MS)],
        env={ENV_JOURNAL: str(journal)},
    )
    started = time.monotonic()
    done = dropped = removed = 0
    lost_per_cycle: list[int] = []
    lost_before: set = set()
    with Load(broker.address, TOPIC, producers=3, chunk=20) as load, consumers(broker.address, TOPIC, "g") as group:
        while done < cycles and time.monotonic() - started < seconds:
            before = load.confirmed_count
            assert wait_for(lambda b=before: load.confirmed_count > b + 10, timeout=60), "no confirmed load"
            time.sleep(rng.uniform(0.0, 0.5))
            broker.kill()
            confirmed_at_crash = load.confirmed()
            loss = simulate_power_loss(broker.data_dir, journal)
            dropped += loss.dropped_bytes
            removed += len(loss.removed)
            broker.restart(kill=True)
            done += 1
            if fsync == "none":
                stored = {v for _o, v in fetch_all(broker.address, TOPIC)}
                lost = {v for v in confirmed_at_crash if v not in stored}
                lost_per_cycle.append(len(lost - lost_before))
                lost_before = lost
        load.stop()
        assert not load.failures(), f"sends failed for good: {load.failures()[:3]}"
        # New messages still reach the group after the last power cut.
        with Producer(broker.address) as producer:
            producer.send(TOPIC, "after-the-last-cut").result(timeout=60)
        # Well inside the lease (ACK_TIMEOUT_MS): lost deliveries must not be what settles the group.
        assert drain_group(broker.address, TOPIC, "g", group, timeout=60), group_state(broker.address, group)
        time.sleep(0.3)
    stored = fetch_all(broker.address, TOPIC)
    sent = load.sent() | {"after-the-last-cut"}
    verdict = judge(load.confirmed(), sent, stored)
    members = judge_group(group, stored)
    report(
        name,
        fsync=fsync,
        power_cuts=done,
        dropped_bytes=dropped,
        removed_files=removed,
        **verdict.numbers(),
        lost_per_cut=lost_per_cycle,
        group_duplicates=members.duplicates,
        group_missing=len(members.missing),
    )
    assert not verdict.unexpected and verdict.log_duplicates == 0
    assert not members.missing, f"the group never got offsets {members.missing[:10]}"
    assert "after-the-last-cut" in {v for _o, v in stored}
    return verdict


def test_power_loss_with_fsync_batch_keeps_every_confirmed_message(brokers, tmp_path):
    verdict = power_loss_cycles(brokers, tmp_path, fsync="batch", cycles=6, seconds=40, seed=3, name="powerloss-batch")
    verdict.assert_safe()


def test_power_loss_with_fsync_none_loses_confirmed_messages_but_recovers(brokers, tmp_path):
    # fsync=none confirms right after the write: a power cut loses what the OS had not written back.
    power_loss_cycles(brokers, tmp_path, fsync="none", cycles=3, seconds=20, seed=4, name="powerloss-none")


@pytest.mark.soak
def test_soak_power_loss_batch(brokers, tmp_path):
    verdict = power_loss_cycles(
        brokers, tmp_path, fsync="batch", cycles=10_000, seconds=soak_seconds() * 0.15, seed=5, name="soak-powerloss"
    )
    verdict.assert_safe()


def test_a_group_ahead_of_the_log_after_a_power_cut_still_gets_new_messages(brokers, tmp_path):
    # Given fsync=none, a group that consumed and committed everything, and a power cut
    journal = tmp_path / "fsio.journal"
    broker = brokers.start(fsync="none", env={ENV_JOURNAL: str(journal)})
    with Producer(broker.address) as producer:
        for i in range(500):
            producer.send(TOPIC, f"old-{i}")
    with consumers(broker.address, TOPIC, "g", n=1) as group:
        assert drain_group(broker.address, TOPIC, "g", group, timeout=90)
        time.sleep(0.6)  # the committed offset (500) is written and fsynced, the log is not
    broker.kill()
    simulate_power_loss(broker.data_dir, journal)
    broker.restart(kill=True)
    stored_before = fetch_all(broker.address, TOPIC)
    # When new messages are published where the log now ends
    with Producer(broker.address) as producer:
        new = [f"new-{i}" for i in range(50)]
        offsets = [f.result(timeout=60) for f in [producer.send(TOPIC, v) for v in new]]
    # Then the group gets them, although its committed offset had been ahead of the log
    with consumers(broker.address, TOPIC, "g", n=1) as group:
        wait_for(lambda: len(group[0].deliveries) >= 50, timeout=60)
    got = {v for _o, v, _a in group[0].deliveries}
    report(
        "powerloss-none-group-ahead",
        stored_after_cut=len(stored_before),
        new_offsets=[offsets[0], offsets[-1]],
        delivered_new=len(got & set(new)),
    )
    assert set(new) <= got, f"the group skipped {len(set(new) - got)} new messages at offsets {offsets[0]}..."
