"""Producer and Admin clients.

``Producer`` batches by linger and size in the caller's thread and does all
socket work in one background I/O thread. Every batch carries the
producer's id and a per-topic sequence, so after a timeout it can
reconnect and resend everything unconfirmed: the broker stores each batch
once and answers a resend with the original offsets.

Per message, ``send()`` appends the record's bytes to the open batch and
returns a light future; ``send_many()`` does the same for a whole list at a
fraction of the cost. While ``max_in_flight`` batches of a topic await their
confirms, that topic's open batch keeps filling (up to ``batch_size``)
instead of queueing up small batches behind them.

When to send a batch that is not full: by default (``eager=True``) at once if
no batch of its topic is in flight, else when a confirm comes back or
``linger_ms`` ends, whichever is first (Nagle's rule, as NATS clients flush):
an idle producer adds no wait and a busy one batches by itself, so one
default serves a low rate (latency) and a high one (throughput). With
``eager=False``, when ``linger_ms`` ends (Kafka's ``linger.ms``): fewer,
fuller batches at a low rate for ``linger_ms`` of added latency. At 5,000
msg/s the linger cost 4.4 ms at the median, eager 1.4 ms (``fsync=batch``).

With one broker the caller's thread sends such a batch itself when the I/O
thread is idle (``_send_now``): the hand-off cost a wake-up and a GIL
hand-over per frame, about 150 µs of a message's latency.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import math
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import add
from typing import Any, cast

import msgpack
import tenacity
import zmq
from conveyor.broker.client.futures import BatchState, batch_futures, new_future
from conveyor.broker.client.leadership import (
    LEADER_POLL,
    LEADERSHIP_ERRORS,
    Suspects,
    held_back,
    in_order,
    resends_due,
    window,
)
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.options import RESEND_WINDOW, check_producer_options
from conveyor.broker.client.partitioner import Partitioner
from conveyor.broker.client.tracing import instrument
from conveyor.broker.net.connection import backoff_seconds, new_dealer
from conveyor.broker.net.security import HandshakeWatch
from conveyor.broker.net.transport import NOBLOCK, recv_frames, send_frames
from conveyor.broker.wire import commands
from conveyor.broker.wire.delivery_times import Times, message_times, now_ms, time_headers, timed_array_header
from conveyor.broker.wire.protocol import Command, decode, error_from_header
from conveyor.broker.wire.values import make_record

from conveyor.errors import (
    ConveyorError,
    NotLeader,
    RequestTimeout,
    UnknownPartition,
    UnknownTopic,
    buffer_full,
    delivery_timed_out,
)
from conveyor.names import split_log

__all__ = ["Producer"]

log = logging.getLogger("conveyor.client")


# --- batch bodies, built as messages arrive -----------------------------------------------
#
# A batch body is a msgpack array of ``[key, headers, value]`` records (see
# ``conveyor.broker.wire.record``). The producer appends each record's encoding to one
# ``bytearray`` as it is sent and adds the array header when the batch goes
# out, so a queued message costs two byte copies and no Python objects.

_packb = msgpack.Packer(use_bin_type=True).pack
_POLLIN = int(zmq.POLLIN)
_POLL_SLACK = 0.0002  # a poll that wakes this early for a linger deadline counts as on time


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _record_prefix(n: int) -> bytes:
    """The encoding of ``[nil, nil, bin(n)]`` up to the value's bytes."""
    return b"\x93\xc0\xc0" + _bin_header(n)


_RECORD_PREFIX = {n: _record_prefix(n) for n in range(1024)}  # a plain dict: the fastest lookup


def _record_prefixes(values: Sequence[bytes]) -> list[bytes]:
    lengths = list(map(len, values))
    if max(lengths, default=0) < 1024:
        return list(map(_RECORD_PREFIX.__getitem__, lengths))
    return [_RECORD_PREFIX.get(n) or _record_prefix(n) for n in lengths]


def _array_header(n: int) -> bytes:
    if n < 16:
        return (0x90 | n).to_bytes(1, "big")
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _encode_record(value: Any, key: str | bytes | None, headers: dict[str, str] | None) -> bytes:
    """One record's msgpack encoding, as ``pack_records`` would write it inside the array."""
    if type(value) is bytes and key is None and headers is None:
        return (_RECORD_PREFIX.get(len(value)) or _record_prefix(len(value))) + value
    return _packb(make_record(value, key, headers))


class _Buffer:
    """The batch being filled for one topic."""

    __slots__ = ("batch", "body", "count", "opened", "times")

    def __init__(
        self,
        opened: float,
        explain_timeout: Callable[[float | None], BaseException],
        partition: int = 0,
        times: Times | None = None,
    ) -> None:
        self.body = bytearray()
        self.count = 0
        self.batch = BatchState(explain_timeout, partition)
        self.opened = opened
        self.times = times  # a timed batch's (not_before_ms, expires_ms): its messages' all, rounded alike


