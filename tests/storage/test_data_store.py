"""The Store: topics in the data directory and atomically written group offsets."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from conveyor.broker.log import durable
from conveyor.broker.log.data_dir import GROUPS_FILE, TOPIC_FILE, Store, check_name
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.log.memory_log import MemoryLog

from conveyor.errors import ConfigError, InvalidName, StorageIOError, TopicExists, UnknownTopic
from tests.storage.storage_helpers import crash_store, random_body


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


def test_create_list_and_reopen_topics(data_dir):
    store = Store(data_dir)
    store.create_topic("orders", segment_bytes=4096)
    store.create_topic("b.c-d_e")
    assert sorted(store.logs) == ["b.c-d_e", "orders"]
    assert isinstance(store.topic("orders"), FileLog)
    store.close()

    reopened = Store(data_dir)

    assert sorted(log.name for log in reopened) == ["b.c-d_e", "orders"]
    assert reopened.topic("orders").config.segment_bytes == 4096
    assert json.loads((data_dir / "topics" / "orders" / TOPIC_FILE).read_text())["segment_bytes"] == 4096


def test_topic_data_survives_reopen(data_dir):
    store = Store(data_dir)
    body = random_body(random.Random(1), 3)
    store.create_topic("t").append(body, 3)
    store.close()

    log = Store(data_dir).topic("t")

    assert (log.end_offset, bytes(log.read(0)[0].body)) == (3, body)


def test_creating_an_existing_topic_fails(data_dir):
    store = Store(data_dir)
    store.create_topic("t")
    with pytest.raises(TopicExists):
        store.create_topic("t")


def test_get_or_create_returns_the_same_log(data_dir):
    store = Store(data_dir)
    assert store.get_or_create("t") is store.get_or_create("t")


def test_delete_topic_removes_its_files_and_groups(data_dir):
    # Given a topic with data and a group offset
    store = Store(data_dir)
    store.create_topic("t").append(random_body(random.Random(0), 1), 1)
    store.commit_offsets({("t", "g"): 1})
    store.sync()
    # When it is deleted
    store.delete_topic("t")
    # Then it is gone, on disk too, and a new topic of that name starts empty
    assert "t" not in store.logs
    assert not (data_dir / "topics" / "t").exists()
    with pytest.raises(UnknownTopic):
        store.topic("t")
    crash_store(store)
    reopened = Store(data_dir)
    assert reopened.logs == {}
    fresh = reopened.create_topic("t")
    assert (fresh.end_offset, reopened.group("t", "g")) == (0, None)


def test_unknown_topic(data_dir):
    with pytest.raises(UnknownTopic):
        Store(data_dir).topic("nope")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../etc", "a b", "ü", "x" * 201, "t\n", None, 5])
def test_invalid_names_are_rejected(data_dir, name):
    store = Store(data_dir)
    with pytest.raises(InvalidName) as info:
        store.create_topic(name)
    assert info.value.code == 206
    assert not any((data_dir / "topics").iterdir())


def test_the_longest_valid_name_is_accepted():
    assert check_name("x" * 200) == "x" * 200


def test_group_offsets_persist_across_reopen(data_dir):
    store = Store(data_dir)
    store.create_topic("t")
    store.commit_offsets({("t", "g1"): 10, ("t", "g2"): 3})
    store.save_group("t", "g3", {"committed_offset": 7, "max_deliveries": 5})
    store.sync()
    crash_store(store)

    reopened = Store(data_dir)

    assert reopened.group("t", "g1") == {"committed_offset": 10}
    assert reopened.group("t", "g2") == {"committed_offset": 3}
    assert reopened.group("t", "g3") == {"committed_offset": 7, "max_deliveries": 5}


def test_group_offsets_not_synced_are_not_on_disk(data_dir):
    store = Store(data_dir)
    store.create_topic("t")
    store.commit_offsets({("t", "g"): 10})
    store.sync()
    store.commit_offsets({("t", "g"): 20})  # staged, never synced: a crash now keeps 10
    crash_store(store)

    assert Store(data_dir).group("t", "g") == {"committed_offset": 10}


def test_deleted_group_is_gone_after_reopen(data_dir):
    store = Store(data_dir)
    store.create_topic("t")
    store.commit_offsets({("t", "g"): 1})
    store.sync()
    store.delete_group("t", "g")
    store.sync()
    crash_store(store)
    assert Store(data_dir).group("t", "g") is None


def test_group_write_is_atomic_when_the_rename_fails(data_dir, monkeypatch):
    # Given offsets already on disk
    store = Store(data_dir)
    store.create_topic("t")
    store.commit_offsets({("t", "g"): 10})
    store.sync()
    groups = data_dir / "topics" / "t" / GROUPS_FILE
    before = groups.read_bytes()
    # When the next write dies before the rename (as a crash would)
    store.commit_offsets({("t", "g"): 20})

    def no_rename(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(StorageIOError):
        store.sync()
    monkeypatch.undo()
    # Then the old file is intact and a reopen sees the old offset
    assert groups.read_bytes() == before
    crash_store(store)
    assert Store(data_dir).group("t", "g") == {"committed_offset": 10}


def test_a_leftover_temp_file_does_not_matter(data_dir):
    store = Store(data_dir)
    store.create_topic("t")
    store.commit_offsets({("t", "g"): 4})
    store.sync()
    (data_dir / "topics" / "t" / f".{GROUPS_FILE}.tmp").write_bytes(b'{"g": {"committed_off')
    crash_store(store)

    assert Store(data_dir).group("t", "g") == {"committed_offset": 4}


def test_atomic_write_fsyncs_the_file_and_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    durable.atomic_write(tmp_path / "f.json", b"{}")

    assert (tmp_path / "f.json").read_bytes() == b"{}"
    assert len(synced) == 2 and synced[1] == str(tmp_path)
    assert synced[0].startswith(str(tmp_path / ".f.json.")) and synced[0].endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_memory_topics_are_not_persisted(data_dir):
    # Given a memory topic with data and a group offset
    store = Store(data_dir)
    log = store.create_topic("mem", storage="memory")
    log.append(random_body(random.Random(0), 2), 2)
    store.commit_offsets({("mem", "g"): 2})
    store.close()
    # Then nothing of it is on disk, and a reopened store does not know it
    assert isinstance(log, MemoryLog)
    assert not (data_dir / "topics" / "mem").exists()
    assert "mem" not in Store(data_dir).logs


def test_unknown_storage_backend_is_refused_before_anything_is_written(data_dir):
    with pytest.raises(ConfigError, match="storage"):
        Store(data_dir).create_topic("t", storage="tape")
    assert not (data_dir / "topics" / "t").exists()


def test_store_sync_makes_every_dirty_log_durable(data_dir):
    store = Store(data_dir, fsync="batch")
    a, b = store.create_topic("a"), store.create_topic("b")
    a.append(random_body(random.Random(0), 1), 1)
    b.append(random_body(random.Random(1), 2), 2)
    assert (a.durable_offset, b.durable_offset) == (0, 0)
    store.sync()
    assert (a.durable_offset, b.durable_offset) == (1, 2)


def test_a_deletion_cut_by_a_crash_does_not_bring_the_topic_back(data_dir, monkeypatch):
    # Given a topic of two segments, and a process that dies after removing the first of them
    store = Store(data_dir)
    log = store.create_topic("t", segment_bytes=1024)
    while log.segment_count() < 2:
        log.append(random_body(random.Random(0), 3), 3)
    store.sync()
    store.commit_offsets({("t", "g"): 1})
    store.sync()

    def dies_midway(path, ignore_errors=False):
        next(iter(sorted(path.glob("*.log")))).unlink()
        raise KeyboardInterrupt("the process dies here")

    monkeypatch.setattr(shutil, "rmtree", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        store.delete_topic("t")
    monkeypatch.undo()
    crash_store(store)
    # When the data directory opens again
    reopened = Store(data_dir)
    # Then the topic stays deleted (no log with a hole), and nothing of it is left
    assert "t" not in reopened.logs and reopened.group("t", "g") is None
    assert sorted(p.name for p in (data_dir / "topics").iterdir()) == []
    assert reopened.create_topic("t").end_offset == 0


def test_a_deleted_topic_leaves_nothing_behind(data_dir):
    store = Store(data_dir)
    store.create_topic("t").append(random_body(random.Random(0), 1), 1)
    store.delete_topic("t")
    assert list((data_dir / "topics").iterdir()) == []


def test_a_read_outside_a_partition_log_names_the_topic_and_partition_never_the_log(data_dir):
    """A user reads partition 3 of orders; the error said 'of orders#3' (the broker's name for the log)."""
    from conveyor.errors import OffsetOutOfRange

    store = Store(data_dir)
    for name in ("orders", "orders#3"):
        store.create_topic(name).append(random_body(random.Random(1), 2), 2)
    with pytest.raises(OffsetOutOfRange) as raised:
        store.topic("orders#3").read(5)
    assert raised.value.message == "offset 5 is outside [0, 2] of orders partition 3"
    assert raised.value.fields == {"topic": "orders", "partition": 3, "offset": 5, "start_offset": 0, "end_offset": 2}
    with pytest.raises(OffsetOutOfRange) as plain:
        store.topic("orders").read(5)
    assert plain.value.message == "offset 5 is outside [0, 2] of orders" and "partition" not in plain.value.fields
    store.close()
