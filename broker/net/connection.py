"""Client sockets to a broker: a DEALER set up the one way every client needs, and the retry delays.

Every client socket (producers, admin, subscription, mirror, the Spark
connector) is made by ``new_dealer``, so CURVE, high-water marks, linger and
the handshake watch are never forgotten. Clients that ask one question at a
time use ``conveyor.broker.net.requester.Requester`` on top of it.
"""

from __future__ import annotations

from typing import Any

import tenacity
import zmq
from conveyor.broker.config.addresses import check_address
from conveyor.broker.net.security import ClientKeys, HandshakeWatch, client_keys, secure_client

from conveyor.errors import ConveyorError

# ZeroMQ's own default, for the sockets that never changed it.
DEFAULT_HWM = 1000


def new_dealer(
    ctx: zmq.Context[Any],
    address: str,
    *,
    auto_reconnect: bool = True,
    keys: ClientKeys | None = None,
    sndhwm: int = 100_000,
    rcvhwm: int = 100_000,
) -> tuple[zmq.Socket[Any], HandshakeWatch]:
    """A DEALER to the broker, and the watch of its handshakes (``AUTH_FAILED`` when the broker refuses it).

    ``ctx`` may be a ``zmq.asyncio.Context``: the socket and its watch are then
    asyncio sockets. ``keys`` are the CURVE keys of this one client; without
    them the process's keys (``configure()``, ``CONVEYOR_CURVE_*``), if any.
    ``rcvhwm=0`` is for clients whose credit bounds what can arrive.

    ``auto_reconnect=False`` is for the producers: ZeroMQ's own reconnect would
    let batches queued after a lost one reach a restarted broker first, and
    the lost one could then fall out of the broker's deduplication window.
    The producer makes a new socket itself and resends everything in order.
    """
    address = check_address(address)
    keys = keys or client_keys()
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock, keys)
    sock.setsockopt(zmq.LINGER, 0)
    if not auto_reconnect:
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    watch = HandshakeWatch(sock, address, keys)  # before connect: the first handshake is watched too
    try:
        sock.connect(address)
    except (ConveyorError, zmq.ZMQError):
        watch.close()
        sock.close(linger=0)
        raise
    return sock, watch


def backoff_seconds(strategy: Any, attempt: int) -> float:
    """Ask a tenacity wait strategy for the delay before ``attempt``."""
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(strategy(state))
