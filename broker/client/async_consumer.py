"""``AsyncConsumer``: ``Consumer`` for asyncio code.

::

    from conveyor import AsyncConsumer

    async with AsyncConsumer("orders", group="audit", timeout=5) as c:
        async for message in c:
            await audit(message.value)
            await c.ack(message)

The same subscription and the same semantics as ``Consumer``; waiting for
the next batch is the event loop's: the subscription's sockets are watched
with ``loop.add_reader`` on their ZMQ_FD, so other tasks run meanwhile and
no thread is added. A ZMQ_FD signals edges, not levels: before each wait
the sockets' ZMQ_EVENTS is read (a send, a heartbeat or an ack, may have
taken the readable signal), and a settle wakes a waiting receive to look
again.

Use it from one event loop; ``stop()`` may also be called from another
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import zmq
from conveyor.broker.client.consumer import ConsumerBase, Messages, check_consumer_options
from conveyor.broker.client.message import Message


class AsyncConsumer(ConsumerBase):
    """``async for`` over a topic as a member of ``group``; ``await ack(message)`` / ``await nack(message, delay=)``.

    The arguments are ``Consumer``'s: ``credit`` (most unsettled messages held), ``timeout`` (seconds
    without a message that end the iteration; ``None``: wait forever, until ``stop()``), ``start``, and
    the group's settings.
    """

    def _setup(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # --- receiving ---------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        message = await self.receive(self.timeout)
        if message is None:
            raise StopAsyncIteration
        return message

    async def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (``None``: until one comes); ``None`` when the
        time passed first, or after ``stop()`` or ``close()``."""
        check_consumer_options(1, timeout)
        if not self._buffer and not self._stopped:
            await self._fill(None if timeout is None else time.monotonic() + timeout)
        return self._next_buffered()

    async def _fill(self, deadline: float | None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = self._wake or asyncio.Event()
        while not self._stopped:
            if self._take():
                return
            wait = self.subscription.tick()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait = min(wait, left)
            sockets = self.subscription.sockets
            if any(_readable(sock) for sock in sockets):
                continue  # came while we sent: reading ZMQ_EVENTS also rearmed the fds
            wake.clear()
            fds = [cast(int, sock.getsockopt(zmq.FD)) for sock in sockets]
            for fd in fds:
                loop.add_reader(fd, wake.set)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), wait + 0.001)
            finally:
                for fd in fds:
                    loop.remove_reader(fd)

    def stop(self) -> None:
        """End the iteration: a waiting ``async for`` (or ``receive``) returns at once, and later ones end too.

        From the event loop's thread or any other.
        """
        self._stopped = True
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
        else:
            loop.call_soon_threadsafe(wake.set)

    def _settled(self) -> None:
        """A settle was sent: it may have taken the readable signal of a waiting receive, which looks again."""
        if self._wake is not None:
            self._wake.set()

    # --- settling ------------------------------------------------------------------------------

    async def ack(self, messages: Messages) -> None:
        """Done with a message (or a list of them): the group's committed offset may move past it."""
        self._ack(messages)
        self._settled()

    async def nack(self, messages: Messages, *, delay: float = 0, error: str = "") -> None:
        """Give a message back for redelivery after ``delay`` seconds; it counts as a delivery, and past the
        group's ``max_deliveries`` the broker moves it to the dead-letter topic with ``error`` as the reason."""
        self._nack(messages, delay, error)
        self._settled()

    async def in_progress(self, messages: Messages) -> None:
        """Still working on it: renew the lease (the group's ack timeout, 30 s by default)."""
        self._in_progress(messages)
        self._settled()

    async def terminate(self, messages: Messages, *, reason: str = "") -> None:
        """Never retry it: straight to the dead-letter topic, with ``reason``."""
        self._terminate(messages, reason)
        self._settled()

    # --- lifecycle -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Give back undelivered messages and say goodbye (unacked ones are redelivered); idempotent."""
        self._close()

    async def __aenter__(self) -> AsyncConsumer:
        self._check_open()  # a closed consumer has left its group: make a new one
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncConsumer({self.topic!r}, group={self.group!r})"


def _readable(sock: zmq.Socket[Any]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
