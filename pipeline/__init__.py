"""Conveyor topics on Spark: the ``conveyor`` data source (batch and streaming, read and write).

    import pipeline
    pipeline.register(spark)
    df = spark.read.format("conveyor").option("broker", "tcp://host:5555").option("topic", "orders").load()

See docs/spark.md for the options and for running on a cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.options import ReadOptions, WriteOptions
from pipeline.source import SCHEMA, ConveyorDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["SCHEMA", "ConveyorDataSource", "ReadOptions", "WriteOptions", "register"]

PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark: SparkSession, *, pushdown: bool = True) -> SparkSession:
    """Register the ``conveyor`` data source (and the ``sqlite`` one the ingest job uses).

    With ``pushdown`` (the default) it also turns on Spark's Python filter
    pushdown, which the source uses for ``offset`` and ``timestamp`` filters;
    with it off, reads work the same, only without the pruning.
    """
    from pipeline.sqlite_source import SQLiteDataSource

    spark.dataSource.register(ConveyorDataSource)
    spark.dataSource.register(SQLiteDataSource)
    if pushdown:
        spark.conf.set(PUSHDOWN_CONF, "true")
    return spark
