"""Requests with exactly one bad header field, and the error code each must get.

The field specs here are written out independently of ``broker/wire/schema.py``
(from docs/protocol.md and what the 48-byte batch header and a member's
4-byte key can hold), so the fuzz tests check the schema instead of
re-reading it. Used by ``test_fuzz.py`` (through a ZeroMQ socket) and by
``tests/faults/test_protocol_fuzz.py`` (over hand-made ZMTP).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
from conveyor.broker.wire.protocol import SIGNATURE, Command
from hypothesis import strategies as st

INVALID_REQUEST, CONFIG_ERROR = 207, 500
I64_MIN, I64_MAX, U64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
MISSING = object()  # "leave the required field out"

# field -> kind: ("int", lo, hi), ("name",) required str, ("text",) str or nil, ("bool",),
# ("position", required), ("ranges",), ("settings",), ("names",) a list of str, ("rid",)
Spec = tuple[Any, ...]
BODY = msgpack.packb([[None, None, b"x"]], use_bin_type=True)

COMMANDS: dict[Command, tuple[dict[str, Any], dict[str, Spec]]] = {
    Command.HELLO: ({"client": "fuzz"}, {"client": ("text",)}),
    Command.HEARTBEAT: ({}, {}),
    Command.BYE: ({"reason": "fuzz"}, {"reason": ("text",)}),
    Command.PUBLISH: (
        {"topic": "fz", "pid": 7, "seq": 0},
        {
            "topic": ("name",),
            "p": ("int", 0, 1023),
            "pid": ("int", -1, I64_MAX),
            "seq": ("int", -1, 2**31 - 1),
        },
    ),
    Command.SUBSCRIBE: (
        {"sub": 9, "topic": "fz", "group": "g", "credit": 10},
        {
            "sub": ("int", 0, 2**32 - 1, "required"),
            "topic": ("name",),
            "p": ("int", 0, 1023),
            "group": ("name",),
            "credit": ("int", 0, 2**32 - 1),
            "batch_size": ("int", I64_MIN, I64_MAX),
            "start": ("position",),
            "key_affinity": ("bool",),
            "max_deliveries": ("int", 1, 2**31 - 1),
            "ack_timeout_ms": ("int", 1, 2**31 - 1),
            "dead_letter_topic": ("str",),
        },
    ),
    Command.UNSUBSCRIBE: ({"sub": 1}, {"sub": ("int", 0, 2**32 - 1, "required")}),
    Command.ACK: ({"sub": 1, "ranges": [[0, 1]]}, {"sub": ("int", 0, 2**32 - 1, "required"), "ranges": ("ranges",)}),
    Command.NACK: (
        {"sub": 1, "ranges": [[0, 1]], "delay_ms": 5, "error": "e", "release": False},
        {
            "sub": ("int", 0, 2**32 - 1, "required"),
            "ranges": ("ranges",),
            "delay_ms": ("int", I64_MIN, I64_MAX),
            "error": ("text",),
            "release": ("bool",),
        },
    ),
    Command.IN_PROGRESS: (
        {"sub": 1, "ranges": [[0, 1]]},
        {"sub": ("int", 0, 2**32 - 1, "required"), "ranges": ("ranges",)},
    ),
    Command.TERM: (
        {"sub": 1, "ranges": [[0, 1]], "reason": "r"},
        {"sub": ("int", 0, 2**32 - 1, "required"), "ranges": ("ranges",), "reason": ("text",)},
    ),
    Command.CREDIT: (
        {"sub": 1, "credit": 5},
        {
            "sub": ("int", 0, 2**32 - 1, "required"),
            "credit": ("int", 0, 2**32 - 1, "required"),
            "batch_size": ("int", I64_MIN, I64_MAX),
        },
    ),
    Command.FETCH: (
        {"topic": "fz", "offset": 0, "max_messages": 1},
        {
            "topic": ("name",),
            "p": ("int", 0, 1023),
            "offset": ("int", 0, I64_MAX),
            "max_messages": ("int", I64_MIN, I64_MAX),
            "max_bytes": ("int", I64_MIN, I64_MAX),
            "wait_ms": ("int", I64_MIN, I64_MAX),
            # a follower's FETCH from its partition leader
            "replica": ("str",),
            "leader_epoch": ("int", 0, 2**31 - 1),
            "last_epoch": ("int", 0, 2**31 - 1),
            "durable": ("int", 0, I64_MAX),
            "report": ("bool",),
        },
    ),
    Command.METADATA: ({"topics": ["fz"]}, {"topics": ("names",)}),
}

ADMIN_OPS: dict[str, tuple[dict[str, Any], dict[str, Spec]]] = {
    "list_topics": ({}, {}),
    "describe_topic": ({"topic": "fz"}, {"topic": ("name",)}),
    "create_topic": (
        {"topic": "fz-new", "config": {}},
        {"topic": ("name",), "config": ("settings",), "partitions": ("int", 1, 1024)},
    ),
    "alter_topic": (
        {"topic": "fz", "config": {"retention_ms": 60_000}},
        {"topic": ("name",), "config": ("settings", "required")},
    ),
    "delete_topic": ({"topic": "fz-gone"}, {"topic": ("name",)}),
    "add_partitions": (
        {"topic": "fz", "partitions": 2},
        {"topic": ("name",), "partitions": ("int", 1, 1024, "required")},
    ),
    "list_groups": ({"topic": "fz"}, {"topic": ("text",)}),
    "describe_group": ({"topic": "fz", "group": "g"}, {"topic": ("name",), "group": ("name",)}),
    "reset_offsets": (
        {"topic": "fz", "group": "g", "to": "earliest"},
        {"topic": ("name",), "group": ("name",), "to": ("position", "required")},
    ),
    "delete_group": ({"topic": "fz", "group": "g-gone"}, {"topic": ("name",), "group": ("name",)}),
    "refresh_topic": ({"topic": "fz"}, {"topic": ("name",)}),
    "mirror_status": ({}, {}),
    "describe_partitions": ({"topic": "fz"}, {"topic": ("text",)}),
    "reassign_topic": (
        {"topic": "fz", "replicas": ["n1"]},
        {"topic": ("name",), "replicas": ("names", "required"), "min_insync_replicas": ("int", 1, 255)},
    ),
}

# Values of every other type, each packable by msgpack.
OTHERS: list[Any] = [None, True, False, 0, -1, 2**64 - 1, 1.5, math.inf, math.nan, "", "x", b"x", [], [1], {}, {"a": 1}]


def _ints_outside(lo: int, hi: int) -> st.SearchStrategy[int]:
    parts = []
    if lo > I64_MIN:
        parts.append(st.integers(I64_MIN, lo - 1))
        parts.append(st.just(lo - 1))
    if hi < U64_MAX:
        parts.append(st.integers(hi + 1, U64_MAX))
        parts.append(st.just(hi + 1))
    return st.one_of(parts)


def _not(*kinds: type) -> st.SearchStrategy[Any]:
    return st.sampled_from([v for v in OTHERS if type(v) not in kinds])


BAD_POSITIONS = [
    {"timestamp": "x"},
    {"offset": math.inf},
    {"offset": 1.5},
    {"offset": 2**63},
    {"timestamp": None},
    {"x": 1},
    {"offset": 1, "timestamp": 2},
    "soon",
    "١٢",  # digits, but not ASCII ones
    "99999999999999999999",
    "",
    2**63,
    1.5,
    math.nan,
    True,
    b"earliest",
    [0],
]
BAD_RANGES = [
    "0-1",
    {"0": 1},
    [[1]],
    [[2, 1]],
    [[1, 1]],
    [[-1, 3]],
    [[0, 2**63]],
    [[0.5, 1]],
    [["a", "b"]],
    [[True, 3]],
    [[0, 1, 2]],
    [[0, 1], None],
    [[0, None]],
]
BAD_SETTINGS = [
    [1, 2],
    "retention_ms=1",
    5,
    {"retention_ms": None, "": 1} | {"x" * 9: [None]},
    {"retention_ms": [1]},
    {"retention_ms": {"ms": 1}},
    {"retention_ms": math.inf},
    {"retention_ms": math.nan},
    {"retention_ms": 2**63},
    {"retention_ms": b"1"},
    {f"k{i}": 1 for i in range(65)},
]


def bad_values(spec: Spec) -> st.SearchStrategy[Any]:
    """Values ``spec`` refuses, with MISSING for a required field."""
    kind = spec[0]
    missing = [st.just(MISSING)] if kind in ("name",) or "required" in spec else []
    if kind == "int":
        return st.one_of(_ints_outside(spec[1], spec[2]), _not(int), *missing)
    if kind in ("name", "str"):
        return st.one_of(_not(str), *missing)
    if kind == "text":
        return _not(str, type(None))
    if kind == "bool":
        return st.one_of(_not(bool), st.just(0), st.just(1), st.just("true"))
    if kind == "position":
        return st.one_of(st.sampled_from(BAD_POSITIONS), *missing)
    if kind == "ranges":
        return st.one_of(st.sampled_from(BAD_RANGES), st.just(MISSING))
    if kind == "settings":
        return st.one_of(st.sampled_from(BAD_SETTINGS), *missing)
    if kind == "names":
        return st.one_of(_not(list), st.sampled_from([[1], ["a", None], [["a"]], [b"a"]]), *missing)
    raise AssertionError(kind)


def expected_code(spec: Spec) -> int:
    return CONFIG_ERROR if spec[0] == "settings" else INVALID_REQUEST


TARGETS: list[tuple[Command, str | None, str, Spec]] = [
    *((c, None, name, spec) for c, (_base, fields) in COMMANDS.items() for name, spec in fields.items()),
    *((Command.ADMIN, op, name, spec) for op, (_base, fields) in ADMIN_OPS.items() for name, spec in fields.items()),
    *((c, None, "rid", ("rid",)) for c in COMMANDS),
    (Command.ADMIN, None, "op", ("name",)),
]

BAD_RIDS = [1.5, [1], {"a": 1}, True, b"x", None]


@st.composite
def one_bad_field(draw: st.DrawFn) -> tuple[list[bytes], int, Any, str]:
    """(frames, expected code, rid the ERROR must carry, what was changed) for one bad field."""
    command, op, name, spec = draw(st.sampled_from(TARGETS))
    base, _fields = COMMANDS[command] if op is None and command is not Command.ADMIN else ({}, {})
    if command is Command.ADMIN:
        base = {"op": op or "list_topics", **(ADMIN_OPS[op][0] if op else {})}
    rid = draw(st.integers(1, 2**31))
    header = {"rid": rid, **base}
    if spec == ("rid",):
        value = draw(st.sampled_from(BAD_RIDS[:-1]))
        header["rid"] = value
        rid = None  # an invalid rid is not echoed
        code = INVALID_REQUEST
    else:
        value = draw(bad_values(spec))
        if value is MISSING:
            header.pop(name, None)
        else:
            header[name] = value
        code = expected_code(spec)
    payload = [BODY] if command is Command.PUBLISH else []
    frames = [SIGNATURE, bytes([command]), msgpack.packb(header, use_bin_type=True), *payload]
    return (
        frames,
        code,
        rid,
        f"{command.name}{' ' + op if op else ''} {name}={'<missing>' if value is MISSING else repr(value)}",
    )
