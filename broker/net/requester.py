"""``Requester``: request/reply with the broker over one DEALER, matched by request id, retried with backoff.

Admin and the Spark connector ask the broker one question at a time (or a
few, pipelined). What they share is here: each request carries a fresh
``rid``; a reply to an older request (abandoned before a reconnect) is
dropped; the broker's ``ERROR`` is raised as its own class; no answer in
time is ``BROKER_UNAVAILABLE``; a refused handshake is ``AUTH_FAILED`` at
once rather than a timeout; retriable failures are tried again on a fresh
socket, after a backoff, until ``retry_for`` seconds have passed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
import zmq
from conveyor.broker.net.connection import DEFAULT_HWM, backoff_seconds, new_dealer
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.net.transport import NOBLOCK, recv_frames_blocking, send_frames
from conveyor.broker.wire.protocol import Command, Frame, decode, encode, error_from_header

from conveyor.errors import AuthFailed, BrokerUnavailable, ConveyorError

T = TypeVar("T")
FramesFor = Callable[..., list[Any]]  # called with rid=: the frames of one request

# 0.1, 0.2, 0.4, 0.8, then 1 s between attempts.
DEFAULT_RETRY_WAIT = tenacity.wait_exponential(multiplier=0.1, max=1.0)


class Requester:
    """One DEALER to the broker for requests and their replies.

    ``timeout`` is how long one request waits for its reply; ``retry_for``
    how long ``request`` keeps trying retriable failures (0: once). After a
    silence or a refusal the socket is replaced, so the next request starts
    on a fresh connection. ``auto_reconnect``, ``keys`` and the high-water
    marks are ``new_dealer``'s. Not thread-safe: callers that share one lock it.
    """

    def __init__(
        self,
        address: str,
        *,
        context: zmq.Context[Any] | None = None,
        keys: ClientKeys | None = None,
        timeout: float = 10.0,
        retry_for: float = 0.0,
        retry_wait: Any = DEFAULT_RETRY_WAIT,
        auto_reconnect: bool = True,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retry_for = retry_for
        self.retry_wait = retry_wait
        self.reconnects = 0
        self._ctx = context or zmq.Context.instance()
        self._keys = keys
        self._auto_reconnect = auto_reconnect
        self._hwm = hwm
        self._rids = itertools.count(1)
        self._lost = False  # the last wait ended in silence or a refusal: this socket is suspect
        self.sock, self.watch = self._open()

    def _open(self) -> tuple[zmq.Socket[Any], Any]:
        sock, watch = new_dealer(
            self._ctx,
            self.address,
            auto_reconnect=self._auto_reconnect,
            keys=self._keys,
            sndhwm=self._hwm,
            rcvhwm=self._hwm,
        )
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(watch.socket, zmq.POLLIN)
        return sock, watch

    def reconnect(self) -> None:
        """A fresh socket; replies to what was sent on the old one never come."""
        self.reconnects += 1
        self._close_socket()
        self.sock, self.watch = self._open()
        self._lost = False

    def send(self, command: Command, header: dict[str, Any], *payload: Any, block: bool = True) -> int:
        """Send a request; its ``rid``. Without ``block``, raises ``zmq.Again`` when the socket has no peer."""
        return self.send_built(lambda rid: encode(command, {**header, "rid": rid}, *payload), block=block)

    def send_built(self, frames_for: FramesFor, *, block: bool = True) -> int:
        """Send ``frames_for(rid=...)`` (a request encoder of ``broker/wire/commands.py``); its ``rid``."""
        rid = next(self._rids)
        send_frames(self.sock, frames_for(rid=rid), 0 if block else NOBLOCK)
        return rid

    def receive(self, timeout: float) -> Frame | None:
        """The next reply to any request, or None after ``timeout`` seconds; ``AUTH_FAILED`` if the broker refused."""
        deadline = time.monotonic() + timeout
        while True:
            events = dict(self._poller.poll(max(1, int((deadline - time.monotonic()) * 1000))))
            if self.sock in events:
                return decode(recv_frames_blocking(self.sock))
            if self.watch.socket in events:
                refused = self.watch.read()
                if refused is not None:
                    self._lost = True
                    raise self.refusal(refused)
                continue
            self._lost = True
            return None

    def refusal(self, refused: AuthFailed) -> AuthFailed:
        """The error a refused handshake raises; subclasses add how their users give keys."""
        return refused

    def wait_for(self, rid: int, timeout: float | None = None) -> Frame:
        """The reply to ``rid`` (older replies are dropped); raises the broker's error, or ``BrokerUnavailable``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            reply = self.receive(deadline - time.monotonic())
            if reply is None:
                raise BrokerUnavailable(
                    f"no answer from {self.address} in time (is a broker running there? "
                    "one that requires CURVE answers only clients that have its public key)"
                )
            if reply.get("rid") != rid:
                continue  # a late answer to a request abandoned before a reconnect
            if reply.command is Command.ERROR:
                raise error_from_header(reply.header)
            return reply

    def request(self, command: Command, header: dict[str, Any], *payload: Any, timeout: float | None = None) -> Frame:
        """One request and its reply, retried as ``retrying`` says."""
        return self.retrying(lambda: self.wait_for(self.send(command, header, *payload), timeout))

    def call(self, frames_for: FramesFor, *, timeout: float | None = None) -> Frame:
        """``request`` for a request encoder: sends ``frames_for(rid=...)``, retried as ``retrying`` says."""
        return self.retrying(lambda: self.wait_for(self.send_built(frames_for), timeout))

    def retrying(self, fn: Callable[[], T]) -> T:
        """``fn()``; retriable broker errors wait a backoff, reconnect and try again until ``retry_for``."""
        deadline = time.monotonic() + self.retry_for
        for attempt in itertools.count(1):
            try:
                return fn()
            except ConveyorError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    if self._lost:
                        self.reconnect()  # the next request starts on a fresh socket
                    raise
            time.sleep(backoff_seconds(self.retry_wait, attempt))
            self.reconnect()
        raise AssertionError("unreachable")

    def _close_socket(self) -> None:
        self.watch.close()
        self.sock.close(linger=0)

    def close(self) -> None:
        self._close_socket()

    def __enter__(self) -> Requester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
