"""Directories the broker creates survive a power cut: each new entry is fsynced in its parent.

A new directory is a name in its parent directory; until the parent is
fsynced a power cut can lose it, and with it everything inside (fsyncs of the
files inside do not make their directory's entry durable). The broker runs
with ``CONVEYOR_FSIO_JOURNAL``, which records the listing of every directory
fsync; every directory the broker created must appear, with its inode, in a
journaled listing of its parent.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.broker.log.syscalls import ENV_JOURNAL, read_journal, simulate_power_loss

from conveyor import Admin, Producer
from tests.faults.fault_helpers import fetch_all, report


def durable_listings(journal: Path) -> dict[str, dict[str, int]]:
    """Each directory's last fsynced listing (name -> inode), by path."""
    return {e["path"]: e["entries"] for e in read_journal(journal) if e["op"] == "dirsync"}


def not_durable(directories: list[Path], journal: Path) -> list[str]:
    listings = durable_listings(journal)
    missing = []
    for directory in directories:
        real = directory.resolve()
        if listings.get(str(real.parent), {}).get(real.name) != real.stat().st_ino:
            missing.append(f"{directory} is not in a synced listing of {directory.parent}")
    return missing


def test_every_directory_the_broker_creates_is_synced_in_its_parent(brokers, tmp_path):
    # Given a broker on a data directory that does not exist yet (nor does its parent)
    journal = tmp_path / "fsio.journal"
    data_dir = tmp_path / "new" / "data"
    broker = brokers.start(data_dir=data_dir, env={ENV_JOURNAL: str(journal)})
    # When topics are created, by ADMIN and by a first publish, and the power goes
    with Admin(broker.address) as admin:
        admin.create_topic("made")
    with Producer(broker.address) as producer:
        assert producer.send("auto", "first").result(timeout=10) == 0
    broker.kill()
    topics = data_dir / "topics"
    created = [tmp_path / "new", data_dir, topics, topics / "made", topics / "auto"]
    # Then each of them was durable in its parent before anything was confirmed in it
    assert not_durable(created, journal) == []
    # And after the power cut the broker comes back with both topics and the confirmed message
    loss = simulate_power_loss(data_dir, journal)
    broker.restart(kill=True)
    with Admin(broker.address) as admin:
        assert {"made", "auto"} <= {t["name"] for t in admin.list_topics()}
    assert fetch_all(broker.address, "auto") == [(0, "first")]
    report("durable-directories", directories=len(created), removed_by_power_cut=len(loss.removed))
