"""The low-level consumer: one DEALER socket, one subscription.

It subscribes with credit, hands out delivered batches as ``Message``
lists, settles them (ack, nack with delay, in-progress, terminate) and
keeps the connection alive with heartbeats. When the broker goes quiet for
longer than its liveness window, or says BYE, it starts over on a new
socket and subscribes again; what it held unacked is redelivered by the
broker, so nothing is lost (at-least-once).

Not thread-safe: one thread calls ``receive`` and the settle methods. The
runner keeps that thread free and runs handlers elsewhere.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any

import zmq
from conveyor.broker.client.leadership import LEADERSHIP_ERRORS
from conveyor.broker.client.message import PARTITION_STRIDE, Message, messages_from_entries
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.net.connection import DEFAULT_HWM, new_dealer
from conveyor.broker.net.security import HandshakeWatch
from conveyor.broker.net.transport import NOBLOCK, recv_frames, send_frames
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, Frame, decode, error_from_header
from conveyor.broker.wire.ranges import to_ranges

from conveyor.errors import ConveyorError, NotLeader
from conveyor.names import check_name, partition_log

log = logging.getLogger("conveyor.consumer")


_offset_of = attrgetter("offset")
MAX_RANGES_PER_FRAME = 2048  # at most 19 bytes each: an ACK stays well under the broker's 64 KiB header limit


def offset_ranges(messages: Iterable[Message | int]) -> list[list[int]]:
    """``[[start, end), ...]`` for messages or offsets; one range in the common case."""
    items = messages if isinstance(messages, list) else list(messages)
    if not items:
        return []
    if isinstance(items[0], int):
        offsets: list[int] = items  # type: ignore[assignment]  # a list of ints (the runner's acks) as it is
    else:
        try:
            offsets = list(map(_offset_of, items))  # a C loop over a delivered batch of messages
        except AttributeError:
            offsets = [m.offset if isinstance(m, Message) else int(m) for m in items]
    first, last = offsets[0], offsets[-1]
    if last - first + 1 == len(offsets) and offsets == list(range(first, last + 1)):
        return [[first, last + 1]]  # contiguous and in order: the common case
    return [list(r) for r in to_ranges(sorted(set(offsets)))]


def by_partition(messages: Iterable[Message | int]) -> dict[int, list[int]]:
    """Offsets by partition, from messages or ``Message.ref`` ints (``offset + partition * 2**52``)."""
    out: dict[int, list[int]] = {}
    for item in messages:
        if isinstance(item, Message):
            out.setdefault(item.partition, []).append(item.offset)
        else:
            partition, offset = divmod(int(item), PARTITION_STRIDE)
            out.setdefault(partition, []).append(offset)
    return out


class DeadLettered(Exception):
    """Given to ``@error_handler`` hooks for a message the broker dead-lettered itself.

    That is past the group's ``max_deliveries``: every attempt was nacked
    (``Nack``), or runners died or hung holding it. ``reason`` is the last
    error the broker kept, ``deliveries`` how often it was delivered.
    """

    def __init__(self, reason: str, deliveries: int, dead_letter_topic: str = "") -> None:
        super().__init__(f"dead-lettered by the broker after {deliveries} deliveries: {reason}")
        self.reason = reason
        self.deliveries = deliveries
        self.dead_letter_topic = dead_letter_topic


class Subscription:
    def __init__(
        self,
        topic: str,
        group: str,
        *,
        address: str | Sequence[str] | None = None,
        credit: int = 1000,
        batch_size: int | None = None,
        start: str | int | dict[str, int] = "earliest",
        key_affinity: bool = False,
        max_deliveries: int | None = None,
        ack_timeout_ms: int | None = None,
        dead_letter_topic: str | None = None,
        heartbeat_ms: int = 1000,
        liveness: int = 3,
        context: zmq.Context[Any] | None = None,
        on_event: Callable[[str, int], None] | None = None,
        on_dead_letter: Callable[[list[Message], DeadLettered], None] | None = None,
        _partition: int = 0,
        _metadata: Metadata | None = None,
    ) -> None:
        self.topic = check_name(topic)  # "T#k" is the broker's name of a partition, no topic: INVALID_NAME
        self.on_event = on_event
        self.on_dead_letter = on_dead_letter  # EVENT DEAD_LETTERED: messages the broker dead-lettered itself
        self.events: list[tuple[str, int]] = []  # (RESET | READY | PARTITIONS, offset), as the broker announced them
        self.group = group
        self.heartbeat = heartbeat_ms / 1000
        self.liveness = liveness
        # One broker, or a list: the subscription goes to the topic's leader and follows it (CONVEYOR_BROKER
        # when not given). A METADATA refresh waits at most one liveness window.
        self.metadata = _metadata or Metadata(address, context=context, timeout=self.heartbeat * liveness)
        # In a cluster each partition of a topic may have another leader: partition k > 0 is then read by a
        # subscription of its own (``_partition`` k, on its own socket to its leader), a child of partition 0's.
        self.partition = _partition
        self.children: dict[int, Subscription] = {}
        self.address = self.metadata.bootstrap[0]  # the broker of the moment
        self.credit = credit
        self.batch_size = batch_size or credit
        self.options: dict[str, Any] = {"start": start, "key_affinity": key_affinity}
        for name, value in (
            ("max_deliveries", max_deliveries),
            ("ack_timeout_ms", ack_timeout_ms),
            ("dead_letter_topic", dead_letter_topic),
        ):
            if value is not None:
                self.options[name] = value
        # A partitioned topic: partition p is subscription p + 1 on this socket (learnt from SUBSCRIBED).
        self.partitions = 1
        self.reconnects = 0
        self.subscribed = False
        # Since when this subscription has been without its broker (None while subscribed): from the start
        # until the first SUBSCRIBED, and from each reconnect until the next; reconnecting does not reset it.
        self.down_since: float | None = time.monotonic()
        self._resubscribe_at = 0.0  # a SUBSCRIBE refused for now (RATE_LIMITED...): when to send it again
        self._ctx = context or zmq.Context.instance()
        self._rids = itertools.count(1)
        self._sock: zmq.Socket[Any] | None = None
        self._watch: HandshakeWatch | None = None
        self._last_heard = self._last_sent = time.monotonic()
        self._connect()

    # --- connection -----------------------------------------------------------------

    def _connect(self) -> None:
        self.address = self._leader()
        # rcvhwm 0: credit bounds what can arrive
        self._sock, self._watch = new_dealer(self._ctx, self.address, sndhwm=DEFAULT_HWM, rcvhwm=0)
        self._send(commands.hello(f"conveyor-consumer/{os.getpid()}", rid=next(self._rids)))
        self._send(
            commands.subscribe(
                1,
                partition_log(self.topic, self.partition),
                self.group,
                credit=self.credit,
                batch_size=self.batch_size,
                settings=self.options,
                rid=next(self._rids),
            )
        )
        self._last_heard = time.monotonic()
        self.subscribed = False
        if self.down_since is None:
            self.down_since = self._last_heard

    def _leader(self) -> str:
        """The topic's leader; the broker of the moment when no broker can say now (the silence check tries again)."""
        try:
            return self.metadata.leader_for(self.topic, self.partition)
        except ConveyorError as exc:
            if not exc.retriable:
                raise
            log.warning("consumer %s/%s: no leader known (%s); trying %s", self.topic, self.group, exc, self.address)
            return self.address

    def _reconnect(self, why: str, *, lost: bool = False) -> None:
        """A new socket to the topic's leader (``lost``: this broker went silent, ask the others first)."""
        log.warning("consumer %s/%s: %s; reconnecting to %s", self.topic, self.group, why, self.address)
        if lost:
            self.metadata.lost(self.address)
        self.reconnects += 1
        if self._watch is not None:
            self._watch.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._connect()

    def _send(self, frames: list[Any]) -> None:
        assert self._sock is not None
        send_frames(self._sock, frames)
        self._last_sent = time.monotonic()

    # --- receiving --------------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> list[Message]:
        """The next delivered batch, or ``[]`` when ``timeout`` passes first.

        Heartbeats and reconnects happen inside, so keep calling it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wait = self._next_tick(now)
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            assert self._sock is not None
            if self._poll(int(wait * 1000) + 1):
                messages = self.read_ready()
                if messages:
                    return messages
            self._tick()
            if deadline is not None and time.monotonic() >= deadline:
                return []

    # --- for event loops that poll many subscriptions (the runner) ----------------

    def down_seconds(self, now: float | None = None) -> float:
        """How long this subscription has been without its broker (0 while subscribed); in a cluster, the
        longest any partition's leader has been missing."""
        since = self.down_since
        mine = 0.0 if since is None else max(0.0, (time.monotonic() if now is None else now) - since)
        return max([mine, *(child.down_seconds(now) for child in self.children.values())])

    @property
    def socket(self) -> zmq.Socket[Any]:
        """Partition 0's socket (the only one, but in a cluster with a partitioned topic: ``sockets``)."""
        assert self._sock is not None
        return self._sock

    @property
    def sockets(self) -> list[zmq.Socket[Any]]:
        """Every socket to poll for this subscription: one per partition leader link (one outside clusters)."""
        return [self.socket, *(child.socket for child in self.children.values())]

    def read_ready(self) -> list[Message]:
        """Messages already waiting on the sockets; never blocks."""
        messages = self._read()
        for child in list(self.children.values()):
            messages += child._read()
        return messages

    def tick(self) -> float:
        """Heartbeat or reconnect if due; return seconds until the next tick."""
        self._tick()
        return self._next_tick(time.monotonic())

    def _poll(self, timeout_ms: int) -> bool:
        if not self.children:
            assert self._sock is not None
            return bool(self._sock.poll(timeout_ms))
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        return bool(poller.poll(timeout_ms))

    def _next_tick(self, now: float) -> float:
        due = min(self._last_sent + self.heartbeat, self._last_heard + self.heartbeat * self.liveness)
        if self._resubscribe_at:
            due = min(due, self._resubscribe_at)
        mine = max(0.0, due - now)
        return min([mine, *(child._next_tick(now) for child in self.children.values())])

    def _tick(self) -> None:
        """Heartbeat or reconnect if due; raise ``AUTH_FAILED`` when the broker refused this client's handshake."""
        for child in list(self.children.values()):
            child._tick()
        if self._watch is not None:
            disconnects = self._watch.disconnects
            refused = self._watch.read()
            if refused is not None:
                raise refused
            if self._watch.disconnects > disconnects and self.metadata.following:
                self._reconnect("leader hung up", lost=True)  # a kill -9: do not wait for the liveness window
                return
        now = time.monotonic()
        if self._resubscribe_at and now >= self._resubscribe_at:
            self._resubscribe_at = 0.0
            self._reconnect("subscribing again after a retriable refusal")
        elif now - self._last_heard > self.heartbeat * self.liveness:
            self._reconnect("broker silent", lost=True)
        elif now - self._last_sent >= self.heartbeat:
            assert self._sock is not None
            try:  # never blocks: without a connection there is no one to tell, and the silence check reconnects
                send_frames(self._sock, commands.heartbeat(), NOBLOCK)
            except zmq.Again:
                pass
            self._last_sent = now

    def _read(self) -> list[Message]:
        assert self._sock is not None
        messages: list[Message] = []
        while True:
            frames = recv_frames(self._sock)
            if frames is None:
                return messages
            self._last_heard = time.monotonic()
            try:
                frame = decode(frames)
            except ConveyorError as exc:
                log.error("undecodable message from the broker: %s", exc)
                continue
            messages += self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> list[Message]:
        if frame.command is Command.DELIVER:
            partition = frame.get("p", 0)
            bodies = [bytes(b) for b in frame.payload]
            return messages_from_entries(
                self.topic, frame.get("entries", []), bodies, partition=partition or self.partition
            )
        if frame.command is Command.SUBSCRIBED:
            self.subscribed = True
            self.down_since = None
            partitions = frame.get("partitions")
            if frame.get("sub") == 1 and isinstance(partitions, int) and partitions > 1 and not self.partition:
                self._subscribe_partitions(partitions)
        elif frame.command is Command.BYE:
            self._reconnect(str(frame.get("reason") or "broker said goodbye"))
        elif frame.command is Command.EVENT:
            event = (str(frame.get("event")), int(frame.get("offset", 0)))
            if event[0] == "DEAD_LETTERED":  # may be frequent: handed on, not kept in ``events``
                self._dead_lettered(frame)
                return []
            if event[0] == "PARTITIONS" and frame.get("sub") == 1 and isinstance(frame.get("partitions"), int):
                self._subscribe_partitions(frame.get("partitions"), first=self.partitions, added=True)
            self.events.append(event)
            if event[0] == "PARTITIONS":  # its offset says nothing; its count is the news
                log.info(
                    "consumer %s/%s: the topic has %s partitions now", self.topic, self.group, frame.get("partitions")
                )
            else:
                log.info("consumer %s/%s: %s at offset %d", self.topic, self.group, *event)
            if self.on_event is not None:
                self.on_event(*event)
        elif frame.command is Command.ERROR:
            exc = error_from_header(frame.header)
            if isinstance(exc, LEADERSHIP_ERRORS):
                # The leader moved (or this one cannot serve now): subscribe again where it is now.
                if isinstance(exc, NotLeader):
                    self.metadata.not_leader(self.topic, self.partition, exc)
                else:
                    self.metadata.stale(self.topic, self.partition)
                hinted = isinstance(exc, NotLeader) and bool(exc.fields.get("leader_addr"))
                self._resubscribe_at = time.monotonic() + (0.0 if hinted else 0.2)
            elif exc.name == "NOT_SUBSCRIBED":
                self._reconnect("broker forgot this subscription")
            elif exc.retriable and not self.subscribed:
                # The SUBSCRIBE itself was refused for now (RATE_LIMITED auto-creating its topic, say): again later.
                wait_ms = exc.fields.get("retry_after_ms")
                delay = max(0.05, min(5.0, wait_ms / 1000)) if isinstance(wait_ms, int | float) else 0.5
                log.info("consumer %s/%s: %s; subscribing again in %.2f s", self.topic, self.group, exc, delay)
                self._resubscribe_at = time.monotonic() + delay
            else:
                raise exc
        return []

    def _subscribe_partitions(self, partitions: int, first: int = 1, *, added: bool = False) -> None:
        """Partition 0 answered: the topic has ``partitions``. Each has a subscription of its own (its own
        group state on the broker) with an equal share of the credit, so the total stays ``credit``.

        ``first``: the partitions below it are subscribed already (EVENT ``PARTITIONS``: partitions were
        added): only the new ones are, and the others' shares shrink to make room. Through one broker
        they share this socket (partition k is subscription k + 1). In a cluster each partition is
        subscribed at its own leader, by a child subscription with a socket of its own.
        """
        if partitions <= first:
            return
        self.partitions = partitions
        credit, batch_size = self._share()
        if self.metadata.following:
            self._send(commands.credit(1, credit, batch_size=batch_size))
            for child in self.children.values():
                child.credit, child.batch_size = credit, batch_size
                child._send(commands.credit(1, credit, batch_size=batch_size))
            self._children(partitions, credit, batch_size, added=added)
            return
        for partition in range(first):
            self._send(commands.credit(partition + 1, credit, batch_size=batch_size))
        for partition in range(first, partitions):
            self._send(
                commands.subscribe(
                    partition + 1,
                    partition_log(self.topic, partition),
                    self.group,
                    credit=credit,
                    batch_size=batch_size,
                    settings=self.options,
                    rid=next(self._rids),
                )
            )

    def _children(self, partitions: int, credit: int, batch_size: int, *, added: bool = False) -> None:
        """A subscription per partition past 0 (``added``: partitions added to the topic since this one
        subscribed, read from their earliest offset, as a single broker starts a group on them)."""
        settings = {**self._settings(), **({"start": "earliest"} if added else {})}
        for partition in range(1, partitions):
            if partition in self.children:
                continue
            self.children[partition] = Subscription(
                self.topic,
                self.group,
                credit=credit,
                batch_size=batch_size,
                heartbeat_ms=int(self.heartbeat * 1000),
                liveness=self.liveness,
                context=self._ctx,
                on_event=self.on_event,
                on_dead_letter=self.on_dead_letter,
                _partition=partition,
                _metadata=self.metadata,
                **settings,
            )

    def _settings(self) -> dict[str, Any]:
        """The group settings this subscription was made with, as keyword arguments."""
        options = dict(self.options)
        return {"start": options.pop("start"), "key_affinity": options.pop("key_affinity"), **options}

    def _share(self) -> tuple[int, int]:
        """Each partition's credit and batch size: ``credit`` split evenly (rounded up), at least 1."""
        if self.partitions == 1:
            return self.credit, self.batch_size
        credit = max(1, -(-self.credit // self.partitions)) if self.credit else 0
        return credit, max(1, min(self.batch_size, credit))

    def _dead_lettered(self, frame: Frame) -> None:
        bodies = [bytes(b) for b in frame.payload]
        messages = messages_from_entries(self.topic, frame.get("entries", []), bodies, partition=frame.get("p", 0))
        exc = DeadLettered(
            str(frame.get("reason") or ""), int(frame.get("deliveries", 0)), str(frame.get("dead_letter_topic") or "")
        )
        log.warning(
            "consumer %s/%s: the broker dead-lettered %d message(s) from offset %d: %s",
            self.topic,
            self.group,
            len(messages),
            int(frame.get("offset", 0)),
            exc,
        )
        if self.on_dead_letter is not None and messages:
            self.on_dead_letter(messages, exc)

    # --- settling --------------------------------------------------------------------------

    def ack(self, messages: Message | int | Iterable[Message | int]) -> None:
        self._settle(commands.ack, messages)

    def nack(
        self,
        messages: Message | int | Iterable[Message | int],
        *,
        delay_ms: int = 0,
        error: str = "",
        release: bool = False,
    ) -> None:
        """Give messages back; ``release`` for ones never tried (not counted as a delivery)."""
        self._settle(commands.nack, messages, delay_ms=int(delay_ms), error=error[:4096], release=release)

    def in_progress(self, messages: Message | int | Iterable[Message | int]) -> None:
        self._settle(commands.in_progress, messages)

    def term(self, messages: Message | int | Iterable[Message | int], *, reason: str = "") -> None:
        self._settle(commands.term, messages, reason=reason[:4096])

    def _settle(
        self, settle: Callable[..., list[Any]], messages: Message | int | Iterable[Message | int], **extra: Any
    ) -> None:
        """``settle``: the encoder of ACK, NACK, IN_PROGRESS or TERM (``broker/wire/commands.py``).

        ``messages``: messages or ``Message.ref`` ints, or one of either.
        """
        if isinstance(messages, (Message, int)):
            messages = [messages]
        if self.children:
            for partition, offsets in by_partition(messages).items():
                owner = self.children.get(partition) if partition else self  # partition 0: this one's own
                if owner is not None:
                    owner._send_settles(settle, [(1, offset_ranges(offsets))], **extra)
            return
        if self.partitions == 1 and not self.partition:
            by_sub = [(1, offset_ranges(messages))]
        elif self.partitions == 1:  # a cluster child: the runner settles by ``Message.ref``
            by_sub = [(1, offset_ranges(by_partition(messages).get(self.partition, [])))]
        else:
            by_sub = [(p + 1, offset_ranges(offsets)) for p, offsets in by_partition(messages).items()]
        self._send_settles(settle, by_sub, **extra)

    def _send_settles(
        self, settle: Callable[..., list[Any]], by_sub: list[tuple[int, list[list[int]]]], **extra: Any
    ) -> None:
        for sub, ranges in by_sub:
            for start in range(0, len(ranges), MAX_RANGES_PER_FRAME):  # scattered offsets: several frames
                self._send(settle(sub, ranges[start : start + MAX_RANGES_PER_FRAME], **extra))

    def set_credit(self, credit: int, batch_size: int | None = None) -> None:
        self.credit = credit
        self.batch_size = batch_size or credit
        share, batch = self._share()
        if self.children:
            self._send(commands.credit(1, share, batch_size=batch))
            for child in self.children.values():
                child.credit, child.batch_size = share, batch
                child._send(commands.credit(1, share, batch_size=batch))
            return
        for partition in range(self.partitions):
            self._send(commands.credit(partition + 1, share, batch_size=batch))

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye so the broker redelivers anything unacked at once."""
        for child in self.children.values():
            child.close()
        if self._sock is None:
            return
        try:
            # Never blocks: with no connection (the broker is down, or refused this client) there is no one to tell.
            send_frames(self._sock, commands.bye(), NOBLOCK)
        except zmq.Again:
            pass
        finally:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            self._sock.close(linger=200)
            self._sock = None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
