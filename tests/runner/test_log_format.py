"""``--log-format json`` and ``--log-config`` on real broker and runner processes: every line they write is parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conveyor.testing import BrokerProcess
from tests.helpers import publish, wait_for
from tests.runner.runner_helpers import APPS, RunnerProcess
from tests.runner.test_group_defaults import SHARING
from tests.runner.test_runner_errors import run, write_app

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def json_lines(lines: list[str]) -> list[dict]:
    """Every line as a JSON object with the four fields always there (a line that is not one fails the test)."""
    parsed = []
    for line in lines:
        fields = json.loads(line)
        assert isinstance(fields, dict), line
        assert {"time", "level", "logger", "message"} <= set(fields), line
        parsed.append(fields)
    return parsed


def stop(runner: RunnerProcess) -> None:
    runner.terminate()
    assert runner.wait(60) == 0, "".join(runner.lines)


def test_broker_and_runner_write_only_json_lines(tmp_path):
    (tmp_path / "data" / "topics" / "not a topic").mkdir(parents=True)  # the broker warns about it at start
    broker = BrokerProcess(tmp_path / "data", env={"CONVEYOR_LOG_FORMAT": "json"}).start()
    try:
        runner = RunnerProcess(broker.address, tmp_path, "app_logs", args=["--log-format", "json"])
        try:
            publish(broker.address, "logged", ["a"], headers={"traceparent": TRACEPARENT})
            wait_for(lambda: any("handled a" in line for line in runner.lines), timeout=30, message="handled a")
        finally:
            stop(runner)
    finally:
        assert broker.stop() == 0
    lines = json_lines(runner.lines)
    assert lines[-1]["message"] == "conveyor runner stopped cleanly"
    handled = [f for f in lines if f["message"] == "handled a"]
    assert len(handled) == 1
    assert handled[0] | {"time": None} == {
        "time": None,
        "level": "WARNING",
        "logger": "app_logs",
        "message": "handled a",
        "topic": "logged",
        "group": "logged",
        "partition": 0,
        "offset": 0,
        "attempt": 99,  # the handler's extra= wins
        "trace_id": TRACE,
    }
    first = [f for f in lines if f["message"] == "handling a" and f["attempt"] == 1]
    assert first and first[0]["trace_id"] == TRACE and first[0]["offset"] == 0
    retried = [f for f in lines if f["logger"] == "conveyor.runner" and "failed on attempt 1" in f["message"]]
    assert retried and (retried[0]["topic"], retried[0]["attempt"], retried[0]["trace_id"]) == ("logged", 1, TRACE)
    started = [f for f in lines if f["message"].startswith("consumer app_logs.logged reads topic logged")]
    assert started and (started[0]["topic"], started[0]["group"]) == ("logged", "logged")
    broker_lines = json_lines(broker.output)
    assert any("broker ready on" in f["message"] for f in broker_lines)
    warned = [f for f in broker_lines if "not a topic name" in f["message"]]
    assert warned and (warned[0]["level"], warned[0]["logger"]) == ("WARNING", "conveyor.store"), broker_lines
    assert broker_lines[-1]["message"] == "conveyor broker stopped cleanly"


def test_log_config_file_decides_handlers_and_format(conveyor_broker, tmp_path):
    logged = tmp_path / "runner.log"
    config = tmp_path / "logging.toml"
    config.write_text(
        f"""\
version = 1
disable_existing_loggers = false

[formatters.json]
"()" = "conveyor.monitoring.logs.JsonFormatter"

[handlers.file]
class = "logging.FileHandler"
filename = "{logged}"
formatter = "json"

[root]
level = "INFO"
handlers = ["file"]

[loggers.app_logs]
level = "WARNING"
"""
    )
    runner = RunnerProcess(conveyor_broker.address, tmp_path, "app_logs", env={"CONVEYOR_LOG_CONFIG": str(config)})
    try:
        publish(conveyor_broker.address, "logged", ["b"])
        wait_for(lambda: logged.exists() and "handled b" in logged.read_text(), timeout=30, message="handled b")
    finally:
        stop(runner)
    lines = json_lines(logged.read_text().splitlines())
    assert not [f for f in lines if f["message"].startswith("handling")], "app_logs below WARNING is dropped"
    assert [f["offset"] for f in lines if f["message"] == "handled b"] == [0]
    assert any(f["message"].startswith("consumer app_logs.logged reads topic logged") for f in lines)
    assert not [line for line in runner.lines if "reads topic" in line], "the file's handlers only: not stderr"


def test_a_log_config_that_does_not_load_stops_the_command_with_exit_2(tmp_path):
    bad = tmp_path / "logging.json"
    bad.write_text("{")
    for command in (
        ["broker", "--data-dir", str(tmp_path / "data")],
        ["run", "app_logs", "--broker", "tcp://127.0.0.1:1"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "conveyor", *command, "--log-config", str(bad), "--metrics-port", "-1"],
            env={**os.environ, "PYTHONPATH": str(APPS)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result
        assert f"[CONFIG_ERROR] --log-config {bad}: not valid JSON" in result.stderr, result.stderr


def test_an_error_the_runner_stops_with_is_a_json_line_in_json_mode(tmp_path):
    write_app(tmp_path, "sharing", SHARING.format(declared=""))
    result = run(tmp_path, "app.sharing", "--log-format", "json")
    assert result.returncode == 2, result
    (error,) = [f for f in json_lines(result.stderr.splitlines()) if f["level"] == "ERROR"]
    assert error["message"].startswith("conveyor run: [CONFIG_ERROR] consumers app.sharing.bill, app.sharing.audit")
    assert result.stdout == ""
