"""The ``conveyor`` command: broker, publish, tail, topics, groups, run, bench.

Every option in an ``Option`` list (the broker's settings, ``--broker``, the
runner's) also comes from ``CONVEYOR_<OPTION>`` and from a TOML file named by
``--config``; a command's own arguments (a topic, ``--format``) are flags
only. Client commands take ``--broker ADDR``. A wrong argument is a
``CONFIG_ERROR`` with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from conveyor.broker.config.addresses import DEFAULT_BROKER, broker_addresses, endpoint_list
from conveyor.broker.config.broker_settings import BrokerSettings, broker_options
from conveyor.broker.config.options import Option
from conveyor.broker.config.sources import add_options, resolve
from conveyor.broker.config.topic_settings import TOPIC_SETTINGS, check_topic_settings

from conveyor import exitcodes
from conveyor.errors import ClusterError, ConfigError, ConveyorError, OffsetOutOfRange, UnknownGroup

CLIENT_OPTIONS = [
    Option("broker", DEFAULT_BROKER, "broker address, or several separated by commas", endpoint_list),
    Option("curve-server-key", "", "the broker's CURVE public key (40 characters, or its .key file)"),
    Option("curve-key", "", "this client's CURVE certificate (.key_secret file)"),
]


def client_options(args: argparse.Namespace, command: str, options: list[Option] | None = None) -> dict[str, Any]:
    """Resolve a client command's options and apply its CURVE keys, if any."""
    from conveyor.broker.net import security

    opts = resolve(args, options or CLIENT_OPTIONS, command)
    broker_addresses(opts["broker"])  # the clients check it too; here it fails before `run` imports any handler
    if opts.get("curve_server_key") or opts.get("curve_key"):
        if not (opts.get("curve_server_key") and opts.get("curve_key")):
            raise ConfigError("CURVE needs both --curve-server-key and --curve-key")
        security.configure(server_key=opts["curve_server_key"], client_key_file=opts["curve_key"])
    return opts


Handler = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {}


def command(
    name: str, help_text: str, setup: Callable[[argparse.ArgumentParser], None]
) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        COMMANDS[name] = (help_text, setup, handler)
        return handler

    return register


# --- broker ---------------------------------------------------------------------------


def _broker_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, broker_options())


@command("broker", "start a broker", _broker_setup)
def cmd_broker(args: argparse.Namespace) -> int:
    from conveyor.broker.server.broker import Broker
    from conveyor.monitoring.logs import announce, configure

    values = resolve(args, broker_options(), "broker")
    settings = BrokerSettings(**values)
    configure(settings.log_level, settings.log_format, settings.log_config)
    broker = Broker(settings)
    endpoint = broker.bind()
    metrics = f"http://{settings.metrics_bind}:{broker.metrics_server.port}/metrics" if broker.metrics_server else "off"

    def ready(_: Broker) -> None:
        announce(
            f"conveyor broker ready on {endpoint} (data {settings.data_dir}, fsync {settings.fsync}, metrics {metrics})"
        )

    broker.serve_forever(ready=ready)
    announce("conveyor broker stopped cleanly")
    return 0


# --- publish ----------------------------------------------------------------------------


def _publish_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument("topic")
    parser.add_argument("messages", nargs="*", help="values to send; one per stdin line when none are given")
    parser.add_argument("--key", help="key for every message")
    parser.add_argument(
        "--partition", type=int, metavar="N", help="send to this partition (default: the key's, or a batch's)"
    )
    parser.add_argument("--header", action="append", default=[], metavar="K=V", help="a header (repeatable)")
    parser.add_argument(
        "--format",
        choices=["text", "json", "bytes"],
        default="text",
        help="text: UTF-8 strings; json: parse each value and send it as an object; bytes: raw",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="do not print offsets (printed one a line: OFFSET, or PARTITION:OFFSET for a topic of several partitions)",
    )


