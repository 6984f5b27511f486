"""Fixtures of the cluster tests: a real etcd on free ports, and a client of it.

``etcd`` is the plugin's ``conveyor_etcd`` (an ``EtcdProcess``: ``.endpoint``, ``.stop()``,
``.kill()``, ``.pause()``, ``.resume()``, ``.restart()``); ``etcd_client`` is an ``Etcd`` on it,
closed after the test (its watches and keepalive threads with it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conveyor.broker.cluster.etcd import Etcd

from conveyor.etcd_process import EtcdProcess


@pytest.fixture
def etcd(conveyor_etcd: EtcdProcess) -> EtcdProcess:
    return conveyor_etcd


@pytest.fixture
def etcd_client(etcd: EtcdProcess) -> Iterator[Etcd]:
    client = Etcd([etcd.endpoint])
    yield client
    client.close()
