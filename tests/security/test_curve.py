"""CURVE: encryption and authentication between clients and the broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from conveyor.broker.client.async_producer import AsyncProducer
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.net import security

from conveyor import Admin, Producer
from conveyor.errors import AuthFailed
from conveyor.testing import BrokerProcess
from tests.helpers import curve_keys, wait_for


@pytest.fixture
def keys(tmp_path):
    return curve_keys(tmp_path)


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
            "conveyor",
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


# Refused clients get AUTH_FAILED from their handshake, long before this timeout would give a BrokerUnavailable.
SLOW = 30_000


def test_an_unauthorized_key_is_refused(secure_broker, keys, as_client):
    as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
    with Admin(secure_broker.address, timeout_ms=SLOW) as admin, pytest.raises(AuthFailed):
        admin.list_topics()


def test_a_plaintext_client_is_refused(secure_broker):
    with Admin(secure_broker.address, timeout_ms=SLOW) as admin, pytest.raises(AuthFailed):
        admin.list_topics()


def test_a_wrong_server_key_is_refused(secure_broker, keys, as_client):
    as_client(keys / "strangers" / "mallory.key", keys / "clients" / "alice.key_secret")
    with Admin(secure_broker.address, timeout_ms=SLOW) as admin, pytest.raises(AuthFailed):
        admin.list_topics()


# --- refusals are distinguishable, counted and logged; bad settings refuse to start ------------------------


def run_broker(tmp_path, *flags, timeout=30):
    """``conveyor broker`` with ``flags`` that should make it refuse to start: its exit code and output."""
    cmd = [sys.executable, "-m", "conveyor", "broker", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1"]
    cmd += ["--data-dir", str(tmp_path / "refused-data"), *map(str, flags)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr


def test_curve_without_authorized_keys_refuses_to_start(keys, tmp_path):
    code, output = run_broker(tmp_path, "--curve-secret-key", keys / "server" / "broker.key_secret")
    assert code == 2, output
    assert "CONFIG_ERROR" in output and "--curve-allow-any-client" in output, output


def test_a_public_key_given_as_the_secret_key_is_named_first(keys, tmp_path):
    # The public half passed where the secret one belongs: that is the mistake to name, whatever else is missing
    code, output = run_broker(tmp_path, "--curve-secret-key", keys / "server" / "broker.key")
    assert code == 2, output
    assert "CONFIG_ERROR" in output and "holds no secret key" in output and ".key_secret" in output, output


def test_curve_allow_any_client_encrypts_and_lets_any_key_in(keys, tmp_path, as_client):
    extra = ["--curve-secret-key", str(keys / "server" / "broker.key_secret"), "--curve-allow-any-client"]
    with BrokerProcess(tmp_path / "any", extra=extra) as broker:
        as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
        with Admin(broker.address, timeout_ms=SLOW) as admin:
            assert admin.list_topics() == []


@pytest.mark.parametrize("flag", ["--curve-authorized-keys", "--curve-allow-any-client"])
def test_a_curve_client_option_without_the_secret_key_refuses_to_start(keys, tmp_path, flag):
    args = [flag, keys / "authorized"] if flag == "--curve-authorized-keys" else [flag]
    code, output = run_broker(tmp_path, *args)
    assert code == 2, output
    assert "CONFIG_ERROR" in output and "--curve-secret-key" in output, output


def test_a_bad_authorized_key_file_refuses_to_start_and_names_it(keys, tmp_path):
    bad = keys / "authorized" / "bob.key"
    bad.write_text("not a certificate\n")
    secret = keys / "server" / "broker.key_secret"
    code, output = run_broker(tmp_path, "--curve-secret-key", secret, "--curve-authorized-keys", keys / "authorized")
    assert code == 2, output
    assert "CONFIG_ERROR" in output and str(bad) in output, output


def test_refused_clients_get_auth_failed_and_are_counted_and_logged(secure_broker, keys, as_client, monkeypatch):
    # Given a client whose key is not authorized: AUTH_FAILED, not a timeout
    as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
    with Admin(secure_broker.address, timeout_ms=SLOW) as admin, pytest.raises(AuthFailed) as refused:
        admin.list_topics()
    assert refused.value.code == 404 and "authorized" in refused.value.message
    # And a plaintext client
    monkeypatch.delenv("CONVEYOR_CURVE_SERVER_KEY")
    monkeypatch.delenv("CONVEYOR_CURVE_KEY")
    with Admin(secure_broker.address, timeout_ms=SLOW) as admin, pytest.raises(AuthFailed) as refused:
        admin.list_topics()
    assert "CONVEYOR_CURVE_KEY" in refused.value.message
    # Then the broker counted the refused key, and logged it
    assert wait_for(lambda: secure_broker.metric("conveyor_auth_failures_total", 'reason="unknown_key"') >= 1, 30)
    # And plaintext handshakes, as long as a client keeps trying: a refused plaintext socket gives up after its
    # first handshake, and one that hangs up before the broker reads its greeting leaves no reason, so each try
    # is a fresh socket (at most one a second) until the broker has counted one
    plaintext: list[zmq.Socket[bytes]] = []
    last_try = [-1.0]
    mismatched = 'reason="mechanism_mismatch"'

    def counted() -> bool:
        if secure_broker.metric("conveyor_auth_failures_total", mismatched) >= 1:
            return True
        if time.monotonic() - last_try[0] >= 1.0:
            last_try[0] = time.monotonic()
            plaintext.append(zmq.Context.instance().socket(zmq.DEALER))
            plaintext[-1].connect(secure_broker.address)
        return False

    try:
        assert wait_for(counted, 60, message="a counted plaintext handshake")
    finally:
        for sock in plaintext:
            sock.close(linger=0)
    logged = "".join(secure_broker.output)
    assert "refused CURVE client handshakes" in logged
    assert security.client_keys() is None


def test_producers_and_subscriptions_of_a_refused_client_get_auth_failed(secure_broker, keys, as_client):
    as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
    producer = Producer(secure_broker.address, request_timeout_ms=SLOW, delivery_timeout_ms=120_000)
    try:
        with pytest.raises(AuthFailed):
            producer.send("secret", b"x").result(timeout=60)
    finally:
        producer.close(timeout=5)

    async def publish() -> None:
        async with AsyncProducer(secure_broker.address, request_timeout_ms=SLOW) as aio:
            with pytest.raises(AuthFailed):
                await asyncio.wait_for(await aio.send("secret", b"x"), 60)
            # The refusal is known before the next send: that batch fails too, at once rather than at
            # request_timeout (SLOW, 30 s), which is past this wait.
            await asyncio.sleep(0.5)
            with pytest.raises(AuthFailed):
                await asyncio.wait_for(await aio.send("secret", b"y"), SLOW / 1000 * 2 / 3)

    asyncio.run(publish())
    sub = Subscription("secret", "g", address=secure_broker.address)
    try:
        with pytest.raises(AuthFailed):
            for _ in range(600):  # 60 s at most
                sub.receive(timeout=0.1)
    finally:
        sub.close()


def test_a_runner_whose_key_is_refused_exits_2_naming_auth_failed(secure_broker, keys, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["CONVEYOR_CURVE_SERVER_KEY"] = str(keys / "server" / "broker.key")
    env["CONVEYOR_CURVE_KEY"] = str(keys / "strangers" / "mallory.key_secret")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "monitoring" / "apps")
    cmd = [
        sys.executable,
        "-m",
        "conveyor",
        "run",
        "app_probe",
        "--broker",
        secure_broker.address,
        "--metrics-port",
        "-1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "AUTH_FAILED" in out.stdout + out.stderr


def test_a_mirror_refused_by_its_parent_names_auth_failed(secure_broker, keys, tmp_path):
    env = {
        "CONVEYOR_CURVE_SERVER_KEY": str(keys / "server" / "broker.key"),
        "CONVEYOR_CURVE_KEY": str(keys / "strangers" / "mallory.key_secret"),
    }
    child = BrokerProcess(tmp_path / "child", extra=["--upstream", secure_broker.address], env=env).start()
    try:
        with Admin(child.address, timeout_ms=SLOW) as admin:
            assert wait_for(lambda: "AUTH_FAILED" in str(admin.mirror_status().get("error", "")), 30)
            assert admin.mirror_status()["status"] == "UNHEALTHY"
    finally:
        child.stop()


def test_a_broker_restart_is_not_an_auth_failure(secure_broker, keys, as_client):
    as_client(keys / "server" / "broker.key", keys / "clients" / "alice.key_secret")
    with Producer(secure_broker.address, linger_ms=1) as producer:
        before = [producer.send("restarts", i) for i in range(50)]
        assert [f.result(timeout=30) for f in before] == list(range(50))
        sub = Subscription("restarts", "g", address=secure_broker.address)
        try:
            # When the broker is killed and comes back, several times
            for round_ in range(3):
                secure_broker.restart(kill=round_ % 2 == 0)
                during = [producer.send("restarts", i) for i in range(10)]
                # Then every client carries on: nothing is called a refusal
                assert all(isinstance(f.result(timeout=60), int) for f in during)
                with Admin(secure_broker.address, timeout_ms=SLOW) as admin:
                    assert any(t["name"] == "restarts" for t in admin.list_topics())
                for _ in range(20):
                    sub.receive(timeout=0.05)  # raises AUTH_FAILED if a restart looked like a refusal
        finally:
            sub.close()


def test_the_spark_connectors_connection_speaks_curve_and_names_a_refusal(secure_broker, keys, as_client):
    from conveyor.pipeline.broker_client import Connection

    as_client(keys / "server" / "broker.key", keys / "clients" / "alice.key_secret")
    with Connection(secure_broker.address, retry_for=0) as conn:
        assert isinstance(conn.admin("list_topics"), list)
    as_client(keys / "server" / "broker.key", keys / "strangers" / "mallory.key_secret")
    with Connection(secure_broker.address, request_timeout=SLOW / 1000, retry_for=0) as conn, pytest.raises(AuthFailed):
        conn.admin("list_topics")
