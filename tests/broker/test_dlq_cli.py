"""``conveyor dlq list|replay``: dead letters made for real by a broker process, read and replayed by the command.

A group with ``max_deliveries=1`` and a nack makes the broker dead-letter a
message into ``<topic>.dlq``; the command runs as a subprocess
(``python -m conveyor dlq ...``), and the replayed messages are consumed from
the origin topic with their history in the headers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from conveyor import Admin, Consumer, Message
from conveyor.testing import BrokerProcess
from tests.broker.broker_helpers import conveyor_cli
from tests.helpers import TIMEOUT, free_address, publish, wait_for


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("dlq-cli")).start()
    yield process
    process.stop()


def end_offset(broker: BrokerProcess, topic: str) -> int:
    with Admin(broker.address) as admin:
        try:
            return int(admin.describe_topic(topic)["end_offset"])
        except Exception:  # not there yet: the dead-letter topic appears with its first dead letter
            return 0


def dead_letter(broker: BrokerProcess, topic: str, values: list[object], keys: list[str]) -> None:
    """Publish ``values`` and nack each once in a group that allows one delivery: the broker dead-letters them."""
    publish(broker.address, topic, values, keys=keys, headers={"trace": "t-1"})
    with Consumer(topic, group="billing", address=broker.address, max_deliveries=1, timeout=TIMEOUT) as c:
        for n, message in enumerate(c, 1):
            c.nack(message, error=f"card declined: {message.key}")
            if n == len(values):
                break
        # Still subscribed, so that each reason is the nack's: closed at once, the broker may find the
        # consumer gone (sending it an EVENT) before it reads the last NACK, and dead-letter that one itself.
        wait_for(lambda: end_offset(broker, f"{topic}.dlq") == len(values), message="the dead letters")


def consume(broker: BrokerProcess, topic: str, group: str, count: int) -> list[Message]:
    got: list[Message] = []
    with Consumer(topic, group=group, address=broker.address, timeout=TIMEOUT) as c:
        for message in c:
            got.append(message)
            c.ack(message)
            if len(got) == count:
                break
    return got


def dlq(broker: BrokerProcess, *args: str):
    return conveyor_cli("dlq", *args, "--broker", broker.address)


def test_list_shows_each_dead_letter_with_its_origin_deliveries_and_reason(broker):
    dead_letter(broker, "bills", [{"id": 1}, {"id": 2}], keys=["k1", "k2"])

    table = dlq(broker, "list", "bills.dlq")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["OFFSET", "ORIGIN", "ORIGIN_PARTITION", "ORIGIN_OFFSET"]
    assert "card declined: k1" in lines[1] and lines[1].split()[:3] == ["0", "bills", "0"]
    assert "card declined: k2" in lines[2] and len(lines) == 3

    rows = [json.loads(line) for line in dlq(broker, "list", "bills.dlq", "--format", "json").stdout.splitlines()]
    assert [(r["offset"], r["origin_topic"], r["origin_offset"], r["group"], r["deliveries"]) for r in rows] == [
        (0, "bills", 0, "billing", 1),
        (1, "bills", 1, "billing", 1),
    ]
    assert [r["reason"] for r in rows] == ["card declined: k1", "card declined: k2"]

    first = dlq(broker, "list", "bills.dlq", "--limit", "1")
    assert len(first.stdout.splitlines()) == 2 and "showing the first 1 of 2" in first.stderr


def test_replay_sends_dead_letters_back_to_their_origin_with_their_history(broker):
    dead_letter(broker, "refunds", [{"id": 7}, "plain text"], keys=["a", "b"])

    dry = dlq(broker, "replay", "refunds.dlq", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would replay 2 dead letter(s)" in dry.stdout and end_offset(broker, "refunds") == 2, "nothing sent"

    done = dlq(broker, "replay", "refunds.dlq")
    assert done.returncode == 0, done.stderr
    assert "replayed 2 dead letter(s) from refunds.dlq (offsets 0-1) to refunds" in done.stdout
    assert "--from-offset 2" in done.stderr, "it says where to start next time"

    replayed = consume(broker, "refunds", "billing", 2)  # the group that dead-lettered them gets them again
    assert [(m.offset, m.key, m.value) for m in replayed] == [(2, "a", {"id": 7}), (3, "b", "plain text")]
    headers = replayed[0].headers
    assert headers["x-replayed-from"] == "refunds.dlq@0" and headers["x-replay-count"] == "1"
    assert headers["trace"] == "t-1", "the original headers stay"
    assert headers["x-last-error"] == "card declined: a" and headers["x-origin-offset"] == "0", "and why it died"
    assert replayed[1].headers["x-replayed-from"] == "refunds.dlq@1"

    # A range, to another topic: the user picks what is sent again.
    publish(broker.address, "refunds-retry", ["seed"])
    again = dlq(broker, "replay", "refunds.dlq", "--from-offset", "1", "--to-offset", "1", "--to", "refunds-retry")
    assert again.returncode == 0, again.stderr
    assert "replayed 1 dead letter(s) from refunds.dlq (offsets 1-1) to refunds-retry" in again.stdout
    (copy,) = consume(broker, "refunds-retry", "audit", 2)[1:]
    assert (copy.key, copy.value, copy.headers["x-replayed-from"]) == ("b", "plain text", "refunds.dlq@1")


def test_errors_are_one_line_with_their_code_and_exit_2(broker):
    unknown = dlq(broker, "list", "nothing-here.dlq")
    assert unknown.returncode == 2 and "[UNKNOWN_TOPIC]" in unknown.stderr, unknown.stderr
    assert "Traceback" not in unknown.stderr

    down = conveyor_cli("dlq", "list", "orders.dlq", "--broker", free_address(), "--timeout", "0.5")
    assert down.returncode == 2 and "[BROKER_UNAVAILABLE]" in down.stderr, down.stderr

    empty = dlq(broker, "replay", "orders.dlq", "--from-offset", "3", "--to-offset", "1")
    assert empty.returncode == 2 and "[CONFIG_ERROR]" in empty.stderr and "empty range" in empty.stderr

    dead_letter(broker, "typos", ["x"], keys=["k"])
    typo = dlq(broker, "replay", "typos.dlq", "--to", "no-such-topic")
    assert typo.returncode == 2 and "[UNKNOWN_TOPIC]" in typo.stderr and "no-such-topic" in typo.stderr
    assert end_offset(broker, "no-such-topic") == 0 and end_offset(broker, "typos") == 1, "nothing was sent"


def test_a_partitioned_topics_dead_letters_go_back_to_their_partitions(broker):
    with Admin(broker.address) as admin:
        admin.create_topic("parts", partitions=2)
    keys = [f"key-{i}" for i in range(8)]  # crc32 spreads them over both partitions
    dead_letter(broker, "parts", [f"v-{i}" for i in range(8)], keys=keys)

    rows = [json.loads(line) for line in dlq(broker, "list", "parts.dlq", "--format", "json").stdout.splitlines()]
    assert len(rows) == 8 and {r["partition"] for r in rows} == {0, 1}
    assert all(r["partition"] == r["origin_partition"] for r in rows), "partition k's dead letters are in k"
    table = dlq(broker, "list", "parts.dlq").stdout.splitlines()
    assert table[0].split()[:2] == ["PARTITION", "OFFSET"]

    ranged = dlq(broker, "replay", "parts.dlq", "--from-offset", "0")
    assert ranged.returncode == 2 and "--partition N" in ranged.stderr, "offsets are per partition"

    done = dlq(broker, "replay", "parts.dlq")
    assert done.returncode == 0 and "replayed 8 dead letter(s)" in done.stdout, done.stderr
    replayed = consume(broker, "parts", "billing", 8)
    origin = {r["key"]: r for r in rows}
    for message in replayed:
        row = origin[message.key]
        assert message.partition == row["origin_partition"]
        assert message.headers["x-replayed-from"] == f"parts.dlq@{row['partition']}:{row['offset']}"
        assert message.value == f"v-{message.key.split('-')[1]}"


def test_the_range_the_target_and_the_history_are_decided_without_a_broker():
    from conveyor.broker.cli.dlq import Span, replay_headers, replay_target, span_of

    assert span_of(0, 5, 20, None, None) == Span(0, 5, 20), "the whole topic as it is now"
    assert span_of(0, 5, 20, 2, 9) == Span(0, 5, 10), "--to-offset is included; below the start is clamped"
    assert span_of(0, 5, 20, 30, None) == Span(0, 30, 30), "past the end: nothing"

    def letter(**headers: str) -> Message:
        return Message("orders.dlq", 7, 0.0, "k", headers, b"{}", partition=1)

    dead = letter(**{"x-origin-topic": "orders", "x-origin-partition": "1", "trace": "t"})
    assert replay_target(dead, None) == ("orders", 1)
    assert replay_target(dead, "orders-retry") == ("orders-retry", None), "another topic: the key decides"
    assert replay_target(letter(), None) is None, "no origin and no --to: skipped"
    assert replay_target(letter(), "elsewhere") == ("elsewhere", None)

    once = replay_headers(dead, "orders.dlq", many=True)
    assert once["x-replayed-from"] == "orders.dlq@1:7" and once["x-replay-count"] == "1" and once["trace"] == "t"
    again = replay_headers(letter(**once), "orders.dlq", many=False)
    assert again["x-replay-count"] == "2" and again["x-replayed-from"] == "orders.dlq@7"
