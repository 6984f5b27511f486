"""The example jobs and the streaming sink, end to end on the shared session."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest
from conveyor.pipeline.jobs import archive, ingest, lag_report

from conveyor import Admin
from tests.spark.spark_helpers import publish_numbered, read

pytestmark = pytest.mark.spark


def test_ingest_files_and_sqlite_then_archive_resumably(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    csv = tmp_path / "orders.csv"
    csv.write_text("id,customer,total\n" + "".join(f"{i},c{i % 7},{i * 1.5}\n" for i in range(500)))
    db = tmp_path / "shop.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL, note BLOB)")
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?, ?, ?)", [(1000 + i, f"c{i % 3}", i / 4, b"x") for i in range(300)]
        )

    log = io.StringIO()
    first = ingest.ingest(spark, address, "orders", [str(csv)], key_column="customer", log=log)
    assert (first.rows, first.first_offset, first.end_offset) == (500, 0, 500)
    assert "ingest csv → orders: 500 messages" in log.getvalue()
    second = ingest.ingest(spark, address, "orders", [str(db)], table="orders", value_format="msgpack", log=log)
    assert (second.rows, second.end_offset) == (300, 800)
    assert "of 300 (100%)" in log.getvalue()

    rows = read(spark, address, "orders").orderBy("offset").collect()
    from_csv = json.loads(bytes(rows[7].value))
    assert from_csv == {"id": 7, "customer": "c0", "total": 10.5} and rows[7].key == "c0"
    assert rows[7].headers["content-type"] == "application/json"
    assert rows[500].headers["content-type"] == "application/msgpack"

    # Archive: everything there now, then only what came since, never twice.
    out, log = str(tmp_path / "archive"), io.StringIO()
    done = archive.archive(spark, address, "orders", out, max_offsets_per_trigger=500, log=log)
    assert (done.rows, done.end_offset) == (800, 800) and done.batches == 2
    publish_numbered(address, "orders", 50, start=800)
    again = archive.archive(spark, address, "orders", out, max_offsets_per_trigger=500, log=log)
    assert (again.rows, again.end_offset) == (50, 850)
    archived = spark.read.parquet(out)
    assert "date" in archived.columns
    assert sorted(r.offset for r in archived.select("offset").collect()) == list(range(850))
    assert "batch 0: 500 rows, offsets 0..500" in log.getvalue()


def test_stream_write_copies_a_topic_once_across_runs(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    publish_numbered(address, "source", 3000)

    def copy_available() -> None:
        query = (
            spark.readStream.format("conveyor")
            .option("broker", address)
            .option("topic", "source")
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", 2000)
            .load()
            .select("key", "value", "headers")
            .writeStream.format("conveyor")
            .option("broker", address)
            .option("topic", "copy")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None
        assert [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]] in ([2000, 1000], [1000])

    copy_available()
    publish_numbered(address, "source", 1000, start=3000)
    copy_available()
    with Admin(address) as admin:
        assert admin.describe_topic("copy")["end_offset"] == 4000

    def rows(topic: str) -> list[tuple]:
        df = read(spark, address, topic).select("key", "value", "headers")
        return sorted((r.key or "", bytes(r.value), sorted((r.headers or {}).items())) for r in df.collect())

    assert rows("copy") == rows("source")


def test_lag_report_samples_groups_into_a_table(spark, conveyor_broker, tmp_path):
    address = conveyor_broker.address
    publish_numbered(address, "billing", 1000)
    with Admin(address) as admin:
        admin.reset_offsets("billing", "invoices", 250)
    log = io.StringIO()
    samples = lag_report.collect_samples(address, samples=2, interval=0.2, log=log)
    assert "sample 2/2: 1 groups, total lag 750" in log.getvalue()
    summary = lag_report.summary(lag_report.lag_table(spark, samples)).collect()
    assert [(r.topic, r.group, r.lag, r.max_lag, r.trend) for r in summary] == [
        ("billing", "invoices", 750, 750, "steady")
    ]
    assert summary[0].consumed_per_s == 0.0 and summary[0].produced_per_s == 0.0
