"""``conveyor.monitoring.logs``: records as JSON lines, the handled message's fields, dictConfig files."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conveyor.monitoring import logs

from conveyor.errors import ConfigError

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def make_record(message: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("conveyor.runner", logging.WARNING, __file__, 1, message, args or ("world",), None)
    record.created = 1_795_000_000.25
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def fake_message(offset: int, attempt: int = 1, headers: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(topic="orders", partition=2, offset=offset, attempt=attempt, headers=headers or {})


def test_a_record_is_one_json_object_with_the_four_fields_first():
    line = logs.JsonFormatter().format(make_record())
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2026-11-18T11:06:40.250Z",
        "level": "WARNING",
        "logger": "conveyor.runner",
        "message": "hello world",
    }
    assert list(json.loads(line))[:4] == ["time", "level", "logger", "message"]


def test_extra_fields_and_an_exception_stay_on_one_line():
    try:
        raise ValueError("line one\nline two")
    except ValueError:
        record = make_record(topic="t", group="g", offset=7, exc_info=sys.exc_info())
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert (fields["topic"], fields["group"], fields["offset"]) == ("t", "g", 7)
    assert "ValueError: line one\nline two" in fields["exception"]


def test_a_value_json_cannot_hold_becomes_its_text():
    fields = json.loads(logs.JsonFormatter().format(make_record("%s", object(), group={1, 2})))
    assert fields["group"] == "{1, 2}"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", TRACE),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),  # the all-zero id is invalid
        ("00-nothex" + "x" * 24 + "-00f067aa0ba902b7-01", None),
        ("garbage", None),
        (None, None),
    ],
)
def test_the_trace_id_comes_from_a_w3c_traceparent(header, expected):
    assert logs.trace_id({} if header is None else {"traceparent": header}) == expected


def test_message_fields_name_the_message_or_the_first_of_a_batch():
    consumer = SimpleNamespace(topic="orders", group="billing")
    one = logs.message_fields(consumer, [fake_message(5, 2, {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})])
    assert one == {"topic": "orders", "group": "billing", "partition": 2, "offset": 5, "attempt": 2, "trace_id": TRACE}
    batch = logs.message_fields(consumer, [fake_message(5, 1), fake_message(6, 3)])
    assert (batch["offset"], batch["attempt"], batch["batch"], batch["trace_id"]) == (5, 3, 2, None)


def test_records_made_while_handling_carry_the_message_and_extra_wins(caplog):
    logs.install_record_factory()
    consumer = SimpleNamespace(topic="orders", group="billing")
    logger = logging.getLogger("tests.logs")
    with caplog.at_level(logging.INFO, logger="tests.logs"):
        with logs.handling(consumer, [fake_message(9, 2)]):
            logger.info("inside")
            logger.info("extra", extra={"attempt": 99, "topic": "other"})
        logger.info("outside")
    inside, extra, outside = (json.loads(logs.JsonFormatter().format(r)) for r in caplog.records)
    assert (inside["topic"], inside["group"], inside["offset"], inside["attempt"]) == ("orders", "billing", 9, 2)
    assert (extra["topic"], extra["attempt"], extra["offset"]) == ("other", 99, 9)
    assert "topic" not in outside and "offset" not in outside


def test_a_log_config_file_is_json_toml_or_yaml(tmp_path):
    (tmp_path / "a.json").write_text('{"version": 1, "root": {"level": "INFO"}}')
    (tmp_path / "a.toml").write_text('version = 1\n[root]\nlevel = "INFO"\n')
    (tmp_path / "a.yaml").write_text("version: 1\nroot:\n  level: INFO\n")
    (tmp_path / "b.toml").write_text('[root]\nlevel = "INFO"\n')
    for name in ("a.json", "a.toml", "a.yaml"):
        assert logs.load_config(str(tmp_path / name))["root"] == {"level": "INFO"}
    assert logs.load_config(str(tmp_path / "b.toml"))["version"] == 1, "version 1 when left out"


def test_a_log_config_file_keeps_the_loggers_made_before_it_unless_it_says_otherwise(tmp_path):
    """dictConfig's own default disables every logger made before it (conveyor.runner, the handlers' modules):
    a file that does not mention ``disable_existing_loggers`` would silence the runner."""
    (tmp_path / "keep.toml").write_text('[root]\nlevel = "INFO"\n')
    (tmp_path / "drop.toml").write_text('disable_existing_loggers = true\n[root]\nlevel = "INFO"\n')
    assert logs.load_config(str(tmp_path / "keep.toml"))["disable_existing_loggers"] is False
    assert logs.load_config(str(tmp_path / "drop.toml"))["disable_existing_loggers"] is True


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("missing.json", None, "not found"),
        ("bad.json", "{", "not valid JSON"),
        ("bad.toml", "[root", "not valid TOML"),
        ("list.json", "[1]", "must hold a table"),
        ("conf.ini", "[x]", "name a .json, .toml or .yaml file"),
    ],
)
def test_a_bad_log_config_file_is_a_config_error(tmp_path, name, text, says):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        logs.load_config(str(path))


def test_a_config_dictconfig_refuses_is_a_config_error(tmp_path):
    path = tmp_path / "wrong.json"
    path.write_text('{"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}')
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    try:
        with pytest.raises(ConfigError, match="--log-config"):
            logs.configure(config_file=str(path))
    finally:
        root.handlers[:], _ = before
        root.setLevel(before[1])


def test_a_record_keeps_the_message_it_was_made_for_when_the_lane_moves_on():
    logs.install_record_factory()
    consumer = SimpleNamespace(topic="orders", group="billing")
    token, cursor = logs.enter_handling(consumer)
    try:
        cursor.current = fake_message(1)
        first = logging.getLogger("tests.logs").makeRecord("tests.logs", logging.INFO, __file__, 1, "m", (), None)
        cursor.current = fake_message(2)
    finally:
        logs.leave_handling(token)
    assert logs.record_fields(first)["offset"] == 1


def test_in_json_mode_uncaught_exceptions_and_warnings_are_json_lines_too():
    script = """
import threading, warnings
from conveyor.monitoring.logs import configure
configure(log_format="json")
warnings.warn("careful")
thread = threading.Thread(target=lambda: 1 / 0, name="worker")
thread.start()
thread.join()
raise RuntimeError("boom")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [(f["level"], f["message"].split(":")[0]) for f in lines] == [
        ("WARNING", "<string>"),
        ("CRITICAL", "uncaught ZeroDivisionError in thread worker"),
        ("CRITICAL", "uncaught RuntimeError"),
    ], lines
    assert "careful" in lines[0]["message"] and "RuntimeError: boom" in lines[2]["exception"]
