"""One local Spark session for every Spark test (the JVM starts once).

Only tests marked ``spark`` use it, so ``pytest -m "not spark"`` never
starts a JVM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from conveyor.pipeline.session import local_session
from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    # local[2,4]: two cores, and up to 4 attempts per task, so task retries can be tested
    # (plain local[2] never retries a failed task).
    session = local_session(
        "conveyor-tests",
        master="local[2,4]",
        shuffle_partitions=2,
        conf={"spark.sql.streaming.minBatchesToRetain": "10"},
    )
    yield session
    session.stop()
