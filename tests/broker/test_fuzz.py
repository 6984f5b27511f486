"""Malformed input against the live broker: it answers, counts, and keeps serving."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
import zmq
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.server import admin as admin_ops
from conveyor.broker.wire import schema
from conveyor.broker.wire.protocol import SIGNATURE, Command, decode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import Admin, Producer
from conveyor.errors import ConveyorError, InvalidRequest
from conveyor.testing import BrokerProcess
from tests.broker.bad_fields import ADMIN_OPS, COMMANDS, one_bad_field
from tests.helpers import wait_for

SILENT = {
    Command.HEARTBEAT,
    Command.BYE,
    Command.ACK,
    Command.NACK,
    Command.IN_PROGRESS,
    Command.TERM,
    Command.CREDIT,
    Command.FETCH,
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    process = BrokerProcess(
        tmp_path_factory.mktemp("fuzz"), extra=["--max-message-bytes", "4096", "--max-batch-bytes", "65536"]
    ).start()
    yield process
    assert process.stop() == 0, "the broker exits cleanly after the fuzzing"


@pytest.fixture(scope="module")
def raw(broker):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    yield sock
    sock.close()


def header(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


commands = st.sampled_from([bytes([c]) for c in Command] + [b"\x00", b"\xff", b"", b"\x02\x02"])
garbage = st.binary(max_size=64)
headers = st.one_of(
    garbage,
    st.builds(
        header,
        st.dictionaries(
            st.text(max_size=8),
            st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.binary(max_size=8), st.none()),
            max_size=6,
        ),
    ),
    st.builds(
        header,
        st.fixed_dictionaries(
            {"topic": st.one_of(st.text(max_size=300), st.integers(-(2**63), 2**63)), "rid": st.integers(0, 10)}
        ),
    ),
    st.builds(nested, st.integers(100, 5000)),
    st.just(b"\xdf\xff\xff\xff\xff"),  # a map declaring 4 billion entries
    st.just(b"\xc6\xff\xff\xff\xff"),  # bin declaring 4 GiB
)
bodies = st.one_of(
    garbage,
    st.just(b"\xdd\xff\xff\xff\xff"),
    st.builds(nested, st.integers(100, 5000)),
    st.just(header([[None, None, b"x" * 5000]])),
    st.just(header([[1, 2, 3]])),
)
messages = st.one_of(
    st.lists(garbage, min_size=0, max_size=6),
    st.builds(lambda c, h, b: [SIGNATURE, c, h, *b], commands, headers, st.lists(bodies, max_size=3)),
    st.builds(lambda c, h: [b"CVY9", c, h], commands, headers),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=messages)
def test_malformed_frames_get_an_error_and_the_broker_survives(broker, raw, frames):
    if not frames or all(len(f) == 0 for f in frames):
        frames = [b""]
    raw.send_multipart(frames)
    try:
        decode(frames, max_batch_bytes=65536)
        expect_reply = False  # well-formed by chance: some commands answer nothing
    except ConveyorError:
        expect_reply = True
    if expect_reply:
        assert raw.poll(5000), f"no answer to {frames!r}"
        reply = decode(raw.recv_multipart())
        assert reply.command is Command.ERROR
        assert isinstance(reply.get("code"), int) and reply.get("message")
    else:
        while raw.poll(50):
            raw.recv_multipart()
    assert broker.proc.poll() is None, "the broker is still running"


def test_errors_are_counted_and_normal_clients_still_work(broker, raw):
    before = broker.metric("conveyor_protocol_errors_total")
    raw.send_multipart([b"junk"])
    assert raw.poll(5000)
    assert decode(raw.recv_multipart()).get("name") == "MALFORMED_FRAME"
    raw.send_multipart(
        [SIGNATURE, bytes([Command.PUBLISH]), header({"topic": "bad name!"}), header([[None, None, b"x"]])]
    )
    assert decode(raw.recv_multipart()).get("name") == "INVALID_NAME"
    raw.send_multipart(
        [SIGNATURE, bytes([Command.PUBLISH]), header({"topic": "big"}), header([[None, None, b"x" * 5000]])]
    )
    assert decode(raw.recv_multipart()).get("name") == "MESSAGE_TOO_LARGE"
    assert broker.metric("conveyor_protocol_errors_total") >= before + 3
    with Producer(broker.address) as producer:
        assert producer.send("after-fuzz", "still fine").result(timeout=10) == 0
    with Admin(broker.address) as admin:
        assert [m.value for m in admin.fetch("after-fuzz", 0, 10)] == ["still fine"]
        assert "big" not in {t["name"] for t in admin.list_topics()} or admin.describe_topic("big")["end_offset"] == 0


# --- one bad header field per command and ADMIN op: the exact code, with the request's rid -------


@pytest.fixture
def dealer(broker):
    with Admin(broker.address) as admin:
        if "fz" not in {t["name"] for t in admin.list_topics()}:
            admin.create_topic("fz")  # so that a good ADMIN alter_topic reaches its setting checks
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    yield sock
    sock.close()


def answer(sock, rid, timeout: float = 10.0):
    """The reply to the request ``rid`` (an ERROR without rid when the rid itself was bad)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            break
        reply = decode(sock.recv_multipart())
        if reply.get("rid") == rid or (rid is None and reply.command is Command.ERROR):
            return reply
    raise AssertionError(f"no answer to rid {rid!r} in {timeout} s")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=one_bad_field())
