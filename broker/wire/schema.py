"""Every header field of every client command (and ADMIN op): its type, range, and whether it is required.

``protocol.decode`` applies this table to each request before any handler
runs, so a handler only ever sees fields of the declared type and range:
an id that does not fit the 32 bits a member key holds, a producer id or
sequence that does not fit the 48-byte batch header, an ``{"offset": inf}``
or a settings map with a list in it is answered ``INVALID_REQUEST`` (or
``CONFIG_ERROR`` for topic settings) with the request's ``rid``, never an
internal error. Unknown fields are ignored (later versions may add
fields); ``protocol.field`` refuses to read a field the table does not
declare, so a new field cannot skip it.

A check is a plain function per field, a few comparisons: the table costs
about a microsecond per request, nothing per message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError, ConveyorError, InvalidRequest

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
MAX_SETTINGS = 64  # keys in a topic settings map

Check = Callable[[Any], str | None]  # None when the value is fine, else what it should be


@dataclass(frozen=True, slots=True)
class Field:
    check: Check
    required: bool = False
    error: type[ConveyorError] = InvalidRequest


def integer(lo: int, hi: int) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is int and lo <= value <= hi:
            return None
        return f"an integer in [{lo}, {hi}]"

    return check


def of_type(kind: type, what: str, *, nil: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is kind or (nil and value is None):
            return None
        return what + (" or nil" if nil else "")

    return check


def request_id(value: Any) -> str | None:
    if value is None or type(value) is str or (type(value) is int and I64_MIN <= value <= 2**64 - 1):
        return None
    return "an integer or a string"


def position(value: Any) -> str | None:
    """``earliest``, ``latest``, an offset (int or digits), ``{"offset": n}`` or ``{"timestamp": ms}``."""
    if value is None or value in ("earliest", "latest"):
        return None
    if type(value) is int:
        return None if I64_MIN <= value <= I64_MAX else _POSITION
    if type(value) is str:
        digits = value[1:] if value[:1] == "-" else value
        return None if digits.isascii() and digits.isdigit() and I64_MIN <= int(value) <= I64_MAX else _POSITION
    if type(value) is dict and len(value) == 1:
        ((key, inner),) = value.items()
        if key in ("offset", "timestamp") and type(inner) is int and I64_MIN <= inner <= I64_MAX:
            return None
    return _POSITION


_POSITION = 'earliest, latest, an offset, {"offset": n} or {"timestamp": ms} (64-bit integers)'


def offset_ranges(value: Any) -> str | None:
    """A list of ``[start, end)`` offset pairs, ``0 <= start < end < 2**63``."""
    if type(value) is not list:
        return _RANGES
    for item in value:
        if not (type(item) is list and len(item) == 2):
            return _RANGES
        start, end = item
        if not (type(start) is int and type(end) is int and 0 <= start < end <= I64_MAX):
            return _RANGES
    return None


_RANGES = "a list of [start, end) offset pairs with 0 <= start < end < 2**63"


def settings_map(value: Any) -> str | None:
    """Topic settings: a map of setting names (the values are checked by ``broker/config/topic_settings.py``)."""
    if value is None:
        return None
    if type(value) is not dict or len(value) > MAX_SETTINGS:
        return f"a map of at most {MAX_SETTINGS} setting names to values"
    if not all(type(key) is str for key in value):
        return "a map with string keys"
    return None


def name_list(value: Any) -> str | None:
    """A list of strings (topic names; each name's pattern is the handler's to check)."""
    if type(value) is list and all(type(item) is str for item in value):
        return None
    return "a list of strings"


TEXT = of_type(str, "a string")
TEXT_OR_NIL = of_type(str, "a string", nil=True)
BOOL = Field(of_type(bool, "true or false"))
NAME = Field(TEXT, required=True)  # topic and group names: the pattern is checked by the handler
SUB = Field(integer(0, U32_MAX), required=True)  # a member's key holds it in 4 bytes
RANGES = Field(offset_ranges, required=True)
OFFSET = Field(integer(0, I64_MAX))
I64 = Field(integer(I64_MIN, I64_MAX))  # counts and durations the handler clamps to the broker's limits
FREE_TEXT = Field(TEXT_OR_NIL)
EPOCH = Field(integer(0, I32_MAX))  # a leader epoch: the batch header's i32
PARTITION = Field(integer(0, 1023))  # absent: partition 0 (conveyor.names.MAX_PARTITIONS)

# By command name. Broker -> client commands have no entry: their receivers check what they read.
COMMANDS: dict[str, dict[str, Field]] = {
    name: {"rid": Field(request_id), **fields}
    for name, fields in {
        "HELLO": {"client": FREE_TEXT},
        "HEARTBEAT": {},
        "BYE": {"reason": FREE_TEXT},
        "PUBLISH": {
            "topic": NAME,
            "p": PARTITION,
            "pid": Field(integer(-1, I64_MAX)),  # the batch header's i64; -1: not idempotent
            "seq": Field(integer(-1, I32_MAX)),  # the batch header's i32
        },
        "SUBSCRIBE": {
            "sub": SUB,
            "topic": NAME,
            "group": NAME,
            "p": PARTITION,
            "credit": Field(integer(0, U32_MAX)),  # and at most --max-credit, checked by the handler
            "batch_size": I64,
            "start": Field(position),
            "key_affinity": BOOL,
            "max_deliveries": Field(integer(1, I32_MAX)),
            "ack_timeout_ms": Field(integer(1, I32_MAX)),  # zmq's timers take a signed 32-bit ms count
            "dead_letter_topic": Field(TEXT),
        },
        "UNSUBSCRIBE": {"sub": SUB},
        "ACK": {"sub": SUB, "ranges": RANGES},
        "NACK": {"sub": SUB, "ranges": RANGES, "delay_ms": I64, "error": FREE_TEXT, "release": BOOL},
        "IN_PROGRESS": {"sub": SUB, "ranges": RANGES},
        "TERM": {"sub": SUB, "ranges": RANGES, "reason": FREE_TEXT},
        "CREDIT": {"sub": SUB, "credit": Field(integer(0, U32_MAX), required=True), "batch_size": I64},
        "FETCH": {
            "topic": NAME,
            "p": PARTITION,
            "offset": OFFSET,
            "max_messages": I64,
            "max_bytes": I64,
            "wait_ms": I64,
            # A follower's FETCH from its partition leader (docs/protocol.md, "Replica FETCH").
            "replica": Field(TEXT),  # its node id
            "leader_epoch": EPOCH,  # the leader epoch it follows
            "last_epoch": EPOCH,  # the epoch of its last batch
            "durable": OFFSET,  # its durable end offset
            "report": BOOL,  # only reports ``durable`` (and ``offset``): not answered, not parked
        },
        "ADMIN": {"op": Field(TEXT, required=True)},
        "METADATA": {"topics": Field(name_list)},  # absent: every topic
    }.items()
}

SETTINGS = Field(settings_map, error=ConfigError)
ADMIN_OPS: dict[str, dict[str, Field]] = {
    "list_topics": {},
    "describe_topic": {"topic": NAME},
    "create_topic": {"topic": NAME, "config": SETTINGS, "partitions": Field(integer(1, 1024))},
    "alter_topic": {"topic": NAME, "config": Field(settings_map, required=True, error=ConfigError)},
    "delete_topic": {"topic": NAME},
    "add_partitions": {"topic": NAME, "partitions": Field(integer(1, 1024), required=True)},  # the new total
    "list_groups": {"topic": FREE_TEXT},
    "describe_group": {"topic": NAME, "group": NAME},
    "reset_offsets": {"topic": NAME, "group": NAME, "to": Field(position, required=True)},
    "delete_group": {"topic": NAME, "group": NAME},
    "refresh_topic": {"topic": NAME},
    "mirror_status": {},
    "describe_partitions": {"topic": FREE_TEXT},  # absent or nil: every partition this node holds
    # Cluster mode: move a topic's replicas (``conveyor topics reassign``); node ids are checked by the agent.
    "reassign_topic": {
        "topic": NAME,
        "replicas": Field(name_list, required=True),
        "min_insync_replicas": Field(integer(1, 255)),
        "partition": PARTITION,  # absent: every partition of the topic
    },
}


def check_header(name: str, header: Mapping[str, Any]) -> None:
    """Raise ``InvalidRequest`` (or the field's error) for the first field out of its type or range."""
    fields = COMMANDS.get(name)
    if fields is None:
        return  # a broker -> client command: its receiver checks what it reads
    _check(name, fields, header)
    if name == "ADMIN":
        op_fields = ADMIN_OPS.get(header["op"])
        if op_fields is not None:  # an unknown op is answered by the ADMIN handler, naming the known ones
            _check(f"ADMIN {header['op']}", op_fields, header)


def _check(name: str, fields: Mapping[str, Field], header: Mapping[str, Any]) -> None:
    for key, value in header.items():
        spec = fields.get(key)
        if spec is not None:
            wanted = spec.check(value)
            if wanted is not None:
                shown = repr(value)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise spec.error(f"{name} field {key!r} must be {wanted}, not {shown}", field=key)
    for key, spec in fields.items():
        if spec.required and key not in header:
            raise spec.error(f"{name} needs field {key!r}", field=key)


def declared(name: str, op: Any, key: str) -> bool:
    """Whether the table declares ``key`` for this command (and ADMIN op)."""
    fields = COMMANDS.get(name)
    if fields is None:
        return True
    return key in fields or key in ADMIN_OPS.get(op, {})


# --- the METADATA_RESULT reply ------------------------------------------------------------
#
# Broker -> client commands are checked by their receivers; this one is checked here, in one
# place, because every client routes by it: ``check_metadata_result`` is what a client runs
# on the reply before trusting an address in it.

PARTITION_FIELDS: dict[str, Check] = {
    "leader": TEXT_OR_NIL,  # node id; nil while the partition has no leader (offline)
    "leader_addr": TEXT_OR_NIL,  # the leader's advertised endpoint, nil with the leader
    "leader_epoch": integer(0, I32_MAX),
    "replicas": name_list,  # node ids, the assignment in preference order
    "isr": name_list,
    "offline": of_type(bool, "true or false"),
}


def check_metadata_result(header: Mapping[str, Any]) -> str | None:
    """None when a METADATA_RESULT header has the documented shape, else what is wrong with it."""
    for key, check in (("node", TEXT), ("controller", TEXT_OR_NIL)):
        wanted = check(header.get(key))
        if wanted is not None:
            return f"{key!r} must be {wanted}"
    nodes, topics = header.get("nodes"), header.get("topics")
    if type(nodes) is not dict or not all(type(k) is str and type(v) is str for k, v in nodes.items()):
        return "'nodes' must be a map of node ids to endpoints"
    if type(topics) is not dict:
        return "'topics' must be a map of topic names"
    for name, topic in topics.items():
        partitions = topic.get("partitions") if type(topic) is dict else None
        if type(partitions) is not dict:
            return f"topic {name!r} must be a map with 'partitions'"
        for number, partition in partitions.items():
            if not (type(number) is str and number.isascii() and number.isdigit()):
                return f"topic {name!r}: partition keys must be decimal strings, not {number!r}"
            if type(partition) is not dict:
                return f"topic {name!r} partition {number}: must be a map"
            for key, check in PARTITION_FIELDS.items():
                wanted = check(partition.get(key))
                if wanted is not None:
                    return f"topic {name!r} partition {number}: {key!r} must be {wanted}"
    return None