@command("publish", "publish messages to a topic", _publish_setup)
def cmd_publish(args: argparse.Namespace) -> int:
    from conveyor.broker.client.admin import Admin
    from conveyor.broker.client.producer import Producer

    from conveyor.names import check_partition

    opts = client_options(args, "publish")
    if args.partition is not None:
        check_partition(args.partition, "--partition")
    headers = dict(_pair(h) for h in args.header) or None
    raws = args.messages or (line.rstrip("\n") for line in sys.stdin)
    values = [_parse_value(raw, args.format, number) for number, raw in enumerate(raws, 1)]  # all valid, or none sent
    with Admin(opts["broker"]) as admin:
        admin.hello()  # no broker there: the same error, after the same wait, as every other command
    futures = []
    with Producer(opts["broker"], request_timeout_ms=5000, delivery_timeout_ms=30_000) as producer:
        for value in values:
            futures.append(producer.send(args.topic, value, key=args.key, headers=headers, partition=args.partition))
        producer.flush(timeout=60)
        many = producer.partitioner.counts.get(args.topic, 1) > 1
    offsets = [f.result() for f in futures]
    if not args.quiet:
        for offset in offsets:
            print(_where(offset, many))
    print(f"published {len(offsets)} message(s) to {args.topic}", file=sys.stderr)
    return 0


def _where(offset: Any, many: bool) -> str:
    """A published message's place: its offset, or ``partition:offset`` in a topic of several (as ``tail`` prints)."""
    return f"{getattr(offset, 'partition', 0)}:{int(offset)}" if many else str(int(offset))


def _parse_value(raw: str, fmt: str, number: int) -> Any:
    if fmt == "json":
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"message {number} is not JSON ({exc}): {raw[:80]!r}") from None
    if fmt == "bytes":
        return raw.encode()
    return raw


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ConfigError(f"expected K=V, got {text!r}")
    return key, value


# --- tail ---------------------------------------------------------------------------------


def _tail_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument("topic")
    parser.add_argument(
        "--from",
        dest="start",
        default="latest",
        help="earliest, latest, an offset, or an ISO time (2026-11-26T10:00:00)",
    )
    parser.add_argument("--count", type=int, default=0, help="exit after N messages (0: follow forever)")
    parser.add_argument(
        "--partition", type=int, metavar="N", help="only this partition (default: every partition, merged by time)"
    )
    parser.add_argument("--format", choices=["json", "text"], default="text")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=0,
        help="exit when no message arrives for this many seconds (0: wait forever)",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="with --from past the end of the topic: wait for that offset instead of exiting with OFFSET_OUT_OF_RANGE",
    )


@command("tail", "print messages of a topic", _tail_setup)
def cmd_tail(args: argparse.Namespace) -> int:
    import time

    from conveyor.broker.client.admin import Admin

    opts = client_options(args, "tail")
    _check_tail_limits(args)
    printed = 0
    with Admin(opts["broker"]) as admin:
        info = admin.describe_topic(args.topic)
        parts = _tail_partitions(args.topic, info, args.partition)
        many = len(info.get("partitions") or [None]) > 1  # text lines then say partition:offset
        offsets = {
            p: _start_offset(
                admin, args.topic, args.start, wait=args.wait, partition=p, info=info, each=args.partition is None
            )
            for p in parts
        }
        last_data = time.monotonic()
        quiet = False
        while args.count <= 0 or printed < args.count:
            want = 1000 if args.count <= 0 else min(1000, args.count - printed)
            # One partition: a long poll, as always. Several: a round over them, waiting only when all were empty.
            wait_ms = 1000 if len(parts) == 1 else (200 if quiet else 0)
            found = []
            for p in parts:
                found += _tail_fetch(admin, args.topic, p, offsets, want, wait_ms)
            if len(parts) > 1:
                found.sort(key=lambda m: m.timestamp)  # merged by broker time for display
            for message in found[:want]:
                _print_message(message, args.format, partition=many)
            printed += min(len(found), want)
            quiet = not found
            if found:
                last_data = time.monotonic()
            elif args.idle_timeout and time.monotonic() - last_data >= args.idle_timeout:
                break
    return 0


def _tail_partitions(topic: str, info: dict[str, Any], asked: int | None) -> list[int]:
    count = len(info.get("partitions") or [None])
    if asked is None:
        return list(range(count))
    if not 0 <= asked < count:
        raise ConfigError(
            f"--partition {asked}: {topic} has {count} partition{'s' if count != 1 else ''} (0 to {count - 1})"
        )
    return [asked]


def _tail_fetch(admin: Any, topic: str, partition: int, offsets: dict[int, int], want: int, wait_ms: int) -> list[Any]:
    """The next messages of one partition; ``offsets[partition]`` moves past them."""
    offset = offsets[partition]
    try:
        messages, header = admin.fetch_batch(topic, offset, want, wait_ms=wait_ms, partition=partition)
    except OffsetOutOfRange as exc:
        start = int(exc.fields.get("start_offset", -1))
        if not offset < start:
            raise
        messages, header = [], {"start_offset": start}
    if offset < header["start_offset"]:
        offset = _overtaken(topic, offset, header["start_offset"])
    if messages:
        offset = messages[-1].offset + 1
    offsets[partition] = offset
    return messages


