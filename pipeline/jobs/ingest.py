"""Load files or a SQLite table into a topic, one message per row.

    python -m conveyor.pipeline.jobs.ingest --topic orders data/orders-*.csv
    python -m conveyor.pipeline.jobs.ingest --topic orders --format json events.jsonl --key-column customer
    python -m conveyor.pipeline.jobs.ingest --topic orders shop.db --table orders --value-format msgpack

Each row becomes a message whose value is the row as a JSON object
(``application/json``) or msgpack map (``application/msgpack``), keyed by
``--key-column`` if given. Spark reads the input in parallel and every
task publishes with the ``conveyor`` sink (idempotent, publisher confirms).
A progress line shows messages landed in the topic (read from the broker),
the rate and Spark's task count.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
from conveyor.broker.wire.values import JSON, MSGPACK
from conveyor.pipeline.broker_client import Connection, partition_bounds
from conveyor.pipeline.jobs.common import job_parser, parse, session_from
from conveyor.pipeline.progress import Progress, spark_tasks
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType

__all__ = ["IngestResult", "ingest", "main", "read_input"]

FORMATS = ("csv", "json", "parquet", "sqlite")
_SQLITE_SUFFIXES = {".db", ".sqlite", ".sqlite3"}


@dataclass
class IngestResult:
    rows: int
    first_offset: int
    end_offset: int


def guess_format(paths: Sequence[str]) -> str:
    suffix = Path(paths[0]).suffix.lower()
    if suffix in _SQLITE_SUFFIXES:
        return "sqlite"
    if suffix in (".json", ".jsonl", ".ndjson"):
        return "json"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv", ".txt"):
        return "csv"
    raise SystemExit(f"cannot tell the format of {paths[0]}: pass --format {'/'.join(FORMATS)}")


def read_input(
    spark: SparkSession,
    paths: Sequence[str],
    fmt: str,
    *,
    table: str | None = None,
    header: bool = True,
    delimiter: str = ",",
    partitions: int = 4,
) -> DataFrame:
    """The rows to publish, as a DataFrame."""
    if fmt == "csv":
        return spark.read.option("header", header).option("inferSchema", True).option("sep", delimiter).csv(list(paths))
    if fmt == "json":
        return spark.read.json(list(paths))
    if fmt == "parquet":
        return spark.read.parquet(*paths)
    if fmt == "sqlite":
        if len(paths) != 1 or not table:
            raise SystemExit("a SQLite ingest takes one database file and --table")
        path = str(Path(paths[0]).resolve())
        return (
            spark.read.format("sqlite")
            .option("path", path)
            .option("table", table)
            .option("numPartitions", str(partitions))
            .load()
        )
    raise SystemExit(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")


def count_rows(paths: Sequence[str], fmt: str, table: str | None) -> int | None:
    """The total when it is cheap to know (SQLite), for the progress line."""
    if fmt == "sqlite" and table:
        with sqlite3.connect(f"file:{Path(paths[0]).resolve()}?mode=ro", uri=True) as db:
            return int(db.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
    return None


def _json_to_msgpack(text: str | None) -> bytes | None:
    return None if text is None else msgpack.packb(json.loads(text), use_bin_type=True)


_to_msgpack = F.udf(_json_to_msgpack, BinaryType(), useArrow=False)


def to_messages(df: DataFrame, *, key_column: str | None = None, value_format: str = "json") -> tuple[DataFrame, str]:
    """``value`` (and ``key``) columns for the sink, and the content type of the values."""
    as_json = F.to_json(F.struct(*[F.col(f"`{c}`") for c in df.columns]))
    value: Column = as_json if value_format == "json" else _to_msgpack(as_json)
    columns = [value.alias("value")]
    if key_column:
        if key_column not in df.columns:
            raise SystemExit(f"--key-column {key_column!r} is not one of the columns: {', '.join(df.columns)}")
        columns.append(F.col(f"`{key_column}`").cast("string").alias("key"))
    return df.select(*columns), (JSON if value_format == "json" else MSGPACK)


def ingest(
    spark: SparkSession,
    broker: str,
    topic: str,
    paths: Sequence[str],
    *,
    fmt: str | None = None,
    table: str | None = None,
    key_column: str | None = None,
    value_format: str = "json",
    header: bool = True,
    delimiter: str = ",",
    partitions: int = 4,
    write_id: str | None = None,
    log: object = sys.stderr,
) -> IngestResult:
    fmt = fmt or guess_format(paths)
    df = read_input(spark, paths, fmt, table=table, header=header, delimiter=delimiter, partitions=partitions)
    messages, content_type = to_messages(df, key_column=key_column, value_format=value_format)
    conn = Connection(broker, retry_for=5.0)
    try:

        def landed() -> int:  # over every partition of the topic
            return sum(bounds.end for bounds in partition_bounds(conn, topic))

        first = landed()

        writer = (
            messages.write.format("conveyor")
            .mode("append")
            .option("broker", broker)
            .option("topic", topic)
            .option("contentType", content_type)
        )
        if write_id:
            writer = writer.option("writeId", write_id)
        with Progress(
            f"ingest {fmt} → {topic}",
            landed,
            total=count_rows(paths, fmt, table),
            extra=lambda: spark_tasks(spark),
            stream=log,  # type: ignore[arg-type]
        ):
            writer.save()
        end = landed()
    finally:
        conn.close()
    return IngestResult(end - first, first, end)


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("ingest", "Publish the rows of CSV / JSON / Parquet files or a SQLite table to a topic.")
    parser.add_argument("paths", nargs="+", help="input files (globs and directories as Spark reads them)")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--format", choices=FORMATS, help="input format (default: from the file name)")
    parser.add_argument("--table", help="SQLite table to read")
    parser.add_argument("--key-column", help="column whose value becomes the message key")
    parser.add_argument("--value-format", choices=["json", "msgpack"], default="json")
    parser.add_argument("--no-header", action="store_true", help="CSV files have no header line")
    parser.add_argument("--delimiter", default=",", help="CSV field separator")
    parser.add_argument("--partitions", type=int, default=4, help="parallel SQLite readers")
    parser.add_argument("--write-id", help="idempotence key: rerunning with the same id stores nothing twice")
    args = parse(parser, argv)
    spark = session_from(args, f"conveyor-ingest-{args.topic}")
    result = ingest(
        spark,
        args.broker,
        args.topic,
        args.paths,
        fmt=args.format,
        table=args.table,
        key_column=args.key_column,
        value_format=args.value_format,
        header=not args.no_header,
        delimiter=args.delimiter,
        partitions=args.partitions,
        write_id=args.write_id,
    )
    print(f"ingest: {result.rows:,} messages in {args.topic} at offsets [{result.first_offset}, {result.end_offset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
