"""Delivery semantics with real `conveyor run` processes and a real broker (issue 15, #10-#12).

Waiting for a key is not a delivery attempt; the retry policy and the
broker's limit agree; the newest subscription sets the group's settings.
"""

from __future__ import annotations

import collections
import re

from conveyor import Admin
from conveyor.errors import ConveyorError
from conveyor.testing import scrape_metric
from tests.helpers import publish, wait_for
from tests.runner.runner_helpers import RunnerProcess, records, wait_records


def runner(address: str, out, spec: str, env: dict[str, str] | None = None) -> RunnerProcess:
    return RunnerProcess(address, out, f"app_semantics:{spec}", env=env)


def runner_metric(proc: RunnerProcess, name: str) -> float:
    url = next(m.group(1) for line in proc.lines if (m := re.search(r"metrics (http://\S+)\)", line)))
    return scrape_metric(url, name)


def dead_letters(address: str, topic: str) -> list:
    with Admin(address) as admin:
        try:
            return admin.fetch(f"{topic}.dlq", 0, 1000)
        except ConveyorError:
            return []  # no dead-letter topic: nothing was dead-lettered


def per_key(rows: list[list[str]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = collections.defaultdict(list)
    for row in rows:
        out[row[4]].append(int(row[2]))
    return out


# --- #10 key order: waiting is not a delivery attempt -------------------------------------------


def test_key_ordered_waiting_is_not_a_delivery_attempt(conveyor_broker, tmp_path):
    n, every = 120, 10
    proc = runner(conveyor_broker.address, tmp_path, "keyed_flaky")
    try:
        publish(conveyor_broker.address, "kf", list(range(n)), keys=[f"k{i % 4}" for i in range(n)])
        done = wait_records(tmp_path, "kf-done", n, timeout=60)
        assert sorted(int(r[2]) for r in done) == list(range(n)), "everything handled once"
        calls = collections.Counter(int(r[2]) for r in records(tmp_path, "kf-call"))
        failed = [i for i in range(n) if i % every == 0]
        assert sorted(o for o, c in calls.items() if c > 1) == failed, "only the failed messages ran twice"
        assert max(calls.values()) == 2
        attempts = {int(r[2]): int(r[3]) for r in done}
        assert {o: a for o, a in attempts.items() if a != 1} == dict.fromkeys(failed, 2), "waiting is not an attempt"
        for key, seen in per_key(done).items():
            assert seen == sorted(seen), f"{key} handled out of order: {seen}"
        assert dead_letters(conveyor_broker.address, "kf") == []
        assert wait_for(lambda: runner_metric(proc, "conveyor_runner_retries_total") == len(failed), 30)
        assert runner_metric(proc, "conveyor_runner_retries_total") == len(failed), "the retry counter counts failures"
    finally:
        proc.kill()


def test_a_delayed_nack_on_the_head_of_a_key_keeps_the_keys_order(conveyor_broker, tmp_path):
    proc = runner(conveyor_broker.address, tmp_path, "keyed_nack")
    try:
        publish(conveyor_broker.address, "kn", list(range(30)), keys=["a" if i % 3 else "b" for i in range(30)])
        done = wait_records(tmp_path, "kn-done", 30, timeout=60)
        assert sorted(int(r[2]) for r in done) == list(range(30))
        for key, seen in per_key(done).items():
            assert seen == sorted(seen), f"{key} handled out of order: {seen}"
        assert [int(r[3]) for r in done if int(r[2]) != 0] == [1] * 29, "only the nacked head came twice"
    finally:
        proc.kill()


def test_key_order_holds_when_the_runner_dies_while_a_key_waits(conveyor_broker, tmp_path):
    env = {"CONVEYOR_TEST_RETRY_DELAY": "3"}
    first = runner(conveyor_broker.address, tmp_path / "first", "keyed_killed", env)
    keys = ["k0" if i % 2 == 0 else "k1" for i in range(40)]
    publish(conveyor_broker.address, "kk", list(range(40)), keys=keys)
    # The head of k0 failed and waits 3 s; k1 flows meanwhile.
    assert wait_for(lambda: len(records(tmp_path / "first", "kk-done")) >= 20, 30)
    first.kill()
    handled_first = [int(r[2]) for r in records(tmp_path / "first", "kk-done")]
    assert all(o % 2 == 1 for o in handled_first), f"no k0 message ran before its head: {handled_first}"
    second = runner(conveyor_broker.address, tmp_path / "second", "keyed_killed", env)
    try:
        k0 = list(range(0, 40, 2))
        assert wait_for(lambda: {int(r[2]) for r in records(tmp_path / "second", "kk-done")} >= set(k0), 30)
        seen = [int(r[2]) for r in records(tmp_path / "second", "kk-done") if r[4] == "k0"]
        assert seen == k0, f"k0 out of order after the kill: {seen}"
    finally:
        second.kill()


def test_sigterm_gives_back_parked_messages_without_counting_them(conveyor_broker, tmp_path):
    env = {"CONVEYOR_TEST_RETRY_DELAY": "3"}
    first = runner(conveyor_broker.address, tmp_path / "first", "keyed_killed", env)
    publish(conveyor_broker.address, "kk", list(range(10)), keys=["k0"] * 10)
    assert wait_for(lambda: len(records(tmp_path / "first", "kk-call")) >= 1, 30)
    first.terminate()  # k0's head waits for its retry, 1..9 are parked
    assert first.wait(60) == 0
    assert records(tmp_path / "first", "kk-done") == []
    second = runner(conveyor_broker.address, tmp_path / "second", "keyed_killed", env)
    try:
        done = wait_records(tmp_path / "second", "kk-done", 10, timeout=30)
        assert [(int(r[2]), int(r[3])) for r in done] == [(0, 2)] + [(i, 1) for i in range(1, 10)]
    finally:
        second.kill()


def test_kill_9_counts_parked_messages_once_as_the_readme_says(conveyor_broker, tmp_path):
    """The one case where waiting counts: a dead runner's parked messages come back with attempt 2, in order.

    The README once said parked messages never count "through runner crashes";
    the broker cannot know which of a dead runner's messages ran (docs/reliability.md).
    """
    env = {"CONVEYOR_TEST_RETRY_DELAY": "3"}
    first = runner(conveyor_broker.address, tmp_path / "first", "keyed_killed", env)
    publish(conveyor_broker.address, "kk", list(range(10)), keys=["k0"] * 10)
    assert wait_for(lambda: len(records(tmp_path / "first", "kk-call")) >= 1, 30)
    first.kill()  # k0's head waits for its retry in the broker, 1..9 are parked in the runner
    assert records(tmp_path / "first", "kk-done") == []
    second = runner(conveyor_broker.address, tmp_path / "second", "keyed_killed", env)
    try:
        done = wait_records(tmp_path / "second", "kk-done", 10, timeout=60)
        assert [(int(r[2]), int(r[3])) for r in done] == [(i, 2) for i in range(10)]
    finally:
        second.kill()


def test_batch_and_async_handlers_keep_key_order_through_retries(conveyor_broker, tmp_path):
    proc = runner(conveyor_broker.address, tmp_path, "keyed_batch")
    other = runner(conveyor_broker.address, tmp_path, "keyed_async")
    try:
        keys = [f"k{i % 3}" for i in range(60)]
        publish(conveyor_broker.address, "kb", list(range(60)), keys=keys)
        publish(conveyor_broker.address, "ka", list(range(60)), keys=keys)
        for name in ("kb-done", "ka-done"):
            done = wait_records(tmp_path, name, 60, timeout=60)
            assert sorted(int(r[2]) for r in done) == list(range(60)), name
            for key, seen in per_key(done).items():
                assert seen == sorted(seen), f"{name}: {key} out of order: {seen}"
        calls = collections.Counter(int(r[2]) for r in records(tmp_path, "ka-call"))
        assert sorted(o for o, c in calls.items() if c > 1) == list(range(0, 60, 10))
    finally:
        proc.kill()
        other.kill()


# --- #11 the retry policy and the broker's limit -------------------------------------------------


def test_stop_after_attempt_15_gets_15_attempts(conveyor_broker, tmp_path):
    proc = runner(conveyor_broker.address, tmp_path, "fifteen")
    try:
        publish(conveyor_broker.address, "fifteen", ["x"])
        dead = wait_records(tmp_path, "fifteen-dead", 1, timeout=30)
        assert [int(r[3]) for r in records(tmp_path, "fifteen-call")] == list(range(1, 16))
        assert [(r[3], r[6].strip()) for r in dead] == [("15", "RuntimeError")]
        with Admin(conveyor_broker.address) as admin:
            assert admin.describe_group("fifteen", "fifteen")["settings"]["max_deliveries"] == 15
    finally:
        proc.kill()


def test_stop_after_delay_fires(conveyor_broker, tmp_path):
    proc = runner(conveyor_broker.address, tmp_path, "delayed")
    try:
        publish(conveyor_broker.address, "delayed", ["x"])
        dead = wait_records(tmp_path, "delayed-dead", 1, timeout=30)
        assert len(dead) == 1 and dead[0][6].strip() == "RuntimeError", records(tmp_path, "delayed-call")
        calls = records(tmp_path, "delayed-call")
        assert 2 <= len(calls) < 10, f"stopped by the 1.5 s delay, not by a count: {len(calls)} calls"
        letters = dead_letters(conveyor_broker.address, "delayed")
        assert len(letters) == 1 and "gave up" in letters[0].headers["x-last-error"]
    finally:
        proc.kill()


def test_error_handler_runs_for_a_message_the_broker_dead_letters(conveyor_broker, tmp_path):
    proc = runner(conveyor_broker.address, tmp_path, "nacked")
    try:
        publish(conveyor_broker.address, "nacked", ["x", "y"])
        dead = wait_records(tmp_path, "nacked-dead", 2, timeout=30)
        assert sorted((int(r[2]), r[6].strip()) for r in dead) == [(0, "DeadLettered:3"), (1, "DeadLettered:3")]
        assert sorted(int(r[3]) for r in records(tmp_path, "nacked-call")) == [1, 1, 2, 2, 3, 3]
        assert wait_for(lambda: len(dead_letters(conveyor_broker.address, "nacked")) == 2, 30)
    finally:
        proc.kill()


def test_error_handler_runs_for_a_poison_message_that_kills_its_runners(conveyor_broker, tmp_path):
    """Two runners die on the message; the third, still in the group, runs the error handler.

    All three subscribe before the message exists: the broker tells only a member still in the
    group (``DEAD_LETTERED`` is best effort, docs/protocol.md), and it notices the second death
    within a heartbeat, sooner than a runner started after that death can subscribe on a loaded machine.
    """
    runners = [runner(conveyor_broker.address, tmp_path, "poison") for _ in range(3)]
    try:
        publish(conveyor_broker.address, "poison", ["x"])
        dead = wait_records(tmp_path, "poison-dead", 1, timeout=60)
        assert [(r[2], r[6].strip()) for r in dead] == [("0", "DeadLettered:2")]
        assert [int(r[3]) for r in records(tmp_path, "poison-call")] == [1, 2]
        assert wait_for(lambda: [p.proc.poll() for p in runners].count(None) == 1, 30), "two runners died"
        died = [p for p in runners if p.proc.poll() is not None]
        assert [p.proc.returncode for p in died] == [17, 17], "two runners died on it, one per delivery"
        (survivor,) = [p for p in runners if p not in died]
        assert dead[0][1] == str(survivor.proc.pid), "the runner still in the group ran the error handler"
        assert wait_for(lambda: len(dead_letters(conveyor_broker.address, "poison")) == 1, 30)
    finally:
        for proc in runners:
            proc.kill()


# --- #12 the newest subscription sets the group's settings ----------------------------------------


def test_a_redeploy_changes_the_groups_settings_and_says_so(conveyor_broker, tmp_path):
    v1 = runner(conveyor_broker.address, tmp_path, "redeploy_v1")
    with Admin(conveyor_broker.address) as admin:
        settings = admin.describe_group("rd", "rd")["settings"]
        assert (settings["max_deliveries"], settings["key_affinity"], settings["ack_timeout_ms"]) == (3, False, 30000)
        v1.terminate()
        assert v1.wait(60) == 0
        v2 = runner(conveyor_broker.address, tmp_path, "redeploy_v2")
        try:
            described = admin.describe_group("rd", "rd")
            settings, last = described["settings"], described["settings_changed"]["changes"]
            assert (settings["max_deliveries"], settings["key_affinity"], settings["ack_timeout_ms"]) == (
                6,
                True,
                20000,
            )
            assert last["max_deliveries"] == {"from": 3, "to": 6}
            assert last["key_affinity"] == {"from": False, "to": True}
            publish(conveyor_broker.address, "rd", ["a"])
            assert [r[2] for r in wait_records(tmp_path, "rd-v2", 1)] == ["0"]
        finally:
            v2.kill()
    assert wait_for(lambda: any("settings changed" in line for line in conveyor_broker.output), 30)
    conveyor_broker.restart()
    with Admin(conveyor_broker.address) as admin:
        assert admin.describe_group("rd", "rd")["settings"]["max_deliveries"] == 6, "stored with the group"
