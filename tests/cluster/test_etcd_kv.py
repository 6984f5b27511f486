"""The etcd client's key-value calls and transactions, against a real etcd (the ``etcd`` fixture)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conveyor.broker.cluster.etcd import Compare, Etcd, KeyValue, Op, prefix_end

from conveyor.errors import ClusterError, ConfigError, EtcdError
from conveyor.etcd_process import EtcdProcess, free_port
from tests.cluster.etcd_helpers import Collected, start_holder
from tests.helpers import wait_for


def test_put_get_and_prefix(etcd_client: Etcd) -> None:
    first = etcd_client.put("/c/topics/a", b"1")
    second = etcd_client.put("/c/topics/b", b"\x00\xff binary")
    etcd_client.put("/c/topicsX", b"outside the prefix")
    assert second > first

    kv = etcd_client.get("/c/topics/b")
    assert kv == KeyValue("/c/topics/b", b"\x00\xff binary", second, second, 1, 0)
    assert etcd_client.get("/c/missing") is None

    kvs, revision = etcd_client.get_prefix("/c/topics/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/c/topics/a", b"1"), ("/c/topics/b", b"\x00\xff binary")]
    assert revision == second + 1

    etcd_client.put("/c/topics/a", b"2")
    old, _ = etcd_client.get_prefix("/c/topics/", revision=first)
    assert [(kv.key, kv.value) for kv in old] == [("/c/topics/a", b"1")]

    assert etcd_client.delete("/c/topics/", prefix=True) > revision
    assert etcd_client.get_prefix("/c/topics/")[0] == []
    assert etcd_client.get("/c/topicsX") is not None


def test_a_stale_cas_fails_and_returns_the_current_record(etcd_client: Etcd) -> None:
    etcd_client.put("/c/p", b"epoch 1")
    read = etcd_client.get("/c/p")
    assert read is not None

    won = etcd_client.cas("/c/p", b"epoch 2", read.mod_revision)
    lost = etcd_client.cas("/c/p", b"epoch 2 again", read.mod_revision)

    assert won.succeeded and won.revision > read.mod_revision
    assert not lost.succeeded
    assert lost.current is not None and lost.current.value == b"epoch 2"
    assert lost.current.mod_revision == won.revision
    assert etcd_client.get("/c/p") == lost.current


def test_cas_on_a_deleted_key_fails_with_no_current_record(etcd_client: Etcd) -> None:
    revision = etcd_client.put("/c/gone", b"x")
    etcd_client.delete("/c/gone")
    result = etcd_client.cas("/c/gone", b"y", revision)
    assert not result.succeeded and result.current is None


def test_put_if_absent_creates_once(etcd_client: Etcd) -> None:
    created = etcd_client.put_if_absent("/c/meta", b'{"format": 1}')
    again = etcd_client.put_if_absent("/c/meta", b'{"format": 2}')

    assert created.succeeded and created.ranges == []
    assert not again.succeeded
    assert again.current is not None and again.current.value == b'{"format": 1}'
    assert again.current.create_revision == created.revision


def test_a_txn_runs_its_operations_in_one_revision(etcd_client: Etcd) -> None:
    etcd_client.put("/c/requests/create/t", b"{}")
    result = etcd_client.txn(
        [Compare.absent("/c/topics/t/config"), Compare("/c/requests/create/t", "VALUE", "=", b"{}")],
        [
            Op.put("/c/topics/t/config", b"config"),
            Op.put("/c/topics/t/partitions/0", b"state"),
            Op.delete("/c/requests/create/t"),
            Op.get("/c/topics/t/", prefix=True),
        ],
        [Op.get("/c/topics/t/config")],
    )
    assert result.succeeded
    assert [[(kv.key, kv.mod_revision) for kv in kvs] for kvs in result.ranges] == [
        [("/c/topics/t/config", result.revision), ("/c/topics/t/partitions/0", result.revision)]
    ]
    assert etcd_client.get("/c/requests/create/t") is None


def test_a_controller_write_is_fenced_once_another_process_took_the_key_over(etcd: EtcdProcess) -> None:
    """The zombie controller of the design brief: its txn names the key's create revision, so it fails."""
    key = "/c/controller"
    with Etcd([etcd.endpoint]) as zombie:
        lease = zombie.lease(2, on_lost=lambda: None)
        mine = zombie.put_if_absent(key, b'{"node": "a"}', lease=lease.id)
        assert mine.succeeded
        fenced = [Compare.created(key, mine.revision)]
        assert zombie.txn(fenced, [Op.put("/c/topics/t/partitions/0", b"a decides")]).succeeded

        lease.close()  # the zombie stops refreshing (SIGSTOP in the real case); its key expires
        wait_for(lambda: zombie.get(key) is None, message="the old controller key to expire")
        holder, _, theirs = start_holder(etcd.endpoint, key, 5)  # another process campaigns and wins
        try:
            assert theirs > mine.revision
            late = zombie.txn(fenced, [Op.put("/c/topics/t/partitions/0", b"a decides late")], [Op.get(key)])
            assert not late.succeeded
            assert late.current is not None and late.current.create_revision == theirs
            assert zombie.get("/c/topics/t/partitions/0").value == b"a decides"  # type: ignore[union-attr]
            assert zombie.txn([Compare.created(key, theirs)], [Op.put("/c/x", b"b decides")]).succeeded
        finally:
            holder.kill()
            holder.wait(30)