def _check_tail_limits(args: argparse.Namespace) -> None:
    """``--count -1`` or ``--idle-timeout nan`` would follow forever where the user asked for a bound."""
    if args.count < 0:
        raise ConfigError(f"--count takes 0 (follow forever) or a number of messages, not {args.count}")
    if not math.isfinite(args.idle_timeout) or args.idle_timeout < 0:
        raise ConfigError(
            f"--idle-timeout takes 0 (wait forever) or a finite number of seconds, not {args.idle_timeout}"
        )


def _overtaken(topic: str, offset: int, start: int) -> int:
    """Retention deleted what the tail was about to read: say so and go on from the log start."""
    print(
        f"conveyor tail: retention deleted offsets {offset} to {start - 1} of {topic} before they were read; "
        f"going on from {start}",
        file=sys.stderr,
        flush=True,
    )
    return start


def _start_offset(
    admin: Any,
    topic: str,
    start: str,
    *,
    wait: bool = False,
    partition: int = 0,
    info: dict[str, Any] | None = None,
    each: bool = False,
) -> int:
    """Where the tail of ``partition`` starts. ``each``: ``--from`` applies to every partition of a topic of
    several, and one whose end is below the offset starts at its end (reads what comes next)."""
    info = info or admin.describe_topic(topic)
    rows = info.get("partitions") or [{"start_offset": info["start_offset"], "end_offset": info["end_offset"]}]
    row = next((r for r in rows if r.get("partition", 0) == partition), rows[0])
    info = {**info, "start_offset": row["start_offset"], "end_offset": row["end_offset"]}
    many = len(rows) > 1
    first, end = int(info["start_offset"]), int(info["end_offset"])
    if start == "earliest":
        return first
    if start == "latest":
        return end
    if start.lstrip("-").isdigit():
        if each and many and not wait and int(start) > end:
            return end
        return _checked_offset(topic, int(start), first, end, wait, partition if many else None)
    return _offset_for_time(admin, topic, _timestamp_ms(start, "--from"), info, partition)


def _checked_offset(topic: str, offset: int, first: int, end: int, wait: bool, partition: int | None = None) -> int:
    """An offset ``--from`` may start at: below the log start is clamped (with a note), past the end is an error.

    Printing nothing and exiting 0 for an offset the topic has not reached
    would look like an empty range; ``--wait`` is the way to ask for it.
    """
    if offset < 0:
        raise ConfigError(f"--from takes earliest, latest, an offset of 0 or more, or an ISO time, not {offset}")
    if offset < first:
        print(f"conveyor tail: offset {offset} was removed by retention; starting at {first}", file=sys.stderr)
        return first
    if offset > end and not wait:
        where = {} if partition is None else {"partition": partition}
        raise OffsetOutOfRange(
            f"--from {offset} is past the end of {topic}{'' if partition is None else f' partition {partition}'} "
            f"(its next message gets offset {end}); use --from latest, or --wait to wait for offset {offset}",
            topic=topic,
            offset=offset,
            end_offset=end,
            **where,
        )
    return offset


def _timestamp_ms(text: str, option: str) -> int:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"{option} takes earliest, latest, an offset or an ISO time (2026-11-26T10:00:00), not {text!r}"
        ) from None
    try:
        return int(when.timestamp() * 1000)
    except (ValueError, OverflowError, OSError) as exc:  # year 1 in a zone east of UTC, year 9999 west of it
        raise ConfigError(f"{option} {text}: the time is out of range ({exc})") from None


def _offset_for_time(admin: Any, topic: str, ts_ms: int, info: dict[str, Any], partition: int = 0) -> int:
    low, high = int(info["start_offset"]), int(info["end_offset"])
    while low < high:  # timestamps grow with offsets: bisect with FETCH
        mid = (low + high) // 2
        messages = admin.fetch(topic, mid, 1, partition=partition)
        if not messages or messages[0].timestamp * 1000 >= ts_ms:
            high = mid
        else:
            low = mid + 1
    return low


