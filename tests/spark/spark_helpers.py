"""Publishing and waiting helpers shared by the Spark tests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from conveyor import Producer
from conveyor.errors import DuplicateSequence


def value_of(i: int) -> bytes:
    return b"%0100d" % i  # 100 bytes, and the offset it should land at is readable in it


def publish_numbered(address: str, topic: str, n: int, *, start: int = 0, batch_size: int = 10_000) -> list[int]:
    """Publish values ``value_of(start..start+n)``; returns their confirmed offsets."""
    with Producer(address, batch_size=batch_size, linger_ms=20, max_batch_bytes=4 << 20) as producer:
        futures = [
            producer.send(
                topic,
                value_of(i),
                key=f"k{i % 10}" if i % 10 == 0 else None,
                headers={"n": str(i)} if i % 100 == 0 else None,
            )
            for i in range(start, start + n)
        ]
        producer.flush(timeout=60)
    return [f.result() for f in futures]


def publish_to_partitions(address: str, topic: str, n: int, *, start: int = 0) -> dict[tuple[int, int], bytes]:
    """``n`` messages (``value_of(start..)``), a tenth keyless, to a topic of several partitions.

    Returns ``{(partition, offset): value}`` as the producer's confirms say.
    """
    with Producer(address, batch_size=500, linger_ms=5) as producer:
        sent = [
            (producer.send(topic, value_of(i), key=None if i % 10 == 0 else f"user-{i % 97}"), value_of(i))
            for i in range(start, start + n)
        ]
        producer.flush(timeout=60)
    return {(f.result().partition, int(f.result())): value for f, value in sent}


def read(spark: SparkSession, address: str, topic: str, **options: Any) -> DataFrame:
    reader = spark.read.format("conveyor").option("broker", address).option("topic", topic)
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


class BackgroundProducer:
    """Publishes ``m{i:08d}`` values at about ``rate`` per second until stopped.

    Keeps every future, so a test can check that everything confirmed (and,
    after a broker crash, everything resent) reached the sink.
    """

    def __init__(self, address: str, topic: str, *, rate: float = 4000.0) -> None:
        self.address = address
        self.topic = topic
        self.rate = rate
        self.futures: list[Future[int]] = []
        self.values: list[bytes] = []
        self.uncertain: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            with Producer(self.address, batch_size=500, linger_ms=10, delivery_timeout_ms=120_000) as producer:
                i = 0
                started = time.monotonic()
                while not self._stop.is_set():
                    for _ in range(100):
                        value = b"m%08d" % i
                        self.futures.append(producer.send(self.topic, value))
                        self.values.append(value)
                        i += 1
                    ahead = i / self.rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
                producer.flush(timeout=120)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self) -> BackgroundProducer:
        self._thread.start()
        return self

    def stop(self) -> list[bytes]:
        """Stop, wait for every confirm; the values confirmed, in order.

        Values the producer gave up on with DUPLICATE_SEQUENCE (it resent a
        batch after a broker crash, and the broker no longer remembers that
        sequence: it may or may not have stored it) are in ``uncertain``.
        """
        self._stop.set()
        self._thread.join(timeout=180)
        assert self.error is None, f"producer failed: {self.error!r}"
        confirmed: list[bytes] = []
        for future, value in zip(self.futures, self.values, strict=True):
            error = future.exception(timeout=1)
            if error is None:
                confirmed.append(value)
            elif isinstance(error, DuplicateSequence):
                self.uncertain.append(value)
            else:
                raise error
        return confirmed

    @property
    def sent(self) -> int:
        return len(self.values)