def test_an_unreachable_etcd_raises_a_retriable_etcd_error() -> None:
    client = Etcd([f"http://127.0.0.1:{free_port()}"], timeout=1.0)
    with pytest.raises(EtcdError) as raised:
        client.get("/c/x")
    assert raised.value.code == 610 and raised.value.name == "ETCD_UNAVAILABLE"
    assert raised.value.retriable and isinstance(raised.value, ClusterError)
    client.close()


def test_a_paused_etcd_times_out(etcd: EtcdProcess, etcd_client: Etcd) -> None:
    etcd_client.put("/c/x", b"1")
    etcd.pause()
    try:
        with pytest.raises(EtcdError, match="did not answer"):
            Etcd([etcd.endpoint], timeout=0.5).get("/c/x")
    finally:
        etcd.resume()
    assert etcd_client.get("/c/x") is not None


def test_the_next_endpoint_is_tried_when_one_is_down(etcd: EtcdProcess) -> None:
    with Etcd([f"http://127.0.0.1:{free_port()}", etcd.endpoint], timeout=1.0) as client:
        client.put("/c/x", b"1")
        assert client.get("/c/x") is not None
        assert client.transport.rotation()[0] == etcd.endpoint  # the one that answered is asked first


def test_user_and_password_get_a_token(etcd: EtcdProcess) -> None:
    user, password = etcd.enable_auth(password="s3cret", user="conveyor")
    with pytest.raises(EtcdError):  # auth is on: no token, no answer
        Etcd([etcd.endpoint]).get("/c/x")
    with pytest.raises(EtcdError) as refused:
        Etcd([etcd.endpoint], user=user, password="wrong").get("/c/x")
    assert "authentication failed" in str(refused.value)

    with Etcd([etcd.endpoint], user=user, password=password) as client:
        client.put("/c/x", b"1")
        assert client.get("/c/x") is not None
        client.transport._token = "not-a-token"  # an expired or revoked token: a 401, then a new token
        assert client.put_if_absent("/c/y", b"2").succeeded

        collected = Collected()  # the watch and the keepalive carry the token too
        client.transport._token = "not-a-token"
        client.watch("/c/", start_revision=1, on_event=collected.on_event, on_resync=collected.on_resync)
        lease = client.lease(2, on_lost=lambda: None)
        client.put("/c/z", b"3", lease=lease.id)
        assert collected.wait(3)[-1] == ("PUT", "/c/z", b"3")
        wait_for(lambda: lease.refreshes >= 3, message="three refreshes")
        assert not lease.lost.is_set()


def test_empty_options_mean_unset(etcd: EtcdProcess) -> None:
    with Etcd([etcd.endpoint], ca="", cert="", key="", user="", password="") as client:
        client.put("/c/x", b"1")
        assert client.transport.user is None and client.transport.tls == {}


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="http://"):
        Etcd(["127.0.0.1:2379"])
    with pytest.raises(ConfigError, match="cert and key"):
        Etcd(["https://127.0.0.1:2379"], cert="/c.pem")
    with pytest.raises(ConfigError, match="user and password"):
        Etcd(["http://127.0.0.1:2379"], user="root")


def test_without_the_extra_the_error_names_it() -> None:
    code = (
        "import sys; sys.modules['requests'] = None\n"
        "from conveyor.broker.cluster.etcd import Etcd, Compare\n"  # the records import without it
        "from conveyor.errors import ConfigError\n"
        "try:\n    Etcd(['http://127.0.0.1:2379'])\n"
        "except ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'conveyor[cluster]'" in out.stdout, out.stderr


def test_prefix_end() -> None:
    assert prefix_end(b"/c/") == b"/c0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
