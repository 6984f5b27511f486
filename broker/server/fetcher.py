"""One link to another broker for long-poll requests: connect, reconnect, request ids, silence.

Both the mirror (a child copying its parent) and a follower (a replica
copying its partition leader) keep long-poll FETCHes in flight on one
DEALER socket inside the broker's loop. What they share lives here: the
socket is registered in the loop's poller, every request gets a fresh rid,
an answer is decoded and handed to ``on_reply``, and a link that has been
silent for longer than a long poll can take is torn down and made again
after a backoff. Requests in flight on a torn-down socket are forgotten
(``on_connect`` tells the owner so it can send them again); nothing polls.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import tenacity
import zmq
from conveyor.broker.net.connection import DEFAULT_HWM, backoff_seconds, new_dealer
from conveyor.broker.net.security import ClientKeys, HandshakeWatch
from conveyor.broker.wire.protocol import Command, Frame, decode

from conveyor.errors import ConveyorError

log = logging.getLogger("conveyor.fetcher")

# Beyond the long poll's own wait, how long an answer may take before the link counts as dead.
SILENCE_MARGIN = 2.0


class Fetcher:
    """A DEALER to ``address`` in the loop's ``poller``; the owner sends requests and handles answers.

    ``on_reply(frame)`` gets every decoded answer; ``on_connect()`` is called
    each time a new socket is made (answers to the old one never come, so the
    owner forgets its rids and sends again); ``on_reconnect()`` counts a link
    torn down. ``wait_ms`` is the longest long poll the owner asks for: an
    answer later than that plus ``SILENCE_MARGIN`` means the link is dead.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        poller: zmq.Poller,
        address: str,
        *,
        wait_ms: int,
        max_batch_bytes: int,
        on_reply: Callable[[Frame], None],
        on_connect: Callable[[], None] = lambda: None,
        on_reconnect: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "upstream",
        keys: Callable[[], ClientKeys | None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self.poller = poller
        self.address = address
        self.wait_ms = wait_ms
        self.max_batch_bytes = max_batch_bytes
        self.on_reply = on_reply
        self.on_connect = on_connect
        self.on_reconnect = on_reconnect
        self.clock = clock
        self.name = name
        self.keys = keys  # CURVE keys for each new socket of this link; None: the process's client keys, if any
        self.socket: zmq.Socket[Any] | None = None
        self.watch: HandshakeWatch | None = None
        self.refused = ""  # the other side refused this broker's handshake (AUTH_FAILED), until it answers
        self.reconnects = 0
        self.last_reply = clock()
        self.down_since: float | None = None
        self._rids = itertools.count(1)
        self._next_connect = 0.0
        self._wait = tenacity.wait_random_exponential(multiplier=0.1, max=5.0)

    # --- the connection ----------------------------------------------------------------

    def connect(self) -> None:
        # The other broker may require CURVE: this broker is its client, with ``keys()`` (a follower's own
        # certificate and its leader's key as of now: a leader restarted with a new certificate is reached
        # at the next reconnect) or the process's client keys (a mirror). rcvhwm 0 (no limit): the owner
        # keeps a bounded number of requests in flight, which bounds the replies.
        keys = self.keys()
        self.socket, self.watch = new_dealer(self.ctx, self.address, keys=keys, sndhwm=DEFAULT_HWM, rcvhwm=0)
        self.poller.register(self.socket, zmq.POLLIN)
        self.last_reply = self.clock()
        self.on_connect()

    def reconnect(self, why: str, *, at_once: bool = False) -> None:
        """Tear the socket down; ``tick`` makes a new one after a backoff (``at_once``: none)."""
        self.reconnects += 1
        self.on_reconnect()
        if self.down_since is None:
            self.down_since = self.last_reply
        log.warning("%s %s: %s; reconnecting", self.name, self.address, why)
        self._drop_socket()
        delay = 0.0 if at_once else backoff_seconds(self._wait, min(self.reconnects, 10))
        self._next_connect = self.clock() + delay

    def change_address(self, address: str) -> None:
        """Talk to another broker from now on (a new parent, a new leader)."""
        if address == self.address:
            return
        log.info("%s changes from %s to %s", self.name, self.address, address)
        self.address = address
        self.reconnect("address changed", at_once=True)

    def close(self) -> None:
        """Close the socket (the owner or the broker is stopping)."""
        self._drop_socket()

    def _drop_socket(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.socket is not None:
            self.poller.unregister(self.socket)
            self.socket.close(linger=0)
            self.socket = None

    # --- the loop's hooks ------------------------------------------------------------------

    def tick(self, now: float) -> float | None:
        """Connect when due, reconnect when silent; ``None`` when connected, else when to come back."""
        if self.socket is None:
            if now < self._next_connect:
                return self._next_connect
            self.connect()
        self._check_handshakes()
        silent = now - self.last_reply
        if silent > self.wait_ms / 1000 + SILENCE_MARGIN:
            self.reconnect(f"no answer for {silent:.1f} s")
            return now + 0.05
        return None

    def silence_deadline(self) -> float:
        """When the link counts as dead unless an answer comes first."""
        return self.last_reply + self.wait_ms / 1000 + SILENCE_MARGIN + 0.01

    def _check_handshakes(self) -> None:
        """A broker that refuses this one's handshake is named (AUTH_FAILED), not just silent."""
        refused = self.watch.read() if self.watch is not None else None
        if refused is not None and not self.refused:
            self.refused = f"{refused.name}: {refused.message}"
            log.error("%s %s refused this broker: %s", self.name, self.address, refused.message)

    def request(self, frames_for: Callable[..., list[Any]]) -> int | None:
        """Send ``frames_for(rid=...)`` (an encoder of ``broker/wire/commands.py``); its rid (None: no socket)."""
        if self.socket is None:
            return None
        rid = next(self._rids)
        try:  # never blocks the broker's loop: a socket without a connection (a refused handshake) has no pipe
            self.socket.send_multipart(frames_for(rid=rid), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no answer will come: the silence check reconnects
        return rid

    def on_readable(self) -> None:
        """Hand every waiting answer to ``on_reply`` (the owner may close the socket while doing so)."""
        while self.socket is not None:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode(frames, max_batch_bytes=self.max_batch_bytes)
            except ConveyorError as exc:
                log.error("undecodable answer from %s %s: %s", self.name, self.address, exc)
                continue
            self.last_reply = self.clock()
            self.refused = ""
            if self.down_since is not None and not is_shutting_down(reply):
                log.info("%s %s is back", self.name, self.address)
                self.down_since = None
            self.on_reply(reply)


def is_shutting_down(reply: Frame) -> bool:
    return reply.command is Command.ERROR and reply.get("name") == "SHUTTING_DOWN"
