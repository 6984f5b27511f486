"""Archive a topic to Parquet, partitioned by day (and hour), exactly once.

    python -m conveyor.pipeline.jobs.archive --broker tcp://broker:5555 --topic orders --output /data/orders
    spark-submit pipeline/jobs/archive.py --topic orders --output s3a://bucket/orders --continuous

A structured-streaming query from the ``conveyor`` source to Spark's file
sink. The checkpoint holds the offsets of every micro-batch and the sink's
log holds the files each batch committed, so a run that is stopped, killed
or loses its broker resumes where it stopped, and each message lands in
the output once. Without ``--continuous`` the job archives everything that
is in the topic when it starts (Trigger.AvailableNow, in slices of
``--max-offsets-per-trigger``) and exits: run it from cron.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.pipeline.jobs.common import job_parser, parse, session_from
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

__all__ = ["ArchiveResult", "archive", "main"]


@dataclass
class ArchiveResult:
    batches: int
    rows: int
    end_offset: int | None


def archive_frame(
    spark: SparkSession,
    broker: str,
    topic: str,
    *,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    partition_by: str = "date",
    options: dict[str, str] | None = None,
) -> DataFrame:
    """The stream the job writes: the source's columns plus ``date`` (and ``hour``), UTC."""
    reader = (
        spark.readStream.format("conveyor")
        .option("broker", broker)
        .option("topic", topic)
        .option("startingOffsets", starting_offsets)
    )
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    for key, value in (options or {}).items():
        reader = reader.option(key, value)
    df = reader.load()
    if partition_by in ("date", "hour"):
        df = df.withColumn("date", F.date_format(F.col("timestamp"), "yyyy-MM-dd"))
    if partition_by == "hour":
        df = df.withColumn("hour", F.date_format(F.col("timestamp"), "HH"))
    return df


def archive(
    spark: SparkSession,
    broker: str,
    topic: str,
    output: str,
    *,
    checkpoint: str | None = None,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    partition_by: str = "date",
    continuous: bool = False,
    interval: str = "10 seconds",
    timeout: float | None = None,
    options: dict[str, str] | None = None,
    log: Any = sys.stderr,
) -> ArchiveResult:
    """Run the archive query until caught up (or, ``continuous``, until stopped); one line per micro-batch."""
    df = archive_frame(
        spark,
        broker,
        topic,
        starting_offsets=starting_offsets,
        max_offsets_per_trigger=max_offsets_per_trigger,
        partition_by=partition_by,
        options=options,
    )
    writer = (
        df.writeStream.format("parquet")
        .option("path", output)
        .option("checkpointLocation", checkpoint or output.rstrip("/") + "/_checkpoint")
        .queryName(f"archive-{topic}")
    )
    if partition_by in ("date", "hour"):
        writer = writer.partitionBy(*(["date", "hour"] if partition_by == "hour" else ["date"]))
    writer = writer.trigger(processingTime=interval) if continuous else writer.trigger(availableNow=True)
    query = writer.start()
    return follow(query, topic, timeout=timeout, log=log)


def follow(query: StreamingQuery, topic: str, *, timeout: float | None = None, log: Any = sys.stderr) -> ArchiveResult:
    """Print each micro-batch as it completes; stop the query on SIGTERM/SIGINT or after ``timeout``."""
    stopping = {"asked": False}

    def stop(signum: int, _frame: Any) -> None:
        stopping["asked"] = True

    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, stop)
    except ValueError:  # not the main thread: no signal handling
        pass
    seen: set[int] = set()
    result = ArchiveResult(0, 0, None)
    started = time.monotonic()
    try:
        while query.isActive:
            query.awaitTermination(1)
            for progress in query.recentProgress:
                if progress["batchId"] in seen:
                    continue
                seen.add(progress["batchId"])
                _report(progress, topic, result, log)
            if stopping["asked"] or (timeout is not None and time.monotonic() - started > timeout):
                print(f"archive {topic}: stopping (the next run resumes from the checkpoint)", file=log, flush=True)
                query.stop()
        for progress in query.recentProgress:
            if progress["batchId"] not in seen:
                seen.add(progress["batchId"])
                _report(progress, topic, result, log)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = query.exception()
    if error is not None:
        raise RuntimeError(f"archive of {topic} failed: {error}")
    print(
        f"archive {topic}: {result.rows:,} rows in {result.batches} batches, up to offset {result.end_offset}", file=log
    )
    return result


def _offset(raw: Any) -> int | None:
    if raw in (None, "null"):
        return None
    value = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(value, dict) and "partitions" in value:  # several partitions: offsets read in all of them
        return sum(int(v) for v in value["partitions"].values())
    return int(value["offset"]) if isinstance(value, dict) and "offset" in value else None


def _report(progress: dict[str, Any], topic: str, result: ArchiveResult, log: Any) -> None:
    rows = int(progress.get("numInputRows", 0))
    source = (progress.get("sources") or [{}])[0]
    start, end, latest = (_offset(source.get(k)) for k in ("startOffset", "endOffset", "latestOffset"))
    if rows == 0 and start == end:
        return  # an idle trigger
    if start is None and end is not None:
        start = end - rows  # the query's first batch reports no start
    result.batches += 1
    result.rows += rows
    result.end_offset = end if end is not None else result.end_offset
    rate = float(progress.get("processedRowsPerSecond") or 0.0)
    lag = f", {latest - end:,} behind" if latest is not None and end is not None else ""
    print(
        f"archive {topic}: batch {progress['batchId']}: {rows:,} rows, offsets {start}..{end}, "
        f"{rate:,.0f} rows/s, total {result.rows:,}{lag}",
        file=log,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("archive", "Archive a Conveyor topic to partitioned Parquet, exactly once.")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--output", required=True, help="Parquet directory (any Hadoop path: file:, hdfs:, s3a:)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default OUTPUT/_checkpoint); keep it to resume")
    parser.add_argument("--starting-offsets", default="earliest", help="earliest, latest or an offset (first run)")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=1_000_000, help="messages per micro-batch")
    parser.add_argument("--partition-by", choices=["date", "hour", "none"], default="date")
    parser.add_argument("--continuous", action="store_true", help="keep running, one micro-batch per --interval")
    parser.add_argument("--interval", default="10 seconds", help="trigger interval with --continuous")
    parser.add_argument("--timeout", type=float, help="stop after this many seconds")
    args = parse(parser, argv)
    spark = session_from(args, f"conveyor-archive-{args.topic}")
    archive(
        spark,
        args.broker,
        args.topic,
        args.output,
        checkpoint=args.checkpoint,
        starting_offsets=args.starting_offsets,
        max_offsets_per_trigger=args.max_offsets_per_trigger,
        partition_by=args.partition_by,
        continuous=args.continuous,
        interval=args.interval,
        timeout=args.timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
