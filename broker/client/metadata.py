"""Finding the leader: bootstrap lists, the METADATA cache, and where each topic's requests go.

Every client (``Producer``, ``AsyncProducer``, ``Admin``, ``Subscription``,
the Spark connector, ``conveyor tail``) routes through ``Metadata``, so
they all follow a new leader the same way:

- Given **one** address, a client sends everything there and never asks
  METADATA, exactly as before clusters. Only a ``NOT_LEADER`` answer with
  the leader's address (``leader_addr``) moves a topic elsewhere.
- Given **several** (``tcp://a:5555,tcp://b:5555`` or a list, also through
  ``CONVEYOR_BROKER``), it asks METADATA of them in turn, each next one
  joining after ``stagger`` seconds without an answer (a dead first
  address costs that, not a timeout), and routes each topic to its
  leader. A topic no node knows yet goes to the node that answered.
- ``NOT_LEADER`` (its ``leader_addr`` hint is used at once),
  ``UNKNOWN_TOPIC``, ``NOT_ENOUGH_REPLICAS`` and a lost connection mark
  the topic (or the address) stale: the next ``leader_for`` asks again.

Sockets are made by ``new_dealer``, so CURVE works as for every client.
Not thread-safe: each client calls it from the one thread that owns its
sockets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import zmq
from conveyor.broker.config.addresses import broker_addresses, check_address
from conveyor.broker.net.connection import new_dealer
from conveyor.broker.net.metadata import ClusterView, PartitionInfo
from conveyor.broker.net.security import ClientKeys
from conveyor.broker.net.transport import recv_frames_blocking, send_frames
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, decode, error_from_header

from conveyor.errors import AuthFailed, BrokerUnavailable, ConfigError, ConveyorError, NotLeader
from conveyor.names import split_log

__all__ = ["ClusterView", "Metadata", "PartitionInfo", "ask_metadata", "broker_addresses"]

STAGGER = 0.5  # seconds before the next bootstrap broker is asked too
NO_LEADER_POLL = 0.2  # seconds between METADATA asks while a partition has no leader in the last answer


def ask_metadata(
    addresses: Sequence[str],
    topics: Sequence[str] | None = None,
    *,
    context: zmq.Context[Any] | None = None,
    keys: ClientKeys | None = None,
    timeout: float = 10.0,
    stagger: float = STAGGER,
) -> ClusterView:
    """The first METADATA answer from ``addresses``, asked in turn: the next joins every ``stagger`` seconds.

    Raises ``BrokerUnavailable`` naming them all when none answers within
    ``timeout``; ``AUTH_FAILED`` only when every one of them refused.
    """
    ctx = context or zmq.Context.instance()
    poller = zmq.Poller()
    asked: dict[Any, tuple[str, Any, Any]] = {}  # socket -> (address, socket, watch)
    refusals: list[AuthFailed] = []
    started = time.monotonic()
    deadline = started + timeout
    try:
        while (now := time.monotonic()) < deadline:  # each pass waits for a socket, the next stagger or the end
            due = started + stagger * len(asked) / 2  # two entries per address: its socket and its watch
            if len(asked) < 2 * len(addresses) and now >= due:
                _ask(ctx, addresses[len(asked) // 2], topics, keys, poller, asked)
                continue
            until = deadline if len(asked) == 2 * len(addresses) else min(deadline, due)
            for sock, _ in poller.poll(max(1, int((until - now) * 1000))):
                view = _answer(sock, asked, refusals, poller)
                if view is not None:
                    return view
            if refusals and len(refusals) == len(addresses):
                raise refusals[0]
    finally:
        for _address, sock, watch in {id(v[1]): v for v in asked.values()}.values():
            watch.close()
            sock.close(linger=0)
    raise BrokerUnavailable(
        f"no METADATA answer from {', '.join(addresses)} within {timeout:g} s (is a broker running there?)",
        address=",".join(addresses),
    )


def _ask(
    ctx: zmq.Context[Any],
    address: str,
    topics: Sequence[str] | None,
    keys: ClientKeys | None,
    poller: zmq.Poller,
    asked: dict[Any, tuple[str, Any, Any]],
) -> None:
    sock, watch = new_dealer(ctx, address, keys=keys, sndhwm=16, rcvhwm=16)
    asked[sock] = asked[watch.socket] = (address, sock, watch)
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.socket, zmq.POLLIN)
    send_frames(sock, commands.metadata(topics, rid=1), zmq.NOBLOCK)  # queued until connected (no peer: Again)


def _answer(
    sock: Any, asked: dict[Any, tuple[str, Any, Any]], refusals: list[AuthFailed], poller: zmq.Poller
) -> ClusterView | None:
    address, data, watch = asked[sock]
    if sock is watch.socket:
        refused = watch.read()
        if refused is not None and refused not in refusals:
            refusals.append(refused)
            poller.unregister(data)
            poller.unregister(watch.socket)
        return None
    try:
        reply = decode(recv_frames_blocking(data))
    except ConveyorError:
        return None  # not an answer this client can use; another broker may give one
    if reply.command is Command.ERROR:
        raise error_from_header(reply.header)
    if reply.command is not Command.METADATA_RESULT:
        return None
    return ClusterView.from_header(address, reply.header)


class Metadata:
    """The METADATA cache of one client, and ``leader_for`` each topic.

    ``bootstrap``: one address, a comma-separated list, a sequence of them,
    or None for ``CONVEYOR_BROKER`` (else the default). ``timeout`` bounds
    one refresh; ``stagger`` is how long each bootstrap broker has before
    the next is asked too.
    """

    def __init__(
        self,
        bootstrap: str | Sequence[str] | None = None,
        *,
        context: zmq.Context[Any] | None = None,
        keys: ClientKeys | None = None,
        timeout: float = 10.0,
        stagger: float = STAGGER,
    ) -> None:
        self.bootstrap = broker_addresses(bootstrap)
        self.timeout = timeout
        self.stagger = stagger
        self.refreshes = 0
        self.view: ClusterView | None = None
        self._ctx = context if context is not None and not _is_async(context) else zmq.Context.instance()
        self._keys = keys
        self._hints: dict[tuple[str, int], str] = {}  # leader addresses NOT_LEADER named since the last refresh
        self._stale = False
        self._dead: set[str] = set()  # addresses lost since the last answer: asked last
        self._refreshed_at = 0.0

    def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has (1 for a topic no broker has yet); one METADATA, the cache untouched.

        Safe from any thread: it asks on sockets of its own.
        """
        timeout = min(self.timeout, 2.0)
        view = ask_metadata(self.bootstrap, [topic], context=self._ctx, keys=self._keys, timeout=timeout)
        return len(view.topics.get(topic) or {0: None})

    @property
    def single(self) -> bool:
        """One bootstrap address: no METADATA unless a broker points elsewhere."""
        return len(self.bootstrap) == 1

    @property
    def following(self) -> bool:
        """Whether this client follows leaders: several brokers, or one that named another leader."""
        return not self.single or self.routed

    @property
    def routed(self) -> bool:
        """Whether anything routes past the bootstrap list: a METADATA answer or a leader a broker named."""
        return self.view is not None or bool(self._hints)

    def leader_for(self, topic: str, partition: int = 0) -> str:
        """The address to send ``topic``'s requests to; refreshes first when the cache is stale or empty.

        ``topic`` may be a partition's log name (``T#k``, as producers key their batches), which is
        partition k of ``T``. ``NotLeader`` (retriable) while the partition has no leader.
        """
        topic, partition = _partition_of(topic, partition)
        hinted = self._hints.get((topic, partition))
        if hinted is not None:
            return hinted
        if self.single and self.view is None and not self._stale:
            return self.bootstrap[0]
        if self.view is None or self._stale:
            self.refresh()
        assert self.view is not None
        address = self.view.leader_address(topic, partition)
        if address is None:
            # Offline, or a partition this answer does not list yet (added since): a routing asks again, at
            # most every NO_LEADER_POLL seconds, so the other partitions' batches do not wait on METADATA
            # at every retry while one partition elects a leader.
            if time.monotonic() - self._refreshed_at >= NO_LEADER_POLL:
                self._stale = True
            raise NotLeader(f"{topic!r} partition {partition} has no leader now", topic=topic, partition=partition)
        return address

    def any_address(self) -> str:
        """A broker for requests any node answers: the one that answered last (asking the list when none has yet)."""
        if (self.view is None or self._stale) and not self.single:
            with contextlib.suppress(BrokerUnavailable):
                self.refresh()
        if self.view is not None and self.view.source not in self._dead:
            return self.view.source
        return self._order()[0]

    def refresh(self, topics: Sequence[str] | None = None) -> ClusterView:
        """Ask METADATA again: the bootstrap brokers in turn, the ones lost lately last."""
        self.refreshes += 1
        view = ask_metadata(
            self._order(), topics, context=self._ctx, keys=self._keys, timeout=self.timeout, stagger=self.stagger
        )
        self.view, self._stale = view, False
        self._refreshed_at = time.monotonic()
        self._hints.clear()
        self._dead.discard(view.source)
        return view

    def _order(self) -> list[str]:
        known = list(self.bootstrap)
        if self.view is not None:
            known += [a for a in self.view.nodes.values() if a not in known and not a.startswith("tcp://0.0.0.0")]
        return [a for a in known if a not in self._dead] + [a for a in known if a in self._dead]

    def not_leader(self, topic: str, partition: int, error: ConveyorError) -> None:
        """A broker answered ``NOT_LEADER``: use the leader it named, or ask again."""
        topic, partition = _partition_of(topic, partition)
        hint = error.fields.get("leader_addr")
        if isinstance(hint, str) and hint:
            try:
                self._hints[(topic, partition)] = check_address(hint)
                return
            except ConfigError:
                pass
        self._hints.pop((topic, partition), None)
        self._stale = True

    def stale(self, topic: str | None = None, partition: int = 0) -> None:
        """``UNKNOWN_TOPIC``, ``NOT_ENOUGH_REPLICAS``, ``FENCED``...: ask again before the next routing."""
        if topic is not None:
            self._hints.pop(_partition_of(topic, partition), None)
        self._stale = True

    def lost(self, address: str) -> None:
        """No answer from ``address`` (timeout or disconnect): route nothing there by hint, ask others first."""
        self._hints = {key: a for key, a in self._hints.items() if a != address}
        if not self.single or self.view is not None:
            self._dead.add(address)
            self._stale = True


def _partition_of(name: str, partition: int) -> tuple[str, int]:
    """``(topic, partition)`` of a topic and partition, or of a partition's log name (``"T#3"``, 0)."""
    return split_log(name) if partition == 0 else (name, partition)


def _is_async(context: zmq.Context[Any]) -> bool:
    import zmq.asyncio

    return isinstance(context, zmq.asyncio.Context)