@dataclass(slots=True)
class _InFlight:
    rid: int
    topic: str
    seq: int
    body: bytes
    count: int
    futures: BatchState
    sent_at: float
    first_sent: float
    attempts: int = 1
    last_error: ConveyorError | None = None  # the last retriable error the broker answered
    held: int = 0  # record bytes counted against the producer's buffer_memory until settled
    address: str = ""  # the broker it was last sent to: an error from another one is stale


class Producer:
    """A thread-safe, batching, idempotent producer with publisher confirms.

    ``send()`` returns a ``concurrent.futures.Future`` of the message's offset,
    resolved when the broker confirms the batch as durable. ``address``
    defaults to ``CONVEYOR_BROKER``, else ``tcp://127.0.0.1:5555``. It may
    be a list of brokers (or ``"tcp://a:5555,tcp://b:5555"``): each topic's
    batches then go to its leader, and follow a new one (``Metadata``).

    ``close()`` (and leaving a ``with`` block) waits for outstanding confirms
    while the broker keeps confirming, and gives up after ``close_timeout_ms``
    without one: a broker that is down costs 5 s, not the delivery timeout.
    Every wait that runs out raises ``RequestTimeout`` (a ``TimeoutError``)
    naming the broker.
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        linger_ms: float = 5.0,
        batch_size: int = 1000,
        max_batch_bytes: int = 1 << 20,
        max_in_flight: int = 8,
        request_timeout_ms: int = 5000,
        delivery_timeout_ms: int = 120_000,
        buffer_memory: int = 32 << 20,
        max_block_ms: float = 60_000,
        close_timeout_ms: float = 5000,
        eager: bool = True,
        retry_wait: Any = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        check_producer_options(
            linger_ms=linger_ms,
            batch_size=batch_size,
            max_batch_bytes=max_batch_bytes,
            max_in_flight=max_in_flight,
            request_timeout_ms=request_timeout_ms,
            delivery_timeout_ms=delivery_timeout_ms,
            buffer_memory=buffer_memory,
            max_block_ms=max_block_ms,
            close_timeout_ms=close_timeout_ms,
        )
        # One address, a comma-separated bootstrap list or a list; CONVEYOR_BROKER when not given.
        self.metadata = Metadata(address, context=context, timeout=request_timeout_ms / 1000)
        self.address = ",".join(self.metadata.bootstrap)
        self.close_timeout = close_timeout_ms / 1000
        self.eager = eager
        self.buffer_memory = buffer_memory
        self.max_block = max_block_ms / 1000
        self.linger = linger_ms / 1000
        self.time_window_ms = max(1, round(linger_ms))  # delayed/expiring messages share a batch within it
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        # Following a new leader resends a topic's unconfirmed batches; each must still be within the
        # broker's deduplication window there, so a cluster client keeps at most that many in flight.
        self.max_in_flight = max_in_flight if self.metadata.single else min(max_in_flight, RESEND_WINDOW)
        self.request_timeout = request_timeout_ms / 1000
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.retry_wait = retry_wait or tenacity.wait_random_exponential(multiplier=0.05, max=2.0)
        self.producer_id = random.getrandbits(62) or 1
        # Which partition each message goes to; the buffers, sequences and flights below are per
        # partition log (``topic`` or ``topic#k``), so the idempotent sequence is per (topic, partition).
        self.partitioner = Partitioner(self.metadata.partition_count)
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._buffers: dict[str, _Buffer] = {}
        self._fast: dict[str, bool] = {}  # per topic: its last batch filled fast (see _ProducerIO._linger)
        self._outstanding = 0
        self._held = 0  # bytes of records sent but not yet confirmed or failed
        self._closed = False
        self._abort: RequestTimeout | None = None  # set by close() when it gives up: the I/O thread fails the rest
        self._last_settled = time.monotonic()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self._io = _ProducerIO(self)
        # The caller's thread sends a batch itself when nothing of its topic is in flight (eager) and the route
        # needs no METADATA round trip (one broker): see ``_send_now``.
        self._direct = eager and self.metadata.single
        self._thread = threading.Thread(target=self._io.run, name="conveyor-producer", daemon=True)
        self._thread.start()
        instrument(self)  # OpenTelemetry, when installed: traced send/send_many on this instance (client/tracing.py)

    # --- the caller's side ----------------------------------------------------------

    def send(
        self,
        topic: str,
        value: Any,
        *,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        partition: int | None = None,
        delay: float | timedelta | None = None,
        not_before: datetime | float | None = None,
        ttl: float | timedelta | None = None,
    ) -> Future[int]:
        """Queue one message; the future resolves to its offset (an ``Offset``, with ``.partition``) once durable.

        ``partition``: this one; else the key's (docs/partitions.md); else the current keyless batch's.
        ``delay`` (seconds or a timedelta) or ``not_before`` (a datetime, or seconds since the epoch): the
        broker holds the message back from consumer groups until then; ``ttl`` (seconds or a timedelta):
        not delivered by then, it goes to the dead-letter topic with ``x-last-error: expired``. Such messages
        go in batches of their own (README, "Delayed messages and expiry"); a bad value raises
        ``InvalidDeliveryTime`` and queues nothing.
        """
        topic = self.partitioner.route(topic, key, partition)
        times = None
        if delay is not None or not_before is not None or ttl is not None:
            times = message_times(now_ms(), delay=delay, not_before=not_before, ttl=ttl, window_ms=self.time_window_ms)
            if times is not None:
                headers = time_headers(times, headers)
        if type(value) is bytes and key is None and headers is None:  # the fast path: nothing to encode
            try:
                record = _RECORD_PREFIX[len(value)] + value
            except KeyError:
                record = _record_prefix(len(value)) + value
        else:
            record = _encode_record(value, key, headers)
        lock = self._lock
        lock.acquire()  # not ``with``: half the cost, and this runs once per message
        try:
            if self._held + len(record) > self.buffer_memory and self._held:
                self._wait_for_room(len(record))
            self._held += len(record)
            buf = self._buffers.get(topic)
            if buf is None or len(buf.body) + len(record) > self.max_batch_bytes or buf.times != times:
                buf = self._open_buffer(topic, buf, direct=self._direct, times=times)
            buf.body += record
            index = buf.count
            buf.count = index + 1
            if index + 1 >= self.batch_size:
                self._hand_off(topic)
            batch = buf.batch
        finally:
            lock.release()
        if index == 0 and self._direct:
            self._send_now(topic, buf)
        return new_future(batch, index)

    def send_many(
        self,
        topic: str,
        values: Iterable[Any],
        *,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        partition: int | None = None,
    ) -> list[Future[int]]:
        """Queue many messages at once (same key and headers); one future per message, in order.

        The same as calling ``send()`` for each value, at a fraction of the cost
        per message: encoding and queueing work on the whole list. They all go to one
        partition (``partition``, the key's, or the current keyless one).
        """
        topic = self.partitioner.route(topic, key, partition)
        if not isinstance(values, list | tuple):
            values = list(values)  # a generator would be used up by the first pass
        if key is None and headers is None and all(type(v) is bytes for v in values):
            records = list(map(add, _record_prefixes(values), values))
        else:
            records = [_encode_record(v, key, headers) for v in values]
        size = sum(map(len, records))
        with self._lock:
            if self._held + size > self.buffer_memory and self._held:
                self._wait_for_room(size)
            self._held += size  # all or nothing: the whole call is queued, or BufferFull and none of it
        futures: list[Future[int]] = []
        done = 0
        total = len(records)
        while done < total:
            with self._lock:
                buf = self._buffers.get(topic)
                if buf is None or len(buf.body) + len(records[done]) > self.max_batch_bytes or buf.times is not None:
                    buf = self._open_buffer(topic, buf)
                take = min(total - done, self.batch_size - buf.count)
                chunk = records[done : done + take]
                if len(buf.body) + sum(map(len, chunk)) > self.max_batch_bytes:
                    # Cut at the byte limit; at least one record, since the buffer had room for the first.
                    sizes = list(itertools.accumulate(map(len, chunk), initial=len(buf.body)))
                    take = max(1, bisect.bisect_right(sizes, self.max_batch_bytes) - 1)
                    chunk = chunk[:take]
                buf.body += b"".join(chunk)
                first = buf.count
                buf.count = first + take
                batch = buf.batch
                if done + take < total or buf.count >= self.batch_size:
                    self._hand_off(topic)
            futures += batch_futures(batch, first, take)
            done += take
        return futures

    def _wait_for_room(self, size: int) -> None:
        """Under the lock: block until ``size`` more bytes fit in ``buffer_memory`` (or nothing is held).

        Back-pressure, as Kafka's ``buffer.memory`` and ``max.block.ms``: a caller
        sending faster than the broker confirms waits here instead of growing the
        buffer without bound.
        """
        deadline = time.monotonic() + self.max_block
        while self._held and self._held + size > self.buffer_memory:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise buffer_full(self._held, self.buffer_memory, self.max_block)
            for topic in list(self._buffers):  # what lingers would wait for its linger: send it now
                self._hand_off(topic)
            self._room.wait(remaining)

    def _open_buffer(
        self, topic: str, full: _Buffer | None, *, direct: bool = False, times: Times | None = None
    ) -> _Buffer:
        """Under the lock: a fresh buffer for ``topic``, handing off the full one.

        ``direct``: the caller tries ``_send_now`` after the lock, and wakes the I/O thread itself if that fails.
        ``times``: a timed batch's; a message with other times (or none) hands it off and opens another, so a
        topic has one open batch and its batches keep the order of ``send()`` calls.
        """
        if self._closed:
            raise RuntimeError("producer is closed")
        if full is not None:
            self._hand_off(topic, wake=not direct)
        explain = functools.partial(self._result_timed_out, topic)
        buf = self._buffers[topic] = _Buffer(time.monotonic(), explain, split_log(topic)[1], times)
        if not direct and not self._woken:  # the I/O thread starts the linger clock
            self._woken = True
            self._wake()
        return buf

    def _send_now(self, topic: str, buf: _Buffer) -> None:
        """Not under the lock: send what is due from this thread if the I/O thread is idle, else wake it.

        A hand-off to the I/O thread costs a wake-up and a GIL hand-over per frame sent (about
        150 µs at the median here): at a low rate that was most of a message's latency. The I/O
        thread is still woken when ``buf`` stays open (its linger clock runs there) or a reply waits.
        """
        if self._io.send_now() and self._buffers.get(topic) is not buf:
            return
        with self._lock:
            if not self._woken:
                self._woken = True
                self._wake()

    def _hand_off(self, topic: str, *, wake: bool = True) -> None:
        """Under the lock: the topic's buffer goes to the I/O thread; its messages now count as outstanding."""
        buf = self._buffers.pop(topic)
        self.partitioner.batch_left(topic)  # sticky batching: the next keyless batch takes the next partition
        self._fast[topic] = self._filling_fast(buf, time.monotonic())
        self._outstanding += buf.count
        self._io.ready.append((topic, buf))
        if wake and not self._woken:
            self._woken = True
            self._wake()

    def _filling_fast(self, buf: _Buffer, now: float) -> bool:
        """Whether ``buf`` is full, or holds a tenth of a batch and fills within ``linger_ms`` at its pace so far.

        Not from fewer messages: a slow sender's few messages sent at once after a stall (a pause
        of the process, a GC) would look fast and wait ``linger_ms`` for nothing.
        """
        if buf.count >= self.batch_size:
            return True
        judged = buf.count >= max(2, self.batch_size // 10)
        return judged and (now - buf.opened) * self.batch_size < self.linger * buf.count

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"\0")

    def flush(self, timeout: float | None = None) -> None:
        """Send everything now and wait until every message is confirmed or failed.

        Past ``timeout`` seconds: ``RequestTimeout`` (a ``TimeoutError``) naming the broker.
        """
        self._wait_settled(timeout, None)

    def _wait_settled(self, timeout: float | None, silence: float | None) -> None:
        """Hand off every buffer and wait for their confirms: up to ``timeout`` in all,
        or until ``silence`` seconds pass without any batch settling."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        with self._lock:
            self._woken = True
            self._wake()
            while True:
                for topic in list(self._buffers):  # also what other threads queued meanwhile
                    self._hand_off(topic)
                if not self._outstanding:
                    return
                now = time.monotonic()
                limit = deadline
                if silence is not None:
                    quiet_until = max(self._last_settled, started) + silence
                    limit = quiet_until if limit is None else min(limit, quiet_until)
                if limit is not None and now >= limit:
                    raise self._unconfirmed(self._outstanding, now - started)
                self._idle.wait(1.0 if limit is None else min(1.0, limit - now))

    def _unconfirmed(self, count: int, waited: float) -> RequestTimeout:
        return RequestTimeout(
            f"{count} message(s) not confirmed by {self.address} after {waited:.1f} s; {self._io.heard()}",
            address=self.address,
            unconfirmed=count,
        )

    def _result_timed_out(self, topic: str, timeout: float | None) -> RequestTimeout:
        """What ``future.result(timeout)`` raises when the caller's wait ran out (the message may still go)."""
        name, partition = split_log(topic)  # a batch goes by its partition's log name, "T#k": say topic and partition
        where = f"{name!r} partition {partition}" if partition else repr(name)
        return RequestTimeout(
            f"no confirm from {self.address} for a message to {where} within {timeout or 0:g} s "
            f"(the producer keeps trying for delivery_timeout_ms); {self._io.heard()}",
            address=self.address,
            topic=name,
            partition=partition,
        )

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, wait for its confirms, and stop the I/O thread.

        With ``timeout``, waits at most that long in all. Without, waits while
        the broker keeps confirming and gives up after ``close_timeout_ms``
        without a confirm. What is unconfirmed then fails its futures, and
        ``close`` raises, with a ``RequestTimeout`` naming the broker.
        """
        if self._closed:
            return
        silence = self.close_timeout if timeout is None else None
        try:
            self._wait_settled(timeout, silence)
        except RequestTimeout as exc:
            self._abort = exc
            raise
        finally:
            with self._lock:
                self._closed = True
                self._wake()
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._wake_r.close()
                self._wake_w.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            self.close()
        except RequestTimeout as error:
            if exc_type is None:
                raise
            log.warning("%s", error)  # do not hide the exception that is already leaving the block

    def _settled(self, count: int, held: int) -> None:
        with self._lock:
            self._last_settled = time.monotonic()
            self._outstanding -= count
            self._held -= held
            self._room.notify_all()
            if self._outstanding <= 0:
                self._idle.notify_all()


def _has_reply(sock: zmq.Socket[Any]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN)


@dataclass(slots=True)
class _Link:
    """The socket to one broker (a topic's leader), and the watch of its handshakes.

    ``fd`` is the socket's ZMQ_FD: the I/O thread waits on it, not on the socket, so a
    caller's thread may send on the socket meanwhile (under ``_ProducerIO.lock``).
    """

    address: str
    sock: zmq.Socket[Any]
    watch: HandshakeWatch
    fd: int


class _ProducerIO:
    """Everything the I/O thread owns: one socket per leader, in-flight batches, resends.

    The I/O thread holds ``lock`` except while it waits; a caller's thread that takes it
    meanwhile (``send_now``) may do what the thread would do on waking. A ZeroMQ socket may
    change threads across a lock; it must not be used by two at once, hence the wait on
    ZMQ_FD, and after every send a look at ZMQ_EVENTS: a send may take the socket's
    "readable" signal, and the wait would then not wake for the reply.
    """

    def __init__(self, producer: Producer) -> None:
        self.p = producer
        self.lock = threading.Lock()
        self.ready: deque[tuple[str, _Buffer]] = deque()  # appended under the producer's lock
        self.queued: deque[tuple[str, _Buffer]] = deque()  # waiting for an in-flight slot
        self.in_flight: dict[int, _InFlight] = {}
        self.per_topic: dict[str, int] = {}
        # Topics whose route is not proven: one batch at a time until a leader confirms one. A batch a
        # broker refused (NOT_LEADER before the topic had a leader) must not be overtaken by its successors
        # on a leader elected meanwhile: it would be stored after them, or refused as older than the window.
        self.probing: set[str] = set()
        self.seqs: dict[str, int] = {}
        self.rids = itertools.count(1)
        self.retry_at: dict[int, float] = {}
        self.reconnects = 0
        self.last_heard: float | None = None  # when the broker last answered anything
        self.poller = zmq.Poller()
        self.links: dict[str, _Link] = {}
        self.by_socket: dict[Any, _Link] = {}  # a link's data socket and its watch's socket -> the link
        self.silent = 0  # handshakes that ended without a reason, counted across sockets
        self.suspects = Suspects()  # leaders that hung up, could not be sent to or did not answer in time
        if producer.metadata.single:
            self._link(producer.metadata.bootstrap[0])  # connect now, as before clusters

    def _link(self, address: str) -> _Link:
        link = self.links.get(address)
        if link is None:
            sock, watch = new_dealer(self.p._ctx, address, auto_reconnect=False)
            watch.silent = self.silent
            link = self.links[address] = _Link(address, sock, watch, cast(int, sock.getsockopt(zmq.FD)))
            self.by_socket[link.fd] = self.by_socket[watch.socket] = link
            self.poller.register(link.fd, zmq.POLLIN)
            self.poller.register(watch.socket, zmq.POLLIN)
        return link

    def _close_link(self, link: _Link) -> None:
        self.silent = link.watch.silent
        self.links.pop(link.address, None)
        for sock in (link.fd, link.watch.socket):
            self.by_socket.pop(sock, None)
            self.poller.unregister(sock)
        link.watch.close()
        link.sock.close(linger=0)

    def heard(self) -> str:
        """When the broker last answered, for error messages."""
        if self.last_heard is None:
            return "nothing was ever heard from that address: is a broker running there?"
        return f"its last answer came {time.monotonic() - self.last_heard:.1f} s ago"

    def run(self) -> None:
        wake = self.p._wake_r.fileno()
        self.poller.register(wake, zmq.POLLIN)
        with self.lock:
            while True:
                timeout = 0 if self._readable() else self._timeout_ms()
                self.lock.release()
                try:
                    events = dict(self.poller.poll(timeout))
                finally:
                    self.lock.acquire()
                if wake in events:
                    self._drain_wake()
                for link in list(self.links.values()):  # a reply may be there without its fd firing (see above)
                    if link.address in self.links and _has_reply(link.sock):
                        self._read_replies(link)  # (the check: a link closed by an earlier one's handling)
                for key in events:
                    watched = self.by_socket.get(key)
                    if watched is not None and watched.address in self.links and key is watched.watch.socket:
                        self._check_handshakes(watched)
                self._collect_lingering()
                self._send_queued()
                self._check_timeouts()
                if self.p._abort is not None:
                    self._fail_everything(self.p._abort)
                    break
                if self.p._closed and not self.in_flight and not self.queued and not self.ready:
                    break
            for link in list(self.links.values()):
                self._close_link(link)

    def send_now(self) -> bool:
        """In a caller's thread: what the I/O thread would send on waking, if it is waiting.

        False when the I/O thread is busy (it picks the batch up itself once woken) or when a
        reply is waiting for it (only it resolves futures).
        """
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.p._closed or self.p._abort is not None:
                return False
            self._collect_lingering()
            self._send_queued()
            return not self._readable()
        except Exception:  # the I/O thread meets the same state on waking and handles it its way
            log.exception("sending from the caller's thread failed; the I/O thread takes over")
            return False
        finally:
            self.lock.release()

    def _readable(self) -> bool:
        """Whether a reply waits on any link (reading ZMQ_EVENTS also rearms the link's fd)."""
        return any(_has_reply(link.sock) for link in self.links.values())

    def _check_handshakes(self, link: _Link) -> None:
        """A broker refused this producer: every batch in flight there fails with AUTH_FAILED now, not at a timeout.

        Then a new socket for what comes next (this one does not reconnect by
        itself): if the broker still refuses, those batches fail the same way.
        """
        silent, disconnects = link.watch.silent, link.watch.disconnects
        refused = link.watch.read()
        gone = link.watch.disconnects > disconnects or link.watch.silent > silent
        if gone and self.p.metadata.following:
            # A leader killed mid-handshake ends it without a reason rather than disconnecting: either way it
            # hung up, so its batches wait for METADATA to name the next leader instead of request_timeout.
            self._leader_gone(link.address)
            return
        if refused is None:
            if link.watch.silent > silent:  # a handshake ended without a reason: this socket will not retry it
                self._reconnect(link.address)
            return
        for flight in [f for f in self.in_flight.values() if f.address == link.address]:
            self._finish(flight)
            flight.futures.fail(refused)
        self._reconnect(link.address)

    def _leader_gone(self, address: str) -> None:
        """A broker this producer follows hung up (a kill -9 resets the connection): its batches do not wait
        for ``request_timeout``. Until another leader is named (asked every ``LEADER_POLL``), or for at most
        ``request_timeout``, they are not sent to it again."""
        self.suspects.hung_up(address, self.p.metadata.view, time.monotonic())
        self._reconnect(address)

    def _fail_everything(self, error: RequestTimeout) -> None:
        """``close()`` gave up: every unconfirmed message fails now instead of at its delivery timeout."""
        for flight in list(self.in_flight.values()):
            self._finish(flight)
            flight.futures.fail(error if flight.last_error is None else self._timed_out(flight))
        with self.p._lock:
            for topic in list(self.p._buffers):
                self.p._hand_off(topic, wake=False)
            self.queued.extend(self.ready)
            self.ready.clear()
        for _topic, buf in self.queued:
            buf.batch.fail(error)
            self.p._settled(buf.count, len(buf.body))
        self.queued.clear()

    def _drain_wake(self) -> None:
        try:
            while self.p._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self.p._lock:
            self.p._woken = False

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        deadlines = [now + 1.0]
        with self.p._lock:
            open_batches = [(t, b) for t, b in self.p._buffers.items() if not self._blocked(t)]
            deadlines += [b.opened + self._linger(t, b, now) for t, b in open_batches]
        deadlines += [f.sent_at + self.p.request_timeout for f in self.in_flight.values()]
        deadlines += list(self.retry_at.values())
        return max(0, math.ceil((min(deadlines) - now) * 1000))  # not a whole extra ms past the linger

    def _blocked(self, topic: str) -> bool:
        """No new batch of ``topic`` now: its in-flight window is full, or one of its batches awaits a resend
        (a newer batch must not reach a leader before an older one it refused or never got)."""
        return held_back(
            self.per_topic.get(topic, 0),
            window(topic in self.probing, self.p.max_in_flight),
            resend_pending=any(self.in_flight[rid].topic == topic for rid in self.retry_at),
        )

    def _linger(self, topic: str, buf: _Buffer, now: float) -> float:
        """How long a topic's open batch waits.

        Eager and none of its batches in flight: nothing, unless the batch fills within ``linger_ms``
        at the pace it is filling (judged from a tenth of a batch on; holding one message so far: if
        the topic's last batch was full); then it waits to be full. A fast sender so gets full
        batches (one broker pass, one fsync per 1,000 messages, not one per message and per round
        trip), and a slow one pays no wait: with 1,000-message batches and 5 ms the two meet at
        200,000 msg/s.
        """
        if not self.p.eager or self.per_topic.get(topic):
            return self.p.linger
        fast = self.p._filling_fast(buf, now) or (buf.count == 1 and self.p._fast.get(topic, False))
        return self.p.linger if fast else 0.0

    def _collect_lingering(self) -> None:
        """Hand off buffers whose linger is over, except where ``max_in_flight`` batches await a confirm.

        Those keep filling until a confirm frees a slot (or they are full): under
        back-pressure batches grow instead of queueing up small.
        """
        now = time.monotonic()
        with self.p._lock:
            for topic, buf in list(self.p._buffers.items()):
                if now - buf.opened >= self._linger(topic, buf, now) - _POLL_SLACK and not self._blocked(topic):
                    self.p._hand_off(topic, wake=False)  # this is the I/O thread
            while self.ready:
                self.queued.append(self.ready.popleft())

    def _send_queued(self) -> None:
        blocked: deque[tuple[str, _Buffer]] = deque()
        while self.queued:
            topic, buf = self.queued.popleft()
            if self._blocked(topic) or any(t == topic for t, _ in blocked):
                blocked.append((topic, buf))  # keep per-topic order
                continue
            self._publish(topic, buf)
        self.queued = blocked

    def _publish(self, topic: str, buf: _Buffer) -> None:
        if topic not in self.seqs and not self.p.metadata.single:
            self.probing.add(topic)  # its first batch: the leader may not be elected yet
        seq = self.seqs.get(topic, 0)
        self.seqs[topic] = seq + 1
        now = time.monotonic()
        body = (timed_array_header(buf.count) if buf.times else _array_header(buf.count)) + buf.body
        flight = _InFlight(next(self.rids), topic, seq, body, buf.count, buf.batch, now, now, held=len(buf.body))
        self.in_flight[flight.rid] = flight
        self.per_topic[topic] = self.per_topic.get(topic, 0) + 1
        self._transmit(flight)

    def _transmit(self, flight: _InFlight) -> None:
        """Send ``flight`` to its topic's leader of the moment (the one address, without a cluster)."""
        address = self._route(flight)
        if address is None:
            return
        flight.address = address
        frames = commands.publish(flight.topic, flight.body, pid=self.p.producer_id, seq=flight.seq, rid=flight.rid)
        flight.sent_at = time.monotonic()
        try:
            send_frames(self._link(address).sock, frames, NOBLOCK)
        except zmq.Again:
            # No connection (the socket does not reconnect by itself): start over on a new one now.
            flight.sent_at = -self.p.request_timeout

    def _route(self, flight: _InFlight) -> str | None:
        """The leader's address; None when no broker could say (asked again after a backoff)."""
        try:
            address = self.p.metadata.leader_for(flight.topic)
        except ConveyorError as exc:
            if not exc.retriable:
                raise
            flight.last_error = exc
            self.retry_at[flight.rid] = time.monotonic() + backoff_seconds(self.p.retry_wait, flight.attempts)
            flight.sent_at = float("inf")
            return None
        now = time.monotonic()
        if not self.suspects.hold(address, flight.topic, self.p.metadata.view, now, self.p.request_timeout):
            return address
        self.retry_at[flight.rid] = now + LEADER_POLL  # ask again then who leads
        flight.sent_at = float("inf")
        return None

    def _read_replies(self, link: _Link) -> None:
        while True:
            frames = recv_frames(link.sock)
            if frames is None:
                return
            self.last_heard = time.monotonic()
            self.suspects.heard_from(link.address)
            try:
                reply = decode(frames)
            except ConveyorError:
                continue
            flight = self.in_flight.get(reply.get("rid"))
            if flight is None:
                continue  # an answer to a batch already settled (a resend's twin)
            if reply.command is Command.PUBLISHED:
                self.probing.discard(flight.topic)  # a leader confirmed: the topic's batches may overlap again
                self.p.partitioner.confirmed(flight.topic, reply.get("partitions"))  # partitions added?
                self._finish(flight)
                flight.futures.resolve(int(reply.get("base_offset")))
            elif reply.command is Command.ERROR and flight.address == link.address:  # else: a former leader's
                self._on_error(flight, error_from_header(reply.header))

    def _on_error(self, flight: _InFlight, exc: ConveyorError) -> None:
        if isinstance(exc, UnknownPartition):  # the topic was made again with fewer partitions: ask its count
            self.p.partitioner.stale(split_log(flight.topic)[0])
        if isinstance(exc, UnknownTopic) and self.p.metadata.following:
            self.p.metadata.stale(flight.topic)  # the next batch asks who has it (a cluster may have made it since)
        if exc.retriable:
            flight.last_error = exc
            if time.monotonic() - flight.first_sent < self.p.delivery_timeout:
                if isinstance(exc, LEADERSHIP_ERRORS):
                    self._follow_leader(flight, exc)
                    return
                flight.attempts += 1
                self.retry_at[flight.rid] = time.monotonic() + backoff_seconds(self.p.retry_wait, flight.attempts)
                flight.sent_at = float("inf")  # not waiting for an answer until resent
                return
            exc = self._timed_out(flight)
        self._finish(flight)
        flight.futures.fail(exc)

    def _follow_leader(self, flight: _InFlight, exc: ConveyorError) -> None:
        """The broker does not lead the topic (or cannot append now): every unconfirmed batch of the topic
        goes again, in sequence order, with its pid and seq, to the leader METADATA (or the hint) names.

        Batches the old leader had replicated are answered with their original
        offsets; the rest were never confirmed and are stored anew.
        """
        metadata = self.p.metadata
        self.probing.add(flight.topic)
        if isinstance(exc, NotLeader):
            metadata.not_leader(flight.topic, 0, exc)
        else:
            metadata.stale(flight.topic)
        hinted = isinstance(exc, NotLeader) and bool(exc.fields.get("leader_addr"))
        when = time.monotonic() + (0.0 if hinted else backoff_seconds(self.p.retry_wait, flight.attempts))
        for other in self.in_flight.values():
            if other.topic != flight.topic:
                continue
            if other.rid not in self.retry_at:
                other.attempts += 1
                other.last_error = exc
                other.sent_at = float("inf")  # not waiting for the old leader's answer
            # All at the same time (one waiting longer for another reason too): they go out in sequence order.
            self.retry_at[other.rid] = min(self.retry_at.get(other.rid, when), when)

    def _timed_out(self, flight: _InFlight) -> ConveyorError:
        sent = flight.attempts - (flight.rid in self.retry_at)  # a resend scheduled but never made
        return delivery_timed_out(self.p.address, flight.topic, flight.last_error, sent)

    def _finish(self, flight: _InFlight) -> None:
        del self.in_flight[flight.rid]
        self.retry_at.pop(flight.rid, None)
        self.per_topic[flight.topic] -= 1
        self.p._settled(flight.count, flight.held)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        # A topic with a resend due sends every batch of it awaiting one, in sequence order, and stops at
        # the first that cannot be routed yet: the leader sees a producer's batches in order.
        topics = {self.in_flight[rid].topic for rid, when in self.retry_at.items() if when <= now}
        due = resends_due({rid: self.in_flight[rid] for rid in self.retry_at}, topics)
        if due and self.suspects.poll_due(now):
            self.p.metadata.stale()  # once per poll, not once per batch
        stalled: dict[str, float] = {}
        for _rid, flight in due:
            if flight.topic in stalled:
                self.retry_at[flight.rid] = stalled[flight.topic]
                continue
            del self.retry_at[flight.rid]
            self._transmit(flight)
            if flight.rid in self.retry_at:  # not routed: the rest of its topic waits with it
                stalled[flight.topic] = self.retry_at[flight.rid]
        expired = [f for f in self.in_flight.values() if now - f.first_sent >= self.p.delivery_timeout]
        for flight in expired:
            error = self._timed_out(flight)
            self._finish(flight)
            flight.futures.fail(error)
        for address in {f.address for f in self.in_flight.values() if now - f.sent_at >= self.p.request_timeout}:
            # No answer in time, or no connection to send on: a leader being followed is suspect too, so the
            # batches wait for METADATA to name the next leader rather than go back to it at once.
            self._leader_gone(address) if self.p.metadata.following else self._reconnect(address)

    def _reconnect(self, address: str) -> None:
        """A fresh socket (to the leader of the moment), then every batch that waited on ``address`` again, in order."""
        self.reconnects += 1
        link = self.links.get(address)
        if link is not None:
            self._close_link(link)
        self.p.metadata.lost(address)
        time.sleep(backoff_seconds(self.p.retry_wait, min(self.reconnects, 10)))
        if self.p.metadata.single:
            self._link(address)
        for flight in sorted((f for f in self.in_flight.values() if f.address == address), key=in_order):
            flight.attempts += 1
            self.retry_at.pop(flight.rid, None)
            self._transmit(flight)
