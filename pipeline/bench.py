"""Throughput and latency of the ``conveyor`` data source on this machine.

    python -m conveyor.pipeline.bench                 # 1M messages of 100 bytes, local[2]
    python -m conveyor.pipeline.bench --messages 200000 --stream-seconds 10

Measures, against a real broker (started in a temporary directory unless
``--broker`` is given) and a local Spark session:

* batch read, rows/s and MB/s of values, with one partition (one
  executor core's worth) and with two (both cores), into Spark's ``noop``
  sink so that nothing but reading is timed;
* batch write, rows/s, from ``spark.range`` to a topic;
* streaming end-to-end latency per micro-batch: from a message's send
  (producer side) to the end of the micro-batch that wrote it to Parquet.

Each figure is the best of ``--repeat`` runs after a warm-up run (the JVM
compiles the hot path on the first one); the median is printed next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.broker.client.producer import Producer

__all__ = ["main"]


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def publish(address: str, topic: str, n: int, size: int) -> float:
    value = b"x" * size
    started = time.perf_counter()
    with Producer(address, batch_size=5000, linger_ms=50, max_batch_bytes=4 << 20) as producer:
        for _ in range(n):
            producer.send(topic, value)
        producer.flush()
    return n / (time.perf_counter() - started)


def line(label: str, n: int, seconds: list[float], value_bytes: int | None = None) -> str:
    best, median = min(seconds), statistics.median(seconds)
    text = f"{label:<34} {n / best:>11,.0f} rows/s (median {n / median:,.0f})"
    if value_bytes:
        text += f"  {n * value_bytes / best / 1e6:6.1f} MB/s of values"
    return text


def stream_latency(spark: Any, address: str, topic: str, seconds: float, rate: float, size: int) -> list[str]:
    """Publish at ``rate``/s into a running query (Parquet sink); latency from send to micro-batch done.

    Each micro-batch's progress says which offsets it read (``startOffset``
    .. ``endOffset``) and when it finished (trigger start + duration); the
    producer's confirms say when each offset was sent.
    """
    import json
    from datetime import datetime

    stop = threading.Event()
    sends: list[tuple[float, Any]] = []  # (wall-clock send time, future of the offset)

    def produce() -> None:
        value = b"y" * size
        with Producer(address, batch_size=200, linger_ms=1) as producer:
            sent = 0
            started = time.monotonic()
            while not stop.is_set():
                sends.append((time.time(), producer.send(topic, value)))
                sent += 1
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            producer.flush(timeout=30)

    Producer(address).send(topic, b"first").result(timeout=10)  # the topic exists before the query starts
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    out = tempfile.mkdtemp(prefix="conveyor-bench-stream-")
    query = (
        spark.readStream.format("conveyor")
        .option("broker", address)
        .option("topic", topic)
        .option("startingOffsets", "latest")
        .load()
        .writeStream.format("parquet")
        .option("path", out + "/data")
        .option("checkpointLocation", out + "/checkpoint")
        .trigger(processingTime="0 seconds")
        .start()
    )
    time.sleep(seconds)
    query.stop()
    stop.set()
    thread.join(timeout=60)
    sent_at = {f.result(): t for t, f in sends if f.done() and f.exception() is None}
    batches = []
    for progress in query.recentProgress:
        source = progress["sources"][0]
        if not progress["numInputRows"] or source["startOffset"] is None:
            continue
        lo, hi = (json.loads(source[k])["offset"] for k in ("startOffset", "endOffset"))
        began = datetime.fromisoformat(progress["timestamp"].replace("Z", "+00:00")).timestamp()
        done = began + progress["durationMs"]["triggerExecution"] / 1000
        lat = [done - sent_at[o] for o in range(lo, hi) if o in sent_at]
        if lat:
            batches.append((hi - lo, min(lat), max(lat), progress["durationMs"]["triggerExecution"] / 1000))
    steady = batches[2:] or batches  # the first micro-batches pay for worker start-up
    if not steady:
        return ["streaming: no micro-batch completed"]
    return [
        f"streaming to Parquet at {rate:,.0f} msg/s: {len(steady)} micro-batches of "
        f"{statistics.mean(b[0] for b in steady):,.0f} rows (trigger: as fast as possible)",
        f"  micro-batch duration: median {statistics.median(b[3] for b in steady) * 1000:,.0f} ms",
        f"  send-to-committed latency, newest message of a batch: median "
        f"{statistics.median(b[1] for b in steady) * 1000:,.0f} ms",
        f"  send-to-committed latency, oldest message of a batch: median "
        f"{statistics.median(b[2] for b in steady) * 1000:,.0f} ms, max {max(b[2] for b in steady) * 1000:,.0f} ms",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.pipeline.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--broker", help="use this broker instead of starting one")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--stream-seconds", type=float, default=15.0)
    parser.add_argument("--stream-rate", type=float, default=5000.0, help="messages per second while streaming")
    args = parser.parse_args(argv)

    from conveyor.pipeline.session import local_session
    from pyspark.sql import functions as F

    broker = None
    if args.broker is None:
        from conveyor.testing import BrokerProcess

        broker = BrokerProcess(tempfile.mkdtemp(prefix="conveyor-bench-")).start()
    address = args.broker or broker.address  # type: ignore[union-attr]
    n, size = args.messages, args.value_bytes
    topic = f"bench-{os.getpid()}"
    out = [f"conveyor Spark benchmark: {n:,} messages of {size} bytes, {args.master}, {os.cpu_count()} cores"]
    try:
        rate = publish(address, topic, n, size)
        out.append(f"{'(publish with conveyor.Producer)':<34} {rate:>11,.0f} rows/s")
        print(out[-1], file=sys.stderr, flush=True)
        spark = local_session("conveyor-bench", master=args.master)

        for parts in (1, 2):

            def read(parts: int = parts) -> None:
                (
                    spark.read.format("conveyor")
                    .option("broker", address)
                    .option("topic", topic)
                    .option("partitionSize", str(-(-n // parts)))
                    .load()
                    .write.format("noop")
                    .mode("overwrite")
                    .save()
                )

            out.append(
                line(f"batch read, {parts} partition{'s' if parts > 1 else ''}", n, timed(read, args.repeat), size)
            )
            print(out[-1], file=sys.stderr, flush=True)

        frame = spark.range(n, numPartitions=2).select(
            F.lpad(F.col("id").cast("string"), size, "0").cast("binary").alias("value")
        )
        frame.write.format("noop").mode("overwrite").save()

        def write() -> None:
            frame.write.format("conveyor").option("broker", address).option("topic", topic + "-w").mode("append").save()

        out.append(line("batch write, 2 partitions", n, timed(write, args.repeat), size))
        print(out[-1], file=sys.stderr, flush=True)

        if args.stream_seconds > 0:
            out += stream_latency(spark, address, topic + "-s", args.stream_seconds, args.stream_rate, size)
        spark.stop()
    finally:
        if broker is not None:
            broker.stop()
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
