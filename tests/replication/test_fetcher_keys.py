"""A fetcher asks for its CURVE keys at every new socket: a leader back with a new certificate is reached."""

from __future__ import annotations

import time

import zmq
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.server.fetcher import Fetcher


def test_each_new_socket_takes_the_keys_of_the_moment() -> None:
    asked: list[float] = []

    def keys() -> ClientKeys | None:
        asked.append(time.monotonic())
        return None  # no CURVE here: what matters is when the keys are asked

    ctx = zmq.Context()
    fetcher = Fetcher(
        ctx, zmq.Poller(), "tcp://127.0.0.1:9", wait_ms=100, max_batch_bytes=1 << 20, on_reply=lambda f: None, keys=keys
    )
    try:
        fetcher.connect()
        assert len(asked) == 1
        fetcher.reconnect("a refused handshake", at_once=True)
        fetcher.tick(time.monotonic())
        assert len(asked) == 2 and fetcher.socket is not None
    finally:
        fetcher.close()
        ctx.term()
