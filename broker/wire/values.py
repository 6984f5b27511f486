"""Message values on the wire: bytes as they are, str as UTF-8, the rest msgpack.

The content type travels in the record's headers so any consumer, in any
language, can decode the value without guessing. A model (pydantic, dataclass,
msgspec Struct: ``broker/wire/models.py``) is sent as the msgpack map it dumps
to, its content type ``application/msgpack; model=<module.Class>``: a plain
msgpack map to any reader, the parameter only says where it came from.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from conveyor.broker.wire.models import model_name, to_builtins

from conveyor.errors import InvalidRequest

CONTENT_TYPE = "content-type"
TEXT = "text/plain; charset=utf-8"
MSGPACK = "application/msgpack"
JSON = "application/json"
OCTETS = "application/octet-stream"


def encode_value(value: Any) -> tuple[bytes, str | None]:
    """The value's bytes and its content type (None for raw bytes)."""
    if isinstance(value, bytes):
        return value, None
    if isinstance(value, bytearray | memoryview):
        return bytes(value), None
    if isinstance(value, str):
        return value.encode(), TEXT
    try:
        return msgpack.packb(value, use_bin_type=True), MSGPACK
    except TypeError:  # a model, or one inside plain data: plain data pays nothing for models
        body = msgpack.packb(value, use_bin_type=True, default=to_builtins)
    name = model_name(value)
    return body, (f"{MSGPACK}; model={name}" if name else MSGPACK)


def decode_value(body: bytes, content_type: str | None) -> Any:
    if not content_type or content_type == OCTETS:
        return body
    base = content_type.split(";", 1)[0].strip().lower()
    if base == MSGPACK:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    if base == JSON or base.endswith("+json"):
        return json.loads(body)
    if base.startswith("text/"):
        return body.decode("utf-8", errors="replace")
    return body


def make_record(
    value: Any, key: str | bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[str | bytes | None, dict[str, str] | None, bytes]:
    """``(key, headers, body)`` as the broker accepts it, or ``InvalidRequest`` at ``send()``.

    The broker refuses a whole batch for one bad record, so a key or header
    it would refuse is caught here, before it can fail the other messages.
    """
    if key is not None and type(key) is not str and type(key) is not bytes:
        raise InvalidRequest(f"a message key must be str, bytes or None, not {type(key).__name__}", field="key")
    if headers and not all(type(k) is str and type(v) is str for k, v in headers.items()):
        raise InvalidRequest("message headers must map str to str", field="headers")
    body, content_type = encode_value(value)
    if content_type is not None:
        headers = {**headers, CONTENT_TYPE: content_type} if headers else {CONTENT_TYPE: content_type}
    return key, headers or None, body
