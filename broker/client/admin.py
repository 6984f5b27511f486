"""``Admin``: topics, groups and offsets, and ``fetch`` to read a range without a group."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import zmq
from conveyor.broker.client.message import Message, messages_from_entries
from conveyor.broker.client.metadata import Metadata, ask_metadata
from conveyor.broker.net.metadata import ClusterView
from conveyor.broker.net.requester import FramesFor, Requester
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import Command, Frame, encode

from conveyor.errors import BrokerUnavailable, ConveyorError, NotEnoughReplicas, NotLeader, UnknownGroup, UnknownTopic
from conveyor.names import check_name, check_partition, partition_log

# Top-level fields of describe_topic / describe_group that are sums over the partitions' rows.
SUMMED = (
    "end_offset",
    "durable_offset",
    "visible_offset",
    "segments",
    "size_bytes",
    "committed_offset",
    "next_offset",
    "lag",
    "in_flight",
    "pending_redelivery",
    "skipped_by_retention",
)


def leaders_of(view: ClusterView) -> dict[str, set[str]]:
    """Each leader's address and the topics it leads (offline partitions have none)."""
    led: dict[str, set[str]] = {}
    for topic in view.topics:
        address = view.leader_address(topic)
        if address is not None:
            led.setdefault(address, set()).add(topic)
    return led


