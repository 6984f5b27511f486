"""kill -9 a process appending with fsync=batch: every offset it reported synced is still there."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.file_log import FileLog
from conveyor.broker.wire.record import unpack_records

from tests.storage.crash_writer import CONFIG, value_for

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("crash_writer.py")


def start_writer(directory: Path, seed: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(directory), str(seed)], stdout=subprocess.PIPE, cwd=REPO, env=env
    )


def read_stdout(proc: subprocess.Popen[bytes], *, lines: int = 0, seconds: float = 0.0, limit: float = 20.0) -> bytes:
    """Read the writer's stdout for ``seconds``, or until it printed ``lines`` lines (at most ``limit`` s)."""
    out = b""
    start = time.monotonic()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() - start < (seconds or limit) and (not lines or out.count(b"\n") < lines):
            if sel.select(timeout=0.01):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
    return out


@pytest.mark.parametrize("seed", range(4))
def test_kill_9_loses_nothing_that_was_reported_synced(tmp_path, seed):
    # Given a writer appending and printing each synced end offset
    rng = random.Random(seed)
    directory = tmp_path / "crash"
    proc = start_writer(directory, seed)
    try:
        # When it is killed with SIGKILL at a random moment after it synced a few times
        out = read_stdout(proc, lines=3)
        out += read_stdout(proc, seconds=rng.uniform(0.01, 0.5))
        os.kill(proc.pid, signal.SIGKILL)  # only the pid we started
        out += proc.communicate(timeout=10)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    synced = [int(line) for line in out.split(b"\n")[:-1]]  # a last line without newline is incomplete
    assert len(synced) >= 3
    assert synced == sorted(synced)
    # Then reopening keeps every reported offset, and every record reads back intact
    log = FileLog("crash", directory, CONFIG, fsync=FsyncPolicy("batch"))
    assert synced[-1] <= log.end_offset
    offset = log.start_offset
    while offset < log.end_offset:
        batches = log.read(offset)
        for batch in batches:
            values = [value for _key, _headers, value in unpack_records(batch.body)]
            assert values == [value_for(batch.base_offset + i) for i in range(batch.count)]
        offset = batches[-1].next_offset
    assert offset == log.end_offset
    # And the log takes appends again where it ended
    assert log.append(b"\x91\x93\xc0\xc0\xc4\x01x", 1).base_offset == log.end_offset - 1
    log.close()
