"""FsyncPolicy parsing and the durable watermark under each policy."""

from __future__ import annotations

import os
import random

import pytest
from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_log import TopicConfig

from conveyor.errors import ConfigError
from tests.helpers import FakeClock
from tests.storage.storage_helpers import file_log, random_body


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("batch", FsyncPolicy("batch")),
        ("none", FsyncPolicy("none")),
        ("always", FsyncPolicy("batch")),
        ("interval:250", FsyncPolicy("interval", 250)),
        ("interval:0", FsyncPolicy("interval", 0)),
        ("  batch\n", FsyncPolicy("batch")),
    ],
)
def test_parse(text, policy):
    assert FsyncPolicy.parse(text) == policy


@pytest.mark.parametrize("text", ["", "sometimes", "interval", "interval:", "interval:-5", "interval:1.5", "BATCH"])
def test_parse_rejects(text):
    with pytest.raises(ConfigError):
        FsyncPolicy.parse(text)


@pytest.mark.parametrize("text", ["batch", "none", "interval:10"])
def test_str_round_trips(text):
    assert str(FsyncPolicy.parse(text)) == text
    assert FsyncPolicy.parse(str(FsyncPolicy.parse(text))) == FsyncPolicy.parse(text)


def body(n: int = 1) -> bytes:
    return random_body(random.Random(n), n)


@pytest.fixture(params=["file", "memory"])
def make(request, tmp_path, clock):
    """Logs whose wall clock and monotonic clock are both ``clock`` (see the test of a wall-clock step below)."""

    def make_log(policy: str, *, monotonic=clock):
        fsync = FsyncPolicy.parse(policy)
        if request.param == "memory":
            return MemoryLog("t", TopicConfig(), fsync=fsync, clock=clock, monotonic=monotonic)
        return file_log(tmp_path / policy, fsync=fsync, clock=clock, monotonic=monotonic)

    return make_log


def test_batch_policy_is_durable_only_after_sync(make):
    log = make("batch")
    log.append(body(2), 2)
    log.append(body(3), 3)
    assert (log.durable_offset, log.end_offset, log.dirty) == (0, 5, True)
    log.sync()
    assert (log.durable_offset, log.dirty) == (5, False)


def test_none_policy_is_durable_immediately(make):
    log = make("none")
    log.append(body(2), 2)
    assert (log.durable_offset, log.dirty) == (2, False)


def test_interval_policy_syncs_once_the_interval_elapses(make, clock):
    # Given an interval policy of 100 ms and a fresh append
    log = make("interval:100")
    log.append(body(2), 2)
    assert log.durable_offset == 0
    assert log.next_sync_due() == pytest.approx(clock() + 0.1)
    # When less than the interval passes, nothing is synced
    clock.advance(0.05)
    assert not log.maybe_sync()
    assert log.durable_offset == 0
    # Then once it has passed, maybe_sync makes everything durable
    clock.advance(0.06)
    assert log.maybe_sync()
    assert log.durable_offset == 2
    assert log.next_sync_due() is None


def test_interval_policy_syncs_on_an_append_after_the_interval(make, clock):
    log = make("interval:100")
    log.append(body(1), 1)
    clock.advance(0.2)
    log.append(body(2), 2)
    assert log.durable_offset == 3


@pytest.mark.parametrize("step", [-3600, -0.5, 3600])
def test_the_interval_is_measured_on_the_monotonic_clock_not_the_wall_clock(make, clock, step):
    # Given an interval policy whose monotonic clock is separate from the wall clock
    monotonic = FakeClock(1000.0)
    log = make("interval:100", monotonic=monotonic)
    log.append(body(2), 2)
    assert log.next_sync_due() == pytest.approx(monotonic() + 0.1)
    # When the wall clock steps (NTP, an operator) while little real time passes
    clock.advance(step)
    monotonic.advance(0.05)
    # Then the interval neither ends early nor stalls
    assert not log.maybe_sync()
    assert log.durable_offset == 0
    monotonic.advance(0.06)
    assert log.maybe_sync()
    assert log.durable_offset == 2
    # And batch timestamps still follow the wall clock
    log.append(body(1), 1)
    assert log.read(2)[0].timestamp_ms == int(clock() * 1000)


def test_batch_policy_never_syncs_on_its_own(make, clock):
    log = make("batch")
    log.append(body(1), 1)
    clock.advance(3600)
    assert log.next_sync_due() is None
    assert log.durable_offset == 0


def test_truncate_pulls_the_durable_watermark_back(make):
    log = make("batch")
    log.append(body(2), 2)
    log.append(body(2), 2)
    log.sync()
    log.truncate_to(2)
    assert (log.end_offset, log.durable_offset) == (2, 2)


def test_batch_policy_fsyncs_exactly_once_per_sync(tmp_path, monkeypatch):
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    log = file_log(tmp_path / "t", fsync=FsyncPolicy("batch"))
    for n in range(5):
        log.append(body(n + 1), n + 1)
    assert calls == []
    log.sync()
    assert len(calls) == 1
    log.sync()  # nothing new: no fsync
    assert len(calls) == 1
