"""The etcd client over TLS with client certificates, against a real etcd serving https."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conveyor.broker.cluster.etcd import Etcd

from conveyor.errors import EtcdError
from conveyor.etcd_process import EtcdProcess, EtcdTls
from tests.cluster.etcd_helpers import Collected
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the test certificates need openssl")


@pytest.fixture
def tls(tmp_path: Path) -> EtcdTls:
    return EtcdTls.generate(tmp_path / "tls")


@pytest.fixture
def tls_etcd(tmp_path: Path, tls: EtcdTls) -> Iterator[EtcdProcess]:
    etcd = EtcdProcess(tmp_path / "etcd", tls=tls).start()
    yield etcd
    etcd.close()


def test_calls_watches_and_keepalives_over_tls(
    tls_etcd: EtcdProcess, tls: EtcdTls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # requests lets this variable override a session's CA: the client passes its CA with each request.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    assert tls_etcd.endpoint.startswith("https://")
    with Etcd([tls_etcd.endpoint], ca=str(tls.ca), cert=str(tls.client_cert), key=str(tls.client_key)) as client:
        collected = Collected()
        client.watch("/c/", start_revision=1, on_event=collected.on_event, on_resync=collected.on_resync)
        lease = client.lease(2, on_lost=lambda: None)
        client.put("/c/nodes/a", b"a", lease=lease.id)
        assert client.put_if_absent("/c/meta", b"{}").succeeded
        assert collected.wait(2) == [("PUT", "/c/nodes/a", b"a"), ("PUT", "/c/meta", b"{}")]
        wait_for(lambda: lease.refreshes >= 3, message="three refreshes")
        assert not lease.lost.is_set()


def test_without_a_client_certificate_or_the_ca_etcd_is_unavailable(tls_etcd: EtcdProcess, tls: EtcdTls) -> None:
    with pytest.raises(EtcdError, match="SSL"):
        Etcd([tls_etcd.endpoint], ca=str(tls.ca), timeout=5).get("/c/x")
    with pytest.raises(EtcdError, match="CERTIFICATE_VERIFY_FAILED"):
        Etcd([tls_etcd.endpoint], cert=str(tls.client_cert), key=str(tls.client_key), timeout=5).get("/c/x")
