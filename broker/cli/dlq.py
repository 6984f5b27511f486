"""``conveyor dlq list|replay DLQ``: what is in a dead-letter topic, and sending it back.

``list`` reads the dead letters without a group (FETCH), so it changes
nothing: each row is the dead letter's offset, where it came from (the
``x-origin-*`` headers the broker wrote, ``broker/server/dead_letters.py``),
how often it was delivered and the last error.

``replay`` re-publishes a range of them to their origin topic and partition
(or ``--to``), with the same key, body and headers, plus
``x-replayed-from: DLQ@OFFSET`` and ``x-replay-count``. It is at-least-once
and remembers nothing: the dead-letter topic is an append-only log, so a
second run over the same range sends the same messages again. The range
(``--from-offset``, ``--to-offset``, both included) is the way to replay
each dead letter once; the command ends by printing the offset to start
from next time. The range's end defaults to the last dead letter when the
command starts, so messages that die again during a replay are not replayed
in a loop.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conveyor.broker.cli.main import CLIENT_OPTIONS, _show, client_options, command
from conveyor.broker.client.message import Message
from conveyor.broker.config.sources import add_options
from conveyor.broker.server.dead_letters import (
    DELIVERY_COUNT,
    LAST_ERROR,
    ORIGIN_GROUP,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
)

from conveyor.errors import ConfigError, UnknownTopic

REPLAYED_FROM = "x-replayed-from"  # DLQ@OFFSET, or DLQ@PARTITION:OFFSET in a dead-letter topic of several partitions
REPLAY_COUNT = "x-replay-count"  # how many times this message was replayed from a dead-letter topic
FETCH_CHUNK = 500
REASON_WIDTH = 80  # a table's reason column; --format json keeps the whole error


def _setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument("action", choices=["list", "replay"])
    parser.add_argument("topic", metavar="DLQ", help="the dead-letter topic (orders.dlq)")
    parser.add_argument("--limit", type=int, default=100, metavar="N", help="list: at most N dead letters (0: all)")
    parser.add_argument(
        "--from-offset", type=int, metavar="N", help="the first dead letter's offset (default: the topic's first)"
    )
    parser.add_argument(
        "--to-offset", type=int, metavar="M", help="the last dead letter's offset, included (default: the last now)"
    )
    parser.add_argument(
        "--partition", type=int, metavar="N", help="only this partition of the dead-letter topic (default: all)"
    )
    parser.add_argument(
        "--to", dest="target", metavar="TOPIC", help="replay: publish to TOPIC instead of each one's origin topic"
    )
    parser.add_argument("--dry-run", action="store_true", help="replay: print what would be sent, send nothing")
    parser.add_argument("--format", choices=["table", "json"], default="table", help="list: a table or JSON lines")
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="how long to wait for the broker's answers"
    )


@command("dlq", "list the dead letters of a dead-letter topic, or replay them to their origin", _setup)
def cmd_dlq(args: argparse.Namespace) -> int:
    from conveyor.broker.client.admin import Admin

    opts = client_options(args, "dlq")
    _check_args(args)
    with Admin(opts["broker"], timeout_ms=int(args.timeout * 1000)) as admin:
        admin.hello()  # no broker there: BROKER_UNAVAILABLE now, before anything else
        spans = _spans(admin, args)
        if args.action == "list":
            return _list(admin, args, spans)
        return _replay(admin, args, spans, opts["broker"])


# --- the range ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """Offsets ``[first, end)`` of one partition of the dead-letter topic to read."""

    partition: int
    first: int
    end: int


def _check_args(args: argparse.Namespace) -> None:
    if args.limit < 0:
        raise ConfigError(f"--limit takes 0 (all) or a number of dead letters, not {args.limit}")
    for flag, value in (("--from-offset", args.from_offset), ("--to-offset", args.to_offset)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} takes an offset, 0 or more, not {value}")
    if args.from_offset is not None and args.to_offset is not None and args.from_offset > args.to_offset:
        raise ConfigError(f"--from-offset {args.from_offset} is past --to-offset {args.to_offset}: an empty range")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout takes seconds, more than 0, not {args.timeout}")
    if args.action == "list" and (args.target or args.dry_run):
        raise ConfigError("--to and --dry-run are for dlq replay")


def _spans(admin: Any, args: argparse.Namespace) -> list[Span]:
    """What to read of each partition: ``--from-offset``/``--to-offset`` within what the topic holds now."""
    try:
        info = admin.describe_topic(args.topic)
    except UnknownTopic:
        raise UnknownTopic(
            f"{args.topic}: no such topic (a dead-letter topic appears with its first dead letter; "
            "`conveyor topics list` shows the topics)",
            topic=args.topic,
        ) from None
    rows = info.get("partitions") or [{"start_offset": info["start_offset"], "end_offset": info["end_offset"]}]
    if args.partition is not None and not any(r.get("partition", 0) == args.partition for r in rows):
        raise ConfigError(f"--partition {args.partition}: {args.topic} has {len(rows)} partition(s)")
    if len(rows) > 1 and args.partition is None and (args.from_offset is not None or args.to_offset is not None):
        raise ConfigError(
            f"{args.topic} has {len(rows)} partitions, each with its own offsets: "
            "with --from-offset or --to-offset, name one with --partition N"
        )
    first, last = args.from_offset, args.to_offset
    return [
        span_of(int(r.get("partition", 0)), int(r["start_offset"]), int(r["end_offset"]), first, last)
        for r in rows
        if args.partition is None or r.get("partition", 0) == args.partition
    ]


def span_of(partition: int, start: int, end: int, first: int | None, last: int | None) -> Span:
    """``--from-offset first --to-offset last`` (both included, either absent) within a partition's ``[start, end)``."""
    low = start if first is None else max(first, start)
    high = end if last is None else min(last + 1, end)
    return Span(partition, low, max(low, high))


