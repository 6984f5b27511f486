"""``Consumer``: read a topic as a member of a group from a plain script, outside the runner.

::

    from conveyor import Consumer

    with Consumer("orders", group="audit", timeout=5) as c:
        for message in c:          # blocks for the next message; ends after 5 s without one
            audit(message.value)
            c.ack(message)         # or c.nack(message, delay=30)

It is the low-level ``Subscription`` (heartbeats, reconnects, partitions,
a cluster's leaders) with what a script wants on top: messages one at a
time from the delivered batches, settling by message, a way to end the
loop (``timeout``, ``stop()``), and a clean goodbye on exit. The runner
(``conveyor run``) stays the way to run handlers as a service; this is
for audits, migrations, one-off fixes and notebooks.

Semantics are the group's: at-least-once. A message given out and not
acked when the consumer closes (or its process dies) is delivered again,
to this group's next member. The broker gives a member at most ``credit``
unsettled messages, so a loop that never settles stops receiving after
``credit`` of them.

One thread iterates and settles (the subscription's socket is that
thread's); ``stop()`` alone may be called from any thread or a signal
handler, and wakes a blocked iteration at once (a wake-up pipe beside the
sockets, no polling).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import zmq
from conveyor.broker.client.message import Message
from conveyor.broker.client.subscription import Subscription

DEFAULT_CREDIT = 100  # unsettled messages a script holds at most: plenty for one loop, little to redeliver

Messages = Message | Iterable[Message]


def check_consumer_options(credit: int, timeout: float | None) -> None:
    """A ``TypeError`` now for settings that cannot work, not a loop that never ends or never starts."""
    if isinstance(credit, bool) or not isinstance(credit, int) or credit < 1:
        raise TypeError(f"credit must be a whole number of messages, 1 or more, not {credit!r}")
    if timeout is not None and (not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout < 0):
        raise TypeError(f"timeout must be None (wait forever) or seconds, 0 or more, not {timeout!r}")


def delay_ms(delay: float) -> int:
    """``nack(delay=)`` in seconds, as the broker takes it (milliseconds)."""
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay) or delay < 0:
        raise ValueError(f"delay must be seconds, 0 or more, not {delay!r}")
    return int(delay * 1000)


def as_list(messages: Messages) -> list[Message]:
    return [messages] if isinstance(messages, Message) else list(messages)


class ConsumerBase:
    """What ``Consumer`` and ``AsyncConsumer`` share: the subscription, the buffer of delivered messages
    not given out yet, and settling (these never block: a settle is one small frame on the socket)."""

    def __init__(
        self,
        topic: str,
        group: str,
        *,
        address: str | Sequence[str] | None = None,
        credit: int = DEFAULT_CREDIT,
        timeout: float | None = None,
        start: str | int | dict[str, int] = "earliest",
        key_affinity: bool = False,
        max_deliveries: int | None = None,
        ack_timeout_ms: int | None = None,
        dead_letter_topic: str | None = None,
    ) -> None:
        check_consumer_options(credit, timeout)
        self.topic = topic
        self.group = group
        self.timeout = timeout
        self.subscription = Subscription(
            topic,
            group,
            address=address,
            credit=credit,
            start=start,
            key_affinity=key_affinity,
            max_deliveries=max_deliveries,
            ack_timeout_ms=ack_timeout_ms,
            dead_letter_topic=dead_letter_topic,
        )
        self._buffer: deque[Message] = deque()
        self._stopped = False
        self._closed = False
        self._setup()

    def _setup(self) -> None:
        """What a subclass adds to the shared state (its way to be woken by ``stop()``)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _next_buffered(self) -> Message | None:
        return self._buffer.popleft() if self._buffer and not self._stopped else None

    def _take(self) -> bool:
        """Move what the sockets hold into the buffer; heartbeat or reconnect if due. True when messages came."""
        messages = self.subscription.read_ready()
        if messages:
            self._buffer.extend(messages)
            return True
        return False

    def _check_open(self) -> None:
        """Settling after close cannot work: the goodbye gave every unacked message back for redelivery."""
        if self._closed:
            raise RuntimeError(
                f"{self!r} is closed: its unacked messages were given back for redelivery to the group,"
                " so they can no longer be settled (settle inside the `with` block)"
            )

    def _ack(self, messages: Messages) -> None:
        self._check_open()
        self.subscription.ack(as_list(messages))

    def _nack(self, messages: Messages, delay: float, error: str) -> None:
        self._check_open()
        self.subscription.nack(as_list(messages), delay_ms=delay_ms(delay), error=error)

    def _in_progress(self, messages: Messages) -> None:
        self._check_open()
        self.subscription.in_progress(as_list(messages))

    def _terminate(self, messages: Messages, reason: str) -> None:
        self._check_open()
        self.subscription.term(as_list(messages), reason=reason)

    def _close(self) -> None:
        """Give back the messages never given out (not counted as deliveries), then say goodbye: the broker
        redelivers what was given out and not acked at once, instead of after the ack timeout."""
        if self._closed:
            return
        self._closed = self._stopped = True
        try:
            if self._buffer:
                self.subscription.nack(list(self._buffer), release=True)
                self._buffer.clear()
        finally:
            self.subscription.close()


