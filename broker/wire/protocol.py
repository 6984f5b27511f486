"""The wire protocol: frame lists in, typed commands out. No sockets here.

Every message is a list of ZeroMQ frames::

    [SIGNATURE, command (1 byte), header (msgpack map), *payload frames]

The header is a small msgpack map of the command's fields; the payload
frames, for PUBLISH, DELIVER and FETCHED, are record batch bodies, one
frame per batch, stored and forwarded as they are. The ROUTER adds the
peer identity in front; the broker strips it before calling ``decode``.
See docs/protocol.md for the full reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
from conveyor.broker.wire.schema import check_header, declared
from conveyor.broker.wire.schema import request_id as valid_rid

from conveyor.errors import (
    BatchTooLarge,
    ConveyorError,
    InvalidRequest,
    MalformedFrame,
    UnknownCommand,
    UnsupportedVersion,
    error_for_code,
)

SIGNATURE = b"CVY1"
VERSION = 1
MAX_HEADER_BYTES = 64 * 1024

Frames = Sequence[bytes | memoryview]


class Command(IntEnum):
    # client -> broker
    HELLO = 0x01
    PUBLISH = 0x02
    SUBSCRIBE = 0x03
    UNSUBSCRIBE = 0x04
    ACK = 0x05
    NACK = 0x06
    IN_PROGRESS = 0x07
    TERM = 0x08
    CREDIT = 0x09
    FETCH = 0x0A
    ADMIN = 0x0B
    METADATA = 0x0C
    # both ways
    HEARTBEAT = 0x10
    BYE = 0x11
    # broker -> client
    WELCOME = 0x20
    PUBLISHED = 0x21
    SUBSCRIBED = 0x22
    DELIVER = 0x23
    FETCHED = 0x24
    RESULT = 0x25
    ERROR = 0x26
    EVENT = 0x27
    METADATA_RESULT = 0x28


# Commands that carry batch bodies after the header, and how many at most.
PAYLOAD_COMMANDS = {Command.PUBLISH: 1, Command.DELIVER: None, Command.FETCHED: None, Command.EVENT: None}


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded message: its command, header fields and payload frames."""

    command: Command
    header: dict[str, Any]
    payload: tuple[bytes | memoryview, ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


_COMMAND_BYTES = {c: bytes([c]) for c in Command}
_packb = msgpack.Packer(use_bin_type=True).pack


def encode(command: Command, header: dict[str, Any] | None = None, *payload: bytes | memoryview) -> list[Any]:
    """The frames of one message, ready for ``send_multipart``.

    A header value msgpack cannot carry (an int past 64 bits, an object) is
    ``InvalidRequest`` naming the field, for every client at once, instead
    of msgpack's ``OverflowError`` or ``TypeError``.
    """
    try:
        packed = _packb(header or {})
    except (OverflowError, TypeError, ValueError) as exc:
        raise _unpackable(command, header or {}, exc) from None
    return [SIGNATURE, _COMMAND_BYTES[command], packed, *payload]


def _unpackable(command: Command, header: dict[str, Any], exc: Exception) -> InvalidRequest:
    for key, value in header.items():
        try:
            _packb({key: value})
        except (OverflowError, TypeError, ValueError) as inner:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return InvalidRequest(
                f"{command.name} field {key!r} cannot be sent: {shown} ({type(inner).__name__}: {inner})", field=key
            )
    return InvalidRequest(f"{command.name} header cannot be sent: {type(exc).__name__}: {exc}")


def decode(frames: Frames, *, max_batch_bytes: int = 16 << 20) -> Frame:
    """Validate and decode one message; raise a ``ProtocolError`` subclass."""
    if len(frames) < 3:
        raise MalformedFrame(f"expected at least 3 frames, got {len(frames)}")
    if bytes(frames[0]) != SIGNATURE:
        if bytes(frames[0][:3]) == SIGNATURE[:3]:
            raise UnsupportedVersion(f"protocol {bytes(frames[0])!r} is not supported, only {SIGNATURE!r}")
        raise MalformedFrame("missing protocol signature")
    command = _decode_command(frames[1])
    header = _decode_header(frames[2])
    check_header(command.name, header)
    payload = tuple(frames[3:])
    _check_payload(command, payload, max_batch_bytes)
    return Frame(command, header, payload)


def request_id(frames: Frames) -> Any:
    """The ``rid`` of a request ``decode`` refused, when its header can be read (to answer it with its rid)."""
    try:
        if len(frames[2]) > MAX_HEADER_BYTES:
            return None
        header = msgpack.unpackb(frames[2], raw=False, strict_map_key=False, max_array_len=65536)
    except Exception:  # a header msgpack cannot read has no rid to give
        return None
    rid = header.get("rid") if isinstance(header, dict) else None
    return rid if valid_rid(rid) is None else None


_COMMANDS = {c.value: c for c in Command}  # a dict lookup: ``Command(x)`` costs an Enum call per message


def _decode_command(frame: bytes | memoryview) -> Command:
    if len(frame) != 1:
        raise MalformedFrame("command frame must be one byte")
    command = _COMMANDS.get(frame[0])
    if command is None:
        raise UnknownCommand(f"unknown command 0x{frame[0]:02x}", command=frame[0])
    return command


def _decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    if len(frame) > MAX_HEADER_BYTES:
        raise MalformedFrame(f"header larger than {MAX_HEADER_BYTES} bytes", limit=MAX_HEADER_BYTES)
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_array_len=65536)
    except msgpack.StackError:  # its message is empty
        raise MalformedFrame("header is nested deeper than msgpack decodes") from None
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise MalformedFrame(f"header is not valid msgpack: {reason[:200]}") from None
    if not isinstance(header, dict):
        raise MalformedFrame("header must be a msgpack map")
    return header


