"""The cluster's key layout and records: every record round-trips, and a damaged one is a RecordError naming its key."""

from __future__ import annotations

import json

import pytest
from conveyor.broker.cluster import keys as k
from conveyor.broker.cluster.keys import (
    CreateRequest,
    DeleteRequest,
    Keys,
    NodeRecord,
    ParsedKey,
    PartitionState,
    ReassignRequest,
    RecordError,
    ShutdownRequest,
    TopicConfigRecord,
    TopicPartition,
)
from hypothesis import given
from hypothesis import strategies as st

KEYS = Keys("prod")
node_ids = st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True)
topics = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,20}", fullmatch=True)


def test_layout_is_the_one_of_the_design() -> None:
    tp = TopicPartition("orders", 0)
    assert KEYS.meta == "/conveyor/prod/meta"
    assert KEYS.node("n1") == "/conveyor/prod/nodes/n1"
    assert KEYS.controller == "/conveyor/prod/controller"
    assert KEYS.topic_config("orders") == "/conveyor/prod/topics/orders/config"
    assert KEYS.partition(tp) == "/conveyor/prod/topics/orders/partitions/0"
    assert KEYS.create_request("orders") == "/conveyor/prod/requests/create/orders"
    assert KEYS.shutdown_request("n1") == "/conveyor/prod/requests/shutdown/n1"
    assert KEYS.reassign_request(tp) == "/conveyor/prod/requests/reassign/orders/0"
    assert Keys().prefix == "/conveyor/default/"


@given(topics, st.integers(0, 10_000), node_ids)
def test_every_key_parses_back(topic: str, partition: int, node: str) -> None:
    tp = TopicPartition(topic, partition)
    assert KEYS.parse(KEYS.partition(tp)).tp == tp
    assert KEYS.parse(KEYS.reassign_request(tp)).tp == tp
    assert KEYS.parse(KEYS.topic_config(topic)).topic == topic
    assert KEYS.parse(KEYS.create_request(topic)).topic == topic
    assert KEYS.parse(KEYS.delete_request(topic)) == ParsedKey("delete", topic=topic)
    assert KEYS.parse(KEYS.node(node)).node_id == node
    assert KEYS.parse(KEYS.shutdown_request(node)).kind == "shutdown"
    assert KEYS.parse(KEYS.controller).kind == "controller"


@pytest.mark.parametrize(
    "key",
    [
        "/conveyor/other/nodes/n1",
        "/conveyor/prod/nodes/",
        "/conveyor/prod/nodes/a/b",
        "/conveyor/prod/topics/t/partitions/x",
        "/conveyor/prod/topics/t/partitions/-1",
        "/conveyor/prod/topics/t/partitions/01",
        "/conveyor/prod/topics/bad name/config",
        "/conveyor/prod/topics/../config",
        "/conveyor/prod/requests/create/",
        "/conveyor/prod/whatever",
    ],
)
def test_a_key_outside_the_layout_is_a_record_error(key: str) -> None:
    with pytest.raises(RecordError, match="conveyor"):
        KEYS.parse(key)


def test_a_bad_cluster_name_is_refused() -> None:
    with pytest.raises(RecordError):
        Keys("a/b")


states = st.lists(node_ids, min_size=1, max_size=5, unique=True).flatmap(
    lambda assignment: st.tuples(
        st.just(tuple(assignment)),
        st.lists(st.sampled_from(assignment), unique=True),
        st.integers(0, 2**31),
    )
)


@given(states)
def test_partition_state_round_trips(drawn: tuple[tuple[str, ...], list[str], int]) -> None:
    assignment, isr, epoch = drawn
    leader = isr[0] if isr else None
    state = PartitionState(assignment, leader, epoch, tuple(isr), leader is None)
    assert k.decode_partition("key", k.encode_partition(state)) == state


def test_other_records_round_trip() -> None:
    node = NodeRecord("n1", "tcp://h:1", "http://h:2", "1.0", 123)
    assert k.decode_node("key", "n1", k.encode_node(node)) == node
    assert "curve_public" not in json.loads(k.encode_node(node))  # a record without CURVE is as before
    curve = NodeRecord("n1", "tcp://h:1", curve_public="x" * 40)
    assert k.decode_node("key", "n1", k.encode_node(curve)) == curve
    config = TopicConfigRecord(3, 2, {"retention_ms": 1000})
    assert k.decode_topic_config("key", k.encode_topic_config(config)) == config
    assert "topic_id" not in json.loads(k.encode_topic_config(config))  # a record from before topic ids
    with_id = TopicConfigRecord(3, 2, {}, topic_id="5f0c")
    assert k.decode_topic_config("key", k.encode_topic_config(with_id)) == with_id
    partitioned = TopicConfigRecord(3, 2, {}, topic_id="5f0c", partitions=8)
    assert k.decode_topic_config("key", k.encode_topic_config(partitioned)) == partitioned
    assert "partitions" not in json.loads(k.encode_topic_config(with_id))  # one partition: the record as before
    with pytest.raises(RecordError, match="partitions"):
        k.decode_topic_config("key", b'{"replication_factor": 1, "min_insync_replicas": 1, "partitions": 1025}')
    assert k.decode_delete("key", k.encode_delete(DeleteRequest("n2"))) == DeleteRequest("n2")
    existing = CreateRequest("n1", 1, 1, {}, assignment=("n1",), leader_epoch=3, partitions=4)
    for create in (CreateRequest("n1"), CreateRequest("n1", 3, 2, {"a": 1}, (602, "too few")), existing):
        assert k.decode_create("key", k.encode_create(create)) == create
    shutdown = ShutdownRequest({TopicPartition("a.b", 0): "n2"}, done=True)
    assert k.decode_shutdown("key", k.encode_shutdown(shutdown)) == shutdown
    assert k.decode_shutdown("key", b"{}") == ShutdownRequest()
    for reassign in (ReassignRequest(("a", "b")), ReassignRequest(("a", "b", "c"), 2)):
        assert k.decode_reassign("key", k.encode_reassign(reassign)) == reassign
    with pytest.raises(RecordError, match="min_insync_replicas"):
        k.decode_reassign("key", b'{"assignment": ["a"], "min_insync_replicas": 2}')
    assert k.decode_controller("key", k.encode_controller("n1")) == "n1"
    assert json.loads(k.encode_meta()) == {"format": 1}


