"""The record batch: the unit that is stored, synced and delivered.

A batch is one fixed header followed by the producer's body, a msgpack
array of records ``[key, headers, value]``. The header is the same on disk
and on the wire, so the broker forwards stored bytes without re-encoding.
Pure functions only: no files, no sockets.

Header layout (big-endian; magic 1 is 48 bytes, magic 2 is 52)::

    0  u64 base_offset     first offset in the batch
    8  u32 batch_length    bytes after this field (header rest + body)
    12 u8  magic           format version, 1 or 2
    13 u8  attributes      reserved, 0
    14 u16 reserved
    16 u32 crc             CRC-32 of every byte from offset 20 to the end
    20 u32 count           records in the body
    24 i64 timestamp_ms    broker append time, ms since the epoch
    32 i64 producer_id     -1 when the producer is not idempotent
    40 i32 sequence        producer batch sequence, -1 when not idempotent
    magic 1:
    44 u32 body_length
    48 ... body
    magic 2:
    44 i32 leader_epoch    the epoch of the partition leader that appended it
    48 u32 body_length
    52 ... body

The base offset sits outside the CRC, as in Kafka; recovery checks it
against the expected next offset instead. The leader epoch is inside it.

Epoch 0 is the epoch of every batch written outside a cluster, and it is
stored as magic 1: a single-node broker writes the same bytes as before
magic 2 existed, and a magic 1 batch reads as epoch 0. A replicated batch
(epoch >= 1) is magic 2. The magic byte says which header follows, so a
reader looks at one byte and unpacks one struct per batch.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack

from conveyor.errors import BatchTooLarge, ConveyorError, InvalidRequest, MalformedFrame, SegmentCorrupt

MAGIC = 1  # the format of batches outside a cluster (epoch 0)
MAGIC_EPOCH = 2  # the format that carries a leader epoch
HEADER = struct.Struct(">QIBBHIIqqiI")  # magic 1
HEADER_V2 = struct.Struct(">QIBBHIIqqiiI")  # magic 2
_PREFIX = struct.Struct(">QIBBHI")  # the part the CRC does not cover
_TAIL = struct.Struct(">IqqiI")  # the part it does, before the body (magic 1)
_TAIL_V2 = struct.Struct(">IqqiiI")  # the same with the leader epoch (magic 2)
HEADER_SIZE = HEADER.size  # the magic 1 header: the smallest, and what a single node writes
HEADER_SIZE_V2 = HEADER_V2.size
MAX_HEADER_SIZE = HEADER_SIZE_V2  # read this much to be sure to hold any header
MAGIC_AT = 12  # the byte that says which header this is
CRC_START = 20
LENGTH_PREFIX = 12  # base_offset + batch_length: what batch_length does not cover
NO_PRODUCER = -1
NO_EPOCH = 0  # the epoch of batches written outside a cluster (magic 1)

assert HEADER_SIZE == 48 and HEADER_SIZE_V2 == 52


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~1.3 us more, paid per batch read
class BatchHeader:
    base_offset: int
    count: int
    timestamp_ms: int
    producer_id: int
    sequence: int
    body_length: int
    crc: int
    leader_epoch: int = NO_EPOCH
    header_size: int = HEADER_SIZE  # HEADER_SIZE for magic 1, HEADER_SIZE_V2 for magic 2

    @property
    def size(self) -> int:
        return self.header_size + self.body_length

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count


@dataclass(slots=True)  # not frozen (see BatchHeader); shared with the tail cache, so never mutate one
class Batch:
    """A stored batch: its header fields and the raw msgpack body."""

    base_offset: int
    count: int
    timestamp_ms: int
    body: bytes
    producer_id: int = NO_PRODUCER
    sequence: int = -1
    leader_epoch: int = NO_EPOCH  # 0: a magic 1 batch

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count


def encode_header(
    base_offset: int,
    count: int,
    timestamp_ms: int,
    body: bytes,
    *,
    producer_id: int = NO_PRODUCER,
    sequence: int = -1,
    leader_epoch: int | None = None,
) -> bytes:
    """The header for ``body``: one CRC over header tail and body.

    ``leader_epoch`` None or 0 (outside a cluster) writes the 48-byte magic 1
    header; an epoch >= 1 writes the 52-byte magic 2 header that holds it.
    """
    if not leader_epoch:
        tail = _TAIL.pack(count, timestamp_ms, producer_id, sequence, len(body))
        magic, size = MAGIC, HEADER_SIZE
    else:
        tail = _TAIL_V2.pack(count, timestamp_ms, producer_id, sequence, leader_epoch, len(body))
        magic, size = MAGIC_EPOCH, HEADER_SIZE_V2
    crc = zlib.crc32(body, zlib.crc32(tail))
    return _PREFIX.pack(base_offset, size - LENGTH_PREFIX + len(body), magic, 0, 0, crc) + tail


def encode_batch(batch: Batch) -> bytes:
    header = encode_header(
        batch.base_offset,
        batch.count,
        batch.timestamp_ms,
        batch.body,
        producer_id=batch.producer_id,
        sequence=batch.sequence,
        leader_epoch=batch.leader_epoch,
    )
    return header + batch.body


def decode_header(buf: bytes | memoryview, pos: int = 0) -> BatchHeader:
    """Parse a header of either magic without checking the CRC (see ``check_batch``)."""
    left = len(buf) - pos
    if left < HEADER_SIZE:
        raise SegmentCorrupt("short header", position=pos)
    magic = buf[pos + MAGIC_AT]
    if magic == MAGIC:
        (base, length, _m, attrs, reserved, crc, count, ts, pid, seq, body_len) = HEADER.unpack_from(buf, pos)
        epoch, size = NO_EPOCH, HEADER_SIZE
    elif magic == MAGIC_EPOCH:
        if left < HEADER_SIZE_V2:
            raise SegmentCorrupt("short header", position=pos)
        (base, length, _m, attrs, reserved, crc, count, ts, pid, seq, epoch, body_len) = HEADER_V2.unpack_from(buf, pos)
        size = HEADER_SIZE_V2
    else:
        raise SegmentCorrupt(f"bad magic {magic}", position=pos)
    if attrs or reserved:  # outside the CRC, so a flipped bit here is only caught by this check
        raise SegmentCorrupt("nonzero reserved header bytes", position=pos)
    if length != size - LENGTH_PREFIX + body_len:
        raise SegmentCorrupt("batch length disagrees with body length", position=pos)
    return BatchHeader(base, count, ts, pid, seq, body_len, crc, epoch, size)


def check_batch(buf: bytes | memoryview, pos: int = 0) -> BatchHeader:
    """Parse and verify the batch at ``pos``; raise ``SegmentCorrupt`` if bad."""
    header = decode_header(buf, pos)
    end = pos + header.size
    if end > len(buf):
        raise SegmentCorrupt("batch runs past the end of the data", position=pos)
    if zlib.crc32(memoryview(buf)[pos + CRC_START : end]) != header.crc:
        raise SegmentCorrupt("CRC mismatch", position=pos)
    return header


def decode_batch(buf: bytes | memoryview, pos: int = 0) -> Batch:
    header = check_batch(buf, pos)
    body = bytes(memoryview(buf)[pos + header.header_size : pos + header.size])
    return Batch(
        header.base_offset,
        header.count,
        header.timestamp_ms,
        body,
        header.producer_id,
        header.sequence,
        header.leader_epoch,
    )


# --- bodies ---------------------------------------------------------------


def validate_body(body: bytes, *, max_message_bytes: int, max_records: int = 1_000_000) -> int:
    """Check that ``body`` is a msgpack array of ``[key, headers, value]``, completely.

    Keys are bin, str or nil; headers a map of str to str, or nil; values
    bin or str; every str valid UTF-8 (the unpacker checks that, in C).
    A body that passes can be unpacked and packed again anywhere (slicing,
    key routing, dead-lettering) without raising. Returns the record count.
    Runs once, when the batch enters the broker; everything downstream
    trusts the stored CRC instead. The unpacker's own limits stop huge
    declared sizes before any allocation.
    """
    try:
        records = msgpack.unpackb(
            body,
            raw=False,
            use_list=False,
            strict_map_key=False,
            max_bin_len=max_message_bytes,
            max_str_len=max_message_bytes,
            max_array_len=max_records,
            max_map_len=max_records,
            max_ext_len=max_message_bytes,
        )
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"a record holds a string that is not valid UTF-8 ({exc.reason})") from None
    except TypeError:  # a map or an array as a map key: unhashable
        raise InvalidRequest("a record holds a map with a map as a key") from None
    except msgpack.StackError:  # its message is empty
        raise MalformedFrame(
            "batch body is nested deeper than msgpack decodes (a record holds arrays or maps within "
            "each other too many levels deep)"
        ) from None
    except ValueError as exc:
        raise _declared_too_many(exc, max_records) from None
    except (msgpack.ExtraData, msgpack.FormatError) as exc:
        raise MalformedFrame(f"batch body is not one msgpack value: {exc}") from None
    if not isinstance(records, tuple) or not records:
        raise InvalidRequest("batch body must be a non-empty msgpack array of records")
    _check_records(records)
    return len(records)


def _declared_too_many(exc: ValueError, max_records: int) -> ConveyorError:
    """An array or map that declares more items than a batch may hold, named by its count, not by bytes."""
    declared = re.fullmatch(r"(\d+) exceeds max_(array|map)_len\((\d+)\)", str(exc))
    if declared and declared.group(2) == "array":
        return BatchTooLarge(
            f"the batch body declares an array of {declared.group(1)} items; a batch holds at most "
            f"{max_records} records",
            count=int(declared.group(1)),
            limit=max_records,
        )
    if declared:
        return MalformedFrame(
            f"batch body declares a map of {declared.group(1)} entries; at most {max_records}",
            count=int(declared.group(1)),
            limit=max_records,
        )
    return MalformedFrame(f"batch body is not one msgpack value: {exc}")


_TUPLE, _THREE = {tuple}, {3}
_KEY_TYPES, _HEADER_TYPES, _VALUE_TYPES = {bytes, str, type(None)}, {dict, type(None)}, {bytes, str}


def _check_records(records: tuple[Any, ...]) -> None:
    # Every loop here runs in C (map/set/filter/chain/count/slicing over builtins): no bytecode per
    # record. The fields are read as three strided slices of the flattened records, and a column
    # that is all nil (keys and headers, usually) is settled by one ``count``.
    if set(map(type, records)) != _TUPLE or set(map(len, records)) != _THREE:
        raise InvalidRequest("each record must be [key, headers, value]")
    n = len(records)
    fields = list(chain.from_iterable(records))
    keys, headers = fields[0::3], fields[1::3]
    if keys.count(None) != n and not set(map(type, keys)) <= _KEY_TYPES:
        raise InvalidRequest("record key must be bin, str or nil")
    if headers.count(None) != n:
        if not set(map(type, headers)) <= _HEADER_TYPES:
            raise InvalidRequest("record headers must be a map or nil")
        maps = list(filter(None, headers))  # the non-empty ones
        try:  # str.join refuses anything but str, in C: cheaper than collecting the types
            "".join(chain(chain.from_iterable(maps), chain.from_iterable(map(dict.values, maps))))
        except TypeError:
            raise InvalidRequest("record headers must map strings to strings") from None
    if not set(map(type, fields[2::3])) <= _VALUE_TYPES:
        raise InvalidRequest("record value must be bin or str")


def pack_records(records: list[tuple[bytes | str | None, dict[str, Any] | None, bytes]]) -> bytes:
    """Encode records as a batch body (the producer side of ``validate_body``).

    The inverse of ``unpack_records``: a string an older version stored with
    bytes that are not UTF-8 comes back out as the same bytes (surrogate
    escapes both ways), so re-encoding a stored record (slicing, key routing,
    dead-lettering) cannot raise on it.
    """
    return msgpack.packb(records, use_bin_type=True, unicode_errors="surrogateescape")


def unpack_records(body: bytes) -> list[tuple[Any, Any, Any]]:
    """Decode a trusted body into ``(key, headers, value)`` tuples (see ``pack_records``)."""
    return msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=False, unicode_errors="surrogateescape")
