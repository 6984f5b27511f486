"""Column helpers: message values as Spark data.

``value`` is binary, as it travels; producers say how to read it in the
``content-type`` header (``application/json``, ``application/msgpack``,
``text/plain``, none for raw bytes). ``decoded_value`` turns it into a
typed column::

    from conveyor.pipeline import columns
    orders = df.select("offset", columns.decoded_value("id long, total double").alias("order"))

JSON is parsed by Spark itself (``from_json``); msgpack goes through a small
Python UDF that re-encodes it as JSON first.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, MapType, StringType, StructType

__all__ = ["content_type", "decoded_value", "msgpack_to_json", "value_as_json"]

JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray):
        try:
            return obj.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, msgpack.ExtType):
        return base64.b64encode(obj.data).decode("ascii")
    return str(obj)


def _msgpack_to_json_one(body: bytes | None) -> str | None:
    if body is None:
        return None
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:  # not msgpack after all: no value rather than a failed job
        return None
    return json.dumps(value, default=_json_default, separators=(",", ":"))


_msgpack_udf = F.udf(_msgpack_to_json_one, StringType(), useArrow=False)


def _col(column: str | Column) -> Column:
    return F.col(column) if isinstance(column, str) else column


def msgpack_to_json(column: str | Column = "value") -> Column:
    """A msgpack-encoded binary column as a JSON string (bytes as UTF-8 or base64)."""
    return _msgpack_udf(_col(column))


def content_type(headers: str | Column = "headers") -> Column:
    """The lower-cased media type of each message (``application/json``), null when unset."""
    raw = F.lower(F.trim(_col(headers).getItem("content-type")))
    return F.trim(F.split(raw, ";").getItem(0))


def value_as_json(value: str | Column = "value", headers: str | Column = "headers", fmt: str = "auto") -> Column:
    """Each value as a JSON string, by its content type (``fmt="auto"``) or as ``json`` / ``msgpack``."""
    as_text = _col(value).cast("string")
    if fmt == "json":
        return as_text
    if fmt == "msgpack":
        return msgpack_to_json(value)
    if fmt != "auto":
        raise ValueError(f"fmt must be auto, json or msgpack, not {fmt!r}")
    media = content_type(headers)
    return F.when(media.isin(*MSGPACK_TYPES), msgpack_to_json(value)).otherwise(as_text)


def decoded_value(
    schema: StructType | ArrayType | MapType | str,
    value: str | Column = "value",
    *,
    headers: str | Column = "headers",
    fmt: str = "auto",
    options: dict[str, str] | None = None,
) -> Column:
    """The value parsed into ``schema`` (a DDL string, or a struct, array or map type), JSON or msgpack.

    ``fmt="auto"`` reads msgpack when the ``content-type`` header says so and
    JSON otherwise; ``json`` and ``msgpack`` force one. Values that do not
    parse become null (Spark's ``from_json`` in PERMISSIVE mode).
    """
    if fmt == "text":
        return _col(value).cast("string")
    return F.from_json(value_as_json(value, headers, fmt), schema, options or {})
