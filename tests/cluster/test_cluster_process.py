"""``conveyor.testing.ClusterProcess``: starting a cluster while other processes take ports too.

Under ``make test`` two pytest workers (and their brokers and clients) pick free ports at the
same time, so a port probed free may be taken before a broker binds it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import conveyor.cluster_process as cluster_process
from conveyor.cluster_process import ClusterProcess
from conveyor.etcd_process import free_port


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process holds (listening) for the whole test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_taken_after_it_was_probed_is_replaced_at_the_first_start(
    tmp_path: Path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([taken])
    monkeypatch.setattr(cluster_process, "free_port", lambda: next(ports, None) or free_port())
    cluster = ClusterProcess(tmp_path / "cluster", nodes=1)
    try:
        cluster.start()
        assert cluster.address("n1") != f"tcp://127.0.0.1:{taken}"
        assert cluster.registered() == {"n1"}
    finally:
        cluster.kill()


def test_a_cluster_that_cannot_start_leaves_no_process_behind(tmp_path: Path, taken: int) -> None:
    cluster = ClusterProcess(tmp_path / "cluster", nodes=2, addresses={"n2": f"tcp://127.0.0.1:{taken}"})
    with pytest.raises(RuntimeError, match="Address already in use"):
        cluster.start(timeout=30)
    assert not cluster.etcd.running()
    assert all(broker.proc is None or broker.proc.poll() is not None for broker in cluster.brokers.values())
