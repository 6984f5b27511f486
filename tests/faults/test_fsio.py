"""The fault layer itself: fault specs, and the power-loss model on small files."""

from __future__ import annotations

import errno
import os

import pytest
from conveyor.broker.log import syscalls


def dirsync(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syscalls.fsync(fd)
    finally:
        os.close(fd)


@pytest.fixture
def layer(tmp_path):
    journal = tmp_path / "journal"
    control = tmp_path / "control"
    syscalls.configure(journal=str(journal), control=str(control))
    yield journal, control
    syscalls.configure()


def test_specs_parse_counts_skips_matches_and_comments():
    plan = syscalls.FaultPlan.parse("fsync_eio_after=2, write_eio=1,match=.log # the log only\nrename_eio")
    assert plan.match == ".log"
    assert plan.faults["fsync_eio"] == syscalls.Fault(remaining=syscalls.ALWAYS, skip=2)
    assert plan.faults["write_eio"] == syscalls.Fault(remaining=1)
    assert [plan.fire("fsync_eio", "a.log") for _ in range(4)] == [False, False, True, True]
    assert not plan.fire("write_eio", "groups.json")
    assert [plan.fire("write_eio", "a.log") for _ in range(2)] == [True, False]
    with pytest.raises(ValueError):
        syscalls.FaultPlan.parse("fsync_sometimes")


def test_without_test_aids_the_calls_are_the_os_calls(tmp_path, monkeypatch):
    syscalls.configure()
    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(fd))  # looked up at call time
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert syscalls.writev(fd, [b"ab", b"c"]) == 3
        syscalls.fdatasync(fd)
        assert calls == [fd]
    finally:
        os.close(fd)


