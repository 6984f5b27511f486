"""The consumer runner as users run it: real `conveyor run` processes, a real broker."""

from __future__ import annotations

import collections
import signal
import time

from conveyor import Admin
from tests.helpers import publish
from tests.runner.runner_helpers import RunnerProcess, by_pid, offsets, records, wait_records


def test_three_runners_share_a_group_each_message_once(conveyor_broker, tmp_path):
    runners = [RunnerProcess(conveyor_broker.address, tmp_path) for _ in range(3)]
    try:
        time.sleep(0.5)  # all three subscribed before the data arrives
        publish(conveyor_broker.address, "work", list(range(3000)))
        rows = wait_records(tmp_path, "work", 3000)
        time.sleep(0.5)
        handled = offsets(tmp_path, "work")
        assert sorted(handled) == list(range(3000)), "each message exactly once"
        shares = by_pid(rows)
        assert len(shares) == 3 and all(len(v) >= 300 for v in shares.values()), {k: len(v) for k, v in shares.items()}
    finally:
        for runner in runners:
            runner.kill()


def test_retry_succeeds_on_the_third_attempt_counted_by_the_broker(conveyor_broker, tmp_path):
    runner = RunnerProcess(conveyor_broker.address, tmp_path)
    try:
        publish(conveyor_broker.address, "flaky", ["a", "b"])
        done = wait_records(tmp_path, "flaky", 2)
        assert sorted((int(r[2]), int(r[3])) for r in done) == [(0, 3), (1, 3)]
        attempts = sorted((int(r[2]), int(r[3])) for r in records(tmp_path, "flaky-attempt"))
        assert attempts == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    finally:
        runner.kill()


def test_exhausted_retries_go_to_the_dead_letter_topic(conveyor_broker, tmp_path):
    runner = RunnerProcess(conveyor_broker.address, tmp_path)
    try:
        publish(conveyor_broker.address, "doomed", ["x"])
        dead = wait_records(tmp_path, "doomed-dead", 1)
        assert [(r[2], r[3], r[6].strip()) for r in dead] == [("0", "3", "RuntimeError")]
        assert [int(r[3]) for r in records(tmp_path, "doomed-attempt")] == [1, 2, 3]
        with Admin(conveyor_broker.address) as admin:
            deadline = time.monotonic() + 10
            letters = []
            while not letters and time.monotonic() < deadline:
                try:
                    letters = admin.fetch("doomed.dlq", 0, 10)
                except Exception:
                    time.sleep(0.1)
        assert len(letters) == 1
        headers = letters[0].headers
        assert letters[0].value == "x"
        assert headers["x-origin-topic"] == "doomed" and headers["x-origin-offset"] == "0"
        assert headers["x-delivery-count"] == "3"
        assert "RuntimeError: cannot handle x" in headers["x-last-error"]
    finally:
        runner.kill()


