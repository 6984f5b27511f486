"""Values that used to mean something by accident, and messages that named the wrong fix (issue 15, verification).

Every case runs the real ``conveyor`` command line or a real broker process:
``retention_ms=-1ms`` was stored as -1 (unlimited); ``CONVEYOR_METRCS_PORT``
and ``--mirror`` without ``--upstream`` were ignored without a word; a
PUBLISH declaring 4 billion records was MESSAGE_TOO_LARGE, a deeply nested
one MALFORMED_FRAME with no reason; a dead-letter topic equal to the group's
own topic was accepted; ``tail --idle-timeout nan`` waited forever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.wire.protocol import SIGNATURE, Command, decode

from conveyor import Admin, Producer
from conveyor.errors import ConfigError
from conveyor.testing import BrokerProcess
from tests.broker.broker_helpers import config_errors, conveyor_cli
from tests.helpers import wait_for

BATCH_TOO_LARGE, MALFORMED_FRAME, INVALID_REQUEST = 205, 201, 207


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("values")).start()
    yield process
    process.stop()


def settings_of(broker: BrokerProcess, topic: str) -> dict:
    with Admin(broker.address) as admin:
        return dict(admin.describe_topic(topic)["config"])


# --- only the bare -1 or `unlimited` means no limit -------------------------------------------


@pytest.mark.parametrize(
    "setting",
    ["retention_ms=-1ms", "retention_ms=-0.001s", "retention_bytes=-1B", "retention_ms=-1.0", "segment_bytes=-1MiB"],
)
def test_a_negative_value_with_a_unit_is_refused_not_unlimited(broker, setting):
    name = "neg-" + str(abs(hash(setting)) % 10_000)
    result = conveyor_cli("topics", "create", name, "--set", setting, "--broker", broker.address)
    (line,) = config_errors(result, setting.partition("=")[0])
    assert "-1 or unlimited" in line, line
    with Admin(broker.address) as admin:
        assert name not in {t["name"] for t in admin.list_topics()}


def test_the_bare_minus_one_and_unlimited_still_mean_no_limit(broker):
    for name, setting in (("unl-a", "retention_ms=-1"), ("unl-b", "retention_bytes=unlimited")):
        result = conveyor_cli("topics", "create", name, "--set", setting, "--broker", broker.address)
        assert result.returncode == 0, result.stderr
        assert settings_of(broker, name)[setting.partition("=")[0]] == -1


def test_the_brokers_retention_flag_refuses_a_negative_value_with_a_unit(tmp_path):
    data = tmp_path / "data"
    base = ["broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1", "--data-dir", str(data)]
    lines = config_errors(conveyor_cli(*base, "--retention-ms=-1ms", "--retention-bytes=-1B"))
    assert any("--retention-ms -1ms" in line for line in lines), lines
    assert any("--retention-bytes -1B" in line for line in lines), lines
    assert not data.exists()


# --- configuration that was accepted silently ---------------------------------------------------


def test_a_misspelt_shared_variable_gets_a_did_you_mean_warning(broker):
    env = {"CONVEYOR_METRCS_PORT": "5", "CONVEYOR_SOAK_SECONDS": "3", "CONVEYOR_TEST_OUT": "/tmp"}
    result = conveyor_cli("topics", "list", "--broker", broker.address, env=env)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "conveyor topics: warning: CONVEYOR_METRCS_PORT is ignored (did you mean CONVEYOR_METRICS_PORT?)"
    ], result.stderr


def test_mirror_without_an_upstream_is_a_config_error(tmp_path):
    data = tmp_path / "data"
    base = ["broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1", "--data-dir", str(data)]
    (line,) = config_errors(conveyor_cli(*base, "--mirror", "orders*"))
    assert "--upstream" in line, line
    assert not data.exists()


# --- messages that name the right fix -------------------------------------------------------


def test_a_bad_stored_extra_says_to_remove_it_not_to_alter_it(conveyor_broker_factory):
    broker = conveyor_broker_factory()
    with Admin(broker.address) as admin:
        admin.create_topic("extra")
    broker.stop()
    path = broker.data_dir / "topics" / "extra" / "topic.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "extra": [1, 2]}))
    broker.start()
    with Admin(broker.address) as admin:
        assert [e["setting"] for e in admin.describe_topic("extra")["config_errors"]] == ["extra"]
    line = next(line for line in broker.output if "stored setting extra" in line)
    assert "topics alter" not in line.replace("`topics alter` changes", ""), line
    assert f"remove it from {path}" in line, line


def test_a_number_for_a_boolean_setting_is_not_told_that_1_works(broker):
    with Admin(broker.address) as admin, pytest.raises(ConfigError) as caught:
        admin.create_topic("bool-one", read_only=1)
    message = caught.value.message
    assert "not the number 1" in message and "1/0" not in message, message


def test_tail_says_a_time_is_out_of_range(broker):
    with Admin(broker.address) as admin:
        admin.create_topic("tail-time")
    result = conveyor_cli("tail", "tail-time", "--from", "0001-01-01T00:00:00", "--broker", broker.address)
    (line,) = config_errors(result, "out of range")
    assert "takes" not in line, line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--idle-timeout", "nan"], "--idle-timeout"),
        (["--idle-timeout", "inf"], "--idle-timeout"),
        (["--idle-timeout", "-1"], "--idle-timeout"),
        (["--count", "-1"], "--count"),
    ],
)
def test_tail_refuses_bounds_that_would_follow_forever(broker, args, needle):
    result = conveyor_cli("tail", "tail-bounds", "--from", "earliest", *args, "--broker", broker.address, timeout=30)
    config_errors(result, needle)


# --- the wire: counts and nesting, and a dead-letter topic that loops ---------------------------


@pytest.fixture
def dealer(broker: BrokerProcess) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    yield sock
    sock.close()


def request(sock: zmq.Socket, command: Command, header: dict, *body: bytes) -> dict:
    rid = header["rid"]
    sock.send_multipart([SIGNATURE, bytes([command]), msgpack.packb(header), *body])
    deadline = time.monotonic() + 30
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            reply = decode(sock.recv_multipart())
            if reply.get("rid") == rid:
                return {"command": reply.command, **reply.header}
    raise AssertionError(f"no answer to {command.name} in 30 s")


@pytest.mark.parametrize(
    ("body", "code", "needles"),
    [
        (b"\xdd\xff\xff\xff\xff", BATCH_TOO_LARGE, ["4294967295"]),
        (b"\x91" * 5000 + b"\xc0", MALFORMED_FRAME, ["nested"]),
    ],
    ids=["4-billion-records", "nested-5000-deep"],
)
def test_a_body_declaring_too_many_records_or_too_deep_says_so(broker, dealer, body, code, needles):
    reply = request(dealer, Command.PUBLISH, {"topic": "wire", "rid": 1}, body)
    assert (reply["command"], reply.get("code")) == (Command.ERROR, code), reply
    assert all(n in reply.get("message", "") for n in needles), reply
    assert broker.proc is not None and broker.proc.poll() is None


def test_a_header_nested_too_deep_says_so(broker, dealer):
    dealer.send_multipart([SIGNATURE, bytes([Command.HELLO]), b"\x91" * 5000 + b"\xc0"])
    assert dealer.poll(30_000), "no answer in 30 s"
    reply = decode(dealer.recv_multipart())
    assert (reply.command, reply.get("code")) == (Command.ERROR, MALFORMED_FRAME), reply.header
    assert "nested deeper" in reply.get("message", ""), reply.header


def test_a_subscribe_that_dead_letters_into_its_own_topic_is_refused(broker, dealer):
    header = {"rid": 2, "sub": 1, "topic": "loop", "group": "g", "credit": 10, "dead_letter_topic": "loop"}
    reply = request(dealer, Command.SUBSCRIBE, header)
    assert (reply["command"], reply.get("code")) == (Command.ERROR, INVALID_REQUEST), reply
    assert "dead_letter_topic" in reply.get("message", ""), reply
    with Admin(broker.address) as admin:
        assert "loop" not in {t["name"] for t in admin.list_topics()}, "a refused SUBSCRIBE made its topic"


def test_a_stored_dead_letter_topic_equal_to_its_topic_is_replaced(conveyor_broker_factory):
    broker = conveyor_broker_factory()
    with Admin(broker.address) as admin:
        admin.create_topic("own")
        admin.reset_offsets("own", "g", "earliest")
    broker.stop()
    path: Path = broker.data_dir / "topics" / "own" / "groups.json"
    groups = json.loads(path.read_text())
    groups["g"]["dead_letter_topic"] = "own"
    path.write_text(json.dumps(groups))
    broker.start()
    with Admin(broker.address) as admin:
        assert admin.describe_group("own", "g")["settings"]["dead_letter_topic"] == ""
    assert wait_for(lambda: "stored dead_letter_topic refused" in "".join(broker.output), 30)


@pytest.mark.parametrize(
    "options",
    [
        {"linger_ms": float("nan")},
        {"request_timeout_ms": float("inf")},
        {"max_block_ms": -1},
        {"close_timeout_ms": True},
        {"max_in_flight": 0},
        {"batch_size": 2.5},
    ],
)
def test_a_producer_refuses_times_and_counts_that_are_no_bound(options):
    for producer_class in (Producer, AsyncProducer) if "max_in_flight" not in options else (Producer,):
        with pytest.raises(ConfigError) as caught:
            producer_class("tcp://127.0.0.1:1", **options)
        assert next(iter(options)) in caught.value.message, caught.value.message