def _letters(admin: Any, topic: str, span: Span) -> Iterator[Message]:
    offset = span.first
    while offset < span.end:
        batch = admin.fetch(topic, offset, min(FETCH_CHUNK, span.end - offset), partition=span.partition)
        batch = [m for m in batch if offset <= m.offset < span.end]
        if not batch:
            return  # retention removed the rest meanwhile
        yield from batch
        offset = batch[-1].offset + 1


# --- list -----------------------------------------------------------------------------------------


def letter_row(message: Message) -> dict[str, Any]:
    """One dead letter as ``list`` shows it (from the headers the broker wrote when it dead-lettered it)."""
    headers = message.headers
    key = message.key.decode("utf-8", errors="replace") if isinstance(message.key, bytes) else message.key
    return {
        "partition": message.partition,
        "offset": message.offset,
        "origin_topic": headers.get(ORIGIN_TOPIC, ""),
        "origin_partition": int(headers.get(ORIGIN_PARTITION, 0)),
        "origin_offset": _int_or_none(headers.get(ORIGIN_OFFSET)),
        "group": headers.get(ORIGIN_GROUP, ""),
        "deliveries": _int_or_none(headers.get(DELIVERY_COUNT)),
        "reason": headers.get(LAST_ERROR, ""),
        "replayed_from": headers.get(REPLAYED_FROM, ""),
        "timestamp": message.timestamp,
        "key": key,
    }


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _list(admin: Any, args: argparse.Namespace, spans: list[Span]) -> int:
    rows: list[dict[str, Any]] = []
    total = sum(s.end - s.first for s in spans)
    for span in spans:
        for message in _letters(admin, args.topic, span):
            if args.limit and len(rows) >= args.limit:
                break
            rows.append(letter_row(message))
    if args.format == "json":
        for row in rows:
            print(json.dumps(row, default=str))
    else:
        many = len(spans) > 1 or any(s.partition for s in spans)
        table = [{**r, "reason": one_line(r["reason"], REASON_WIDTH)} for r in rows]
        columns: list[Any] = (["partition"] if many else []) + ["offset", ("origin_topic", "origin")]
        columns += ["origin_partition", "origin_offset", "group", "deliveries", "reason"]
        _show(table, "table", columns)
    if args.limit and total > len(rows) and len(rows) == args.limit:
        print(
            f"conveyor dlq: showing the first {len(rows)} of {total} dead letters (--limit 0 shows all, "
            "--from-offset N starts later)",
            file=sys.stderr,
        )
    return 0


def one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


# --- replay ---------------------------------------------------------------------------------------


def replay_headers(message: Message, dead_letter_topic: str, many: bool) -> dict[str, str]:
    """The dead letter's headers (its content type, its own headers and why it died) plus where it was replayed from."""
    where = f"{message.partition}:{message.offset}" if many else str(message.offset)
    count = _int_or_none(message.headers.get(REPLAY_COUNT)) or 0
    return {**message.headers, REPLAYED_FROM: f"{dead_letter_topic}@{where}", REPLAY_COUNT: str(count + 1)}


