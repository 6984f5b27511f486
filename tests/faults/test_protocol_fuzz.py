"""The protocol fuzzer, below ZeroMQ: raw bytes and hand-made ZMTP on the broker's TCP port.

``tests/broker/test_fuzz.py`` throws malformed Conveyor frames at the broker
through a ZeroMQ socket. This module goes under it, with a plain TCP socket:
random bytes, mutated ZMTP greetings, a hand-rolled ZMTP 3.0 client sending
the same malformed frames (its strategies are reused), wrong frame counts,
huge declared frame sizes, truncated frames, deep msgpack nesting. While it
runs, a normal producer and consumer keep working through the same broker.

What must hold: the broker never dies, its RSS stays bounded, every bad
message that reaches it is answered with an ERROR (or a clean disconnect)
and counted in ``conveyor_protocol_errors_total``, and the normal clients
see every confirmed message.
"""

from __future__ import annotations

import random
import socket
import struct
import time

import msgpack
import pytest
from conveyor.broker.wire.protocol import SIGNATURE, Command, decode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import Admin, Producer
from conveyor.errors import ConveyorError
from tests.broker.bad_fields import one_bad_field
from tests.broker.test_fuzz import messages as malformed_messages
from tests.broker.test_fuzz import nested
from tests.faults.fault_helpers import ConsumerThread, Load, fetch_all, judge, judge_group, report, rss_bytes
from tests.helpers import wait_for

MiB = 1 << 20
MAX_BATCH = 65536
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
assert len(GREETING) == 64
STATS = {"tcp_inputs": 0, "greetings": 0, "zmtp_messages": 0, "errors_received": 0, "disconnects": 0, "silent": 0}
RSS: list[int] = []


def zmtp_frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready_command(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return zmtp_frame(body, command=True)


class RawZmtp:
    """Just enough ZMTP 3.0 (NULL mechanism) to talk to the broker's ROUTER by hand."""

    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.buf = b""

    def handshake(self) -> None:
        self.sock.sendall(GREETING + ready_command())
        greeting = self._read(64)
        assert greeting[0] == 0xFF and greeting[9] == 0x7F, greeting
        flags, body = self._frame()
        assert flags & 4 and body[1:6] == b"READY", body

    def send(self, frames: list[bytes]) -> None:
        data = b"".join(zmtp_frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))
        self.sock.sendall(data)

    def recv(self, timeout: float) -> list[bytes] | None:
        """One message, None on timeout; raises EOFError when the broker hung up."""
        self.sock.settimeout(timeout)
        try:
            frames = []
            while True:
                flags, body = self._frame()
                if flags & 4:
                    continue  # a command (PING...): not a message
                frames.append(body)
                if not flags & 1:
                    return frames
        except TimeoutError:
            return None

    def _frame(self) -> tuple[int, bytes]:
        flags = self._read(1)[0]
        size = struct.unpack(">Q", self._read(8))[0] if flags & 2 else self._read(1)[0]
        return flags, self._read(size)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("the broker closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A broker with small limits, plus a normal producer and consumer running all along."""
    from tests.faults.fault_helpers import Brokers

    started = Brokers(tmp_path_factory.mktemp("rawfuzz"))
    broker = started.start(extra=["--max-message-bytes", "4096", "--max-batch-bytes", str(MAX_BATCH)])
    load = Load(broker.address, "bystander", producers=1, chunk=5, pause=0.02)
    consumer = ConsumerThread(broker.address, "bystander", "g", credit=50)
    load.__enter__()
    consumer.start()
    RSS.append(rss_bytes(broker.pid))
    with Admin(broker.address) as admin:
        admin.create_topic("fz")  # so that a good ADMIN alter_topic reaches its setting checks
    broker.errors_before = broker.metric("conveyor_protocol_errors_total")  # type: ignore[attr-defined]
    yield broker, load, consumer
    consumer.stop()
    load.stop()
    started.cleanup()


def alive(broker) -> None:
    assert broker.proc.poll() is None, "the broker died:\n" + "".join(broker.output[-20:])
    RSS.append(rss_bytes(broker.pid))


def mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(i, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[i:]
        elif op == 2:
            data[i:i] = rng.randbytes(rng.randint(1, 16))
        else:
            data[i:i] = b"\xff" * rng.randint(1, 8)
    return bytes(data)


def poke(address: str, data: bytes, *, read: float = 0.05) -> None:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        try:
            sock.sendall(data)
            sock.settimeout(read)
            sock.recv(4096)
        except OSError:
            pass  # reset, timeout: either is a fine answer to garbage
    STATS["tcp_inputs"] += 1


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(min_size=1, max_size=2048), st.binary(min_size=1, max_size=16).map(lambda b: b * 300)))
def test_random_bytes_on_the_tcp_port(target, data):
    broker, _load, _consumer = target
    poke(broker.address, data)
    alive(broker)


def test_mutated_greetings_on_the_tcp_port(target):
    broker, _load, _consumer = target
    rng = random.Random(9)
    valid = GREETING + ready_command()
    for i in range(2000):
        data = mutate(rng, valid)
        if i % 3 == 0:  # a greeting that may pass, then garbage in the frame layer
            data += rng.randbytes(rng.randint(1, 256))
        poke(broker.address, data, read=0.01)
        STATS["greetings"] += 1
        if i % 100 == 0:
            alive(broker)
    alive(broker)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=malformed_messages)