def test_the_partition_json_is_the_design_s() -> None:
    state = PartitionState(("a", "b", "c"), "a", 7, ("a", "b"), False)
    assert json.loads(k.encode_partition(state)) == {
        "assignment": ["a", "b", "c"],
        "leader": "a",
        "leader_epoch": 7,
        "isr": ["a", "b"],
        "offline": False,
    }


GOOD = {"assignment": ["a", "b"], "leader": "a", "leader_epoch": 1, "isr": ["a", "b"], "offline": False}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"assignment": "a"}, "wrong type"),
        ({"assignment": []}, "empty"),
        ({"assignment": ["a", "a"]}, "repeats"),
        ({"assignment": ["a", "b/c"]}, "node ids"),
        ({"isr": ["a", "z"]}, "not within assignment"),
        ({"leader": "b", "isr": ["a"]}, "not in isr"),
        ({"leader": None}, "exactly when online"),
        ({"offline": True}, "exactly when online"),
        ({"leader_epoch": -1}, ">= 0"),
        ({"leader_epoch": True}, "wrong type"),
        ({"leader_epoch": "1"}, "wrong type"),
    ],
)
def test_a_damaged_partition_record_says_what_is_wrong(change: dict[str, object], why: str) -> None:
    with pytest.raises(RecordError, match=why) as caught:
        k.decode_partition("/conveyor/prod/topics/t/partitions/0", json.dumps({**GOOD, **change}).encode())
    assert "/conveyor/prod/topics/t/partitions/0" in str(caught.value)


@pytest.mark.parametrize("value", [b"", b"{", b"[]", b"\xff\xfe", b"null", b'"x"'])
def test_a_value_that_is_not_a_json_object_is_a_record_error(value: bytes) -> None:
    for decode in (k.decode_partition, k.decode_topic_config, k.decode_create, k.decode_reassign):
        with pytest.raises(RecordError):
            decode("key", value)
    with pytest.raises(RecordError):
        k.decode_node("key", "n1", value)


def test_missing_fields_and_impossible_configs_are_record_errors() -> None:
    with pytest.raises(RecordError, match="missing field 'advertise'"):
        k.decode_node("key", "n1", b"{}")
    with pytest.raises(RecordError, match="min_insync_replicas 3 > replication_factor 2"):
        k.decode_topic_config("key", b'{"replication_factor": 2, "min_insync_replicas": 3}')
    with pytest.raises(RecordError, match="replication_factor"):
        k.decode_topic_config("key", b'{"replication_factor": 0, "min_insync_replicas": 1}')
    with pytest.raises(RecordError, match="refused"):
        k.decode_create("key", b'{"from": "n1", "refused": {"code": "x"}}')
    with pytest.raises(RecordError):
        k.decode_shutdown("key", b'{"successors": {"t/x": "n1"}}')
    with pytest.raises(RecordError):
        k.decode_controller("key", b'{"node": 3}')


@given(st.binary(max_size=64))
def test_no_bytes_crash_a_decoder(value: bytes) -> None:
    for decode in (k.decode_partition, k.decode_topic_config, k.decode_create, k.decode_reassign, k.decode_shutdown):
        try:
            decode("key", value)
        except RecordError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
fields = st.sampled_from(
    [
        "assignment",
        "leader",
        "leader_epoch",
        "isr",
        "offline",
        "replication_factor",
        "min_insync_replicas",
        "settings",
        "from",
        "config",
        "refused",
        "successors",
        "done",
        "advertise",
        "started_ms",
        "node",
    ]
)


@given(st.dictionaries(fields, json_values, max_size=6))
def test_no_json_object_crashes_a_decoder(obj: dict[str, object]) -> None:
    value = json.dumps(obj).encode()
    for decode in (
        k.decode_partition,
        k.decode_topic_config,
        k.decode_create,
        k.decode_reassign,
        k.decode_shutdown,
        k.decode_controller,
    ):
        try:
            decode("key", value)
        except RecordError:
            pass
    try:
        k.decode_node("key", "n1", value)
    except RecordError:
        pass
