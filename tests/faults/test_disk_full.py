"""Disk full: the data directory on a 4 MiB tmpfs, filled up by a ballast file.

Producers get a clear, retriable ``STORAGE_FULL``; what is stored stays
readable and consumable; publishing resumes when space is freed; nothing is
torn. If tmpfs cannot be mounted here, ENOSPC is injected by ``broker/log/syscalls.py``
instead (the test says so in its report).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request

import msgpack
import pytest
import zmq
from conveyor.broker.log.syscalls import ENV_CONTROL
from conveyor.broker.wire.protocol import Command, decode, encode

from conveyor import Producer
from conveyor.errors import RequestTimeout, StorageFull
from tests.faults.fault_helpers import consumers, drain_group, fetch_all, report
from tests.faults.test_io_errors import whole_batches_only
from tests.helpers import wait_for

TOPIC = "full"


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, or None when mounting is impossible here."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path, chunk: int = 64 * 1024) -> int:
    """Write ``path`` until the file system is full; return its size."""
    written = 0
    with path.open("wb", buffering=0) as f:
        block = b"\xee" * chunk
        while chunk:
            try:
                written += f.write(block[:chunk])
            except OSError:
                chunk //= 2
    return written


def raw_publish(address: str, seq: int, value: bytes = b"x" * 100, pid: int = 4242) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        body = msgpack.packb([[None, None, value]])
        sock.send_multipart(encode(Command.PUBLISH, {"rid": 1, "topic": TOPIC, "pid": pid, "seq": seq}, body))
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart())
        return {"command": reply.command.name, **reply.header}
    finally:
        sock.close()


def test_a_full_disk_refuses_publishes_clearly_harms_nothing_and_recovers(brokers, small_disk, tmp_path):
    # Given a broker whose data directory is on a small disk, with 2000 messages stored
    control = tmp_path / "faults"
    if small_disk is not None:
        data_dir, mode = small_disk / "data", "tmpfs"
        broker = brokers.start(data_dir=data_dir, extra=["--segment-bytes", str(512 * 1024)])
    else:  # pragma: no cover - only where mount is not allowed
        data_dir, mode = tmp_path / "data", "fsio-enospc"
        broker = brokers.start(data_dir=data_dir, env={ENV_CONTROL: str(control)})
    values = [f"before-{i}" for i in range(2000)]
    with Producer(broker.address) as producer:
        futures = [producer.send(TOPIC, v) for v in values]
        producer.flush(timeout=20)
    assert [f.result() for f in futures] == list(range(2000))
    # When the disk fills up
    if small_disk is not None:
        ballast = small_disk / "ballast"
        ballast_bytes = fill(ballast)
    else:  # pragma: no cover
        control.write_text("write_enospc,dirsync_eio=0")
        ballast_bytes = 0
    # (the last page of the active segment may still have room: use it up)
    slack: list[bytes] = []
    seq = 100
    for size in (1000, 100, 10, 1):
        while raw_publish(broker.address, seq, b"s" * size, pid=4243)["command"] == "PUBLISHED":
            slack.append(b"s" * size)
            seq += 1
        seq += 1
    # Then a producer is refused (it retries STORAGE_FULL until its delivery timeout is spent;
    # the Producer then reports REQUEST_TIMEOUT or STORAGE_FULL, whichever comes first)
    with Producer(broker.address, delivery_timeout_ms=1500, request_timeout_ms=1000) as producer:
        future = producer.send(TOPIC, "while-full")
        with pytest.raises((StorageFull, RequestTimeout)) as refused:
            future.result(timeout=20)
    # and on the wire the answer is STORAGE_FULL, retriable
    reply = raw_publish(broker.address, seq=0)
    assert (reply["command"], reply["name"], reply["code"]) == ("ERROR", "STORAGE_FULL", 103)
    assert broker.metric("conveyor_protocol_errors_total", 'name="STORAGE_FULL"') >= 2
    health_url = broker.metrics_url.replace("/metrics", "/healthz")
    with contextlib.suppress(urllib.error.HTTPError):
        health = json.loads(urllib.request.urlopen(health_url, timeout=5).read())
        assert health["status"] != "HEALTHY"
    # And everything stored is still served, and consumed
    assert [v for _o, v in fetch_all(broker.address, TOPIC)] == [*values, *slack]
    with consumers(broker.address, TOPIC, "g", n=1) as group:
        assert wait_for(lambda: len(group[0].deliveries) >= 2000 + len(slack), timeout=20)
    assert sorted(o for o, _v, _a in group[0].deliveries) == list(range(2000 + len(slack)))
    # And a producer that keeps retrying gets through once space is freed
    retrying = Producer(broker.address, delivery_timeout_ms=60_000, request_timeout_ms=1000)
    later = [retrying.send(TOPIC, f"after-{i}") for i in range(200)]
    time.sleep(1.0)
    assert not any(f.done() for f in later), "confirmed while the disk was full"
    if small_disk is not None:
        ballast.unlink()
    else:  # pragma: no cover
        control.write_text("")
    retrying.flush(timeout=30)
    retrying.close()
    first = 2000 + len(slack)
    assert [f.result() for f in later] == list(range(first, first + 200))
    assert raw_publish(broker.address, seq=0)["command"] == "PUBLISHED"
    with consumers(broker.address, TOPIC, "g", n=1) as group:
        assert drain_group(broker.address, TOPIC, "g", group, timeout=20)
    # And after a restart the log is whole: every confirmed message, no torn batch
    assert broker.stop() == 0
    assert whole_batches_only(data_dir) > 0
    broker.start()
    stored = [v for _o, v in fetch_all(broker.address, TOPIC)]
    assert stored == [*values, *slack, *(f"after-{i}" for i in range(200)), b"x" * 100]
    assert broker.metric("conveyor_log_truncated_bytes_total") == 0
    report(
        "disk-full",
        mode=mode,
        ballast_bytes=ballast_bytes,
        slack_messages=len(slack),
        stored=len(stored),
        raw_publish_got="STORAGE_FULL",
        producer_future_got=refused.value.name,
    )
