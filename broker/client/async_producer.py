"""``AsyncProducer``: the producer for asyncio code, on ``zmq.asyncio``.

Same wire behaviour as ``Producer`` (linger, batches, idempotent resends);
``send()`` returns an ``asyncio.Future`` of the offset without waiting for
the confirm, ``send_and_wait()`` waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, cast

import tenacity
import zmq
import zmq.asyncio
from conveyor.broker.client.options import check_producer_options
from conveyor.broker.config.addresses import broker_address
from conveyor.broker.net.connection import DEFAULT_HWM, new_dealer
from conveyor.broker.net.security import HandshakeWatch
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode, error_from_header
from conveyor.broker.wire.record import pack_records
from conveyor.broker.wire.values import make_record

from conveyor.errors import ConveyorError, RequestTimeout, buffer_full, delivery_timed_out


@dataclass(slots=True)
class _Batch:
    topic: str
    records: list[Any] = field(default_factory=list)
    futures: list[asyncio.Future[int]] = field(default_factory=list)
    size: int = 0
    seq: int = -1
    body: bytes = b""
    first_sent: float = 0.0
    sent_at: float = 0.0
    attempts: int = 0
    last_error: ConveyorError | None = None  # the last retriable error the broker answered


class AsyncProducer:
    """The asyncio producer; ``address`` defaults to ``CONVEYOR_BROKER``, else ``tcp://127.0.0.1:5555``.

    ``close()`` is bounded as ``Producer.close()``: it gives up after
    ``close_timeout_ms`` without a confirm, failing what is left with a
    ``RequestTimeout`` that names the broker.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        linger_ms: float = 5.0,
        batch_size: int = 1000,
        max_batch_bytes: int = 1 << 20,
        request_timeout_ms: int = 5000,
        delivery_timeout_ms: int = 120_000,
        buffer_memory: int = 32 << 20,
        max_block_ms: float = 60_000,
        close_timeout_ms: float = 5000,
        eager: bool = False,
        retry_wait: Any = None,
    ) -> None:
        check_producer_options(
            linger_ms=linger_ms,
            batch_size=batch_size,
            max_batch_bytes=max_batch_bytes,
            request_timeout_ms=request_timeout_ms,
            delivery_timeout_ms=delivery_timeout_ms,
            buffer_memory=buffer_memory,
            max_block_ms=max_block_ms,
            close_timeout_ms=close_timeout_ms,
        )
        self.address = broker_address(address)
        self.close_timeout = close_timeout_ms / 1000
        self._last_settled = time.monotonic()
        self._last_heard: float | None = None  # when the broker last answered anything
        self.eager = eager  # as Producer: a batch may go at once while none of its topic is in flight
        self.buffer_memory = buffer_memory
        self.max_block = max_block_ms / 1000
        self._held = 0  # record bytes sent but not yet confirmed or failed
        self._freed = asyncio.Event()  # set whenever a settled batch gives back buffer room
        self.linger = linger_ms / 1000
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.request_timeout = request_timeout_ms / 1000
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.retry_wait = retry_wait or tenacity.wait_random_exponential(multiplier=0.05, max=2.0)
        self.producer_id = random.getrandbits(62) or 1
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._watch: HandshakeWatch | None = None
        self._buffers: dict[str, _Batch] = {}
        self._in_flight: dict[int, _Batch] = {}
        self._seqs: dict[str, int] = {}
        self._rids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._linger_handles: dict[str, asyncio.Handle] = {}
        self._flights: dict[str, int] = {}  # batches in flight per topic

    async def start(self) -> AsyncProducer:
        self._sock = self._new_socket()
        self._tasks = [
            asyncio.create_task(self._reader()),
            asyncio.create_task(self._watchdog()),
            asyncio.create_task(self._handshakes()),
        ]
        return self

    def _new_socket(self) -> zmq.asyncio.Socket:
        """A DEALER to the broker; its handshakes are watched (``self._watch``, replacing the old socket's)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        sock, self._watch = new_dealer(self._ctx, self.address, sndhwm=DEFAULT_HWM, rcvhwm=DEFAULT_HWM)
        return cast(zmq.asyncio.Socket, sock)

    async def _handshakes(self) -> None:
        """When the broker refuses this producer's handshake, what is in flight fails with AUTH_FAILED at once."""
        while True:
            watch = self._watch
            assert watch is not None
            try:
                frames = await cast(zmq.asyncio.Socket, watch.socket).recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                if watch is self._watch:
                    raise  # this task is being cancelled (close())
                continue  # the watch was replaced with its socket (a reconnect): watch the new one
            watch.on_event(frames)
            if watch.failure is not None and watch is self._watch:
                self._refused(watch.failure)

    def _refused(self, error: ConveyorError) -> None:
        batches, self._in_flight = list(self._in_flight.values()), {}
        for batch in batches:
            self._settled(batch)
            for future in batch.futures:
                if not future.done():
                    future.set_exception(error)

    async def send(
        self, topic: str, value: Any, *, key: str | bytes | None = None, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        """Queue one message; the returned future resolves to its offset."""
        if self._sock is None:
            await self.start()
        record = make_record(value, key, headers)
        size = len(record[2]) + 16
        if self._held and self._held + size > self.buffer_memory:
            await self._wait_for_room(size)
        self._held += size
        batch = self._buffers.get(topic)
        if batch is not None and batch.size + size > self.max_batch_bytes:
            self._ship(topic)
            batch = None
        if batch is None:
            batch = self._buffers[topic] = _Batch(topic)
            loop = asyncio.get_running_loop()
            if self.eager and not self._flights.get(topic):
                # Once this task yields: sends made in the same step still join the batch.
                self._linger_handles[topic] = loop.call_soon(self._ship, topic)
            else:
                self._linger_handles[topic] = loop.call_later(self.linger, self._ship, topic)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        batch.records.append(record)
        batch.futures.append(future)
        batch.size += size
        if len(batch.records) >= self.batch_size:
            self._ship(topic)
        return future

    async def _wait_for_room(self, size: int) -> None:
        """Back-pressure, as ``Producer``: wait until ``size`` more bytes fit in ``buffer_memory``."""
        for topic in list(self._buffers):  # what lingers would wait for its linger: send it now
            self._ship(topic)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_block
        while self._held and self._held + size > self.buffer_memory:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise buffer_full(self._held, self.buffer_memory, self.max_block)
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)

    def _settled(self, batch: _Batch) -> None:
        """A batch is confirmed or failed for good: its bytes no longer count against ``buffer_memory``."""
        self._last_settled = time.monotonic()
        self._held -= batch.size
        self._freed.set()
        self._flights[batch.topic] -= 1
        if self.eager and not self._flights[batch.topic] and batch.topic in self._buffers:
            self._ship(batch.topic)  # the pipe is idle: what waited for this confirm goes now

    async def send_and_wait(self, topic: str, value: Any, **kwargs: Any) -> int:
        return await (await self.send(topic, value, **kwargs))

    def _ship(self, topic: str) -> None:
        handle = self._linger_handles.pop(topic, None)
        if handle:
            handle.cancel()
        batch = self._buffers.pop(topic, None)
        if batch is None or not batch.records:
            return
        batch.seq = self._seqs.get(topic, 0)
        self._seqs[topic] = batch.seq + 1
        batch.body = pack_records(batch.records)
        batch.first_sent = time.monotonic()
        rid = next(self._rids)
        self._in_flight[rid] = batch
        self._flights[topic] = self._flights.get(topic, 0) + 1
        self._transmit(rid, batch)

    def _transmit(self, rid: int, batch: _Batch) -> None:
        assert self._sock is not None
        frames = commands.publish(batch.topic, batch.body, pid=self.producer_id, seq=batch.seq, rid=rid)
        batch.sent_at = time.monotonic()
        batch.attempts += 1
        self._sock.send_multipart(frames)

    async def _reader(self) -> None:
        while True:
            assert self._sock is not None
            sock = self._sock
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                await asyncio.sleep(0.01)  # the socket was replaced under us
                continue
            self._last_heard = time.monotonic()
            try:
                reply = decode(frames)
            except ConveyorError:
                continue
            batch = self._in_flight.pop(reply.get("rid"), None)
            if batch is None:
                continue
            if reply.command is Command.PUBLISHED:
                self._settled(batch)
                base = int(reply.get("base_offset"))
                for i, future in enumerate(batch.futures):
                    if not future.done():
                        future.set_result(base + i)
            elif reply.command is Command.ERROR:
                self._on_error(reply.get("rid"), batch, error_from_header(reply.header))

    def _on_error(self, rid: int, batch: _Batch, exc: ConveyorError) -> None:
        if exc.retriable:
            batch.last_error = exc
            if time.monotonic() - batch.first_sent < self.delivery_timeout:
                self._in_flight[rid] = batch
                asyncio.get_running_loop().call_later(self.request_timeout / 10, self._transmit, rid, batch)
                return
            exc = delivery_timed_out(self.address, batch.topic, exc, batch.attempts)
        self._settled(batch)
        for future in batch.futures:
            if not future.done():
                future.set_exception(exc)

    async def _watchdog(self) -> None:
        """Resend on a fresh socket when confirms stop coming."""
        while True:
            await asyncio.sleep(min(1.0, self.request_timeout / 2))
            now = time.monotonic()
            for rid, batch in list(self._in_flight.items()):
                if now - batch.first_sent > self.delivery_timeout:
                    del self._in_flight[rid]
                    self._settled(batch)
                    error = delivery_timed_out(self.address, batch.topic, batch.last_error, batch.attempts)
                    for future in batch.futures:
                        if not future.done():
                            future.set_exception(error)
            if any(now - b.sent_at > self.request_timeout for b in self._in_flight.values()):
                old, self._sock = self._sock, self._new_socket()
                if old is not None:
                    old.close(linger=0)
                for rid, batch in sorted(self._in_flight.items(), key=lambda item: (item[1].topic, item[1].seq)):
                    self._transmit(rid, batch)

    async def flush(self, timeout: float | None = None) -> None:
        """Ship every buffer and wait for all confirms; past ``timeout``, a ``RequestTimeout`` naming the broker."""
        await self._wait_settled(timeout, None)

    async def _wait_settled(self, timeout: float | None, silence: float | None) -> None:
        """Wait for every confirm: up to ``timeout`` in all, or until ``silence`` seconds pass without one."""
        for topic in list(self._buffers):
            self._ship(topic)
        started = time.monotonic()
        while pending := [f for b in self._in_flight.values() for f in b.futures if not f.done()]:
            now = time.monotonic()
            limits = [] if timeout is None else [started + timeout]
            if silence is not None:
                limits.append(max(self._last_settled, started) + silence)
            if limits and now >= min(limits):
                raise self._unconfirmed(len(pending), now - started)
            wait = min(1.0, min(limits) - now) if limits else None
            await asyncio.wait(pending, timeout=wait)

    def _unconfirmed(self, count: int, waited: float) -> RequestTimeout:
        if self._last_heard is None:
            heard = "nothing was ever heard from that address: is a broker running there?"
        else:
            heard = f"its last answer came {time.monotonic() - self._last_heard:.1f} s ago"
        return RequestTimeout(
            f"{count} message(s) not confirmed by {self.address} after {waited:.1f} s; {heard}",
            address=self.address,
            unconfirmed=count,
        )

    async def close(self, timeout: float | None = None) -> None:
        """Ship what is queued and wait for its confirms, as ``Producer.close()``: at most ``timeout`` in all,
        or by default until ``close_timeout_ms`` passes without a confirm; then what is left fails."""
        silence = self.close_timeout if timeout is None else None
        try:
            await self._wait_settled(timeout, silence)
        except RequestTimeout as error:
            self._fail_in_flight(error)
            raise
        finally:
            for task in self._tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    def _fail_in_flight(self, error: RequestTimeout) -> None:
        for batch in self._in_flight.values():
            failure = (
                error
                if batch.last_error is None
                else delivery_timed_out(self.address, batch.topic, batch.last_error, batch.attempts)
            )
            for future in batch.futures:
                if not future.done():
                    future.set_exception(failure)
        self._in_flight.clear()

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            await self.close()
        except RequestTimeout as error:
            if exc_type is None:
                raise
            logging.getLogger("conveyor.client").warning("%s", error)  # keep the exception already leaving
