"""CURVE: encryption and authentication between clients and the broker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from broker import security
from broker.client import Admin, Producer
from broker.errors import BrokerUnavailable
from consumers.session import Subscription
from consumers.testing import BrokerProcess


@pytest.fixture
def keys(tmp_path):
    security.generate(tmp_path / "server", "broker")
    security.generate(tmp_path / "clients", "alice")
    security.generate(tmp_path / "strangers", "mallory")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(tmp_path / "clients" / "alice.key", authorized / "alice.key")
    return tmp_path


@pytest.fixture
def secure_broker(keys, tmp_path):
    broker = BrokerProcess(
        tmp_path / "data",
        extra=[
            "--curve-secret-key",
            str(keys / "server" / "broker.key_secret"),
            "--curve-authorized-keys",
            str(keys / "authorized"),
        ],
    ).start()
    yield broker
    broker.stop()


@pytest.fixture
def as_client(monkeypatch):
    def use(server_key, client_key_file):
        monkeypatch.setattr(security, "_configured", None)
        monkeypatch.setenv("CONVEYOR_CURVE_SERVER_KEY", str(server_key))
        monkeypatch.setenv("CONVEYOR_CURVE_KEY", str(client_key_file))

    yield use
    monkeypatch.delenv("CONVEYOR_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_CURVE_KEY", raising=False)


def test_an_authorized_client_works_end_to_end(secure_broker, keys, as_client):
    as_client(keys / "server" / "broker.key", keys / "clients" / "alice.key_secret")
    with Producer(secure_broker.address) as producer:
        assert producer.send("secret", "hello").result(timeout=10) == 0
    sub = Subscription("secret", "g", address=secure_broker.address)
    got = []
    for _ in range(50):
        got += sub.receive(timeout=0.1)
        if got:
            break
    sub.ack(got)
    sub.close()
    assert [m.value for m in got] == ["hello"]
    # The CLI takes the same keys as flags.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_CURVE")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker",
            "tail",
            "secret",
            "--from",
            "earliest",
            "--count",
            "1",
            "--format",
            "json",
            "--broker",
            secure_broker.address,
            "--curve-server-key",
            str(keys / "server" / "broker.key"),
            "--curve-key",
            str(keys / "clients" / "alice.key_secret"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert '"value": "hello"' in out.stdout


def test_an_unauthorized_key_is_refused(secure_broker, keys, as_client):
    as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
    with Admin(secure_broker.address, timeout_ms=1500) as admin, pytest.raises(BrokerUnavailable):
        admin.list_topics()


def test_a_plaintext_client_is_refused(secure_broker):
    with Admin(secure_broker.address, timeout_ms=1500) as admin, pytest.raises(BrokerUnavailable):
        admin.list_topics()


def test_a_wrong_server_key_is_refused(secure_broker, keys, as_client):
    as_client(keys / "strangers" / "mallory.key", keys / "clients" / "alice.key_secret")
    with Admin(secure_broker.address, timeout_ms=1500) as admin, pytest.raises(BrokerUnavailable):
        admin.list_topics()
