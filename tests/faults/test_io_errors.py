"""fsync and write failing with EIO, short and torn writes, injected by ``broker/log/syscalls.py``.

The broker runs with ``CONVEYOR_FSIO_CONTROL`` naming a file the test writes
fault specs into while load runs. What must hold:

- no confirm for what was not synced: every confirmed message is still
  there after the fault, after a restart, and after a simulated power cut
  that also models what Linux does to the pages of a failed fsync (they may
  be marked clean without reaching the disk: "fsyncgate");
- the producer gets a retriable error (``STORAGE_IO_ERROR``) and its resend
  is stored once;
- no partial record is ever accepted: the files hold whole batches only.
"""

from __future__ import annotations

import contextlib
import time

import msgpack
import pytest
import zmq
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.log.syscalls import ENV_CONTROL, ENV_JOURNAL, read_journal, simulate_power_loss
from conveyor.broker.wire.protocol import Command, decode, encode

from conveyor import Admin, Producer
from tests.faults.fault_helpers import Load, fetch_all, judge, report
from tests.faults.test_files import batches_of
from tests.helpers import wait_for

TOPIC = "io"


def start(brokers, tmp_path, fsync: str = "batch", segment_bytes: int = 128 * 1024):
    control = tmp_path / "faults"
    journal = tmp_path / "fsio.journal"
    broker = brokers.start(
        fsync=fsync,
        extra=["--segment-bytes", str(segment_bytes)],
        env={ENV_CONTROL: str(control), ENV_JOURNAL: str(journal)},
    )
    return broker, control, journal


def inject(control, spec: str, times: int, gap: float, load: Load) -> None:
    """Write ``spec`` to the control file ``times`` times, ``gap`` apart, while confirms keep coming."""
    for i in range(times):
        before = load.confirmed_count
        control.write_text(f"{spec}\n# {i}\n")  # a new content each time: the broker re-reads it
        time.sleep(gap)
        with contextlib.suppress(AssertionError):  # confirms that stall are judged at the end
            wait_for(lambda b=before: load.confirmed_count > b, timeout=10)
    control.write_text("")


def faults_injected(journal) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in read_journal(journal):
        if event["op"] == "fault":
            counts[event["kind"]] = counts.get(event["kind"], 0) + 1
    return counts


def whole_batches_only(data_dir) -> int:
    """Walk every segment: every byte belongs to a whole batch. Returns how many batches."""
    total = 0
    for segment in sorted(data_dir.glob("topics/*/*.log")):
        spans = batches_of(segment)
        assert sum(size for _p, size in spans) == segment.stat().st_size, f"partial record in {segment}"
        total += len(spans)
    return total


def finish(broker, load: Load, journal, name: str, *, power_cut: bool) -> dict:
    """Stop the load, crash (and cut power), restart, and judge."""
    load.stop()
    assert not load.failures(), f"sends failed for good: {load.failures()[:3]}"
    broker.kill()
    cut = simulate_power_loss(broker.data_dir, journal) if power_cut else None
    broker.restart(kill=True)
    stored = fetch_all(broker.address, TOPIC)
    verdict = judge(load.confirmed(), load.sent(), stored)
    errors = broker.metric("conveyor_log_truncated_bytes_total")
    broker.stop()
    batches = whole_batches_only(broker.data_dir)
    numbers = {
        **verdict.numbers(),
        "faults_injected": faults_injected(journal),
        "zeroed_by_failed_fsync": sum(cut.holes.values()) if cut else 0,
        "batches_on_disk": batches,
        "torn_bytes_cut_at_restart": errors,
    }
    report(name, **numbers)
    verdict.assert_safe()
    return numbers


def test_a_failed_fsync_is_never_confirmed_even_after_a_power_cut(brokers, tmp_path):
    # Given producers under fsync=batch
    broker, control, journal = start(brokers, tmp_path)
    with Load(broker.address, TOPIC, producers=3, chunk=20, request_timeout_ms=1000) as load:
        assert wait_for(lambda: load.confirmed_count > 100, timeout=20)
        # When single fsyncs of the log fail now and then
        inject(control, "fsync_eio=1,match=.log", times=6, gap=0.3, load=load)
        # Then producers were told to retry, and got confirms again once fsync worked
        assert broker.metric("conveyor_protocol_errors_total", 'name="STORAGE_IO_ERROR"') >= 1
        before = load.confirmed_count
        assert wait_for(lambda: load.confirmed_count > before + 100, timeout=20)
        numbers = finish(broker, load, journal, "fsync-eio-then-power-cut", power_cut=True)
    assert numbers["faults_injected"].get("fsync_eio", 0) >= 3


def test_fsync_failing_for_a_while_confirms_nothing_until_it_works_again(brokers, tmp_path):
    broker, control, journal = start(brokers, tmp_path)
    with Load(broker.address, TOPIC, producers=3, chunk=20, request_timeout_ms=1000) as load:
        assert wait_for(lambda: load.confirmed_count > 100, timeout=20)
        # When every fsync fails for a second
        control.write_text("fsync_eio,match=.log")
        time.sleep(0.3)  # confirms in flight when it started may still arrive
        during = load.confirmed_count
        # a raw PUBLISH gets a retriable STORAGE_IO_ERROR
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.address)
        body = msgpack.packb([[None, None, b"raw"]])
        sock.send_multipart(encode(Command.PUBLISH, {"rid": 1, "topic": TOPIC, "pid": 99, "seq": 0}, body))
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart())
        assert (reply.command, reply.get("name"), reply.get("code")) == (Command.ERROR, "STORAGE_IO_ERROR", 104)
        time.sleep(0.7)
        # Then nothing was confirmed meanwhile
        assert load.confirmed_count == during, "confirms while every fsync failed"
        control.write_text("")
        # And once fsync works, the producers' resends are confirmed, and so is the raw resend, once
        assert wait_for(lambda: load.confirmed_count > during + 100, timeout=20)
        sock.send_multipart(encode(Command.PUBLISH, {"rid": 2, "topic": TOPIC, "pid": 99, "seq": 0}, body))
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart())
        sock.close()
        assert reply.command is Command.PUBLISHED, reply.header
        load.threads[0].sent.add(b"raw")  # no content type: it reads back as bytes
        load.threads[0].confirmed[b"raw"] = reply.get("base_offset")
        finish(broker, load, journal, "fsync-eio-for-a-second", power_cut=True)


