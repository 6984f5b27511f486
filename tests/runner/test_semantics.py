"""Delivery semantics with real `conveyor run` processes and a real broker (issue 15, #10-#12).

Waiting for a key is not a delivery attempt; the retry policy and the
broker's limit agree; the newest subscription sets the group's settings.
"""

from __future__ import annotations

import collections
import re

from runner_helpers import RunnerProcess, records, wait_records

from broker.client import Admin, Producer
from broker.errors import ConveyorError
from consumers.testing import scrape_metric, wait_for


def publish(address: str, topic: str, values: list, keys: list | None = None) -> None:
    with Producer(address, linger_ms=1) as producer:
        for i, value in enumerate(values):
            producer.send(topic, value, key=None if keys is None else keys[i])
        producer.flush(timeout=30)


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






# --- #12 the newest subscription sets the group's settings ----------------------------------------


def test_a_redeploy_changes_the_groups_settings_and_says_so(conveyor_broker, tmp_path):
    v1 = runner(conveyor_broker.address, tmp_path, "redeploy_v1")
    with Admin(conveyor_broker.address) as admin:
        settings = admin.describe_group("rd", "rd")["settings"]
        assert (settings["max_deliveries"], settings["key_affinity"], settings["ack_timeout_ms"]) == (3, False, 30000)
        v1.terminate()
        assert v1.wait(20) == 0
        v2 = runner(conveyor_broker.address, tmp_path, "redeploy_v2")
        try:
            settings = admin.describe_group("rd", "rd")["settings"]
            assert (settings["max_deliveries"], settings["key_affinity"], settings["ack_timeout_ms"]) == (
                6,
                True,
                20000,
            )
            publish(conveyor_broker.address, "rd", ["a"])
            assert [r[2] for r in wait_records(tmp_path, "rd-v2", 1)] == ["0"]
        finally:
            v2.kill()
    assert wait_for(lambda: any("settings changed" in line for line in conveyor_broker.output), 10)
    conveyor_broker.restart()
    with Admin(conveyor_broker.address) as admin:
        assert admin.describe_group("rd", "rd")["settings"]["max_deliveries"] == 6, "stored with the group"
