"""The whole configuration is checked before a command starts: one ``[CONFIG_ERROR]`` line per problem, exit 2.

Issue 15 #16: unknown TOML keys were ignored, ``heartbeat_ms = true`` was
accepted, ``--log-level verbose`` was a traceback, a bad variable was not
named, ``CONVEYOR_METRICS_PORT`` could not tell the broker from the runner,
and ``tcp://127.0.0.1:70000`` served on port 4464. Every case runs the real
``conveyor`` command line; where a command must start, it starts for real.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conveyor import Admin
from tests.broker.broker_helpers import REPO, config_errors, conveyor_cli
from tests.helpers import free_port


def refused_broker(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The CONFIG_ERROR lines of a broker start that must fail, having made no data directory."""
    data = tmp_path / "data"
    base = ["broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1", "--data-dir", str(data)]
    result = conveyor_cli(*base, *args, env=env)
    lines = config_errors(result)
    assert not data.exists(), "a refused start made the data directory"
    return lines


def toml(tmp_path: Path, text: str, name: str = "conveyor.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_wrong_types_in_the_config_file_are_refused_and_named(tmp_path):
    path = toml(
        tmp_path,
        'heartbeat_ms = true\nfsync = 3\n[broker]\nauto_create_topics = "maybe"\nmax_credit = 1.5\nmirror = [1, 2]\n',
    )
    lines = refused_broker(tmp_path, "--config", path)
    assert len(lines) == 5, lines
    text = "\n".join(lines)
    for needle in ("heartbeat_ms = true", "fsync = 3", "[broker] auto_create_topics", "[broker] max_credit"):
        assert needle in text, text
    assert all(path in line for line in lines), lines
    assert "must be an integer, not a boolean" in text, text


def test_unknown_keys_and_tables_get_a_did_you_mean(tmp_path):
    path = toml(
        tmp_path,
        'heartbeat_msx = 10\n[brokr]\nfsync = "none"\n[broker]\nretention_msec = 5\n[run]\nconcurency = 2\n',
    )
    lines = refused_broker(tmp_path, "--config", path)
    text = "\n".join(lines)
    assert len(lines) == 4, lines
    assert "heartbeat_msx" in text and "did you mean heartbeat_ms?" in text, text
    assert "[brokr]" in text and "did you mean [broker]?" in text, text
    assert "[broker] retention_msec" in text and "did you mean retention_ms?" in text, text
    assert "[run] concurency" in text and "did you mean concurrency?" in text, text


def test_flags_and_variables_are_checked_with_their_names(tmp_path):
    env = {"CONVEYOR_AUTO_CREATE_TOPICS": "maybe", "CONVEYOR_LIVENESS": "0", "CONVEYOR_FSYNC": "sometimes"}
    lines = refused_broker(tmp_path, "--log-level", "verbose", "--heartbeat-ms", "abc", env=env)
    text = "\n".join(lines)
    assert len(lines) == 5, lines
    assert "CONVEYOR_AUTO_CREATE_TOPICS=maybe" in text, text
    assert "CONVEYOR_LIVENESS" in text and "at least 1" in text, text
    assert "CONVEYOR_FSYNC" in text and "interval:MS" in text, text
    assert "--log-level" in text and "DEBUG, INFO, WARNING, ERROR" in text, text
    assert "--heartbeat-ms" in text and "'abc'" in text, text
    # A shadowed variable is still checked: the configuration as a whole must be right.
    lines = refused_broker(tmp_path, "--liveness", "3", env={"CONVEYOR_LIVENESS": "-4"})
    assert len(lines) == 1 and "CONVEYOR_LIVENESS" in lines[0], lines


def test_the_runner_checks_its_options_too(tmp_path):
    result = conveyor_cli("run", "nosuch_module", "--log-level", "verbose", "--graceful-timeout", "-1")
    lines = config_errors(result, "--log-level", "--graceful-timeout")
    assert len(lines) == 2, lines
    result = conveyor_cli("run", "nosuch_module", env={"CONVEYOR_RUN_METRICS_PORT": "65536"})
    config_errors(result, "CONVEYOR_RUN_METRICS_PORT", "at most 65535")


def test_values_too_large_for_a_timer_or_the_wire_are_refused_at_start(tmp_path):
    lines = refused_broker(
        tmp_path, "--heartbeat-ms", str(2**31), "--max-credit", str(2**64), "--fsync", f"interval:{2**31}"
    )
    text = "\n".join(lines)
    assert len(lines) == 3, lines
    assert "--heartbeat-ms" in text and "at most 2147483647" in text, text
    assert "--max-credit" in text and "at most 9223372036854775807" in text, text
    assert "--fsync" in text and "2147483647" in text, text


def test_ports_out_of_range_and_an_empty_data_dir_are_refused(tmp_path):
    lines = refused_broker(tmp_path, "--bind", "tcp://127.0.0.1:70000")
    assert "--bind" in lines[0] and "70000" in lines[0] and "65535" in lines[0], lines
    refused_broker(tmp_path, "--metrics-port", "70000")
    refused_broker(tmp_path, "--upstream", "tcp://127.0.0.1:0")
    refused_broker(tmp_path, "--registry", "127.0.0.1:8500")
    result = conveyor_cli("broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1", "--data-dir", "")
    config_errors(result, "--data-dir")
    config_errors(conveyor_cli("topics", "--broker", "tcp://127.0.0.1:70000"), "--broker", "70000")
    config_errors(conveyor_cli("publish", "t", "x", env={"CONVEYOR_BROKER": "tcp://h:99999"}), "CONVEYOR_BROKER")
    topology = toml(tmp_path, "{}", "topology.json")
    config_errors(conveyor_cli("registry", "--topology", topology, "--port", "70000"), "--port", "65535")


def test_a_per_command_variable_wins_over_the_shared_one(conveyor_broker, tmp_path):
    broker_port, shared_port = free_port(), free_port()
    env = {"CONVEYOR_METRICS_PORT": str(shared_port), "CONVEYOR_BROKER_METRICS_PORT": str(broker_port)}
    data = tmp_path / "data"
    args = [sys.executable, "-m", "conveyor", "broker", "--bind", "tcp://127.0.0.1:*", "--data-dir", str(data)]
    line = _ready_line(args, env)
    assert f":{broker_port}/metrics" in line, line

    run_port = free_port()
    apps = REPO / "tests" / "runner" / "apps"
    env = {
        "CONVEYOR_METRICS_PORT": str(broker_port),  # taken by the broker above: the runner must not use it
        "CONVEYOR_RUN_METRICS_PORT": str(run_port),
        "CONVEYOR_RUN_BROKER": conveyor_broker.address,
        "CONVEYOR_BROKER": "tcp://127.0.0.1:1",  # shadowed by CONVEYOR_RUN_BROKER
        "CONVEYOR_TEST_OUT": str(tmp_path / "out"),
        "PYTHONPATH": str(apps),
    }
    line = _ready_line([sys.executable, "-m", "conveyor", "run", "app_record"], env, ready="runner ready")
    assert f":{run_port}/metrics" in line and conveyor_broker.address in line, line


def _ready_line(cmd: list[str], env: dict[str, str], ready: str = "ready on") -> str:
    """Start ``cmd``, return its ready line, stop it (SIGTERM) and check it exits cleanly."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**base, **env}, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # the process prints its ready line or exits: this loop ends
            seen.append(line)
            if ready in line:
                return line
        raise AssertionError("no ready line:\n" + "".join(seen))
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_client_table_holds_the_address_beside_a_broker_table(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    both = toml(tmp_path, f'[client]\nbroker = "{address}"\n[broker]\nfsync = "none"\n', "both.toml")
    result = conveyor_cli("topics", "create", "from-client-table", "--config", both)
    assert result.returncode == 0, result.stderr
    # The old form, a top-level key, keeps working when there is no [broker] table.
    old = toml(tmp_path, f'broker = "{address}"\n', "old.toml")
    result = conveyor_cli("topics", "list", "--format", "json", "--config", old)
    assert result.returncode == 0 and "from-client-table" in result.stdout, result.stderr
    # The command's own table wins over [client]; a variable wins over both.
    mixed = toml(tmp_path, f'[client]\nbroker = "tcp://127.0.0.1:1"\n[topics]\nbroker = "{address}"\n', "mixed.toml")
    assert conveyor_cli("topics", "--config", mixed).returncode == 0
    result = conveyor_cli("topics", "--config", both, env={"CONVEYOR_BROKER": "tcp://127.0.0.1:70000"})
    config_errors(result, "CONVEYOR_BROKER")
    # Both forms in one file are not TOML: say what to write instead.
    clash = toml(tmp_path, f'broker = "{address}"\n[broker]\nfsync = "none"\n', "clash.toml")
    (line,) = config_errors(conveyor_cli("topics", "--config", clash), "[client]")
    assert "[broker]" in line, line
    with Admin(address) as admin:
        assert "from-client-table" in {t["name"] for t in admin.list_topics()}


def test_a_good_configuration_from_every_source_starts_the_broker(tmp_path):
    path = toml(
        tmp_path,
        'log_level = "warning"\n[client]\nbroker = "tcp://127.0.0.1:5555"\n'
        '[broker]\nheartbeat_ms = 500\nretention_ms = "7d"\nauto_create_topics = false\nmirror = ["a*", "b*"]\n'
        'upstream = "tcp://127.0.0.1:1"\n'
        "[run]\nconcurrency = 2\n",
    )
    data = tmp_path / "data"
    env = {"CONVEYOR_MAX_CREDIT": "5000", "CONVEYOR_BROKER_LIVENESS": "4", "CONVEYOR_LOG_LEVEL": "debug"}
    cmd = [sys.executable, "-m", "conveyor", "broker", "--config", path, "--bind", "tcp://127.0.0.1:*"]
    line = _ready_line([*cmd, "--data-dir", str(data), "--metrics-port", "0"], env)
    assert re.search(r"ready on tcp://127\.0\.0\.1:\d+ ", line), line


def test_a_registry_topology_is_checked_at_start(tmp_path):
    missing = conveyor_cli("registry", "--topology", str(tmp_path / "nosuch.json"), "--port", "0")
    config_errors(missing, "cannot be read")
    path = toml(tmp_path, '{"nodez": 1, "nodes": {"a": {"parnt": "x"}, "b": {"parent": "tcp://h:70000"}}}', "t.json")
    lines = config_errors(conveyor_cli("registry", "--topology", path, "--port", "0"))
    text = "\n".join(lines)
    assert len(lines) == 3, lines
    assert "did you mean 'nodes'?" in text and "did you mean 'parent'?" in text and "70000" in text, text


def test_a_bench_scenario_file_is_checked_before_anything_runs(tmp_path):
    path = toml(tmp_path, '{"scenarios": [{"name": "x", "mesages": 5, "producers": true}]}', "bench.json")
    (line,) = config_errors(conveyor_cli("bench", "--config", path))
    assert "did you mean 'messages'?" in line and "producers = true" in line, line
    config_errors(conveyor_cli("bench", "--config", str(tmp_path / "nosuch.json")), "nosuch.json")
