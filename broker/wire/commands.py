"""One encoder per command: the frames of every request a client sends and every reply the broker sends.

Each function takes a command's fields as typed arguments and returns the
frame list ``protocol.encode`` makes, ready for ``send_multipart``. The
header keys of each command are spelled here and nowhere else, so a
field's name cannot drift between the broker and its clients. Pure
functions: no sockets, no state. Optional fields left at ``None`` are not
sent (the receiver applies its default); ``rid`` comes first, as in the
table of docs/protocol.md.

See docs/protocol.md for what each field means.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from conveyor.broker.wire.protocol import Command, encode, error_header

from conveyor.errors import ConveyorError
from conveyor.names import split_log

Body = bytes | memoryview
WireEntries = list[dict[str, Any]]  # entry maps made by ``DeliveryEntry.to_wire`` or ``entry.wire_entry``
Ranges = Sequence[Sequence[int]] | Sequence[tuple[int, int]]


def _with(header: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``header`` plus the optional fields that are set, in the order given."""
    for key, value in optional.items():
        if value is not None:
            header[key] = value
    return header


def _topic(log: str) -> dict[str, Any]:
    """The ``topic`` field of a log name, and ``p`` for a partition other than 0 (``"orders#3"``: topic orders, p 3).

    Every encoder here takes the log name (a topic's partition k > 0 is the log ``topic#k``,
    see conveyor/names.py); on the wire a partition is always the ``p`` field, absent for 0,
    so a single-partition frame is byte for byte what it was.
    """
    topic, partition = split_log(log)
    return {"topic": topic, "p": partition} if partition else {"topic": topic}


