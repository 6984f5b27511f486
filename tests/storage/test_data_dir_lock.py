"""One process per data directory: a second broker (or offline opener) is refused before it reads anything.

Real broker processes: the lock matters between processes, and the refusal is the CLI's exit code and message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor.broker.log.data_dir import Store
from conveyor.broker.log.data_dir_lock import LOCK_FILE, DataDirLock

from conveyor import Admin, Producer
from conveyor.errors import DataDirLocked
from conveyor.testing import BrokerProcess


def second_broker(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``conveyor broker`` on ``data_dir``, as a user would start it; it must not keep running."""
    cmd = [sys.executable, "-m", "conveyor", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1"]
    return subprocess.run(
        [*cmd, "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60, env=os.environ
    )


def refusal(data_dir: Path, pid: int) -> str:
    return f"[DATA_DIR_LOCKED] {data_dir} is in use by pid {pid} (lock {data_dir / LOCK_FILE})"


@pytest.fixture
def broker(tmp_path: Path):
    started = BrokerProcess(tmp_path / "data").start()
    yield started
    started.kill()


def test_a_second_broker_on_the_same_data_directory_exits_2_naming_the_holder(broker):
    # Given a broker that stored messages
    with Producer(broker.address) as producer:
        assert producer.send("t", "one").result(timeout=10) == 0
    # When a second broker starts on the same data directory
    second = second_broker(broker.data_dir)
    # Then it exits 2 naming the directory, the first broker's pid and the lock file, and never got ready
    assert second.returncode == 2, second.stdout + second.stderr
    assert refusal(broker.data_dir, broker.pid) in second.stderr
    assert "ready" not in second.stdout
    # And the first broker keeps serving the same log
    with Producer(broker.address) as producer:
        assert producer.send("t", "two").result(timeout=10) == 1
    with Admin(broker.address) as admin:
        assert [m.value for m in admin.fetch("t", 0, 10)] == ["one", "two"]


def test_deleting_the_lock_file_does_not_let_a_second_broker_in(broker):
    (broker.data_dir / LOCK_FILE).unlink()

    second = second_broker(broker.data_dir)

    assert second.returncode == 2, second.stdout + second.stderr
    assert refusal(broker.data_dir, broker.pid) in second.stderr  # the holder found in /proc/locks


def test_the_lock_is_taken_before_recovery_touches_a_segment(broker):
    # Given a running broker whose newest segment ends in bytes a recovery would cut as a torn tail
    with Producer(broker.address) as producer:
        producer.send("t", "kept").result(timeout=10)
    segment = next((broker.data_dir / "topics" / "t").glob("*.log"))
    with segment.open("ab") as f:
        f.write(b"\x00" * 100)
    size = segment.stat().st_size
    # When a second broker tries to start there
    assert second_broker(broker.data_dir).returncode == 2
    # Then it cut nothing
    assert segment.stat().st_size == size


def test_offline_openers_respect_the_lock(broker):
    with pytest.raises(DataDirLocked) as refused:
        Store(broker.data_dir)
    assert refused.value.pid == broker.pid
    with pytest.raises(DataDirLocked):
        DataDirLock(broker.data_dir)


def test_the_lock_dies_with_its_broker(broker):
    # Given a broker killed with -9: no chance to release anything
    with Producer(broker.address) as producer:
        producer.send("t", "one").result(timeout=10)
    broker.kill()
    # Then the next broker starts on the directory, writes its own pid, and has the data
    broker.start()
    assert (broker.data_dir / LOCK_FILE).read_text().strip() == str(broker.pid)
    with Admin(broker.address) as admin:
        assert [m.value for m in admin.fetch("t", 0, 10)] == ["one"]
    # And a clean stop lets an offline opener in
    broker.stop()
    Store(broker.data_dir).close()
