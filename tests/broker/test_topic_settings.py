"""Topic settings are checked by one table before anything is written; a stored bad one never stops the broker.

Every case runs real brokers and the real ``conveyor`` command line. Issue 15
#2: ``--set retention_ms=abc`` used to be stored as a string and crash-loop
the broker at its next segment roll, and ``storage=files`` left a
half-created topic that stopped the next start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conveyor.broker.client.subscription import Subscription

from conveyor import Admin, Producer
from conveyor.errors import ConfigError, ReadOnlyTopic, UnknownTopic
from conveyor.testing import BrokerProcess
from tests.broker.broker_helpers import config_errors, conveyor_cli, drain
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(tmp_path_factory.mktemp("topic-settings")).start()
    yield broker
    broker.stop()


def topic_dirs(broker: BrokerProcess) -> set[str]:
    return {p.name for p in (broker.data_dir / "topics").iterdir()}


def stored(broker: BrokerProcess, topic: str) -> dict[str, Any]:
    return json.loads((broker.data_dir / "topics" / topic / "topic.json").read_text())


def publish_small_batches(address: str, topic: str, count: int, size: int = 100) -> None:
    with Producer(address, linger_ms=0) as producer:
        for i in range(count):
            producer.send(topic, b"x" * size, key=str(i).encode())
            if i % 10 == 9:
                producer.flush(timeout=30)  # small batches: many segment rolls
        producer.flush(timeout=30)


BAD_FORMS = [
    ("retention_ms=abc", "retention_ms"),
    ("read_only=maybe", "read_only"),
    ("retention_bytes=1G", "ambiguous"),
    ("segment_bytes=64M", "64MB"),
    ("retention_ms=7x", "retention_ms"),
    ("retention_ms=", "retention_ms"),
    ("segment_bytes=512", "at least 1024"),
    ("segment_bytes=1.5", "segment_bytes"),
    ("storage=files", "file, memory"),
    ("retention_bytes=-2", "retention_bytes"),
    ("index_interval_bytes=0", "at least 1"),
    ("cache_bytes=-1", "at least 0"),
    ("retention_bytes=9223372036854775808", "at most 9223372036854775807"),
    ("retention_ms=300000000000d", "at most 9223372036854775807"),
    ("retension_ms=1d", "did you mean retention_ms"),
    ("retention_ms", "K=V"),
]


@pytest.mark.parametrize(("setting", "needle"), BAD_FORMS, ids=[s for s, _ in BAD_FORMS])
def test_a_bad_setting_through_the_cli_is_refused_and_leaves_nothing_behind(shared_broker, setting, needle):
    name = "bad-cli-" + str(BAD_FORMS.index((setting, needle)))
    result = conveyor_cli("topics", "create", name, "--set", setting, "--broker", shared_broker.address)
    (line,) = config_errors(result, needle)
    key = setting.partition("=")[0]
    assert key in line or "K=V" in line, line
    assert name not in topic_dirs(shared_broker)
    with Admin(shared_broker.address) as admin:
        assert name not in {t["name"] for t in admin.list_topics()}


BAD_VALUES: list[tuple[str, Any, str]] = [
    ("retention_ms", "abc", "retention_ms"),
    ("read_only", "maybe", "read_only"),
    ("read_only", 1, "read_only"),
    ("retention_bytes", True, "retention_bytes"),
    ("retention_bytes", "1G", "ambiguous"),
    ("storage", "files", "storage"),
    ("storage", 3, "storage"),
    ("segment_bytes", 512, "at least 1024"),
    ("segment_bytes", 1 << 40, "at most"),
    ("retention_ms", 2**63, "at most 9223372036854775807"),
    ("retention_ms", 1.5, "retention_ms"),
    ("cache_bytes", None, "cache_bytes"),
    ("colour", "blue", "unknown topic setting"),
    ("extra", {"mirror_of": "x"}, "unknown topic setting"),
]


@pytest.mark.parametrize(("key", "value", "needle"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_a_bad_setting_through_the_admin_api_is_a_config_error(shared_broker, key, value, needle):
    name = "bad-api-" + str(BAD_VALUES.index((key, value, needle)))
    with Admin(shared_broker.address) as admin:
        with pytest.raises(ConfigError) as caught:
            admin.create_topic(name, **{key: value})
        assert needle in caught.value.message and key in caught.value.message, caught.value.message
        assert name not in {t["name"] for t in admin.list_topics()}
    assert name not in topic_dirs(shared_broker)


def test_human_forms_are_stored_as_numbers(shared_broker):
    sets = [
        "retention_ms=7d",
        "retention_bytes=1GB",
        "segment_bytes=64MiB",
        "read_only=no",
        "index_interval_bytes=8KiB",
        "cache_bytes=1MB",
    ]
    args = [arg for s in sets for arg in ("--set", s)]
    result = conveyor_cli("topics", "create", "human", *args, "--broker", shared_broker.address)
    assert result.returncode == 0, result.stderr
    expected = {
        "retention_ms": 7 * 86_400_000,
        "retention_bytes": 10**9,
        "segment_bytes": 64 << 20,
        "read_only": False,
        "index_interval_bytes": 8192,
        "cache_bytes": 10**6,
    }
    assert {k: json.loads(result.stdout)["config"][k] for k in expected} == expected
    on_disk = stored(shared_broker, "human")
    assert {k: on_disk[k] for k in expected} == expected
    assert all(type(on_disk[k]) is type(v) for k, v in expected.items()), on_disk
    with Admin(shared_broker.address) as admin:
        config = admin.create_topic("human-api", retention_ms="unlimited", retention_bytes="500MiB", read_only="yes")
        config2 = admin.create_topic("human-api-2", retention_ms="500ms", segment_bytes="2KB")
    assert (config["config"]["retention_ms"], config["config"]["read_only"]) == (-1, True)
    assert config["config"]["retention_bytes"] == 500 << 20
    assert (config2["config"]["retention_ms"], config2["config"]["segment_bytes"]) == (500, 2000)


def test_the_brokers_own_topic_defaults_go_through_the_same_table(conveyor_broker_factory, tmp_path):
    broker = conveyor_broker_factory(extra=["--retention-ms", "7d", "--segment-bytes", "1MiB"])
    with Admin(broker.address) as admin:
        config = admin.create_topic("defaults")["config"]
    assert (config["retention_ms"], config["segment_bytes"]) == (7 * 86_400_000, 1 << 20)

    data = tmp_path / "never-made"
    base = ["broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1", "--data-dir", str(data)]
    config_errors(conveyor_cli(*base, "--retention-ms", "abc"), "--retention-ms", "not a duration")
    config_errors(conveyor_cli(*base, env={"CONVEYOR_SEGMENT_BYTES": "1G"}), "CONVEYOR_SEGMENT_BYTES", "ambiguous")
    toml = tmp_path / "c.toml"
    toml.write_text('[broker]\nretention_bytes = "lots"\n')
    config_errors(conveyor_cli(*base, "--config", str(toml)), "retention_bytes", str(toml))
    config_errors(conveyor_cli(*base, "--segment-bytes", "100"), "at least 1024")
    assert not data.exists(), "a refused start made the data directory"


def test_a_bad_stored_setting_is_reported_and_the_broker_keeps_serving(conveyor_broker_factory):
    # The broker's own defaults: 1 KiB segments and 4 KB retention, so the rolls and retention the old
    # code crashed at happen within a few hundred small messages.
    extra = ["--segment-bytes", "1KiB", "--retention-bytes", "4KB"]
    broker = conveyor_broker_factory(extra=extra)
    with Admin(broker.address) as admin:
        admin.create_topic("hand", segment_bytes=2048)
    broker.stop()
    hand = broker.data_dir / "topics" / "hand" / "topic.json"
    edited = {**json.loads(hand.read_text()), "retention_ms": "abc", "read_only": "maybe", "segment_bytes": 10}
    edited["storage"] = "files"
    hand.write_text(json.dumps(edited))
    half = broker.data_dir / "topics" / "half"  # what `--set storage=files` used to leave behind
    half.mkdir()
    (half / "topic.json").write_text(json.dumps({"storage": "files", "retention_ms": "7d"}))

    broker.start()
    with Admin(broker.address) as admin:
        errors = {e["setting"]: e for e in admin.describe_topic("hand")["config_errors"]}
        assert set(errors) == {"retention_ms", "read_only", "segment_bytes", "storage"}, errors
        assert errors["segment_bytes"]["stored"] == 10 and errors["segment_bytes"]["used"] == 1024
        assert "at least 1024" in errors["segment_bytes"]["error"]
        half_info = admin.describe_topic("half")
        assert [e["setting"] for e in half_info["config_errors"]] == ["storage"]
        assert half_info["config"]["retention_ms"] == 7 * 86_400_000  # a human form on disk is read as such
    labels = 'setting="retention_ms",topic="hand"'
    assert broker.metric("conveyor_topic_config_errors_total", labels) == 1
    assert broker.metric("conveyor_topic_config_errors_total", 'topic="half"') == 1
    assert "topic hand: stored setting retention_ms" in "".join(broker.output), "".join(broker.output)

    # Rolls at the default 1 KiB; retention runs with the default 4 KB.
    publish_small_batches(broker.address, "hand", 300)
    publish_small_batches(broker.address, "half", 50)
    with Admin(broker.address) as admin:
        assert wait_for(lambda: admin.describe_topic("hand")["start_offset"] > 0, timeout=30)
        info = admin.describe_topic("hand")
        assert info["end_offset"] == 300 and info["segments"] > 1, info
        assert admin.describe_topic("half")["end_offset"] == 50
    assert broker.proc is not None and broker.proc.poll() is None

    broker.restart()  # and again after a restart: the stored values are reported, never fatal
    with Admin(broker.address) as admin:
        assert len(admin.describe_topic("hand")["config_errors"]) == 4
        fixed = admin.alter_topic("hand", retention_ms="1h", read_only=False)
        assert fixed["config_errors"] == [] and fixed["config"]["retention_ms"] == 3_600_000
    on_disk = json.loads(hand.read_text())
    assert (on_disk["retention_ms"], on_disk["read_only"], on_disk["storage"]) == (3_600_000, False, "file")
    assert on_disk["segment_bytes"] == 1024


def test_alter_applies_settings_live_and_replaces_topic_json(conveyor_broker):
    address = conveyor_broker.address
    created = conveyor_cli("topics", "create", "live", "--set", "segment_bytes=1KiB", "--broker", address)
    assert created.returncode == 0, created.stderr
    publish_small_batches(address, "live", 200)
    with Admin(address) as admin:
        before = admin.describe_topic("live")
    assert before["start_offset"] == 0 and before["segments"] > 5, before

    result = conveyor_cli("topics", "alter", "live", "--set", "retention_bytes=2KB", "--broker", address)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["retention_bytes"] == 2000
    with Admin(address) as admin:
        assert wait_for(lambda: admin.describe_topic("live")["start_offset"] > 0, timeout=30)
        assert admin.describe_topic("live")["end_offset"] == 200
    directory = conveyor_broker.data_dir / "topics" / "live"
    assert stored(conveyor_broker, "live")["retention_bytes"] == 2000
    assert [p.name for p in directory.iterdir() if p.suffix not in (".log", ".index")] == ["topic.json"]

    config_errors(conveyor_cli("topics", "alter", "live", "--set", "retention_ms=abc", "--broker", address), "abc")
    config_errors(conveyor_cli("topics", "alter", "live", "--set", "storage=memory", "--broker", address), "storage")
    config_errors(conveyor_cli("topics", "alter", "live", "--broker", address), "--set")
    assert stored(conveyor_broker, "live")["retention_ms"] == -1

    with Admin(address) as admin:
        admin.alter_topic("live", read_only="yes")
        with Producer(address, linger_ms=0) as producer, pytest.raises(ReadOnlyTopic):
            producer.send("live", b"refused").result(timeout=30)
        admin.alter_topic("live", read_only=False)
        with pytest.raises(UnknownTopic):
            admin.alter_topic("no-such-topic", retention_ms=1)
        with pytest.raises(ConfigError, match="at least 1024"):
            admin.alter_topic("live", segment_bytes=1)
    with Producer(address, linger_ms=0) as producer:
        assert producer.send("live", b"accepted").result(timeout=30) == 200

    conveyor_broker.restart()
    with Admin(address) as admin:
        config = admin.describe_topic("live")["config"]
    assert (config["retention_bytes"], config["read_only"], config["segment_bytes"]) == (2000, False, 1024)


def test_alter_on_a_memory_topic_and_its_segments_rolls_at_the_new_size(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("ephemeral", storage="memory")
        assert admin.alter_topic("ephemeral", retention_ms="1d")["config"]["retention_ms"] == 86_400_000
        admin.create_topic("rolls", segment_bytes="128MiB")
        publish_small_batches(address, "rolls", 30)
        assert admin.describe_topic("rolls")["segments"] == 1
        admin.alter_topic("rolls", segment_bytes="1KiB")
        publish_small_batches(address, "rolls", 60)
        assert admin.describe_topic("rolls")["segments"] > 3
    assert not (Path(conveyor_broker.data_dir) / "topics" / "ephemeral").exists()


def test_a_stored_group_setting_out_of_range_is_replaced_by_the_default(conveyor_broker):
    """The same class as topic.json: a hand-edited groups.json must not make a group dead-letter everything."""
    address = conveyor_broker.address
    publish_small_batches(address, "grouped", 5)
    with Admin(address) as admin:
        admin.reset_offsets("grouped", "g", "earliest")
    conveyor_broker.stop()
    path = conveyor_broker.data_dir / "topics" / "grouped" / "groups.json"
    groups = json.loads(path.read_text())
    groups["g"].update(max_deliveries=0, ack_timeout_ms=-5, dead_letter_topic="no such/name")
    path.write_text(json.dumps(groups))

    conveyor_broker.start()
    with Admin(address) as admin:
        settings = admin.describe_group("grouped", "g")["settings"]
    assert (settings["max_deliveries"], settings["ack_timeout_ms"], settings["dead_letter_topic"]) == (10, 30_000, "")
    output = "".join(conveyor_broker.output)
    assert "stored max_deliveries 0 is out of range" in output and "stored dead_letter_topic refused" in output
    with Subscription("grouped", "g", address=address) as sub:
        got = drain([sub], 5, timeout=30)[0]
    assert sorted(m.offset for m in got) == [0, 1, 2, 3, 4] and {m.attempt for m in got} == {1}
    with Admin(address) as admin:
        assert "grouped.dlq" not in {t["name"] for t in admin.list_topics()}
