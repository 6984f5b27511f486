"""kill -9 of the broker at random moments under confirmed load from several producers.

Each cycle: producers (threads, each with its own Producer) and a consumer
group run; once new confirms arrive, the broker is killed with SIGKILL at a
random moment and restarted on the same port and data. At the end the whole
topic is read (FETCH) and the group drained, and both are compared with what
was confirmed: nothing lost, nothing stored twice (idempotent producers), the
group saw every offset (re-deliveries counted: at-least-once).
"""

from __future__ import annotations

import random
import time

import pytest

from tests.faults.fault_helpers import Load, consumers, drain_group, fetch_all, judge, judge_group, report, soak_seconds
from tests.helpers import wait_for

TOPIC = "chaos"


def kill_loop(brokers, *, fsync: str, kills: int, seconds: float, seed: int, name: str) -> None:
    rng = random.Random(seed)
    broker = brokers.start(fsync=fsync, extra=["--heartbeat-ms", "500", "--segment-bytes", str(256 * 1024)])
    started = time.monotonic()
    done = 0
    with Load(broker.address, TOPIC, producers=3, chunk=25) as load, consumers(broker.address, TOPIC, "g") as group:
        while done < kills and time.monotonic() - started < seconds:
            before = load.confirmed_count
            assert wait_for(lambda b=before: load.confirmed_count > b + 10, timeout=20), (
                f"no confirmed load after kill {done}:\n{load.describe()}\n" + "".join(broker.output[-5:])
            )
            time.sleep(rng.uniform(0.0, 0.6))
            broker.restart(kill=True)
            done += 1
        # Let the producers finish what they have in flight against a live broker.
        assert wait_for(lambda: load.confirmed_count > 0, timeout=5)
        load.stop()
        assert not load.failures(), f"sends failed for good: {load.failures()[:3]}"
        assert drain_group(broker.address, TOPIC, "g", group, timeout=30), "the group did not catch up"
        time.sleep(0.3)
    stored = fetch_all(broker.address, TOPIC)
    verdict = judge(load.confirmed(), load.sent(), stored)
    members = judge_group(group, stored)
    report(
        name,
        fsync=fsync,
        kills=done,
        seconds=round(time.monotonic() - started, 1),
        **verdict.numbers(),
        group_delivered=members.delivered,
        group_duplicates=members.duplicates,
        group_missing=len(members.missing),
    )
    verdict.assert_safe()
    assert not members.missing, f"the group never got offsets {members.missing[:10]}"
    assert done >= min(kills, 3)


def test_kill_9_twenty_times_under_confirmed_load_loses_nothing(brokers):
    kill_loop(brokers, fsync="batch", kills=20, seconds=60, seed=1, name="kill9-batch")


@pytest.mark.parametrize("fsync", ["interval:20", "none"])
def test_kill_9_under_other_fsync_policies_loses_nothing(brokers, fsync):
    # A kill -9 leaves the page cache: even fsync=none keeps every confirmed message.
    kill_loop(brokers, fsync=fsync, kills=4, seconds=20, seed=2, name=f"kill9-{fsync}")


@pytest.mark.soak
@pytest.mark.parametrize("fsync", ["batch", "interval:20", "none"])
def test_soak_kill_9(brokers, fsync):
    share = {"batch": 0.4, "interval:20": 0.15, "none": 0.15}[fsync]
    kill_loop(brokers, fsync=fsync, kills=10_000, seconds=soak_seconds() * share, seed=7, name=f"soak-kill9-{fsync}")
