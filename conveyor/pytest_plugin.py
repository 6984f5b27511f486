"""The pytest plugin: a real broker on a free port, in a temporary directory.

Installed with Conveyor (entry point ``pytest11``); the fixtures can also be imported from
``conveyor.testing``. In any project::

    def test_orders(conveyor_broker):
        with Producer(conveyor_broker.address) as producer:
            producer.send("orders", {"id": 1}).result(timeout=5)

``conveyor_etcd`` is a real etcd (the ``etcd`` binary, Debian's ``etcd-server``) on free
loopback ports, for the cluster's tests: ``.endpoint``, ``.stop()``, ``.kill()``,
``.pause()``, ``.resume()``, ``.restart()``.

``conveyor_consumers`` is ``conveyor.testing.run_consumers``: ``with conveyor_consumers(bill) as app:``
runs the handlers in the real runner against the session's shared broker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.broker_process import BrokerProcess
from conveyor.etcd_process import EtcdProcess


@pytest.fixture
def conveyor_broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Start as many brokers as a test needs; all are stopped afterwards."""
    started: list[BrokerProcess] = []

    def start(*, fsync: str = "batch", extra: list[str] | None = None, name: str = "broker") -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"{name}-{len(started)}", fsync=fsync, extra=extra).start()
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@pytest.fixture
def conveyor_broker(conveyor_broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A running broker (``.address``, ``.metrics_url``, ``.data_dir``, ``.restart()``)."""
    return conveyor_broker_factory()


@pytest.fixture
def conveyor_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A running one-member etcd in ``tmp_path/etcd`` (``.endpoint``: ``http://127.0.0.1:PORT``); killed afterwards."""
    etcd = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield etcd
    finally:
        etcd.close()


@pytest.fixture
def conveyor_consumers() -> Callable[..., Any]:
    """``run_consumers``: run ``@consumer`` handlers against the session's broker (conveyor/consumer_harness.py)."""
    from conveyor.consumer_harness import run_consumers

    return run_consumers
