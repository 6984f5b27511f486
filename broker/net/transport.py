"""Multipart messages in and out of a ZeroMQ socket, straight through pyzmq's compiled socket.

pyzmq's ``send_multipart`` and ``recv_multipart`` are Python loops that build
an ``IntFlag`` for every frame and read ``RCVMORE`` through the option
machinery: about 12 µs per message on a 2-core machine, more than the
broker's own work for a small batch, and paid again in every client. These
call the compiled ``send``/``recv`` with plain ints. The frames on
the wire are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _CompiledSocket

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
# Below this a copy is cheaper than handing libzmq a reference to the Python buffer (pyzmq's own default).
COPY_THRESHOLD = 65536

_send = _CompiledSocket.send
_recv = _CompiledSocket.recv


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Send ``frames`` as one message; large frames (batch bodies) go without a copy.

    Raises what ``send`` raises: ``zmq.Again`` under ``NOBLOCK`` when the peer's
    queue is full, ``EHOSTUNREACH`` from a ROUTER_MANDATORY socket for a peer that is gone.
    """
    last = len(frames) - 1
    more = flags | _SNDMORE
    for i, frame in enumerate(frames):
        _send(sock, frame, more if i < last else flags, len(frame) < COPY_THRESHOLD)


# Each part is received as a zmq.Frame, whose ``more`` reads the message flag
# directly; asking the socket for RCVMORE instead goes through an Enum
# conversion, ~2 µs per part.


def recv_frames(sock: zmq.Socket[Any]) -> list[bytes] | None:
    """Every part of the next waiting message, or ``None`` when nothing waits; never blocks."""
    try:
        return _parts(sock, NOBLOCK)
    except zmq.Again:
        return None


def recv_frames_blocking(sock: zmq.Socket[Any]) -> list[bytes]:
    """Every part of the next message, waiting for it (after a poll said one is there)."""
    return _parts(sock, 0)


def _parts(sock: zmq.Socket[Any], flags: int) -> list[bytes]:
    """The parts of one message; once its first part is in, the rest are already there."""
    frame = _recv(sock, flags, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, flags, False)
        parts.append(frame.bytes)
    return parts
