"""The floor of ``conveyor bench``: a bare pyzmq forwarder, with or without a group-committed log.

What it is the floor of, and why: Conveyor's single-node hot path is a ZeroMQ
hop in (producer to broker), an append with one fdatasync per pass (group
commit, ``fsync=batch``), an ack back, and a ZeroMQ hop out to the consumers
of a group. This process does only that, in Python with pyzmq, and nothing
else: no groups, no leases, no redelivery, no offsets, no index, no metrics.
Whatever Conveyor spends above it, in the same run of the same harness, is
Conveyor's own path (issue #19); what it spends at this level is the transport,
the interpreter and the disk. It is a benchmark tool, not product: a consumer
that disconnects loses what was sent to it, and nothing is ever read back.

Two modes (the ``forwarder`` system of ``conveyor bench``):

- no ``--log`` (``forwarder:ram``): the floor for ``fsync=none``.
- ``--log PATH`` (``forwarder:fsync``): the floor for ``fsync=batch``. Each
  read burst (every frame ready on the input socket, up to ``BURST``) is
  appended to ``PATH`` one write per batch, then one ``os.fdatasync`` for the
  burst, and only then forwarded and acknowledged: nothing is confirmed or
  delivered before it is on disk.

Wire (all frames are single ZeroMQ frames; ``ROUTER`` adds/strips the peer id):

- Producer ``DEALER`` -> ``--in`` (``ROUTER``): ``[batch_id, body]``, where
  ``batch_id`` is 8 opaque bytes and ``body`` is the batch's values, each as a
  ``<I`` little-endian length followed by the value (``encode``/``decode``): one
  frame per batch, like a Conveyor producer's batch, and the forwarder never
  looks inside it.
- Forwarder -> producer: ``[batch_id]`` once the batch was forwarded (after its
  burst's fdatasync under ``--log``).
- Consumer ``DEALER`` -> ``--out`` (``ROUTER``): ``[b"hello"]``, answered
  ``[b"welcome"]``; from then on the consumer is in the round-robin and gets
  ``[body]`` frames, one per batch, in turn with the other consumers (a single
  group). Batches that arrive before any consumer said hello wait.

Run: ``python -m conveyor.benchmarks.forwarder --in 5555 --out 5556 [--log FILE]``
(binds 127.0.0.1). It stops on SIGTERM. Its code uses nothing of Conveyor but
the package it lives in: only pyzmq and the standard library.
"""

from __future__ import annotations

import argparse
import os
import struct
from collections import deque
from collections.abc import Iterable

import zmq

LENGTH = struct.Struct("<I")
BURST = 1024  # at most this many batches per read burst (one fdatasync each), so acks are never held long
HELLO, WELCOME = b"hello", b"welcome"


def encode(values: Iterable[bytes]) -> bytes:
    """One batch body: each value preceded by its ``<I`` length."""
    pack = LENGTH.pack
    return b"".join(pack(len(v)) + v for v in values)


def decode(body: bytes) -> list[bytes]:
    """The values of a batch body (``encode``'s inverse)."""
    out, at, end, unpack = [], 0, len(body), LENGTH.unpack_from
    while at < end:
        (n,) = unpack(body, at)
        at += 4
        out.append(body[at : at + n])
        at += n
    return out


class Forwarder:
    """The loop: block on the two sockets; on input, read a burst, (log + fdatasync), forward, ack."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], in_port: int, out_port: int, log: str = "") -> None:
        self.inbound = ctx.socket(zmq.ROUTER)
        self.inbound.bind(f"tcp://127.0.0.1:{in_port}")
        self.outbound = ctx.socket(zmq.ROUTER)
        self.outbound.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full consumer blocks the send: backpressure, no drop
        self.outbound.bind(f"tcp://127.0.0.1:{out_port}")
        self.fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log else -1
        self.consumers: list[bytes] = []
        self.turn = 0
        self.waiting: deque[bytes] = deque()  # bodies that arrived before any consumer

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbound, zmq.POLLIN)
        poller.register(self.outbound, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())  # blocks: nothing here wakes on a timer
            if self.outbound in ready:
                self._greet()
            if self.inbound in ready:
                self._burst()

    def _greet(self) -> None:
        while True:
            try:
                peer, _hello = self.outbound.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if peer not in self.consumers:
                self.consumers.append(peer)
            self.outbound.send_multipart([peer, WELCOME])
        while self.waiting and self.consumers:
            self._forward(self.waiting.popleft())

    def _burst(self) -> None:
        frames = []
        recv = self.inbound.recv_multipart
        while len(frames) < BURST:
            try:
                frames.append(recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        if self.fd >= 0:
            for _peer, _batch_id, body in frames:
                os.writev(self.fd, [LENGTH.pack(len(body)), body])
            os.fdatasync(self.fd)  # one per burst: the group commit
        for peer, batch_id, body in frames:
            self._forward(body)
            self.inbound.send_multipart([peer, batch_id])

    def _forward(self, body: bytes) -> None:
        """To the next consumer in turn; one that went away leaves the turn (what it had is lost: no redelivery)."""
        while self.consumers:
            peer = self.consumers[self.turn % len(self.consumers)]
            self.turn += 1
            try:
                self.outbound.send_multipart([peer, body])
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.consumers.remove(peer)
        self.waiting.append(body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.forwarder", description=__doc__.split("\n")[0])
    parser.add_argument("--in", dest="in_port", type=int, required=True, help="port of the producers' ROUTER")
    parser.add_argument("--out", dest="out_port", type=int, required=True, help="port of the consumers' ROUTER")
    parser.add_argument("--log", default="", help="append every batch here, one fdatasync per read burst")
    args = parser.parse_args(argv)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    Forwarder(ctx, args.in_port, args.out_port, args.log).run()


if __name__ == "__main__":
    main()
