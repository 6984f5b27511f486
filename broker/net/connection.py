"""Client sockets to a broker: a DEALER set up the one way every client needs, and the retry delays.

Every client socket (producer, admin, subscription, mirror, Spark) is made
here, so CURVE, high-water marks and the handshake watch are never forgotten.
"""

from __future__ import annotations

from typing import Any

import tenacity
import zmq
from conveyor.broker.config.addresses import check_address
from conveyor.broker.net.security import HandshakeWatch, secure_client

from conveyor.errors import ConveyorError


def new_dealer(
    ctx: zmq.Context[Any], address: str, *, auto_reconnect: bool = True
) -> tuple[zmq.Socket[Any], HandshakeWatch]:
    """A DEALER to the broker, and the watch of its handshakes (``AUTH_FAILED`` when the broker refuses it).

    ``auto_reconnect=False`` is for the producer: ZeroMQ's own reconnect would
    let batches queued after a lost one reach a restarted broker first, and
    the lost one could then fall out of the broker's deduplication window.
    The producer makes a new socket itself and resends everything in order.
    """
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    if not auto_reconnect:
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    watch = HandshakeWatch(sock, address)  # before connect: the first handshake is watched too
    try:
        sock.connect(check_address(address))
    except ConveyorError:
        watch.close()
        sock.close(linger=0)
        raise
    return sock, watch


def backoff_seconds(strategy: Any, attempt: int) -> float:
    """Ask a tenacity wait strategy for the delay before ``attempt``."""
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(strategy(state))