def test_malformed_messages_over_hand_made_zmtp_get_an_error(target, frames):
    broker, _load, _consumer = target
    if not frames:
        frames = [b""]
    try:
        decode(frames, max_batch_bytes=MAX_BATCH)
        expect_error = False
    except ConveyorError:
        expect_error = True
    conn = RawZmtp(broker.address)
    try:
        conn.handshake()
        conn.send(frames)
        STATS["zmtp_messages"] += 1
        reply = conn.recv(5.0 if expect_error else 0.05)
    except EOFError:
        reply = None
        STATS["disconnects"] += 1
    finally:
        conn.close()
    if expect_error and reply is not None:
        answer = decode(reply)
        assert answer.command is Command.ERROR and isinstance(answer.get("code"), int)
        STATS["errors_received"] += 1
    elif expect_error:
        assert sum(map(len, frames)) > MAX_BATCH, f"no answer to {frames!r}"  # only an oversized one is dropped
    else:
        STATS["silent"] += 1
    alive(broker)


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("huge-declared-frame", b"\x02" + struct.pack(">Q", 1 << 62) + b"x" * 100),
        ("over-max-message", b"\x02" + struct.pack(">Q", MAX_BATCH + 65536 + 1) + b"x" * 4096),
        ("huge-declared-command", b"\x06" + struct.pack(">Q", 1 << 40) + b"x" * 10),
        # libzmq keeps the parts of an unfinished multipart message, with no limit on their number:
        # memory grows by ~64 bytes per empty part (a known limit, see docs/reliability.md).
        ("many-more-frames", b"\x01\x00" * 100_000),
        ("truncated-frame", b"\x00\xff" + b"x" * 10),
    ],
)
def test_transport_abuse_is_a_disconnect_or_nothing(target, name, wire):
    broker, _load, _consumer = target
    before = rss_bytes(broker.pid)
    conn = RawZmtp(broker.address)
    try:
        conn.handshake()
        conn.sock.sendall(wire)
        try:
            conn.recv(0.5)
        except EOFError:
            STATS["disconnects"] += 1
    except (ConnectionResetError, BrokenPipeError):
        STATS["disconnects"] += 1
    finally:
        conn.close()
    STATS["zmtp_messages"] += 1
    alive(broker)
    assert rss_bytes(broker.pid) - before < 32 * MiB, f"{name} made the broker allocate"


def test_deep_nesting_and_wrong_frame_counts_over_zmtp(target):
    broker, _load, _consumer = target
    cases = [
        [SIGNATURE, bytes([Command.PUBLISH]), nested(50_000)],  # header nested 50k deep
        [SIGNATURE, bytes([Command.PUBLISH]), msgpack.packb({"topic": "t", "rid": 1}), nested(60_000)],
        [SIGNATURE],
        [SIGNATURE, bytes([Command.HELLO])],
        [SIGNATURE, bytes([Command.PUBLISH]), msgpack.packb({"topic": "t"}), b"\x90", b"\x90", b"\x90"],
        [b""] * 100,
        [SIGNATURE, bytes([Command.FETCH]), msgpack.packb({"rid": 3, "topic": "t", "max_messages": 1 << 62})],
    ]
    # An unknown header field is ignored (a newer client talking to this broker), however nested
    header = {"op": "list_topics", "rid": 2, "x": [[[[[[]]]]]]}
    unknown_field = [SIGNATURE, bytes([Command.ADMIN]), msgpack.packb(header)]
    conn = RawZmtp(broker.address)
    try:
        conn.handshake()
        replies = []
        for frames in cases:
            conn.send(frames)
            STATS["zmtp_messages"] += 1
            replies.append(conn.recv(5.0))
        conn.send(unknown_field)
        STATS["zmtp_messages"] += 1
        answer = conn.recv(5.0)
    finally:
        conn.close()
    errors = [decode(r).command for r in replies if r is not None]
    STATS["errors_received"] += errors.count(Command.ERROR)
    assert errors == [Command.ERROR] * len(cases)
    assert answer is not None and decode(answer).command is Command.RESULT
    alive(broker)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=one_bad_field())
def test_one_bad_header_field_over_hand_made_zmtp_gets_the_exact_code_and_its_rid(target, case):
    broker, _load, _consumer = target
    frames, code, rid, what = case
    conn = RawZmtp(broker.address)
    try:
        conn.handshake()
        conn.send(frames)
        STATS["zmtp_messages"] += 1
        reply = conn.recv(10.0)
    finally:
        conn.close()
    assert reply is not None, f"no answer to {what}"
    answer = decode(reply)
    assert answer.command is Command.ERROR, f"{what}: answered {answer.command.name} {answer.header}"
    assert (answer.get("code"), answer.get("rid")) == (code, rid), f"{what}: {answer.header}"
    STATS["errors_received"] += 1
    alive(broker)


def test_the_broker_counted_the_errors_and_the_bystanders_lost_nothing(target):
    broker, load, consumer = target
    # Normal clients still work, and the ones that ran all along saw everything confirmed
    with Producer(broker.address) as producer:
        producer.send("bystander", "last").result(timeout=10)
    load.stop()
    stored = fetch_all(broker.address, "bystander")
    sent = load.sent() | {"last"}
    verdict = judge(load.confirmed(), sent, stored)
    verdict.assert_safe()
    assert wait_for(lambda: len({o for o, _v, _a in consumer.deliveries}) >= len(stored), timeout=20)
    assert not judge_group([consumer], stored).missing
    counted = broker.metric("conveyor_protocol_errors_total") - broker.errors_before
    alive(broker)
    peak = max(RSS)
    report(
        "protocol-fuzz",
        **STATS,
        errors_counted=counted,
        rss_start_mib=round(RSS[0] / MiB, 1),
        rss_peak_mib=round(peak / MiB, 1),
        bystander_confirmed=verdict.confirmed,
    )
    assert counted >= STATS["errors_received"]
    assert peak - RSS[0] < 64 * MiB
    time.sleep(0)