class Admin:
    """Topics, groups and offsets; also ``fetch`` to read a range without a group.

    ``address``: one broker, or a list (``"tcp://a:5555,tcp://b:5555"``);
    ``CONVEYOR_BROKER`` when not given. With a list, requests about a topic
    go to its leader, the others to any broker that answers (``Metadata``).
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        timeout_ms: int = 10_000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.timeout = timeout_ms / 1000
        self.metadata = Metadata(address, context=context, timeout=self.timeout)
        self.address = ",".join(self.metadata.bootstrap)  # CONVEYOR_BROKER when not given, as the command line
        self._ctx = context
        self._lock = threading.Lock()
        self._requesters: dict[str, Requester] = {}
        self._requester = self._to(self.metadata.bootstrap[0]) if self.metadata.single else None

    def _to(self, address: str | None) -> Requester:
        """The requester to ``address`` (made on first use); None: any broker that answers METADATA."""
        if address is None:
            address = self.metadata.refresh().source if self.metadata.view is None else self.metadata.any_address()
        requester = self._requesters.get(address)
        if requester is None:
            # One try per request (no retry): a failed one is the caller's to judge.
            requester = Requester(address, context=self._ctx, timeout=self.timeout, hwm=100_000)
            self._requesters[address] = requester
        return requester

    @property
    def _sock(self) -> zmq.Socket[Any]:
        """The socket of the moment (tests speak raw frames on it)."""
        return (self._requester or self._to(None)).sock

    def request(self, command: Command, header: dict[str, Any], *, timeout: float | None = None) -> Any:
        """One request, one reply; raises the broker's error as its own class."""
        topic = header.get("topic")
        return self._call(lambda rid: encode(command, {**header, "rid": rid}), timeout=timeout, topic=topic)

    def _call(self, frames_for: FramesFor, *, timeout: float | None = None, topic: str | None = None) -> Frame:
        """Send ``frames_for(rid=...)`` (a request encoder of ``broker/wire/commands.py``) and wait for its reply.

        With several brokers: to ``topic``'s leader (or any broker), and once more to the leader a
        ``NOT_LEADER`` names, or to the next broker when this one does not answer.
        """
        wait = self.timeout if timeout is None else timeout
        with self._lock:
            if self._requester is not None and not self.metadata.routed:  # one broker: as before clusters
                try:
                    return self._requester.call(frames_for, timeout=wait)
                except NotLeader as exc:
                    if not topic:
                        raise
                    self.metadata.not_leader(topic, 0, exc)
            tries = len(self.metadata.bootstrap) + 2
            for attempt in range(tries):
                requester = self._to(self.metadata.leader_for(topic) if topic else None)
                try:
                    return requester.call(frames_for, timeout=wait)
                except (NotLeader, NotEnoughReplicas, BrokerUnavailable, UnknownTopic) as exc:
                    if attempt == tries - 1 or (isinstance(exc, UnknownTopic) and topic is None):
                        raise
                    self._reroute(requester.address, topic, exc)
            raise AssertionError("unreachable")

    def _reroute(self, address: str, topic: str | None, exc: ConveyorError) -> None:
        if isinstance(exc, NotLeader) and topic:
            self.metadata.not_leader(topic, 0, exc)
        elif isinstance(exc, BrokerUnavailable):
            self.metadata.lost(address)
        else:
            self.metadata.stale(topic)

    def _admin(self, op: str, **args: Any) -> Any:
        return self._call(partial(commands.admin, op, args), topic=args.get("topic")).get("result")

    def create_topic(self, name: str, *, partitions: int = 1, **config: Any) -> dict[str, Any]:
        """A topic with ``partitions`` logs (docs/partitions.md) and the settings in ``config``."""
        more = {"partitions": partitions} if partitions != 1 else {}
        made = self._admin("create_topic", topic=name, config=config, **more)
        if self.metadata.following:
            self._wait_known(name, partitions)
        return made

    def _wait_known(self, topic: str, partitions: int) -> None:
        """In a cluster: until every live node's METADATA lists the new topic's partitions (at most ``timeout``).

        The node that answered the create knows the topic; the others learn it from their etcd
        watch a moment later. A producer that asked one of them in between would take the topic
        for one partition and route its first batches' keys there; after this returns any node
        answers with the real count.
        """
        with self._lock:
            view = self.metadata.refresh()
        addresses = [a for a in view.nodes.values() if not a.startswith("tcp://0.0.0.0")] or self.metadata.bootstrap
        deadline = time.monotonic() + self.timeout
        for address in addresses:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    answer = ask_metadata([address], [topic], context=self._ctx, timeout=min(2.0, left))
                except BrokerUnavailable:
                    break  # a node that is down learns it when it starts
                if len(answer.topics.get(topic) or {}) >= partitions:
                    break
                time.sleep(0.02)  # an admin call waiting for other processes: bounded by the timeout

    def alter_topic(self, name: str, **config: Any) -> dict[str, Any]:
        """Change a topic's settings live (``retention_ms="7d"``, ``read_only=True``, ...); its description after.

        Each setting is checked as in ``create_topic``: a bad one is a ``ConfigError`` and nothing changes.
        """
        return self._admin("alter_topic", topic=name, config=config)

    def add_partitions(self, name: str, partitions: int) -> dict[str, Any]:
        """Grow ``name`` to ``partitions`` in all (the new total, as Kafka's CreatePartitions); its description after.

        Only up, to at most 1024: anything else is ``INVALID_REQUEST`` and nothing changes. Keys map
        by ``crc32(key) % partitions``, so most keys move to another partition from now on
        (docs/partitions.md, "How to add partitions"). Refused in a cluster for now (``PARTITIONS_UNSUPPORTED``).
        """
        return self._admin("add_partitions", topic=name, partitions=partitions)

    def reassign_topic(
        self,
        name: str,
        replicas: list[str] | tuple[str, ...],
        *,
        min_insync_replicas: int | None = None,
        partition: int | None = None,
    ) -> dict[str, Any]:
        """In a cluster: move the topic's replicas to ``replicas`` (node ids; the first is the preferred leader).

        Answered once the controller has the request: the new replicas then join as followers, catch
        up, and the old ones leave once the new are in sync (``METADATA`` shows the moves).
        ``min_insync_replicas`` becomes the topic's when the move is done. ``partition``: move that
        one only (to move a partition's leadership to another node); default, every partition.
        """
        args: dict[str, Any] = {"topic": name, "replicas": list(replicas)}
        if min_insync_replicas is not None:
            args["min_insync_replicas"] = min_insync_replicas
        if partition is not None:
            args["partition"] = partition
        return self._admin("reassign_topic", **args)

    def delete_topic(self, name: str) -> dict[str, Any]:
        return self._admin("delete_topic", topic=name)

    def list_topics(self) -> list[dict[str, Any]]:
        """Every topic's description; in a cluster, a topic whose partitions have several leaders is
        described whole (``describe_topic`` merges each leader's rows), not by the node that answered."""
        view = ask_metadata(self.metadata.bootstrap, None, context=self._ctx, timeout=self.timeout)
        if len(view.nodes) <= 1:  # one broker: its own list
            topics = self._admin("list_topics")
            return [self.describe_topic(row["name"]) if self._leaders(row["name"]) else row for row in topics]
        # A cluster: every topic it has (a node lists only those it holds partition 0 of), each described whole
        described = []
        for name in sorted(topic for topic in view.topics if not topic.startswith("__")):
            try:
                described.append(self.describe_topic(name))
            except UnknownTopic:
                continue  # deleted meanwhile
        return described

    def describe_topic(self, name: str) -> dict[str, Any]:
        """The topic, with ``partitions`` (start and end offset of each) and ``end_offset`` (their sum)."""
        return self._merged("describe_topic", name)

    def _merged(self, op: str, topic: str, **args: Any) -> dict[str, Any]:
        """``op`` about ``topic``, answered by partition 0's leader; in a cluster whose partitions of ``topic``
        have several leaders, each answers for the ones it leads and their ``partitions`` rows are merged.

        Every top-level field that is a sum over the partitions (``SUMMED``, where the rows have it) is
        computed again from the merged rows, so it is the whole topic's, not the first leader's share.
        """
        first = self._admin(op, topic=topic, **args)
        leaders = self._leaders(topic)
        if not leaders or not isinstance(first, dict):
            return first
        rows = {row["partition"]: row for row in first.get("partitions", [])}
        for address, numbers in sorted(leaders.items()):
            if all(number in rows for number in numbers):
                continue
            try:
                answer = self._to_once(address, partial(commands.admin, op, {"topic": topic, **args}))
            except (UnknownGroup, UnknownTopic):
                continue  # no state of the group there yet (partitions added, no member since): no rows
            rows.update({row["partition"]: row for row in answer.get("partitions", []) if row["partition"] in numbers})
        merged = [rows[number] for number in sorted(rows)]
        totals = {key: sum(row[key] for row in merged) for key in SUMMED if merged and all(key in r for r in merged)}
        return {**first, "partitions": merged, **totals}

    def _leaders(self, topic: str) -> dict[str, list[int]]:
        """Each leader of ``topic``'s partitions and the partitions it leads; empty on one broker, or
        when one node leads them all."""
        if not self.metadata.following:
            return {}
        with self._lock:
            view = self.metadata.refresh()
        led: dict[str, list[int]] = {}
        for number in sorted(view.topics.get(topic) or {}):
            address = view.leader_address(topic, number)
            if address is not None:
                led.setdefault(address, []).append(number)
        return led if len(led) > 1 else {}

    def list_groups(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Every group (of ``topic``, if given). A topic's groups live on its leader, so with a list of
        brokers each leader is asked for the groups of the topics it leads."""
        if topic or self.metadata.single:
            return self._whole(self._admin("list_groups", **({"topic": topic} if topic else {})))
        with self._lock:
            view = self.metadata.refresh()
        rows: list[dict[str, Any]] = []
        for address, topics in sorted(leaders_of(view).items()):
            answer = self._to_once(address, partial(commands.admin, "list_groups", {}))
            rows += [row for row in answer if row.get("topic") in topics]
        return self._whole(sorted(rows, key=lambda row: (row["topic"], row["group"])))

    def _whole(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each group of a topic whose partitions have several leaders, described whole (merged rows and sums)."""
        several = {topic: bool(self._leaders(topic)) for topic in {row["topic"] for row in groups}}
        return [self.describe_group(row["topic"], row["group"]) if several[row["topic"]] else row for row in groups]

    def _to_once(self, address: str, frames_for: FramesFor) -> Any:
        with self._lock:
            return self._to(address).call(frames_for, timeout=self.timeout).get("result")

    def describe_group(self, topic: str, group: str) -> dict[str, Any]:
        """The group, with ``partitions`` (committed offset and lag of each) and ``lag`` (their sum)."""
        return self._merged("describe_group", topic, group=group)

    def reset_offsets(
        self, topic: str, group: str, to: str | int | dict[str, int], *, partition: int | None = None
    ) -> dict[str, Any]:
        """``to``: ``"earliest"``, ``"latest"``, an offset (0 or more), or ``{"timestamp": ms}``: applied to
        every partition, or to ``partition`` alone (sent to that partition's leader). The group after."""
        if partition is None:
            return self._merged("reset_offsets", topic, group=group, to=to)
        check_partition(partition)
        request = partial(
            commands.admin, "reset_offsets", {"topic": topic, "group": group, "to": to, "partition": partition}
        )
        answer = self._call(request, topic=partition_log(topic, partition)).get("result")  # at partition k's leader
        if not self._leaders(topic):
            return answer
        try:
            return self.describe_group(topic, group)
        except UnknownGroup:  # a group this reset made: the other leaders have not got it yet
            return answer

    def delete_group(self, topic: str, group: str) -> dict[str, Any]:
        """The group goes from every partition (in a cluster, from each partition's leader)."""
        answer: dict[str, Any] = self._admin("delete_group", topic=topic, group=group)
        for address in sorted(self._leaders(topic)):
            try:
                self._to_once(address, partial(commands.admin, "delete_group", {"topic": topic, "group": group}))
            except (UnknownGroup, UnknownTopic):
                pass  # that leader's partitions had no state of the group (or went with the first answer)
        return answer

    def refresh_topic(self, topic: str) -> dict[str, Any]:
        """On a child broker: drop the topic and mirror it again from the parent's start.

        Subscribers get a RESET event, re-read from the start, then a READY event.
        """
        return self._admin("refresh_topic", topic=topic)

    def mirror_status(self) -> dict[str, Any] | None:
        """The upstream link of a child broker (None on a broker that mirrors nothing)."""
        return self._admin("mirror_status")

    def describe_partitions(self, topic: str | None = None) -> dict[str, Any]:
        """The partitions the broker answering holds: ``node``, ``cluster``, ``partitions``.

        A leader's rows carry the high watermark, the in-sync set and each follower's
        lag; a follower's carry its leader and its own high watermark. Given a topic,
        the request goes to that topic's leader; without one, to the first broker that
        answers (``conveyor cluster status`` asks each node in turn).
        """
        return self._admin("describe_partitions", **({"topic": topic} if topic else {}))

    def hello(self) -> dict[str, Any]:
        return self._call(partial(commands.hello, f"conveyor-admin/{os.getpid()}")).header

    def fetch(
        self,
        topic: str,
        offset: int,
        max_messages: int = 1000,
        *,
        wait_ms: int = 0,
        max_bytes: int = 1 << 20,
        partition: int = 0,
    ) -> list[Message]:
        """Read up to ``max_messages`` of ``partition`` from ``offset`` without a group (FETCH)."""
        return self.fetch_batch(topic, offset, max_messages, wait_ms=wait_ms, max_bytes=max_bytes, partition=partition)[
            0
        ]

    def fetch_batch(
        self,
        topic: str,
        offset: int,
        max_messages: int = 1000,
        *,
        wait_ms: int = 0,
        max_bytes: int = 1 << 20,
        partition: int = 0,
    ) -> tuple[list[Message], dict[str, Any]]:
        """Messages and the reply header (``start_offset``, ``end_offset`` of that partition)."""
        check_partition(partition)
        request = partial(
            commands.fetch,
            partition_log(check_name(topic), partition),  # "T#k" is no alias of a partition: INVALID_NAME
            offset,
            max_messages=max_messages,
            max_bytes=max_bytes,
            wait_ms=wait_ms,
        )
        # to the partition's leader: Metadata reads a log name "T#k" as partition k of T
        reply = self._call(request, timeout=self.timeout + wait_ms / 1000, topic=partition_log(topic, partition))
        entries, bodies = reply.get("entries", []), [bytes(b) for b in reply.payload]
        messages = messages_from_entries(topic, entries, bodies, partition=partition)
        return messages[:max_messages], reply.header

    def close(self) -> None:
        for requester in self._requesters.values():
            requester.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