class Consumer(ConsumerBase):
    """Iterate over a topic as a member of ``group``; settle each message with ``ack``/``nack``.

    ``credit``: the most unsettled messages the broker gives this consumer (delivered in batches,
    handed out one at a time). ``timeout``: iteration ends after that many seconds without a message
    (``None``: it waits for the next one forever, until ``stop()``). ``start``: where a new group
    begins (``earliest``, ``latest``, an offset). ``max_deliveries``, ``ack_timeout_ms``,
    ``dead_letter_topic``, ``key_affinity``: the group's settings, as for ``Subscription``.
    ``address``: a broker, or a cluster's list (``CONVEYOR_BROKER`` when not given).
    """

    def _setup(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- receiving ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        message = self.receive(self.timeout)
        if message is None:
            raise StopIteration
        return message

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (``None``: until one comes); ``None`` when the
        time passed first, or after ``stop()`` or ``close()``."""
        check_consumer_options(1, timeout)
        if not self._buffer and not self._stopped:
            self._fill(None if timeout is None else time.monotonic() + timeout)
        return self._next_buffered()

    def _fill(self, deadline: float | None) -> None:
        """Wait on the sockets and the wake-up pipe until a batch is delivered, ``deadline``, or ``stop()``;
        wake up early only to heartbeat (the subscription says when)."""
        while not self._stopped:
            if self._take():
                return
            wait = self.subscription.tick()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait = min(wait, left)
            poller = zmq.Poller()
            for sock in self.subscription.sockets:  # one, or one per partition leader in a cluster
                poller.register(sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            if any(fd == self._wake_r for fd, _ in poller.poll(int(wait * 1000) + 1)):
                self._drain_wake()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 512):
                pass

    def stop(self) -> None:
        """End the iteration: a blocked ``for`` loop (or ``receive``) returns at once, and later ones end too.

        Safe from any thread and from a signal handler. Messages delivered but not handed out yet are
        given back when the consumer closes.
        """
        self._stopped = True
        if self._closed:
            return  # the pipe is closed: its numbers may belong to another file by now
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # --- settling ------------------------------------------------------------------------------

    def ack(self, messages: Messages) -> None:
        """Done with a message (or a list of them): the group's committed offset may move past it."""
        self._ack(messages)

    def nack(self, messages: Messages, *, delay: float = 0, error: str = "") -> None:
        """Give a message back for redelivery after ``delay`` seconds; it counts as a delivery, and past the
        group's ``max_deliveries`` the broker moves it to the dead-letter topic with ``error`` as the reason."""
        self._nack(messages, delay, error)

    def in_progress(self, messages: Messages) -> None:
        """Still working on it: renew the lease (the group's ack timeout, 30 s by default)."""
        self._in_progress(messages)

    def terminate(self, messages: Messages, *, reason: str = "") -> None:
        """Never retry it: straight to the dead-letter topic, with ``reason``."""
        self._terminate(messages, reason)

    # --- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give back undelivered messages and say goodbye (unacked ones are redelivered); idempotent."""
        if self._closed:
            return
        try:
            self._close()
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> Consumer:
        self._check_open()  # a closed consumer has left its group: make a new one
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Consumer({self.topic!r}, group={self.group!r})"
