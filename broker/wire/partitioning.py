"""Which partition a message goes to: the key hash every client shares (docs/partitions.md).

A key maps to ``crc32(key) % partitions``: CRC-32 as zlib, PNG, Ethernet,
Java's ``java.util.zip.CRC32``, Go's ``hash/crc32.ChecksumIEEE`` and .NET's
``System.IO.Hashing.Crc32`` compute it, read as an unsigned 32-bit number. A
``str`` key is hashed as its UTF-8 bytes. It is in every language's standard
library (a client in another language matches it without porting a hash),
and in Python it is one C call, where Kafka's murmur2 would be Python
arithmetic per message. Kafka's partitions therefore do not line up with
ours for the same key; nothing here needs them to.
"""

from __future__ import annotations

import zlib

from conveyor.errors import UnknownPartition


def key_bytes(key: str | bytes) -> bytes:
    return key.encode("utf-8", "surrogatepass") if isinstance(key, str) else bytes(key)


def partition_for_key(key: str | bytes, partitions: int) -> int:
    """The partition of ``key`` among ``partitions`` (``crc32(utf8(key)) % partitions``)."""
    if partitions <= 1:
        return 0
    return zlib.crc32(key_bytes(key)) % partitions


def unknown_partition(topic: str, partition: int, partitions: int) -> UnknownPartition:
    """The error for ``partition`` of a topic that has ``partitions``: the same words from client and broker."""
    return UnknownPartition(
        f"topic {topic} has {partitions} partition{'s' if partitions != 1 else ''}, no partition {partition}",
        topic=topic,
        partition=partition,
        partitions=partitions,
    )