def _print_message(message: Any, fmt: str, *, partition: bool = False) -> None:
    """One line; in text, ``partition:offset`` when the topic has several partitions (json always has both)."""
    if fmt == "json":
        print(json.dumps(message.to_dict(), default=_json_default, ensure_ascii=False), flush=True)
    else:
        data = message.to_dict()
        where = f"{data['partition']}:{data['offset']}" if partition else f"{data['offset']}"
        print(f"{where}\t{data['key'] or ''}\t{data['value']}", flush=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


# --- topics and groups ----------------------------------------------------------------------


def _topics_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument(
        "action",
        choices=["list", "create", "alter", "describe", "delete", "refresh", "reassign"],
        nargs="?",
        default="list",
        help="alter: change settings live; refresh: on a child broker, drop and re-mirror a topic from the parent; "
        "reassign: in a cluster, move a topic's replicas to --replicas",
    )
    parser.add_argument("name", nargs="?")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="K=V",
        help="a topic setting for create or alter: "
        + ", ".join(f"{name} ({setting.help})" for name, setting in TOPIC_SETTINGS.items())
        + "; sizes take KB/MB/GB or KiB/MiB/GiB, durations ms/s/m/h/d/w",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        metavar="N",
        help="create: the topic's partitions, each a log of its own (default 1); alter: add partitions up to "
        "N in all (only up; most keys then map to another partition; see docs/partitions.md)",
    )
    parser.add_argument(
        "--replication-factor", type=int, metavar="N", help="create, in a cluster: replicas (default min(3, nodes))"
    )
    parser.add_argument(
        "--min-insync-replicas",
        type=int,
        metavar="N",
        help="create or reassign, in a cluster: in-sync replicas a publish needs (reassign: once the move is done)",
    )
    parser.add_argument(
        "--replicas", metavar="A,B,C", help="reassign: the node ids to hold the topic (the first is preferred leader)"
    )
    parser.add_argument(
        "--partition", type=int, metavar="N", help="reassign: move this partition only (default: every partition)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=600.0,
        metavar="SECONDS",
        help="reassign: wait until the new replicas are the in-sync set (default 600 s; exits 2 if they are not)",
    )
    parser.add_argument("--format", choices=["table", "json"], default="table")


@command("topics", "list, create, alter, describe, delete, refresh or reassign topics", _topics_setup)
def cmd_topics(args: argparse.Namespace) -> int:
    from conveyor.broker.client.admin import Admin

    opts = client_options(args, "topics")
    with Admin(opts["broker"]) as admin:
        if args.action == "list":
            result: Any = admin.list_topics()
        else:
            if not args.name:
                raise ConfigError(f"topics {args.action} needs a topic name")
            config = dict(_pair(s) for s in args.set)  # sent as typed: the broker's settings table parses them
            check_topic_settings({k: v for k, v in config.items() if k != "storage"})  # the same table, no broker
            if args.partitions is not None:
                _check_partitions(args.partitions)
            if args.action == "create":
                for name in ("replication_factor", "min_insync_replicas"):
                    if getattr(args, name) is not None:
                        config[name] = getattr(args, name)  # a cluster's controller reads them; one node refuses
                result = admin.create_topic(
                    args.name, partitions=1 if args.partitions is None else args.partitions, **config
                )
            elif args.action == "alter":
                if not config and args.partitions is None:
                    raise ConfigError("topics alter needs at least one --set K=V, or --partitions N")
                if args.partitions is not None:
                    result = admin.add_partitions(args.name, args.partitions)
                if config:
                    result = admin.alter_topic(args.name, **config)
            elif args.action == "describe":
                result = admin.describe_topic(args.name)
                if args.format == "table":
                    _show_topic(result)
                    return 0
            elif args.action == "refresh":
                result = admin.refresh_topic(args.name)
            elif args.action == "reassign":
                result = _reassign(admin, args, opts["broker"])
            else:
                result = admin.delete_topic(args.name)
    _show(
        result,
        args.format,
        ["name", ("partition_count", "partitions"), "start_offset", "end_offset", "segments", "size_bytes"],
    )
    return 0


def _check_partitions(count: int) -> None:
    from conveyor.names import MAX_PARTITIONS

    if not 1 <= count <= MAX_PARTITIONS:
        raise ConfigError(f"--partitions takes 1 to {MAX_PARTITIONS} (partitions in all), not {count}")


def _show_topic(info: dict[str, Any]) -> None:
    """``topics describe`` as a table: the topic's fields, then a row per partition."""
    config = ", ".join(f"{k}={v}" for k, v in sorted((info.get("config") or {}).items()))
    fields = [
        "name",
        ("partition_count", "partitions"),
        "start_offset",
        "end_offset",
        "durable_offset",
        "visible_offset",
        "segments",
        "size_bytes",
    ]
    extra = {"groups": ", ".join(info.get("groups") or []) or "-", "config": config or "-"}
    if info.get("config_errors"):
        extra["config_errors"] = json.dumps(info["config_errors"], default=str)
    _show_block(info, fields, extra)
    _show_rows(info.get("partitions") or [])


