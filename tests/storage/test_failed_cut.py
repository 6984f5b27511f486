"""A failed write whose partial bytes could not be cut must never end up inside a sealed segment.

Recovery cuts a torn tail only in the newest segment; a sealed segment must be whole. So when
a torn write's cleanup fails, the bytes past the segment's size must be gone before anything
seals it (a roll) or syncs it, not only before the next append to it.
"""

from __future__ import annotations

import errno
import os
import random

import pytest
from conveyor.broker.log import syscalls
from conveyor.broker.wire.record import pack_records

from conveyor.errors import StorageIOError
from tests.storage.storage_helpers import Expected, append_random, assert_log_holds, file_log, segment_files


class TornThenCutFails:
    """The next write stores half its bytes then fails; the cleanup's ftruncate fails ``cut_failures`` times."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cut_failures: int = 1) -> None:
        self.tear_next = False
        self.cut_failures = cut_failures
        real_writev, real_ftruncate = syscalls.writev, syscalls.ftruncate

        def writev(fd: int, buffers) -> int:
            if self.tear_next:
                self.tear_next = False
                data = b"".join(buffers)
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.EIO, "torn")
            return real_writev(fd, buffers)

        def ftruncate(fd: int, length: int) -> None:
            if self.cut_failures:
                self.cut_failures -= 1
                raise OSError(errno.EIO, "cut failed")
            real_ftruncate(fd, length)

        monkeypatch.setattr(syscalls, "writev", writev)
        monkeypatch.setattr(syscalls, "ftruncate", ftruncate)


def append_big(log) -> Expected:
    """One batch too big to share a 4 KiB segment: appending it rolls."""
    body = pack_records([(None, None, b"x" * 3500)])
    return Expected(log.append(body, 1).base_offset, 1, body)


def fill_then_tear(tmp_path, monkeypatch, cut_failures: int = 1):
    log = file_log(tmp_path, segment_bytes=4096)
    rng = random.Random(7)
    expected = [append_random(log, rng, max_count=3, max_value=150) for _ in range(3)]
    faults = TornThenCutFails(monkeypatch, cut_failures)
    faults.tear_next = True
    with pytest.raises(StorageIOError):
        append_random(log, rng, max_count=3, max_value=150)
    return log, rng, expected, faults


def test_a_roll_after_an_uncut_torn_write_seals_only_whole_batches(tmp_path, monkeypatch):
    log, rng, expected, _ = fill_then_tear(tmp_path, monkeypatch)
    expected.append(append_big(log))  # too big to fit: the torn one is sealed
    assert len(segment_files(tmp_path)) == 2
    while len(segment_files(tmp_path)) < 3:
        expected.append(append_random(log, rng, max_count=3, max_value=150))
    log.sync()
    log.close()

    reopened = file_log(tmp_path, segment_bytes=4096)  # a sealed segment with junk would be SEGMENT_CORRUPT
    assert_log_holds(reopened, expected)
    assert reopened.truncated_bytes == 0
    reopened.close()


def test_a_sync_after_an_uncut_torn_write_leaves_no_junk_on_disk(tmp_path, monkeypatch):
    log, _, expected, _ = fill_then_tear(tmp_path, monkeypatch)
    log.sync()
    newest = segment_files(tmp_path)[-1]
    assert newest.stat().st_size == sum(e.size for e in expected)
    log.close()
    reopened = file_log(tmp_path, segment_bytes=4096)
    assert_log_holds(reopened, expected)
    reopened.close()


def test_a_roll_whose_cut_fails_again_refuses_the_batch_and_loses_nothing(tmp_path, monkeypatch):
    log, _rng, expected, faults = fill_then_tear(tmp_path, monkeypatch, cut_failures=3)
    refused = 0
    while len(segment_files(tmp_path)) < 2:  # the cut fails twice more: those appends are refused, retriable
        try:
            expected.append(append_big(log))
        except StorageIOError as exc:
            assert exc.retriable
            refused += 1
    assert refused == 2 and faults.cut_failures == 0
    log.sync()
    log.close()
    reopened = file_log(tmp_path, segment_bytes=4096)
    assert_log_holds(reopened, expected)
    reopened.close()