def _request(rid: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A request's header: its ``rid`` first (when it has one), then its fields."""
    return fields if rid is None else {"rid": rid, **fields}


# --- client -> broker ------------------------------------------------------------------
# Every request encoder takes ``rid`` by keyword, so a client can bind the fields first
# (``functools.partial``) and add the rid it picks when it sends.


def hello(client: str | None, *, rid: Any = None) -> list[Any]:
    return encode(Command.HELLO, _request(rid, {"client": client}))


def publish(topic: str, body: Body, *, pid: int | None = None, seq: int | None = None, rid: Any = None) -> list[Any]:
    """One batch body for ``topic``; ``pid`` and ``seq`` make it idempotent."""
    return encode(Command.PUBLISH, _request(rid, _with(_topic(topic), pid=pid, seq=seq)), body)


def subscribe(
    sub: int,
    topic: str,
    group: str,
    *,
    credit: int | None = None,
    batch_size: int | None = None,
    settings: Mapping[str, Any] | None = None,  # start, key_affinity and the group settings, as given
    rid: Any = None,
) -> list[Any]:
    header = _with({"sub": sub, **_topic(topic), "group": group}, credit=credit, batch_size=batch_size)
    return encode(Command.SUBSCRIBE, _request(rid, {**header, **(settings or {})}))


def unsubscribe(sub: int) -> list[Any]:
    return encode(Command.UNSUBSCRIBE, {"sub": sub})


def ack(sub: int, ranges: Ranges) -> list[Any]:
    return encode(Command.ACK, {"sub": sub, "ranges": ranges})


def nack(
    sub: int, ranges: Ranges, *, delay_ms: int | None = None, error: str | None = None, release: bool = False
) -> list[Any]:
    """Give offsets back; ``release`` (sent only when true) for ones never tried: not counted as a delivery."""
    header = _with({"sub": sub, "ranges": ranges}, delay_ms=delay_ms, error=error, release=True if release else None)
    return encode(Command.NACK, header)


def in_progress(sub: int, ranges: Ranges) -> list[Any]:
    return encode(Command.IN_PROGRESS, {"sub": sub, "ranges": ranges})


def term(sub: int, ranges: Ranges, *, reason: str | None = None) -> list[Any]:
    return encode(Command.TERM, _with({"sub": sub, "ranges": ranges}, reason=reason))


def credit(sub: int, credit: int, *, batch_size: int | None = None) -> list[Any]:
    return encode(Command.CREDIT, _with({"sub": sub, "credit": credit}, batch_size=batch_size))


def fetch(
    topic: str,
    offset: int,
    *,
    max_messages: int,
    max_bytes: int = 1 << 20,
    wait_ms: int = 0,
    replica: str | None = None,
    leader_epoch: int | None = None,
    last_epoch: int | None = None,
    durable: int | None = None,
    report: bool | None = None,
    rid: Any = None,
) -> list[Any]:
    """Read from ``offset`` without a group; ``wait_ms`` > 0 parks it until data comes (long poll).

    A follower fetching from its partition leader also names itself (``replica``, its node id) and
    says which ``leader_epoch`` it follows, the epoch of its last batch (``last_epoch``) and how far
    its log is durable (``durable``): the leader's high watermark moves on that report. With
    ``report`` it reads nothing and gets no answer: a follower whose next FETCH is already parked
    at the leader says so how far it synced.
    """
    header = {
        **_topic(topic),
        "offset": offset,
        "max_messages": max_messages,
        "max_bytes": max_bytes,
        "wait_ms": wait_ms,
    }
    replica_fields = {
        "replica": replica,
        "leader_epoch": leader_epoch,
        "last_epoch": last_epoch,
        "durable": durable,
        "report": report,
    }
    return encode(Command.FETCH, _request(rid, _with(header, **replica_fields)))


def admin(op: str, args: Mapping[str, Any] | None = None, *, rid: Any = None) -> list[Any]:
    """An ADMIN op; its arguments go in the header next to ``op``."""
    return encode(Command.ADMIN, _request(rid, {"op": op, **(args or {})}))


def metadata(topics: Sequence[str] | None = None, *, rid: Any = None) -> list[Any]:
    """Ask any node who leads what: ``topics`` (None: every topic the node knows)."""
    return encode(Command.METADATA, _request(rid, _with({}, topics=None if topics is None else list(topics))))


# --- both ways -------------------------------------------------------------------------


def heartbeat() -> list[Any]:
    return encode(Command.HEARTBEAT)


def bye(reason: str | None = None) -> list[Any]:
    return encode(Command.BYE, _with({}, reason=reason))


# --- broker -> client ------------------------------------------------------------------


def welcome(
    rid: Any,
    *,
    heartbeat_ms: int,
    liveness: int,
    max_message_bytes: int,
    max_batch_bytes: int,
    max_credit: int,
    version: int = 1,
) -> list[Any]:
    return encode(
        Command.WELCOME,
        {
            "rid": rid,
            "version": version,
            "heartbeat_ms": heartbeat_ms,
            "liveness": liveness,
            "max_message_bytes": max_message_bytes,
            "max_batch_bytes": max_batch_bytes,
            "max_credit": max_credit,
        },
    )


def published(
    rid: Any, topic: str, *, base_offset: int, count: int, duplicate: bool, partitions: int | None = None
) -> list[Any]:
    """The confirm of a PUBLISH: the batch holds ``[base_offset, base_offset + count)``.

    ``partitions``: the topic's count, when it has more than one (a producer learns added partitions).
    """
    header = {"rid": rid, **_topic(topic), "base_offset": base_offset, "count": count, "duplicate": duplicate}
    return encode(Command.PUBLISHED, _with(header, partitions=partitions))


def subscribed(
    rid: Any,
    sub: int,
    topic: str,
    group: str,
    *,
    committed_offset: int,
    end_offset: int,
    heartbeat_ms: int,
    partitions: int | None = None,
) -> list[Any]:
    """``partitions`` (partition 0's answer, when the topic has more than one): the client subscribes to the others."""
    header = {
        "rid": rid,
        "sub": sub,
        **_topic(topic),
        "group": group,
        "committed_offset": committed_offset,
        "end_offset": end_offset,
        "heartbeat_ms": heartbeat_ms,
    }
    return encode(Command.SUBSCRIBED, _with(header, partitions=partitions))


def deliver(sub: int, topic: str, entries: WireEntries, bodies: Iterable[Body]) -> list[Any]:
    """Batches for a subscription: one body per entry, in the same order."""
    header = {"sub": sub, **_topic(topic), "entries": entries}
    return encode(Command.DELIVER, header, *bodies)


def fetched(
    rid: Any,
    topic: str,
    *,
    start_offset: int,
    end_offset: int,
    entries: WireEntries,
    bodies: Iterable[Body],
    hw: int | None = None,
    diverging: Mapping[str, int] | None = None,
) -> list[Any]:
    """The answer to a FETCH: where the log starts and (durably) ends, and one body per entry.

    A replica FETCH's answer also carries the leader's high watermark (``hw``), and
    ``diverging`` (``{epoch, end_offset}``) when the follower's log left the leader's:
    the follower truncates to ``end_offset`` and fetches again.
    """
    header = {
        "rid": rid,
        **_topic(topic),
        "start_offset": start_offset,
        "end_offset": end_offset,
        "entries": entries,
    }
    optional = {"hw": hw, "diverging": None if diverging is None else dict(diverging)}
    return encode(Command.FETCHED, _with(header, **optional), *bodies)


def result(rid: Any, value: Any) -> list[Any]:
    """The answer to an ADMIN op."""
    return encode(Command.RESULT, {"rid": rid, "result": value})


def metadata_result(
    rid: Any,
    *,
    node: str,
    controller: str | None,
    nodes: Mapping[str, str],
    topics: Mapping[str, Any],
) -> list[Any]:
    """The answer to METADATA: the answering ``node``, the ``controller``, every node's endpoint, and per topic
    ``{"partitions": {"0": {leader, leader_addr, leader_epoch, replicas, isr, offline}}}``
    (the shape ``schema.check_metadata_result`` checks)."""
    header = {"rid": rid, "node": node, "controller": controller, "nodes": dict(nodes), "topics": dict(topics)}
    return encode(Command.METADATA_RESULT, header)


def error(exc: ConveyorError, rid: Any = None) -> list[Any]:
    return encode(Command.ERROR, error_header(exc, rid))


def event(sub: int, topic: str, event: str, offset: int, *, partitions: int | None = None) -> list[Any]:
    """An EVENT without messages: ``RESET`` or ``READY`` of a mirrored topic, ``PARTITIONS`` (the new count)."""
    header = {"sub": sub, **_topic(topic), "event": event, "offset": offset}  # a log name: partition k is ``p``
    return encode(Command.EVENT, _with(header, partitions=partitions))


def dead_lettered(
    sub: int,
    topic: str,
    *,
    offset: int,
    reason: str,
    deliveries: int,
    dead_letter_topic: str,
    entries: WireEntries,
    bodies: Iterable[Body],
) -> list[Any]:
    """An EVENT ``DEAD_LETTERED``: the messages the broker moved past ``max_deliveries``, as DELIVER carries them."""
    header = {
        "sub": sub,
        **_topic(topic),  # a log name: partition k > 0 is ``p`` (the messages' partition)
        "event": "DEAD_LETTERED",
        "offset": offset,
        "reason": reason,
        "deliveries": deliveries,
        "dead_letter_topic": dead_letter_topic,
        "entries": entries,
    }
    return encode(Command.EVENT, header, *bodies)
