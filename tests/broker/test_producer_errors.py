"""What a Producer's futures fail with when the delivery timeout runs out, against a real broker.

A batch the broker keeps refusing with a retriable error is resent until
``delivery_timeout_ms``; then its futures fail with that error (class and
code), saying how many attempts were made. Only when no answer ever came is
it ``REQUEST_TIMEOUT``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tenacity
from conveyor.broker.log.syscalls import ENV_CONTROL

from conveyor import Admin, Producer
from conveyor.errors import RequestTimeout, StorageFull, StorageIOError
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for


def refused_send(address: str, topic: str) -> BaseException | None:
    producer = Producer(
        address,
        linger_ms=1,
        request_timeout_ms=1000,
        delivery_timeout_ms=1500,
        retry_wait=tenacity.wait_fixed(0.1),
    )
    try:
        return producer.send(topic, "refused").exception(timeout=15)
    finally:
        producer.close(timeout=5)


@pytest.mark.parametrize(
    "fault,error,code",
    [("write_eio", StorageIOError, 104), ("write_enospc", StorageFull, 103)],
    ids=["eio", "enospc"],
)
def test_a_batch_refused_until_its_delivery_timeout_fails_with_the_brokers_last_error(
    tmp_path: Path, fault, error, code
):
    # Given a broker whose appends to the topic fail with a retriable storage error
    control = tmp_path / "faults"
    with BrokerProcess(tmp_path / "data", env={ENV_CONTROL: str(control)}) as broker:
        with Admin(broker.address) as admin:
            admin.create_topic("refused")
        control.write_text(f"{fault},match=.log")
        # When a producer keeps resending a batch until its delivery timeout runs out
        failed = refused_send(broker.address, "refused")
        # Then its future fails with the broker's error, its class and code, not REQUEST_TIMEOUT
        assert type(failed) is error, repr(failed)
        assert (failed.code, failed.retriable) == (code, True)
        found = re.search(r"delivery timed out after (\d+) attempts; last error: ", failed.message)
        assert found, failed.message
        attempts = int(found.group(1))
        assert attempts >= 2 and failed.fields["attempts"] == attempts
        assert failed.fields["topic"] == "refused"
        # every attempt reached the broker and was refused (the last one maybe after the timeout)
        assert wait_for(lambda: sum(f"injected {fault}" in line for line in broker.output) >= attempts)
        # And once the fault is gone the topic takes writes again
        control.write_text("")
        with Producer(broker.address) as producer:
            assert producer.send("refused", "accepted").result(timeout=10) == 0


def test_a_batch_nobody_answers_fails_with_request_timeout(tmp_path: Path):
    # Given the address of a broker that is gone
    broker = BrokerProcess(tmp_path / "data").start()
    address = broker.address
    broker.kill()
    # When a batch is sent there, no answer ever comes: REQUEST_TIMEOUT, as before
    failed = refused_send(address, "anything")
    assert type(failed) is RequestTimeout, repr(failed)
    assert failed.code == 401 and "no confirm from" in failed.message