def _check_payload(command: Command, payload: tuple[bytes | memoryview, ...], max_batch_bytes: int) -> None:
    limit = PAYLOAD_COMMANDS.get(command, 0)
    if limit is not None and len(payload) > limit:
        raise MalformedFrame(f"{command.name} takes {limit} payload frame(s), got {len(payload)}")
    if command is Command.PUBLISH and not payload:
        raise MalformedFrame("PUBLISH needs a batch body frame")
    for body in payload:
        if len(body) > max_batch_bytes:
            raise BatchTooLarge(
                f"batch of {len(body)} bytes exceeds the limit of {max_batch_bytes}",
                size=len(body),
                limit=max_batch_bytes,
            )


# --- field access with stable errors ---------------------------------------------


def field(frame: Frame, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """A header field of the expected type, or ``InvalidRequest`` naming it.

    Only fields ``broker/wire/schema.py`` declares can be read: their type and
    range were checked when the frame was decoded.
    """
    if not declared(frame.command.name, frame.header.get("op"), key):
        raise LookupError(f"{frame.command.name} field {key!r} is not declared in broker/wire/schema.py")
    value = frame.header.get(key, default)
    if value is ...:
        raise InvalidRequest(f"{frame.command.name} needs field {key!r}", field=key)
    if value is not default and ((isinstance(value, bool) and kind is int) or not isinstance(value, kind)):
        raise InvalidRequest(f"{frame.command.name} field {key!r} has the wrong type", field=key)
    return value


def ranges(frame: Frame, key: str = "ranges") -> list[tuple[int, int]]:
    """Offset ranges ``[[start, end), ...]`` from a settle command (checked by the schema at decode)."""
    return [(start, end) for start, end in field(frame, key, list)]


# --- errors on the wire --------------------------------------------------------------


def error_header(exc: ConveyorError, rid: Any = None) -> dict[str, Any]:
    header: dict[str, Any] = {"code": exc.code, "name": exc.name, "message": exc.message}
    if rid is not None:
        header["rid"] = rid
    details = {k: v for k, v in exc.fields.items() if isinstance(v, str | int | float | bool) or v is None}
    if details:
        header["fields"] = details
    return header


def error_from_header(header: dict[str, Any]) -> ConveyorError:
    """Rebuild the typed error a broker sent, for the client to raise."""
    cls = error_for_code(int(header.get("code", 1)))
    fields = header.get("fields") or {}
    return cls(str(header.get("message", "")), **{str(k): v for k, v in fields.items()})