def test_runner_killed_mid_batch_loses_nothing(conveyor_broker, tmp_path):
    # Given a slow runner that holds messages when it is killed
    slow = RunnerProcess(conveyor_broker.address, tmp_path / "slow", env={"CONVEYOR_TEST_SLOW": "0.05"})
    publish(conveyor_broker.address, "work", list(range(200)))
    wait_records(tmp_path / "slow", "work", 10)
    slow.kill()
    # When a healthy runner takes over
    healthy = RunnerProcess(conveyor_broker.address, tmp_path / "healthy")
    try:
        done_before = set(offsets(tmp_path / "slow", "work"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if done_before | set(offsets(tmp_path / "healthy", "work")) >= set(range(200)):
                break
            time.sleep(0.1)
        # Then every message was handled by one of them
        assert done_before | set(offsets(tmp_path / "healthy", "work")) == set(range(200))
        assert len(done_before) < 200, "the kill really happened mid-stream"
    finally:
        healthy.kill()


def test_sigterm_drains_within_the_graceful_timeout(conveyor_broker, tmp_path):
    runner = RunnerProcess(
        conveyor_broker.address, tmp_path / "first", env={"CONVEYOR_TEST_SLOW": "0.3"}, args=["--graceful-timeout", "5"]
    )
    publish(conveyor_broker.address, "work", list(range(40)))
    wait_records(tmp_path / "first", "work", 2)
    started = time.monotonic()
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.wait(10) == 0
    assert time.monotonic() - started < 5.5
    assert any("stopped cleanly" in line for line in runner.lines)
    handled_first = offsets(tmp_path / "first", "work")
    assert 0 < len(handled_first) < 40
    second = RunnerProcess(conveyor_broker.address, tmp_path / "second")
    try:
        wait_records(tmp_path / "second", "work", 40 - len(handled_first))
        time.sleep(0.5)
        handled_second = offsets(tmp_path / "second", "work")
        assert sorted(handled_first + handled_second) == list(range(40)), "finished ones acked, the rest released"
        attempts = [int(r[3]) for r in records(tmp_path / "second", "work")]
        assert max(attempts) == 1, "released messages do not count as a delivery"
    finally:
        second.kill()


def test_async_and_batch_handlers(conveyor_broker, tmp_path):
    runner = RunnerProcess(conveyor_broker.address, tmp_path)
    try:
        publish(conveyor_broker.address, "async-work", list(range(300)))
        publish(conveyor_broker.address, "batched", list(range(300)))
        assert sorted(int(r[2]) for r in wait_records(tmp_path, "async", 300)) == list(range(300))
        rows = wait_records(tmp_path, "batched", 300)
        assert sorted(int(r[2]) for r in rows) == list(range(300))
        assert max(int(r[6]) for r in rows) > 1, "batch handlers receive several messages per call"
        assert max(int(r[6]) for r in rows) <= 25
    finally:
        runner.kill()


def test_key_ordered_concurrency_keeps_per_key_order(conveyor_broker, tmp_path):
    runner = RunnerProcess(conveyor_broker.address, tmp_path)
    try:
        keys = [f"k{i % 16}" for i in range(2000)]
        publish(conveyor_broker.address, "keyed", list(range(2000)), keys=keys)
        rows = wait_records(tmp_path, "keyed", 2000, timeout=40)
        assert sorted(int(r[2]) for r in rows) == list(range(2000))
        per_key: dict[str, list[int]] = collections.defaultdict(list)
        for row in rows:
            per_key[row[4]].append(int(row[2]))
        assert all(v == sorted(v) for v in per_key.values()), "each key in offset order"
        assert len(per_key) == 16
    finally:
        runner.kill()


def test_key_ordered_runner_over_a_partitioned_topic_keeps_per_key_order(conveyor_broker, tmp_path):
    with Admin(conveyor_broker.address) as admin:
        admin.create_topic("keyed", partitions=4)  # before the runner subscribes (it would make one partition)
    runner = RunnerProcess(conveyor_broker.address, tmp_path)
    try:
        keys = [f"k{i % 16}" for i in range(1000)]
        publish(conveyor_broker.address, "keyed", list(range(1000)), keys=keys)
        rows = wait_records(tmp_path, "keyed", 1000, timeout=40)
        assert sorted(int(r[5]) for r in rows) == list(range(1000)), "every message once, from every partition"
        per_key: dict[str, list[int]] = collections.defaultdict(list)
        for row in rows:
            per_key[row[4]].append(int(row[5]))
        assert all(v == sorted(v) for v in per_key.values()), "each key in the order it was sent"
        with Admin(conveyor_broker.address) as admin:
            assert sum(p["end_offset"] > 0 for p in admin.describe_topic("keyed")["partitions"]) > 1
    finally:
        runner.kill()


def test_dead_letters_of_a_partition_go_to_the_same_partition_of_the_dead_letter_topic(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("doomed", partitions=3)
    runner = RunnerProcess(address, tmp_path)
    try:
        from conveyor import Producer

        with Producer(address) as producer:
            assert producer.send("doomed", "x", partition=2).result(30) == 0
        wait_records(tmp_path, "doomed-dead", 1)
        with Admin(address) as admin:
            deadline = time.monotonic() + 30
            letters = []
            while not letters and time.monotonic() < deadline:
                try:
                    letters = admin.fetch("doomed.dlq", 0, 10, partition=2)
                except Exception:
                    time.sleep(0.1)
            assert [(m.partition, m.value) for m in letters] == [(2, "x")]
            assert len(admin.describe_topic("doomed.dlq")["partitions"]) == 3
    finally:
        runner.kill()