def replay_target(message: Message, to: str | None) -> tuple[str, int | None] | None:
    """Where a dead letter goes back to: ``(topic, partition)``; the origin's partition when it goes to its origin
    topic (None: the key's, as any send), and None when it names no origin and no ``--to`` was given."""
    origin = message.headers.get(ORIGIN_TOPIC)
    topic = to or origin
    if not topic:
        return None
    if topic != origin:
        return topic, None
    return topic, int(message.headers.get(ORIGIN_PARTITION, 0))


@dataclass
class Progress:
    """What a replay sent, for the closing line (and for the user when it stops half-way)."""

    replayed: int = 0
    planned: int = 0  # --dry-run
    skipped: int = 0
    last: dict[int, int] | None = None  # partition of the dead-letter topic: last offset confirmed

    def next_offsets(self) -> str:
        last = self.last or {}
        if len(last) == 1:
            return f"--from-offset {next(iter(last.values())) + 1}"
        return ", ".join(f"partition {p}: --from-offset {o + 1}" for p, o in sorted(last.items()))


def _replay(admin: Any, args: argparse.Namespace, spans: list[Span], broker: str) -> int:
    from conveyor.broker.client.producer import Producer

    many = len(spans) > 1 or any(s.partition for s in spans)
    checked: set[str] = set()
    progress = Progress(last={})
    targets: set[str] = set()
    pending: list[tuple[Any, Message]] = []
    with Producer(broker, request_timeout_ms=int(args.timeout * 1000), delivery_timeout_ms=30_000) as producer:
        try:
            for span in spans:
                for message in _letters(admin, args.topic, span):
                    target = replay_target(message, args.target)
                    if target is None:
                        progress.skipped += 1
                        continue
                    _check_target(admin, target[0], checked)
                    targets.add(target[0])
                    if args.dry_run:
                        _say_planned(message, target, many)
                        progress.planned += 1
                        continue
                    headers = replay_headers(message, args.topic, many)
                    future = producer.send(
                        target[0], message.body, key=message.key, headers=headers, partition=target[1]
                    )
                    pending.append((future, message))
                    if len(pending) >= FETCH_CHUNK:
                        _confirm(producer, pending, progress, args.timeout)
            _confirm(producer, pending, progress, args.timeout)
        except BaseException:
            if progress.replayed:
                print(
                    f"conveyor dlq: stopped after {progress.replayed} replayed dead letter(s) were confirmed; "
                    f"to go on without sending those again: {progress.next_offsets()}",
                    file=sys.stderr,
                )
            raise
    _summary(args, spans, progress, targets)
    return 0


def _check_target(admin: Any, topic: str, checked: set[str]) -> None:
    """A replay to a topic that does not exist (a typo in ``--to``) is an error, not a new topic."""
    if topic in checked:
        return
    try:
        admin.describe_topic(topic)
    except UnknownTopic:
        raise UnknownTopic(
            f"{topic}: no such topic to replay to (create it with `conveyor topics create {topic}`, or use --to)",
            topic=topic,
        ) from None
    checked.add(topic)


def _confirm(producer: Any, pending: list[tuple[Any, Message]], progress: Progress, timeout: float) -> None:
    """Wait for the confirms of what was sent, in order; a failed one raises (what came before it counts)."""
    producer.flush(timeout=max(60.0, timeout))
    for future, message in pending:
        future.result(timeout=timeout)
        progress.replayed += 1
        assert progress.last is not None
        progress.last[message.partition] = message.offset
    pending.clear()


def _say_planned(message: Message, target: tuple[str, int | None], many: bool) -> None:
    where = f"{message.partition}:{message.offset}" if many else str(message.offset)
    to = target[0] if target[1] is None else f"{target[0]} partition {target[1]}"
    print(f"would replay {where} -> {to}")


def _summary(args: argparse.Namespace, spans: list[Span], progress: Progress, targets: set[str]) -> None:
    ranges = ", ".join(
        (f"partition {s.partition} " if len(spans) > 1 or s.partition else "") + f"offsets {s.first}-{s.end - 1}"
        for s in spans
        if s.end > s.first
    )
    verb = "would replay" if args.dry_run else "replayed"
    count = progress.planned if args.dry_run else progress.replayed
    to = ", ".join(sorted(targets)) or "-"
    print(f"{verb} {count} dead letter(s) from {args.topic} ({ranges or 'none'}) to {to}")
    if progress.skipped:
        print(
            f"conveyor dlq: skipped {progress.skipped} message(s) with no {ORIGIN_TOPIC} header (use --to TOPIC)",
            file=sys.stderr,
        )
    if progress.replayed:
        print(
            f"conveyor dlq: replay is at-least-once and remembers nothing; to replay only later dead letters "
            f"next time: {progress.next_offsets()}",
            file=sys.stderr,
        )
