"""``conveyor.testing.EtcdProcess``: the real etcd the cluster tests start, and its faults."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.etcd_process import EtcdProcess
from conveyor.testing import EtcdProcess as Exported


def test_the_testing_module_hands_it_out() -> None:
    assert Exported is EtcdProcess


def test_faults_keep_the_ports_and_the_data(etcd: EtcdProcess) -> None:
    endpoint, pid = etcd.endpoint, etcd.pid
    assert endpoint.startswith("http://127.0.0.1:") and etcd.healthy()
    etcd.put("/c/x", b"kept")

    etcd.pause()
    assert not etcd.healthy(timeout=0.5)
    etcd.resume()
    etcd.wait_healthy()

    etcd.restart(kill=True)
    assert etcd.pid != pid and etcd.endpoint == endpoint
    answer = etcd.post("kv/range", {"key": "L2MveA=="})  # /c/x
    assert answer["kvs"][0]["value"] == "a2VwdA=="  # kept

    etcd.stop()
    assert not etcd.running() and not etcd.healthy(timeout=0.5)
    etcd.start()
    assert etcd.healthy() and etcd.endpoint == endpoint


def test_stop_resumes_a_paused_etcd_first(etcd: EtcdProcess) -> None:
    etcd.pause()
    etcd.stop()
    assert not etcd.running()


def test_a_failed_start_says_why(tmp_path: Path) -> None:
    broken = EtcdProcess(tmp_path / "etcd", extra=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="no-such-flag"):
        broken.start(timeout=30)
    assert not broken.running()


def test_a_directory_it_made_is_removed() -> None:
    with EtcdProcess() as etcd:
        directory = etcd.directory
        assert etcd.healthy() and (directory / "data").is_dir()
    assert not directory.exists()
