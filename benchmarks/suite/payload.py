"""What every value carries: its send time and a unique sequence number, padded to the message size.

The first 12 bytes are ``<qI``: ``time.time_ns()`` when the producer handed the
value to its client, and the message's sequence number (unique across every
producer of a run). All processes run on one machine, so they share one clock
and ``receive time - send time`` is the end-to-end latency.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable

STAMP = struct.Struct("<qI")


def padding(message_size: int) -> bytes:
    return b"." * (message_size - STAMP.size)


def make_values(seqs: Iterable[int], pad: bytes, sent_ns: int | None = None) -> list[bytes]:
    """Values for ``seqs``, all stamped with one send time (now unless given)."""
    now = time.time_ns() if sent_ns is None else sent_ns
    pack = STAMP.pack
    return [pack(now, seq) + pad for seq in seqs]


def make_scheduled_values(seqs: range, pad: bytes, first_due_ns: int, interval_ns: float) -> list[bytes]:
    """Values for ``seqs``, each stamped with the time it was due, not the time it went out.

    A client whose ``send`` blocks (a synchronous round trip) sends the next
    messages late; stamping them when finally sent would hide that wait
    (coordinated omission). Stamped with the schedule, every system is charged
    for its own client's stalls, as wrk2 and HdrHistogram measure.
    """
    pack = STAMP.pack
    base = seqs.start
    return [pack(first_due_ns + int((seq - base) * interval_ns), seq) + pad for seq in seqs]


def read_stamp(value: bytes) -> tuple[int, int]:
    """``(sent_ns, seq)``."""
    return STAMP.unpack_from(value)
