"""Small helpers for tests that drive a real broker with real clients."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from consumers.message import Message
from consumers.session import Subscription


def drain(
    subs: Sequence[Subscription],
    expected: int,
    *,
    timeout: float = 15.0,
    ack: bool = True,
    on_batch: Callable[[int, list[Message]], None] | None = None,
) -> list[list[Message]]:
    """Receive from every subscription until ``expected`` messages arrived in all."""
    got: list[list[Message]] = [[] for _ in subs]
    deadline = time.monotonic() + timeout
    while sum(map(len, got)) < expected and time.monotonic() < deadline:
        for i, sub in enumerate(subs):
            batch = sub.receive(timeout=0.02)
            if batch:
                got[i] += batch
                if on_batch:
                    on_batch(i, batch)
                if ack:
                    sub.ack(batch)
    return got


def quiet(subs: Sequence[Subscription], seconds: float) -> list[Message]:
    """Whatever arrives in ``seconds`` (acked), to show nothing more comes."""
    extra: list[Message] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sub in subs:
            batch = sub.receive(timeout=0.02)
            extra += batch
            if batch:
                sub.ack(batch)
    return extra


def free_address() -> str:
    """A loopback address where nothing listens (a broker that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