def _show_group(info: dict[str, Any]) -> None:
    """``groups describe`` as a table: the group's fields, then a row per partition."""
    fields = ["topic", "group", "committed_offset", "next_offset", "end_offset", "lag", "in_flight"]
    fields += ["pending_redelivery", "skipped_by_retention"]
    members = ", ".join(
        f"{m.get('peer', '')[:8]}/{m.get('sub')} credit {m.get('credit')}" for m in info.get("members") or []
    )
    _show_block(info, fields, {"members": members or "-"})
    _show_rows(info.get("partitions") or [])


def _show_block(info: dict[str, Any], fields: list[Any], extra: dict[str, str]) -> None:
    pairs = [(f[1], info.get(f[0], "")) if isinstance(f, tuple) else (f, info.get(f, "")) for f in fields]
    pairs += list(extra.items())
    width = max(len(label) for label, _ in pairs)
    for label, value in pairs:
        print(f"{label.upper().ljust(width)}  {value}")
    print()


def _show_rows(rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    _show(rows, "table", columns)


def _reassign(admin: Any, args: argparse.Namespace, broker: str) -> dict[str, Any]:
    """``topics reassign T --replicas a,b,c [--wait]``: store the move; with ``--wait``, until it is done."""
    replicas = [node.strip() for node in (args.replicas or "").split(",") if node.strip()]
    if not replicas:
        raise ConfigError("topics reassign needs --replicas A,B,C (node ids)")
    result: dict[str, Any] = admin.reassign_topic(
        args.name, replicas, min_insync_replicas=args.min_insync_replicas, partition=args.partition
    )
    if args.wait is None:
        return result
    from conveyor.broker.client.metadata import Metadata

    numbers = result.get("partitions") or [0]
    dead = result.get("dead_letter_topic")
    metadata, deadline = Metadata(broker), time.monotonic() + args.wait
    while True:
        topics = metadata.refresh([args.name, *([dead] if dead else [])]).topics
        moved = [topics.get(args.name, {}).get(number) for number in numbers]
        if dead:  # the dead-letter topic's same partitions move with them (those it has)
            moved += [p for number, p in topics.get(dead, {}).items() if number in numbers]
        # A whole topic's partitions each take the replicas in an order that keeps their leaders spread
        # (docs/partitions.md); one partition named takes them in the order given.
        if all(p is not None and set(p.replicas) == set(replicas) and set(p.isr) == set(replicas) for p in moved) and (
            args.partition is None or (moved[0] is not None and list(moved[0].replicas) == replicas)
        ):
            partition = moved[0]
            assert partition is not None
            return {**result, "state": "done", "leader": partition.leader, "isr": list(partition.isr)}
        if time.monotonic() > deadline:
            raise ClusterError(f"reassignment of {args.name} to {','.join(replicas)} not done in {args.wait:g} s")
        time.sleep(0.2)  # a CLI waiting on another process's progress: bounded by --wait


def _groups_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument("action", choices=["list", "describe", "reset", "delete"], nargs="?", default="list")
    parser.add_argument("topic", nargs="?")
    parser.add_argument("group", nargs="?")
    parser.add_argument("--to", help="reset target: earliest, latest, an offset, or an ISO time")
    parser.add_argument(
        "--partition", type=int, metavar="N", help="reset: this partition only (default: every partition)"
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="on a child broker: first drop and re-mirror the topic from the parent's start",
    )
    parser.add_argument("--format", choices=["table", "json"], default="table")


@command("groups", "list, describe, reset or delete consumer groups", _groups_setup)
def cmd_groups(args: argparse.Namespace) -> int:
    from conveyor.broker.client.admin import Admin

    opts = client_options(args, "groups")
    with Admin(opts["broker"]) as admin:
        if args.action == "list":
            result: Any = admin.list_groups(args.topic)
        else:
            if not (args.topic and args.group):
                raise ConfigError(f"groups {args.action} needs TOPIC GROUP")
            if args.action == "describe":
                result = admin.describe_group(args.topic, args.group)
                if args.format == "table":
                    _show_group(result)
                    return 0
            elif args.action == "delete":
                result = admin.delete_group(args.topic, args.group)
            else:
                if args.refresh:
                    result = admin.refresh_topic(args.topic)  # the topic's groups restart at the parent's start
                    with contextlib.suppress(UnknownGroup):  # no such group here yet: the refresh is the result
                        result = admin.describe_group(args.topic, args.group)
                elif not args.to:
                    raise ConfigError("groups reset needs --to earliest|latest|OFFSET|ISO-TIME, or --refresh")
                else:
                    result = admin.reset_offsets(
                        args.topic, args.group, _reset_target(args.to), partition=_reset_partition(args.partition)
                    )
    _show(result, args.format, ["topic", "group", "committed_offset", "end_offset", "lag", "in_flight"])
    return 0


def _reset_target(text: str) -> Any:
    if text in ("earliest", "latest"):
        return text
    if text.lstrip("-").isdigit():
        if int(text) < 0:
            raise ConfigError(f"--to takes earliest, latest, an offset of 0 or more, or an ISO time, not {text}")
        return int(text)
    return {"timestamp": _timestamp_ms(text, "--to")}


def _reset_partition(partition: int | None) -> int | None:
    from conveyor.names import check_partition

    return None if partition is None else check_partition(partition, "--partition")


def _show(result: Any, fmt: str, columns: list[Any]) -> None:
    """A list as a table (``columns``: keys, or ``(key, header)``); anything else, and ``--format json``, as JSON."""
    if fmt == "json" or not isinstance(result, list):
        print(json.dumps(result, indent=None if isinstance(result, list) else 2, default=str))
        return
    keys = [c[0] if isinstance(c, tuple) else c for c in columns]
    heads = [c[1] if isinstance(c, tuple) else c for c in columns]
    rows = [[str(item.get(c, "")) for c in keys] for item in result]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(heads)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(heads, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _registry_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", required=True, help='JSON file: {"nodes": {NAME: {"parent": ADDR, ...}}}')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500, help="0: any free port")


@command("registry", "serve a topology registry for --registry discovery", _registry_setup)
def cmd_registry(args: argparse.Namespace) -> int:
    from conveyor.broker.server.topology import serve

    if not 0 <= args.port <= 65535:  # the socket layer would raise OverflowError, or wrap it
        raise ConfigError(f"--port {args.port}: must be a port, 0-65535 (0: any free port)")
    server = serve(args.topology, host=args.host, port=args.port)
    print(f"conveyor registry ready on http://{args.host}:{server.server_address[1]} ({args.topology})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _keys_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["generate", "show"])
    parser.add_argument("name", help="generate: a name for the pair; show: a .key or .key_secret file")
    parser.add_argument("--dir", default=".", help="where generate writes NAME.key and NAME.key_secret")


@command("keys", "generate or show CURVE certificates for encryption and authentication", _keys_setup)
def cmd_keys(args: argparse.Namespace) -> int:
    import zmq.auth
    from conveyor.broker.net import security

    if args.action == "generate":
        public, secret = security.generate(args.dir, args.name)
        print(f"public key file (share it): {public}")
        print(f"secret key file (keep it):  {secret}")
        print(f"public key: {zmq.auth.load_certificate(str(public))[0].decode()}")
    else:
        try:
            key = zmq.auth.load_certificate(args.name)[0]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{args.name}: not a readable CURVE certificate ({exc})") from None
        print(key.decode())
    return 0


# --- entry point ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor message broker")
    parser.add_argument("--version", action="version", version=f"conveyor {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, setup, handler) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        setup(sub)
        sub.set_defaults(handler=handler)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("conveyor")
    except PackageNotFoundError:
        return "(not installed)"


def _load_plugins() -> None:
    """``run``, ``cluster`` and ``dlq`` register themselves on import; ``bench`` comes from the benchmarks package,
    which the CLI alone may use."""
    import importlib

    importlib.import_module("conveyor.broker.cli.run")
    importlib.import_module("conveyor.broker.cli.cluster")
    importlib.import_module("conveyor.broker.cli.dlq")
    bench = importlib.import_module("conveyor.benchmarks.cli")
    COMMANDS.setdefault("bench", (bench.HELP, bench.setup, bench.run))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except ConveyorError as exc:
        from conveyor.monitoring.logs import announce

        for line in exc.message.splitlines() or [""]:  # one line per problem, each with its code
            announce(f"conveyor {args.command}: [{exc.name}] {line}", level="ERROR", stream=sys.stderr)
        return exitcodes.ERROR
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return exitcodes.BROKEN_PIPE


def _silence_stdout() -> None:
    """The reader went away: point stdout at /dev/null so that the interpreter's final flush stays quiet too."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
