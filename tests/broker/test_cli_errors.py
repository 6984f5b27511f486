"""A wrong argument on the command line is one ``[CONFIG_ERROR]`` line and exit code 2, never a traceback.

Every case runs the real ``conveyor`` entry point (``python -m conveyor``) as a
user would, against a real broker where one is needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from conveyor import Admin, Producer
from tests.helpers import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]


def conveyor(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def assert_config_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "[CONFIG_ERROR]" in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_an_address_without_a_scheme_says_what_an_address_looks_like():
    assert_config_error(conveyor("publish", "t", "x", "--broker", "127.0.0.1:5555"), "tcp://HOST:PORT")
    assert_config_error(conveyor("topics", "--broker", "http://127.0.0.1:9100"), "tcp://HOST:PORT")
    assert_config_error(conveyor("broker", "--upstream", "127.0.0.1:5555", "--metrics-port", "-1"), "tcp://HOST:PORT")


def test_a_value_that_is_not_json_publishes_nothing(conveyor_broker):
    address = conveyor_broker.address
    result = conveyor("publish", "cli-json", '{"ok": 1}', "{bad", "--format", "json", "--broker", address)
    assert_config_error(result, "message 2 is not JSON")
    with Admin(conveyor_broker.address) as admin:
        topics = {t["name"]: t for t in admin.list_topics()}
    assert topics.get("cli-json", {"end_offset": 0})["end_offset"] == 0, "the valid first value was not sent alone"


def test_bad_times_and_missing_arguments(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    assert conveyor("publish", "cli-times", "a", "--broker", address).returncode == 0
    assert_config_error(conveyor("tail", "cli-times", "--from", "bogus", "--broker", address), "--from")
    assert_config_error(conveyor("groups", "reset", "cli-times", "g", "--to", "soon", "--broker", address), "--to")
    assert_config_error(conveyor("groups", "reset", "cli-times", "g", "--broker", address), "needs --to")
    assert_config_error(conveyor("topics", "describe", "--broker", address), "needs a topic name")
    assert_config_error(conveyor("keys", "show", str(tmp_path / "nosuch.key")), "not a readable CURVE certificate")


def test_a_taken_port_is_named(conveyor_broker, tmp_path):
    taken = conveyor("broker", "--bind", conveyor_broker.address, "--data-dir", str(tmp_path / "a"))
    assert_config_error(taken, "cannot bind", "Address already in use")
    metrics_port = conveyor_broker.metrics_url.rsplit(":", 1)[1].split("/")[0]
    args = ["--bind", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "b"), "--metrics-port", metrics_port]
    assert_config_error(conveyor("broker", *args), "cannot serve metrics", "--metrics-port 0")


def test_version():
    result = conveyor("--version")
    assert result.returncode == 0 and result.stdout.startswith("conveyor "), result


def test_the_runner_is_not_ready_before_the_broker_answers():
    """`conveyor run` against an address where nothing listens: it says it is connecting, not that it is ready."""
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "conveyor", "run", "examples.handlers", "--broker", address, "--metrics-port", "-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        # Past one liveness window (3 s) it has tried to reconnect once: wait for it to say so, however slow the machine
        assert wait_for(lambda: any("broker silent; reconnecting" in line for line in lines), timeout=60), lines
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert f"connecting to {address}" in output, output
    assert "runner ready" not in output, output
    assert "broker silent; reconnecting" in output, output
    assert "stopped cleanly" in output, output


def test_tail_from_past_the_end_says_so_unless_asked_to_wait(conveyor_broker):
    address = conveyor_broker.address
    assert conveyor("publish", "cli-past", "a", "--broker", address).returncode == 0
    past = conveyor("tail", "cli-past", "--from", "99999", "--count", "1", "--broker", address)
    assert past.returncode == 2, past
    assert "[OFFSET_OUT_OF_RANGE]" in past.stderr and "--wait" in past.stderr, past.stderr
    assert "Traceback" not in past.stderr and past.stdout == "", past
    assert_config_error(conveyor("tail", "cli-past", "--from", "-3", "--broker", address), "--from")
    at_end = conveyor("tail", "cli-past", "--from", "1", "--idle-timeout", "1", "--broker", address)
    assert at_end.returncode == 0 and at_end.stdout == "", at_end  # the end itself is where new messages come

    cmd = [sys.executable, "-m", "conveyor", "tail", "cli-past", "--from", "3", "--wait", "--count", "1"]
    waiting = subprocess.Popen([*cmd, "--broker", address], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert conveyor("publish", "cli-past", "b", "c", "d", "--broker", address).returncode == 0
        output, _ = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0 and output.split("\t")[0] == "3" and output.strip().endswith("d"), output


def test_piping_into_head_stops_quietly(conveyor_broker):
    """`conveyor tail ... | head -1`: the reader goes away; exit 141 (as `cat` does), no traceback."""
    address = conveyor_broker.address
    with Producer(address, linger_ms=1) as producer:
        producer.send_many("cli-head", [b"line %d" % i for i in range(20_000)])  # far more than a pipe holds
        producer.flush(timeout=30)
    cmd = [sys.executable, "-m", "conveyor", "tail", "cli-head", "--from", "earliest", "--count", "20000"]
    proc = subprocess.Popen(
        [*cmd, "--broker", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # what `head -1` does after its line
        errors = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first.startswith("0\t"), first
    assert proc.returncode == 141, (proc.returncode, errors)
    assert errors == "", errors