def test_out_of_range_and_ill_typed_fields_get_the_right_error(broker, dealer, case):
    frames, code, rid, what = case
    dealer.send_multipart(frames)
    reply = answer(dealer, rid)
    assert reply.command is Command.ERROR, f"{what}: answered {reply.command.name} {reply.header}"
    assert (reply.get("code"), reply.get("rid")) == (code, rid), f"{what}: {reply.header}"
    assert "internal error" not in reply.get("message", ""), what
    assert broker.proc.poll() is None, f"{what} ended the broker"


def test_every_command_and_admin_op_is_covered_by_the_bad_field_cases():
    client_commands = {c for c in Command if c < Command.HEARTBEAT} | {Command.HEARTBEAT, Command.BYE}
    assert set(COMMANDS) | {Command.ADMIN} == client_commands
    assert set(ADMIN_OPS) == set(admin_ops.OPS)
    assert set(ADMIN_OPS) == set(schema.ADMIN_OPS)
    for command, (_base, fields) in COMMANDS.items():
        assert set(fields) | {"rid"} == set(schema.COMMANDS[command.name]), command


REPORTED = [
    ("sub -1", Command.SUBSCRIBE, {"sub": -1, "topic": "rep", "group": "g"}, 207),
    ("sub 2**32", Command.SUBSCRIBE, {"sub": 2**32, "topic": "rep", "group": "g"}, 207),
    ("pid 2**63", Command.PUBLISH, {"topic": "rep", "pid": 2**63, "seq": 0}, 207),
    ("seq 2**31", Command.PUBLISH, {"topic": "rep", "pid": 1, "seq": 2**31}, 207),
    (
        "start timestamp x",
        Command.SUBSCRIBE,
        {"sub": 1, "topic": "rep", "group": "g", "start": {"timestamp": "x"}},
        207,
    ),
    (
        "start offset inf",
        Command.SUBSCRIBE,
        {"sub": 1, "topic": "rep", "group": "g", "start": {"offset": math.inf}},
        207,
    ),
    (
        "reset to timestamp x",
        Command.ADMIN,
        {"op": "reset_offsets", "topic": "rep", "group": "g", "to": {"timestamp": "x"}},
        207,
    ),
    ("reset without to", Command.ADMIN, {"op": "reset_offsets", "topic": "rep", "group": "g"}, 207),
    ("config a list", Command.ADMIN, {"op": "create_topic", "topic": "rep2", "config": [1, 2]}, 500),
    ("config int keys", Command.ADMIN, {"op": "create_topic", "topic": "rep2", "config": {1: 2}}, 201),  # map keys: str
    ("fetch offset 2**63", Command.FETCH, {"topic": "rep", "offset": 2**63}, 207),
    ("ack range past 2**63", Command.ACK, {"sub": 1, "ranges": [[0, 2**64 - 1]]}, 207),
]


def test_the_reported_frames_get_invalid_request_and_the_broker_keeps_dispatching(broker, dealer):
    with Producer(broker.address) as producer:
        producer.send("rep", b"first").result(timeout=30)
    for i, (what, command, fields, code) in enumerate(REPORTED, start=1):
        body = [header([[None, None, b"x"]])] if command is Command.PUBLISH else []
        dealer.send_multipart([SIGNATURE, bytes([command]), header({"rid": i, **fields}), *body])
        reply = answer(dealer, i)
        assert (reply.command, reply.get("code")) == (Command.ERROR, code), (
            f"{what}: {reply.command.name} {reply.header}"
        )
    with Admin(broker.address) as admin:
        assert (
            admin.describe_group("rep", "g")["committed_offset"] == 0
            if "g" in admin.describe_topic("rep")["groups"]
            else True
        )
        assert "rep2" not in {t["name"] for t in admin.list_topics()}
    with Producer(broker.address) as producer:
        producer.send("rep", b"second").result(timeout=30)
    with Subscription("rep", "after", address=broker.address) as sub:  # the next dispatch
        got = []
        assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or len(got) >= 2, timeout=30)
        assert [m.body for m in got] == [b"first", b"second"]
    assert broker.proc.poll() is None


@pytest.mark.parametrize(
    ("call", "field_name"),
    [
        (lambda a: a.reset_offsets("cw", "g", 2**64), "to"),
        (lambda a: a.fetch("cw", 2**70), "offset"),
        (lambda a: a.create_topic("cw2", retention_ms=object()), "config"),
        (lambda a: a.describe_topic(object()), "topic"),
    ],
)
def test_a_value_the_wire_cannot_carry_is_an_invalid_request_and_the_client_stays_usable(broker, call, field_name):
    with Admin(broker.address) as admin:
        with pytest.raises(InvalidRequest, match=f"field '{field_name}' cannot be sent") as raised:
            call(admin)
        assert raised.value.fields["field"] == field_name
        assert isinstance(admin.list_topics(), list)  # the same client goes on


def test_a_raw_reset_offsets_without_a_target_is_refused_and_moves_nothing(broker):
    with Producer(broker.address) as producer:
        for future in [producer.send("rs", b"m") for _ in range(3)]:
            future.result(timeout=30)
    with Admin(broker.address) as admin:
        admin.reset_offsets("rs", "g", "latest")
        with pytest.raises(InvalidRequest, match="needs field 'to'"):
            admin.request(Command.ADMIN, {"op": "reset_offsets", "topic": "rs", "group": "g"})
        assert admin.describe_group("rs", "g")["committed_offset"] == 3
