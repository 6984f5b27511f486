"""The offsets writer thread when writes fail, and what the Store does with a damaged ``groups.json``."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conveyor.broker.log import data_dir as store_module
from conveyor.broker.log import syscalls
from conveyor.broker.log.data_dir import GROUPS_FILE, OffsetWriter, Store

from conveyor.errors import ConveyorError, MetadataCorrupt, StorageFull, StorageIOError
from tests.helpers import wait_for


@pytest.fixture
def faults(tmp_path: Path) -> Iterator[Path]:
    """A control file for ``broker/syscalls.py``: write a fault spec into it to switch faults on."""
    control = tmp_path / "faults"
    syscalls.configure(control=str(control))
    yield control
    syscalls.configure()


class Errors:
    """What the writer reports through ``on_error``."""

    def __init__(self) -> None:
        self.seen: list[tuple[Path, ConveyorError]] = []

    def __call__(self, path: Path, error: ConveyorError) -> None:
        self.seen.append((path, error))

    def __len__(self) -> int:
        return len(self.seen)


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# --- the writer thread -----------------------------------------------------------------------------------


def test_a_failed_write_keeps_the_newest_data_and_is_retried_with_backoff(tmp_path, faults, caplog):
    # Given offsets writes that fail with EIO
    caplog.set_level(logging.WARNING, logger="conveyor.store")
    path = tmp_path / GROUPS_FILE
    errors = Errors()
    writer = OffsetWriter(on_error=errors, backoff=0.05, max_backoff=0.2)
    faults.write_text("write_eio,match=groups.json")
    try:
        # When data is submitted, fails, and newer data comes while it is failing
        writer.submit(path, b'{"g": 1}')
        assert wait_for(lambda: len(errors) >= 1)
        writer.submit(path, b'{"g": 2}')
        time.sleep(1.0)
        # Then it was retried, with a backoff (no busy loop), counted each time and logged once
        failures = len(errors)
        assert 3 <= failures <= 15, f"{failures} attempts in about a second"
        assert all(isinstance(e, StorageIOError) and p == path for p, e in errors.seen)
        assert not path.exists()
        assert len(messages(caplog, "cannot write offsets file")) == 1
        # And once writes work again the newest data reaches the disk, and the streak ends
        faults.write_text("")
        assert wait_for(lambda: path.exists() and path.read_bytes() == b'{"g": 2}')
        assert wait_for(lambda: len(messages(caplog, "written again after")) == 1)  # logged just after the write
        settled = len(errors)
        time.sleep(0.3)
        assert len(errors) == settled
        # And a new failure starts a new streak: logged again
        faults.write_text("write_enospc=1,match=groups.json")
        writer.submit(path, b'{"g": 3}')
        assert wait_for(lambda: path.read_bytes() == b'{"g": 3}')
        assert isinstance(errors.seen[-1][1], StorageFull)
        assert len(messages(caplog, "cannot write offsets file")) == 2
        assert wait_for(lambda: len(messages(caplog, "written again after")) == 2)
    finally:
        faults.write_text("")
        writer.close()


def test_data_submitted_during_a_failing_write_is_not_overwritten_by_the_older_data(tmp_path, monkeypatch):
    # Given a write of older data that fails while newer data is submitted
    path = tmp_path / GROUPS_FILE
    writing, fail_now = threading.Event(), threading.Event()
    real_write = store_module.atomic_write

    def write(target: Path, data: bytes) -> None:
        if data == b"old":
            writing.set()
            fail_now.wait(5)
            raise StorageIOError("injected")
        real_write(target, data)

    monkeypatch.setattr(store_module, "atomic_write", write)
    writer = OffsetWriter(backoff=0.01, max_backoff=0.01)
    try:
        writer.submit(path, b"old")
        assert writing.wait(5)
        writer.submit(path, b"new")
        fail_now.set()
        # Then the newer data is written, and the failed older data is never retried over it
        assert wait_for(lambda: path.exists())
        time.sleep(0.2)
        assert path.read_bytes() == b"new"
    finally:
        writer.close()


def test_flush_tries_a_failing_file_at_once_raises_and_keeps_it_pending(tmp_path, faults):
    # Given a file failing to be written, and a backoff far longer than the test
    path = tmp_path / GROUPS_FILE
    errors = Errors()
    writer = OffsetWriter(on_error=errors, backoff=60, max_backoff=60)
    faults.write_text("fsync_eio,match=groups.json")
    try:
        writer.submit(path, b"1")
        assert wait_for(lambda: len(errors) == 1)
        # When flush() is called, it tries the file now (not after the backoff) and says it failed
        started = time.monotonic()
        with pytest.raises(StorageIOError):
            writer.flush()
        with pytest.raises(StorageIOError):
            writer.flush()
        assert time.monotonic() - started < 5
        assert len(errors) == 3
        # Then the data is still pending: the next flush, with the fault gone, writes it
        faults.write_text("")
        writer.flush()
        assert path.read_bytes() == b"1"
    finally:
        writer.close()


def test_close_does_not_wait_for_a_file_that_keeps_failing(tmp_path, faults):
    writer = OffsetWriter(backoff=60, max_backoff=60)
    faults.write_text("write_eio,match=groups.json")
    writer.submit(tmp_path / GROUPS_FILE, b"1")
    started = time.monotonic()
    with pytest.raises(StorageIOError):
        writer.flush()
    writer.close()
    assert time.monotonic() - started < 5


def test_the_store_counts_failed_offsets_writes_per_topic(tmp_path, faults):
    # Given a store with a counter, and offsets writes of topic t failing
    counted: list[str] = []

    class Counter:
        def labels(self, topic: str) -> Counter:
            counted.append(topic)
            return self

        def inc(self) -> None:
            pass

    store = Store(tmp_path / "data", offsets_write_errors=Counter())
    store.create_topic("t")
    faults.write_text("write_eio,match=groups.json")
    store.commit_offsets({("t", "g"): 5})
    # When the broker's loop hands the offsets over (without waiting), nothing is raised to it
    store.write_groups(wait=False)
    assert wait_for(lambda: counted == ["t"])
    # Then they reach the disk once writes work again, without anything else moving
    faults.write_text("")
    groups = tmp_path / "data" / "topics" / "t" / GROUPS_FILE
    assert wait_for(lambda: groups.exists() and json.loads(groups.read_text()) == {"g": {"committed_offset": 5}})
    store.close()


def test_offsets_of_a_deleted_topic_are_dropped_and_the_writer_goes_on(tmp_path, faults):
    # Given offsets of topic t failing to be written, then t deleted
    store = Store(tmp_path / "data")
    store.create_topic("t")
    store.create_topic("u")
    faults.write_text("rename_eio,match=t/groups.json")
    store.commit_offsets({("t", "g"): 1})
    with pytest.raises(StorageIOError):
        store.sync()
    store.delete_topic("t")
    faults.write_text("")
    # Then the writer still writes the other topics' offsets, and a file whose directory is gone is dropped
    store.commit_offsets({("u", "g"): 2})
    store.sync()
    assert store.group("u", "g") == {"committed_offset": 2}
    writer = OffsetWriter()
    writer.submit(tmp_path / "gone" / GROUPS_FILE, b"{}")
    writer.flush()
    writer.close()
    store.close()
    assert Store(tmp_path / "data").group("u", "g") == {"committed_offset": 2}


# --- a damaged groups.json ----------------------------------------------------------------------------------


CORRUPTIONS = {
    "garbage": (b"\xff\xfe\x00garbage", "not valid JSON"),
    "cut-json": (b'{"g": {"committed_off', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "not-an-object": (b"[1, 2]", "expected a JSON object, found an array"),
    "group-not-an-object": (b'{"g": 7}', "group 'g' is an integer, not an object"),
    "offset-a-string": (b'{"g": {"committed_offset": "12"}}', "committed_offset must be an integer"),
    "offset-negative": (b'{"g": {"committed_offset": -4}}', "committed_offset -4 is negative"),
    "bad-group-name": (b'{"a/b": {"committed_offset": 1}}', "is not a valid group name"),
    "flag-not-a-bool": (b'{"g": {"committed_offset": 1, "key_affinity": 1}}', "key_affinity must be a boolean"),
}


def damaged_store(data_dir: Path, content: bytes) -> Path:
    store = Store(data_dir)
    store.create_topic("t")
    store.create_topic("u")
    store.commit_offsets({("t", "g"): 3, ("u", "g"): 4})
    store.close()
    groups = data_dir / "topics" / "t" / GROUPS_FILE
    groups.write_bytes(content)
    return groups


@pytest.mark.parametrize("content,says", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_a_damaged_groups_file_is_refused_naming_the_file_and_what_is_wrong(tmp_path, content, says):
    groups = damaged_store(tmp_path / "data", content)
    with pytest.raises(MetadataCorrupt) as refused:
        Store(tmp_path / "data")
    message = str(refused.value)
    assert message.startswith(f"[METADATA_CORRUPT] {groups}: ")
    assert says in message and "--quarantine" in message
    assert "\n" not in message
    assert refused.value.fields["path"] == str(groups)
    assert groups.read_bytes() == content  # untouched


def test_with_quarantine_a_damaged_groups_file_is_moved_aside_and_its_groups_forgotten(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="conveyor.store")
    groups = damaged_store(tmp_path / "data", b"\x00" * 40)
    store = Store(tmp_path / "data", quarantine=True)
    assert store.groups["t"] == {}
    assert store.group("u", "g") == {"committed_offset": 4}  # other topics keep theirs
    assert not groups.exists()
    assert (groups.parent / "quarantine" / GROUPS_FILE).read_bytes() == b"\x00" * 40
    assert len(messages(caplog, "quarantined corrupt offsets file")) == 1
    # A second damaged file later does not overwrite the first one kept aside
    store.commit_offsets({("t", "g"): 9})
    store.close()
    groups.write_bytes(b"{")
    Store(tmp_path / "data", quarantine=True).close()
    assert (groups.parent / "quarantine" / f"{GROUPS_FILE}.1").read_bytes() == b"{"
    assert (groups.parent / "quarantine" / GROUPS_FILE).read_bytes() == b"\x00" * 40
