"""Conveyor topics on Spark: the ``conveyor`` data source (batch and streaming, read and write).

    from conveyor import pipeline
    pipeline.register(spark)
    df = spark.read.format("conveyor").option("broker", "tcp://host:5555").option("topic", "orders").load()

See docs/spark.md for the options and for running on a cluster.
"""

from __future__ import annotations

if __name__ != "conveyor.pipeline":
    raise ImportError(f"import conveyor.pipeline, not {__name__} (the repository's folders install under conveyor)")

import importlib
from typing import TYPE_CHECKING, Any

from conveyor.pipeline.options import ReadOptions, WriteOptions
from conveyor.pipeline.source import SCHEMA, ConveyorDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["SCHEMA", "ConveyorDataSource", "ReadOptions", "WriteOptions", "register"]

# Submodules that ``from conveyor import pipeline`` makes reachable as attributes
# (``pipeline.session.local_session()``, as docs/spark.md writes it), each imported on first use:
# a session module starts nothing by itself.
SUBMODULES = frozenset(
    {
        "bench",
        "broker_client",
        "broker_publisher",
        "broker_reader",
        "columns",
        "jobs",
        "options",
        "progress",
        "session",
        "sink",
        "source",
        "sqlite_source",
    }
)


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"conveyor.pipeline.{name}")
    raise AttributeError(f"module 'conveyor.pipeline' has no attribute {name!r}")


PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark: SparkSession, *, pushdown: bool = True) -> SparkSession:
    """Register the ``conveyor`` data source (and the ``sqlite`` one the ingest job uses).

    With ``pushdown`` (the default) it also turns on Spark's Python filter
    pushdown, which the source uses for ``offset`` and ``timestamp`` filters;
    with it off, reads work the same, only without the pruning.
    """
    from conveyor.pipeline.sqlite_source import SQLiteDataSource

    spark.dataSource.register(ConveyorDataSource)
    spark.dataSource.register(SQLiteDataSource)
    if pushdown:
        spark.conf.set(PUSHDOWN_CONF, "true")
    return spark
