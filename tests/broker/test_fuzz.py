"""Malformed input against the live broker: it answers, counts, and keeps serving."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.client import Admin, Producer
from broker.errors import ConveyorError
from broker.protocol import SIGNATURE, Command, decode
from consumers.testing import BrokerProcess

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
