"""A small ``sqlite`` data source: a SQLite table read through Python's sqlite3.

    spark.read.format("sqlite").option("path", "shop.db").option("table", "orders").load()

The table is split into ``numPartitions`` rowid ranges read in parallel, so
the database file must be readable at the same path by every executor
(local mode, or a shared volume). Column types come from the declared
types, by SQLite's affinity rules: INTEGER → long, REAL → double, BLOB →
binary, everything else → string. Tables ``WITHOUT ROWID`` are read as one
partition.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import BinaryType, DataType, DoubleType, LongType, StringType, StructField, StructType

__all__ = ["SQLiteDataSource", "sqlite_schema"]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def affinity(declared: str) -> DataType:
    """SQLite's column affinity rules (https://sqlite.org/datatype3.html), as Spark types."""
    t = (declared or "").upper()
    if "INT" in t:
        return LongType()
    if any(s in t for s in ("CHAR", "CLOB", "TEXT")):
        return StringType()
    if "BLOB" in t:
        return BinaryType()
    if any(s in t for s in ("REAL", "FLOA", "DOUB")):
        return DoubleType()
    return StringType()  # NUMERIC, DATE, no type: values vary, text keeps them all


def _connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)


def sqlite_schema(path: str, table: str) -> StructType:
    with _connect(path) as db:
        rows = db.execute(f"PRAGMA table_info({_quote(table)})").fetchall()
    if not rows:
        raise ValueError(f"no table {table!r} in {path}")
    return StructType([StructField(name, affinity(decl), True) for _cid, name, decl, *_ in rows])


@dataclass
class RowidRange(InputPartition):
    lo: int | None
    hi: int | None

    def __post_init__(self) -> None:
        self.value = (self.lo, self.hi)


def _arrow_type(t: DataType) -> pa.DataType:
    if isinstance(t, LongType):
        return pa.int64()
    if isinstance(t, DoubleType):
        return pa.float64()
    return pa.binary() if isinstance(t, BinaryType) else pa.string()


def _coerce(value: Any, t: DataType) -> Any:
    """A value that does not fit its column's declared type (SQLite allows that)."""
    if value is None:
        return None
    try:
        if isinstance(t, LongType):
            return int(value)
        if isinstance(t, DoubleType):
            return float(value)
    except (TypeError, ValueError):
        return None
    if isinstance(t, BinaryType):
        return value if isinstance(value, bytes) else str(value).encode()
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class SQLiteReader(DataSourceReader):
    def __init__(self, path: str, table: str, schema: StructType, partitions: int, where: str | None) -> None:
        self.path = path
        self.table = table
        self.schema = schema
        self.num_partitions = partitions
        self.where = where

    def partitions(self) -> Sequence[InputPartition]:
        with _connect(self.path) as db:
            try:
                lo, hi = db.execute(f"SELECT min(rowid), max(rowid) FROM {_quote(self.table)}").fetchone()
            except sqlite3.OperationalError:  # WITHOUT ROWID
                return [RowidRange(None, None)]
        if lo is None:
            return []
        n = max(1, min(self.num_partitions, hi - lo + 1))
        step = math.ceil((hi - lo + 1) / n)
        return [RowidRange(lo + i * step, min(lo + (i + 1) * step, hi + 1)) for i in range(n)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RowidRange):
            return
        columns = ", ".join(_quote(f.name) for f in self.schema.fields)
        clauses, args = [], []
        if partition.lo is not None:
            clauses.append("rowid >= ? AND rowid < ?")
            args += [partition.lo, partition.hi]
        if self.where:
            clauses.append(f"({self.where})")
        sql = f"SELECT {columns} FROM {_quote(self.table)}" + (" WHERE " + " AND ".join(clauses) if clauses else "")
        if partition.lo is not None:
            sql += " ORDER BY rowid"
        schema = pa.schema([pa.field(f.name, _arrow_type(f.dataType)) for f in self.schema.fields])
        with _connect(self.path) as db:
            cursor = db.execute(sql, args)
            while rows := cursor.fetchmany(20_000):
                arrays = []
                for i, f in enumerate(self.schema.fields):
                    values = [row[i] for row in rows]
                    try:
                        arrays.append(pa.array(values, schema.field(i).type))
                    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                        arrays.append(pa.array([_coerce(v, f.dataType) for v in values], schema.field(i).type))
                yield pa.RecordBatch.from_arrays(arrays, schema=schema)


class SQLiteDataSource(DataSource):
    """Options: ``path`` (the database file), ``table``, ``numPartitions`` (4), ``where`` (an SQL condition)."""

    @classmethod
    def name(cls) -> str:
        return "sqlite"

    def _path_table(self) -> tuple[str, str]:
        path, table = self.options.get("path"), self.options.get("table")
        if not path or not table:
            raise ValueError('the sqlite source needs option("path", FILE) and option("table", NAME)')
        return str(path), str(table)

    def schema(self) -> StructType:
        return sqlite_schema(*self._path_table())

    def reader(self, schema: StructType) -> DataSourceReader:
        path, table = self._path_table()
        return SQLiteReader(path, table, schema, int(self.options.get("numPartitions", 4)), self.options.get("where"))
