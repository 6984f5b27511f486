"""``AsyncProducer``: the producer for asyncio code, on ``zmq.asyncio``.

Same wire behaviour as ``Producer`` (linger, batches, idempotent resends);
``send()`` returns an ``asyncio.Future`` of the offset without waiting for
the confirm, ``send_and_wait()`` waits for it. It follows a cluster's
leaders as ``Producer`` does, with the same decisions
(``conveyor.broker.client.leadership``): a leader that hangs up or does not
answer in time is suspect until METADATA names the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

import tenacity
import zmq
import zmq.asyncio
from conveyor.broker.client.futures import Offset
from conveyor.broker.client.leadership import (
    LEADER_POLL,
    LEADERSHIP_ERRORS,
    Suspects,
    held_back,
    resends_due,
    window,
)
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.options import RESEND_WINDOW, check_producer_options
from conveyor.broker.client.partitioner import Partitioner
from conveyor.broker.client.tracing import instrument
from conveyor.broker.net.connection import DEFAULT_HWM, backoff_seconds, new_dealer
from conveyor.broker.net.security import HandshakeWatch
from conveyor.broker.wire import commands
from conveyor.broker.wire.delivery_times import Times, message_times, now_ms, pack_timed_records, time_headers
from conveyor.broker.wire.protocol import Command, decode, error_from_header
from conveyor.broker.wire.record import pack_records
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
    address: str = ""  # the broker it was last sent to: an error from another one is stale
    times: Times | None = None  # a timed batch's (not_before_ms, expires_ms): see ``delivery_times``


@dataclass(slots=True)
class _Link:
    """The socket to one broker, its handshake watch, and the tasks reading them."""

    address: str
    sock: zmq.asyncio.Socket
    watch: HandshakeWatch
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class AsyncProducer:
    """The asyncio producer; ``address`` defaults to ``CONVEYOR_BROKER``, else ``tcp://127.0.0.1:5555``.

    ``close()`` is bounded as ``Producer.close()``: it gives up after
    ``close_timeout_ms`` without a confirm, failing what is left with a
    ``RequestTimeout`` that names the broker.
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
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
        # One address, a comma-separated bootstrap list or a list; CONVEYOR_BROKER when not given.
        self.metadata = Metadata(address, timeout=request_timeout_ms / 1000)
        # Routes as ``Producer`` does; buffers, sequences and flights are per partition log (``topic#k``).
        self.partitioner = Partitioner(self.metadata.partition_count)
        self.address = ",".join(self.metadata.bootstrap)
        self.close_timeout = close_timeout_ms / 1000
        self._last_settled = time.monotonic()
        self._last_heard: float | None = None  # when the broker last answered anything
        # As Producer, but off by default here: under a leader kill in a cluster an eager AsyncProducer once
        # waited out request_timeout instead of following the leader (not understood yet; the linger path is tested).
        self.eager = eager
        self.buffer_memory = buffer_memory
        self.max_block = max_block_ms / 1000
        self._held = 0  # record bytes sent but not yet confirmed or failed
        self._freed = asyncio.Event()  # set whenever a settled batch gives back buffer room
        self.linger = linger_ms / 1000
        self.time_window_ms = max(1, round(linger_ms))  # delayed/expiring messages share a batch within it
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.request_timeout = request_timeout_ms / 1000
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.retry_wait = retry_wait or tenacity.wait_random_exponential(multiplier=0.05, max=2.0)
        self.producer_id = random.getrandbits(62) or 1
        self._ctx = zmq.asyncio.Context.instance()
        self._started = False
        self._links: dict[str, _Link] = {}  # one socket per broker that leads a topic
        self._silent = 0  # handshakes that ended without a reason, counted across sockets (as ``Producer``)
        self._suspects = Suspects()  # leaders that hung up or did not answer in time (as ``Producer``)
        self._resending: set[str] = set()  # topics whose batches wait to follow their leader
        # Topics whose route is not proven (their first batch, or after a leadership error): one batch at a
        # time until a leader confirms one, so no batch overtakes one a broker refused (as ``Producer``).
        self._probing: set[str] = set()
        self._buffers: dict[str, _Batch] = {}
        self._in_flight: dict[int, _Batch] = {}
        self._seqs: dict[str, int] = {}
        self._rids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._linger_handles: dict[str, asyncio.Handle] = {}
        self._flights: dict[str, int] = {}  # batches in flight per topic
        # Following leaders: at most RESEND_WINDOW batches of a topic await a confirm (a resend to a new
        # leader must stay within its deduplication window); the next ones wait here, in order.
        self._waiting: dict[str, deque[_Batch]] = {}
        instrument(self)  # OpenTelemetry, when installed: a traced send on this instance (client/tracing.py)

    async def start(self) -> AsyncProducer:
        self._started = True
        if self.metadata.single:
            self._link(self.metadata.bootstrap[0])  # connect now, as before clusters
        self._tasks = [asyncio.create_task(self._watchdog())]
        return self

    def _link(self, address: str) -> _Link:
        """The socket to ``address`` (made on first use), with its reader and its handshake watch."""
        link = self._links.get(address)
        if link is None:
            sock, watch = new_dealer(self._ctx, address, sndhwm=DEFAULT_HWM, rcvhwm=DEFAULT_HWM)
            watch.silent = self._silent
            link = self._links[address] = _Link(address, cast(zmq.asyncio.Socket, sock), watch)
            link.tasks = [asyncio.create_task(self._reader(link)), asyncio.create_task(self._handshakes(link))]
        return link

    def _forget_link(self, link: _Link) -> None:
        """The next batch to ``link.address`` gets a new socket (its silent handshakes still count)."""
        self._silent = link.watch.silent
        if self._links.get(link.address) is link:
            del self._links[link.address]

    async def _close_link(self, link: _Link) -> None:
        self._forget_link(link)
        for task in link.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        link.watch.close()
        link.sock.close(linger=0)

    async def _handshakes(self, link: _Link) -> None:
        """When a broker refuses this producer's handshake, what is in flight there fails with AUTH_FAILED at once."""
        while True:
            frames = await cast(zmq.asyncio.Socket, link.watch.socket).recv_multipart()
            silent, disconnects = link.watch.silent, link.watch.disconnects
            link.watch.on_event(frames)
            if link.watch.failure is not None:
                # Fail what is in flight there, and drop the socket: a refusal known before a batch is sent
                # (start() connects at once) would otherwise leave that batch on a socket that does not
                # try again, until request_timeout. The next batch gets a new socket and handshake.
                self._refused(link.watch.failure, link.address)
                self._forget_link(link)  # now: a batch sent before the close below would be lost with it
                self._tasks.append(asyncio.create_task(self._close_link(link)))
                return
            if (link.watch.disconnects > disconnects or link.watch.silent > silent) and self.metadata.following:
                # A leader this producer follows hung up (kill -9), or was killed mid-handshake (which ends it
                # without a reason): resend now, not after request_timeout.
                self._tasks.append(asyncio.create_task(self._leader_gone(link)))
                return

    async def _leader_gone(self, link: _Link) -> None:
        """A leader this producer follows hung up: it is suspect, so its batches wait for METADATA to name the
        next leader (asked every ``LEADER_POLL``) rather than go back to it while its lease still runs."""
        self._suspects.hung_up(link.address, self.metadata.view, time.monotonic())
        await self._close_link(link)
        self._resend_from(link.address)

    def _resend_from(self, address: str) -> None:
        """Every batch last sent to ``address`` goes again, in sequence order, to its leader of the moment."""
        self.metadata.lost(address)
        for rid, batch in resends_due({rid: b for rid, b in self._in_flight.items() if b.address == address}):
            self._transmit(rid, batch)

    def _refused(self, error: ConveyorError, address: str) -> None:
        for rid, batch in list(self._in_flight.items()):
            if batch.address == address:
                del self._in_flight[rid]
                self._settled(batch)
                for future in batch.futures:
                    if not future.done():
                        future.set_exception(error)

    async def send(
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
    ) -> asyncio.Future[int]:
        """Queue one message; the returned future resolves to its offset (an ``Offset``, with ``.partition``).

        ``partition``: this one; else the key's (docs/partitions.md); else the current keyless batch's.
        ``delay``, ``not_before``, ``ttl``: as ``Producer.send``.
        """
        times = None
        if delay is not None or not_before is not None or ttl is not None:
            times = message_times(now_ms(), delay=delay, not_before=not_before, ttl=ttl, window_ms=self.time_window_ms)
            if times is not None:
                headers = time_headers(times, headers)
        if not self._started:
            await self.start()
        if topic not in self.partitioner.counts:  # asked once per topic, off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.partitioner.count, topic)
        topic = self.partitioner.route(topic, key, partition)
        record = make_record(value, key, headers)
        size = len(record[2]) + 16
        if self._held and self._held + size > self.buffer_memory:
            await self._wait_for_room(size)
        self._held += size
        batch = self._buffers.get(topic)
        if batch is not None and (batch.size + size > self.max_batch_bytes or batch.times != times):
            self._ship(topic)  # other times: a batch of their own, after this one (the order of sends)
            batch = None
        if batch is None:
            batch = self._buffers[topic] = _Batch(topic, times=times)
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
        self._release(batch.topic)
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
        self.partitioner.batch_left(topic)  # sticky batching: the next keyless batch takes the next partition
        batch.seq = self._seqs.get(topic, 0)
        self._seqs[topic] = batch.seq + 1
        batch.body = pack_timed_records(batch.records) if batch.times else pack_records(batch.records)
        batch.first_sent = time.monotonic()
        if batch.seq == 0 and self.metadata.following:
            self._probing.add(topic)
        if self._waiting.get(topic) or self._held_back(topic):
            self._waiting.setdefault(topic, deque()).append(batch)
            return
        self._launch(batch)

    def _held_back(self, topic: str) -> bool:
        """No new batch of ``topic`` now: its window is full, or its batches wait for a resend (order first)."""
        if not self.metadata.following:
            return topic in self._resending
        in_flight = self._flights.get(topic, 0)
        return held_back(in_flight, window(topic in self._probing, RESEND_WINDOW), topic in self._resending)

    def _launch(self, batch: _Batch) -> None:
        rid = next(self._rids)
        self._in_flight[rid] = batch
        self._flights[batch.topic] = self._flights.get(batch.topic, 0) + 1
        self._transmit(rid, batch)

    def _release(self, topic: str) -> None:
        """A batch of ``topic`` settled: the next waiting one goes (in sequence order)."""
        waiting = self._waiting.get(topic)
        while waiting and not self._held_back(topic):
            self._launch(waiting.popleft())
        if waiting is not None and not waiting:
            del self._waiting[topic]

    def _transmit(self, rid: int, batch: _Batch) -> None:
        """Send ``batch`` to its topic's leader of the moment (the one address, without a cluster).

        A refresh of the leaders (only with several brokers, or after a broker
        named another leader) asks METADATA on this thread: at most
        ``request_timeout_ms``.
        """
        if rid not in self._in_flight:
            return  # settled while it waited for this resend
        try:
            address = self.metadata.leader_for(batch.topic)
        except ConveyorError as exc:
            if not exc.retriable:
                raise
            batch.last_error = exc
            self._resend_later(batch.topic, backoff_seconds(self.retry_wait, batch.attempts + 1))
            return
        if self._suspects.hold(address, batch.topic, self.metadata.view, time.monotonic(), self.request_timeout):
            self._resend_later(batch.topic, LEADER_POLL)  # ask again then who leads
            return
        frames = commands.publish(batch.topic, batch.body, pid=self.producer_id, seq=batch.seq, rid=rid)
        batch.address = address
        batch.sent_at = time.monotonic()
        batch.attempts += 1
        self._link(address).sock.send_multipart(frames)

    async def _reader(self, link: _Link) -> None:
        while True:
            frames = await link.sock.recv_multipart()
            self._last_heard = time.monotonic()
            self._suspects.heard_from(link.address)
            try:
                reply = decode(frames)
            except ConveyorError:
                continue
            rid = reply.get("rid")
            batch = self._in_flight.get(rid)
            if batch is None:
                continue
            if reply.command is Command.PUBLISHED:
                self._probing.discard(batch.topic)  # a leader confirmed: the topic's batches may overlap again
                self.partitioner.confirmed(batch.topic, reply.get("partitions"))  # partitions added?
                del self._in_flight[rid]
                self._settled(batch)
                base = int(reply.get("base_offset"))
                partition = split_log(batch.topic)[1]
                for i, future in enumerate(batch.futures):
                    if not future.done():
                        future.set_result(Offset(base + i, partition))
            elif reply.command is Command.ERROR and batch.address == link.address:  # else: a former leader's
                self._on_error(rid, batch, error_from_header(reply.header))

    def _on_error(self, rid: int, batch: _Batch, exc: ConveyorError) -> None:
        if isinstance(exc, UnknownPartition):  # the topic was made again with fewer partitions: ask its count
            self.partitioner.stale(split_log(batch.topic)[0])
        if isinstance(exc, UnknownTopic) and self.metadata.following:
            self.metadata.stale(batch.topic)  # the next batch asks who has it (a cluster may have made it since)
        if exc.retriable:
            batch.last_error = exc
            if time.monotonic() - batch.first_sent < self.delivery_timeout:
                if isinstance(exc, LEADERSHIP_ERRORS):
                    self._follow_leader(batch, exc)
                    return
                self._resend_later(batch.topic, self.request_timeout / 10)
                return
            exc = delivery_timed_out(self.address, batch.topic, exc, batch.attempts)
        del self._in_flight[rid]
        self._settled(batch)
        for future in batch.futures:
            if not future.done():
                future.set_exception(exc)

    def _follow_leader(self, batch: _Batch, exc: ConveyorError) -> None:
        """As ``Producer``: the topic's unconfirmed batches go again, in sequence order, with the same pid and
        seq, to the leader the ``NOT_LEADER`` names (at once) or METADATA names (after a backoff)."""
        if isinstance(exc, NotLeader):
            self.metadata.not_leader(batch.topic, 0, exc)
        else:
            self.metadata.stale(batch.topic)
        self._probing.add(batch.topic)
        hinted = isinstance(exc, NotLeader) and bool(exc.fields.get("leader_addr"))
        self._resend_later(batch.topic, 0.0 if hinted else backoff_seconds(self.retry_wait, batch.attempts))

    def _resend_later(self, topic: str, delay: float) -> None:
        """Every unconfirmed batch of ``topic`` goes again after ``delay``, together and in sequence order;
        until then no newer batch of it is sent."""
        if topic in self._resending:
            return
        self._resending.add(topic)
        for other in self._in_flight.values():
            if other.topic == topic:
                other.sent_at = float("inf")  # not waiting for the old answer
        asyncio.get_running_loop().call_later(delay, self._resend_topic, topic)

    def _resend_topic(self, topic: str) -> None:
        self._resending.discard(topic)
        if self._suspects.poll_due(time.monotonic()):
            self.metadata.stale()  # a leader is suspect: ask who leads now (once per poll, not once per topic)
        for rid, batch in resends_due(self._in_flight, {topic}):
            self._transmit(rid, batch)
            if topic in self._resending:  # not routed yet: the rest goes with it later
                return
        self._release(topic)

    async def _watchdog(self) -> None:
        """Resend on a fresh socket (to the leader of the moment) when confirms stop coming."""
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
            stuck = {b.address for b in self._in_flight.values() if now - b.sent_at > self.request_timeout}
            for address in stuck:
                if self.metadata.following:
                    # No answer in time (a leader killed with no hang-up seen): suspect, as one that hung up.
                    self._suspects.hung_up(address, self.metadata.view, now)
                link = self._links.get(address)
                if link is not None:
                    await self._close_link(link)
                self._resend_from(address)

    async def flush(self, timeout: float | None = None) -> None:
        """Ship every buffer and wait for all confirms; past ``timeout``, a ``RequestTimeout`` naming the broker."""
        await self._wait_settled(timeout, None)

    async def _wait_settled(self, timeout: float | None, silence: float | None) -> None:
        """Wait for every confirm: up to ``timeout`` in all, or until ``silence`` seconds pass without one."""
        for topic in list(self._buffers):
            self._ship(topic)
        started = time.monotonic()
        while pending := [f for b in self._unsettled() for f in b.futures if not f.done()]:
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
            for link in list(self._links.values()):
                await self._close_link(link)

    def _unsettled(self) -> list[_Batch]:
        return [*self._in_flight.values(), *(b for waiting in self._waiting.values() for b in waiting)]

    def _fail_in_flight(self, error: RequestTimeout) -> None:
        for batch in self._unsettled():
            failure = (
                error
                if batch.last_error is None
                else delivery_timed_out(self.address, batch.topic, batch.last_error, batch.attempts)
            )
            for future in batch.futures:
                if not future.done():
                    future.set_exception(failure)
        self._in_flight.clear()
        self._waiting.clear()

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            await self.close()
        except RequestTimeout as error:
            if exc_type is None:
                raise
            logging.getLogger("conveyor.client").warning("%s", error)  # keep the exception already leaving