def test_the_control_file_switches_faults_at_runtime(tmp_path, layer):
    _journal, control = layer
    fd = os.open(tmp_path / "data.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        control.write_text("torn_write=1,match=data.log")
        with pytest.raises(OSError) as failed:
            syscalls.writev(fd, [b"x" * 10])
        assert failed.value.errno == errno.EIO
        assert os.fstat(fd).st_size == 5  # half of it reached the file
        assert syscalls.write(fd, b"y" * 4) == 4  # the fault was for one call
        control.write_text("short_write")
        assert syscalls.write(fd, b"z" * 8) == 4
        control.write_text("")
        assert syscalls.write(fd, b"z" * 8) == 8
    finally:
        os.close(fd)
    assert syscalls.injected() == {"torn_write": 1, "short_write": 1}


def test_power_loss_keeps_what_was_synced_and_drops_the_rest(tmp_path, layer):
    journal, _control = layer
    root = tmp_path / "data"
    root.mkdir()
    # a file synced at 6 bytes, then appended to
    fd = os.open(root / "seg.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    syscalls.write(fd, b"synced")
    dirsync(root)  # its name is durable
    syscalls.fdatasync(fd)
    syscalls.write(fd, b"+lost")
    # a file whose fsync failed: the range is in doubt, and a later sync does not bring it back
    bad = os.open(root / "bad.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    dirsync(root)
    syscalls.write(bad, b"AAAA")
    syscalls.fdatasync(bad)
    syscalls.write(bad, b"BBBB")
    syscalls.configure(journal=str(journal), faults="fsync_eio=1")
    with pytest.raises(OSError):
        syscalls.fdatasync(bad)
    syscalls.configure(journal=str(journal))
    syscalls.write(bad, b"CCCC")
    syscalls.fdatasync(bad)
    # an offsets file replaced by a rename the directory never saw, and a file created after the last dir sync
    (root / "groups.json").write_text("old")
    dirsync(root)
    (root / ".groups.json.tmp").write_text("new")
    syscalls.replace(root / ".groups.json.tmp", root / "groups.json")
    (root / "late.log").write_bytes(b"never durable")
    os.close(fd)
    os.close(bad)

    loss = syscalls.simulate_power_loss(root, journal)

    assert (root / "seg.log").read_bytes() == b"synced"
    assert (root / "bad.log").read_bytes() == b"AAAA" + bytes(4) + b"CCCC"
    assert (root / "groups.json").read_text() == "old"
    assert not (root / "late.log").exists()
    assert loss.truncated == {str(root / "seg.log"): 5}
    assert loss.holes == {str(root / "bad.log"): 4}
    assert str(root / "late.log") in loss.removed
    assert str(root / "groups.json") in loss.restored


def test_a_cut_after_a_failed_fsync_removes_the_doubt(tmp_path, layer):
    journal, _control = layer
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "seg.log"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    syscalls.write(fd, b"good")
    syscalls.fdatasync(fd)
    syscalls.write(fd, b"doubt")
    syscalls.configure(journal=str(journal), faults="fsync_eio=1")
    with pytest.raises(OSError):
        syscalls.fdatasync(fd)
    syscalls.configure(journal=str(journal))
    syscalls.ftruncate(fd, 4)  # what the broker does: cut back to the durable size
    syscalls.write(fd, b"again")
    syscalls.fdatasync(fd)
    os.close(fd)
    loss = syscalls.simulate_power_loss(tmp_path / "d", journal)
    assert path.read_bytes() == b"goodagain"
    assert not loss.holes


def test_what_is_known_of_a_deleted_file_does_not_stick_to_its_inode(tmp_path, layer):
    journal, _control = layer
    root = tmp_path / "d"
    root.mkdir()
    for _ in range(3):  # the kernel tends to hand a freed inode to the next file
        fd = os.open(root / "seg.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
        dirsync(root)
        syscalls.write(fd, b"x" * 10)
        syscalls.configure(journal=str(journal), faults="fsync_eio=1")
        with pytest.raises(OSError):
            syscalls.fdatasync(fd)
        syscalls.configure(journal=str(journal))
        os.close(fd)
        syscalls.unlink(root / "seg.log")
        dirsync(root)
    fd = os.open(root / "seg.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    dirsync(root)
    syscalls.write(fd, b"fresh")
    syscalls.fdatasync(fd)
    os.close(fd)
    loss = syscalls.simulate_power_loss(root, journal)
    assert (root / "seg.log").read_bytes() == b"fresh"
    assert not loss.holes


def durable_write(path, data: bytes, *, sync_directory: bool = True) -> None:
    """atomic_write's steps through the layer; without the directory sync the rename is not durable."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        syscalls.write(fd, data)
        syscalls.fsync(fd)
    finally:
        os.close(fd)
    syscalls.replace(tmp, path)
    if sync_directory:
        dirsync(path.parent)


def test_a_file_a_cut_brought_back_keeps_its_old_bytes_at_the_next_cut(tmp_path, layer):
    # The first cut brings back the old file's bytes under the new file's inode: what the
    # journal says of that inode (its new, shorter synced size) must not cut them at the next cut.
    journal, _control = layer
    root = tmp_path / "data"
    root.mkdir()
    old, new = b'{"group": "%s"}' % (b"o" * 200), b'{"g": 1}'
    durable_write(root / "groups.json", old)
    durable_write(root / "groups.json", new, sync_directory=False)
    first = syscalls.simulate_power_loss(root, journal)
    assert first.restored == [str(root / "groups.json")]
    assert (root / "groups.json").read_bytes() == old
    # The restarted writer touches something else only, then the power goes again
    fd = os.open(root / "other.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    syscalls.write(fd, b"x")
    syscalls.fsync(fd)
    os.close(fd)
    dirsync(root)
    syscalls.simulate_power_loss(root, journal)
    assert (root / "groups.json").read_bytes() == old
    assert (root / "other.log").read_bytes() == b"x"


def test_a_journal_line_cut_by_a_kill_does_not_hide_what_comes_after(tmp_path, layer):
    journal, _control = layer
    root = tmp_path / "data"
    root.mkdir()
    durable_write(root / "a.json", b"first")
    syscalls.simulate_power_loss(root, journal)
    with open(journal, "ab") as f:  # what a kill in the middle of a journal write leaves
        f.write(b'{"op": "sync", "pa')
    syscalls.configure(journal=str(journal))  # the writer starts again, appending to the same journal
    durable_write(root / "b.json", b"second")
    syscalls.simulate_power_loss(root, journal)
    assert (root / "a.json").read_bytes() == b"first"
    assert (root / "b.json").read_bytes() == b"second"
