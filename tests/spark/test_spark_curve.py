"""The Spark source and sink through a broker that requires CURVE, with the keys given as options.

The Python workers that run the reader and writer are other processes,
started by the JVM with its environment: only what travels with the
options reaches them. These tests give keys as options only (the test
process has no CONVEYOR_CURVE_* variables), so a pass shows they travel.
"""

from __future__ import annotations

import pytest
from conveyor.broker.net import security

from conveyor.testing import BrokerProcess
from tests.helpers import curve_keys
from tests.spark.spark_helpers import read

pytestmark = pytest.mark.spark


@pytest.fixture
def keys(tmp_path):
    return curve_keys(tmp_path)


@pytest.fixture
def curve_broker(keys, tmp_path, monkeypatch):
    monkeypatch.delenv("CONVEYOR_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_CURVE_KEY", raising=False)
    monkeypatch.setattr(security, "_configured", None)
    extra = ["--curve-secret-key", str(keys / "server" / "broker.key_secret")]
    broker = BrokerProcess(tmp_path / "data", extra=[*extra, "--curve-authorized-keys", str(keys / "authorized")])
    yield broker.start()
    broker.stop()


def curve_options(keys, who="clients/alice"):
    return {"curveServerKey": str(keys / "server" / "broker.key"), "curveKey": str(keys / f"{who}.key_secret")}


def test_a_batch_write_and_read_through_a_curve_broker(spark, curve_broker, keys):
    address = curve_broker.address
    rows = [(f"payload-{i}", f"key-{i % 3}") for i in range(3000)]
    df = spark.createDataFrame(rows, "value string, key string").repartition(3)
    writer = df.write.format("conveyor").option("broker", address).option("topic", "sealed").mode("append")
    for name, value in curve_options(keys).items():
        writer = writer.option(name, value)
    writer.save()

    back = read(spark, address, "sealed", partitionSize=1000, **curve_options(keys))
    assert back.rdd.getNumPartitions() == 3
    got = back.select("value", "key").collect()
    assert sorted((bytes(r.value).decode(), r.key) for r in got) == sorted(rows)


def test_a_read_without_keys_fails_with_auth_failed(spark, curve_broker, keys):
    with pytest.raises(Exception) as failed:
        read(spark, curve_broker.address, "sealed").collect()
    message = str(failed.value)
    assert "AUTH_FAILED" in message
    assert "curveServerKey" in message  # says how to give the keys to the connector


def test_a_write_with_an_unauthorized_key_fails_with_auth_failed(spark, curve_broker, keys):
    df = spark.createDataFrame([("x",)], "value string")
    writer = df.write.format("conveyor").option("broker", curve_broker.address).option("topic", "sealed")
    for name, value in curve_options(keys, "strangers/mallory").items():
        writer = writer.option(name, value)
    with pytest.raises(Exception) as failed:
        writer.mode("append").save()
    assert "AUTH_FAILED" in str(failed.value)


def test_only_one_of_the_two_key_options_is_an_option_error(spark, curve_broker, keys):
    with pytest.raises(Exception) as failed:
        read(spark, curve_broker.address, "sealed", curveKey=str(keys / "clients" / "alice.key_secret")).collect()
    assert "curveServerKey" in str(failed.value)
