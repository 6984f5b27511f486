"""Per-group lag and throughput over time, from the broker's admin API, into a table.

    python -m conveyor.pipeline.jobs.lag_report --broker tcp://broker:5555 --samples 12 --interval 5 --output /data/lag

Samples ``list_groups`` every ``--interval`` seconds (one admin request per
sample: committed offset, end offset and lag of every group), then lets
Spark turn the samples into rates with window functions: messages consumed
per second (committed offset growth), produced per second (end offset
growth) and the lag trend. The rows are appended to a Parquet table
(``--output``) or a catalog table (``--table``), and a summary per group is
printed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from conveyor.pipeline.broker_client import Connection
from conveyor.pipeline.jobs.common import job_parser, parse, session_from
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

__all__ = ["SAMPLE_SCHEMA", "collect_samples", "lag_table", "main", "summary"]

SAMPLE_SCHEMA = StructType(
    [
        StructField("sampled_at", TimestampType(), False),
        StructField("topic", StringType(), False),
        StructField("group", StringType(), False),
        StructField("committed_offset", LongType(), True),
        StructField("end_offset", LongType(), True),
        StructField("lag", LongType(), True),
        StructField("in_flight", LongType(), True),
        StructField("members", IntegerType(), True),
    ]
)


def collect_samples(
    broker: str, *, samples: int, interval: float, topic: str | None = None, log: Any = sys.stderr
) -> list[tuple[Any, ...]]:
    """``samples`` snapshots of every group, ``interval`` seconds apart."""
    rows: list[tuple[Any, ...]] = []
    with Connection(broker, retry_for=max(10.0, interval * 2)) as conn:
        for i in range(samples):
            if i:
                time.sleep(interval)
            now = datetime.now(UTC)
            groups = conn.admin("list_groups", **({"topic": topic} if topic else {}))
            for g in groups:
                rows.append(
                    (
                        now,
                        str(g["topic"]),
                        str(g["group"]),
                        int(g.get("committed_offset", 0)),
                        int(g.get("end_offset", 0)),
                        int(g.get("lag", 0)),
                        int(g.get("in_flight", 0)),
                        len(g.get("members") or []),
                    )
                )
            total = sum(int(g.get("lag", 0)) for g in groups)
            print(
                f"lag_report: sample {i + 1}/{samples}: {len(groups)} groups, total lag {total:,}", file=log, flush=True
            )
    return rows


def lag_table(spark: SparkSession, rows: list[tuple[Any, ...]]) -> DataFrame:
    """The samples with per-interval rates: ``consumed_per_s``, ``produced_per_s``, ``lag_change``."""
    df = spark.createDataFrame(rows, SAMPLE_SCHEMA)
    w = Window.partitionBy("topic", "group").orderBy("sampled_at")
    seconds = F.col("sampled_at").cast("double") - F.lag(F.col("sampled_at").cast("double")).over(w)
    return (
        df.withColumn("interval_s", seconds)
        .withColumn("consumed_per_s", (F.col("committed_offset") - F.lag("committed_offset").over(w)) / seconds)
        .withColumn("produced_per_s", (F.col("end_offset") - F.lag("end_offset").over(w)) / seconds)
        .withColumn("lag_change", F.col("lag") - F.lag("lag").over(w))
    )


def summary(table: DataFrame) -> DataFrame:
    """One row per group: last and peak lag, mean rates, and whether it is catching up."""
    last = Window.partitionBy("topic", "group").orderBy(F.col("sampled_at").desc())
    return (
        table.withColumn("_n", F.row_number().over(last))
        .groupBy("topic", "group")
        .agg(
            F.max(F.when(F.col("_n") == 1, F.col("lag"))).alias("lag"),
            F.max("lag").alias("max_lag"),
            F.round(F.avg("consumed_per_s"), 1).alias("consumed_per_s"),
            F.round(F.avg("produced_per_s"), 1).alias("produced_per_s"),
            F.sum("lag_change").alias("lag_change"),
            F.max(F.when(F.col("_n") == 1, F.col("members"))).alias("members"),
        )
        .withColumn(
            "trend",
            F.when(F.col("lag_change") > 0, "falling behind")
            .when(F.col("lag_change") < 0, "catching up")
            .otherwise("steady"),
        )
        .orderBy(F.col("lag").desc(), "topic", "group")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("lag_report", "Sample per-group lag and throughput into a table.")
    parser.add_argument("--topic", help="only this topic's groups")
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--output", help="Parquet directory to append the samples to")
    parser.add_argument("--table", help="catalog table to append to (saveAsTable) instead of --output")
    args = parse(parser, argv)
    if args.samples < 2:
        parser.error("--samples must be at least 2 to measure throughput")
    rows = collect_samples(args.broker, samples=args.samples, interval=args.interval, topic=args.topic)
    spark = session_from(args, "conveyor-lag-report")
    table = lag_table(spark, rows)
    if args.table:
        table.write.mode("append").saveAsTable(args.table)
    elif args.output:
        table.write.mode("append").partitionBy("topic").parquet(args.output)
    summary(table).show(100, truncate=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