@pytest.mark.parametrize(
    "spec",
    [
        "write_eio=1,match=.log",
        "write_enospc=1,match=.log",
        "short_write=1,match=.log",
        "torn_write=1,match=.log",
        "torn_write=1,ftruncate_eio=1,match=.log",
    ],
    ids=["eio", "enospc", "short", "torn", "torn-and-cut-fails"],
)
def test_failed_and_short_writes_leave_whole_batches_only(brokers, tmp_path, spec):
    broker, control, journal = start(brokers, tmp_path, segment_bytes=32 * 1024)
    with Load(broker.address, TOPIC, producers=3, chunk=20, request_timeout_ms=1000) as load:
        assert wait_for(lambda: load.confirmed_count > 100, timeout=20)
        inject(control, spec, times=4, gap=0.2, load=load)
        before = load.confirmed_count
        assert wait_for(lambda: load.confirmed_count > before + 100, timeout=20)
        # What consumers would read right now is whole and in place, before any restart
        confirmed = load.confirmed()  # before the read: all of it must be there
        stored = fetch_all(broker.address, TOPIC)
        verdict = judge(confirmed, load.sent(), stored)  # sent after the read: all it holds was sent
        verdict.assert_safe()
        numbers = finish(broker, load, journal, f"write-faults-{spec}", power_cut=False)
    assert numbers["torn_bytes_cut_at_restart"] == 0, "a partial record was left in the log"
    assert sum(numbers["faults_injected"].values()) >= 4


@pytest.mark.parametrize(
    ("fsync", "segment_bytes"), [("interval:30", 128 * 1024), ("batch", 2048)], ids=["interval", "rolls"]
)
def test_fsync_failures_inside_an_append_fail_every_confirm_they_cut(brokers, tmp_path, fsync, segment_bytes):
    # A sync can run inside an append: under interval:MS when the interval is due, under any policy when
    # the segment rolls (the sealed segment is synced first). When it fails, the log is cut back to its
    # durable offset, and every confirm still waiting for what was cut must fail, not just this PUBLISH's.
    broker, control, journal = start(brokers, tmp_path, fsync=fsync, segment_bytes=segment_bytes)
    with Load(broker.address, TOPIC, producers=3, chunk=20, request_timeout_ms=1000) as load:
        assert wait_for(lambda: load.confirmed_count > 100, timeout=20)
        inject(control, "fsync_eio=1,match=.log", times=15, gap=0.15, load=load)
        before = load.confirmed_count
        assert wait_for(lambda: load.confirmed_count > before + 100, timeout=20)
        confirmed = load.confirmed()  # before the read: all of it must be there
        stored = fetch_all(broker.address, TOPIC)
        verdict = judge(confirmed, load.sent(), stored)  # sent after the read: all it holds was sent
        verdict.assert_safe()
        finish(broker, load, journal, f"fsync-eio-in-append-{fsync}", power_cut=True)


@pytest.mark.parametrize("spec", ["write_eio,match=.dlq", "fsync_eio,match=.dlq"], ids=["write", "fsync"])
def test_dead_letters_survive_a_failing_dead_letter_topic(brokers, tmp_path, spec):
    # Given a group that dead-letters at the first nack, and a dead-letter topic whose writes fail
    broker, control, journal = start(brokers, tmp_path)
    with Admin(broker.address) as admin:
        admin.create_topic("dl.dlq")
    with Producer(broker.address) as producer:
        for i in range(200):
            producer.send("dl", f"d{i}")
    control.write_text(spec)
    sub = Subscription("dl", "g", address=broker.address, credit=50, max_deliveries=1)
    try:
        # When every message is nacked while the dead-letter topic cannot be written
        deadline = time.monotonic() + 1.5
        nacked = 0
        while time.monotonic() < deadline:
            batch = sub.receive(timeout=0.1)
            if batch:
                sub.nack(batch, error="poison")
                nacked += len(batch)
        assert broker.proc.poll() is None, "the broker died of a dead-letter write:\n" + "".join(broker.output[-5:])
        # Then, once it can be written, every message reaches it, none is lost on the way
        control.write_text("")

        def dead_lettered() -> set[int]:
            return {int(m.headers["x-origin-offset"]) for m in Admin(broker.address).fetch("dl.dlq", 0, 10_000)}

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and dead_lettered() != set(range(200)):
            batch = sub.receive(timeout=0.1)
            if batch:
                sub.nack(batch, error="poison")
    finally:
        sub.close()
    broker.restart(kill=True)
    got = dead_lettered()
    report(
        "dead-letter-faults",
        spec=spec,
        nacked_during_fault=nacked,
        dead_lettered=len(got),
        faults_injected=faults_injected(journal),
    )
    assert got == set(range(200)), f"never dead-lettered: {sorted(set(range(200)) - got)[:10]}"
