"""The data source's options, parsed once, with the errors users see.

Spark hands options over as a case-insensitive map of strings; these
dataclasses turn them into typed values (and are pickled to executors with
the reader and writer).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.broker.config.addresses import DEFAULT_BROKER
from conveyor.broker.net.security import ClientKeys, load_client_keys

from conveyor.errors import ConfigError

__all__ = ["CurveOptions", "ReadOptions", "StartPosition", "WriteOptions", "parse_position"]

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}


class OptionError(ValueError):
    """A bad option value; the message names the option."""


def _get(options: Mapping[str, str], name: str, default: Any = None) -> Any:
    # Spark's map is case-insensitive; a plain dict (tests, direct use) may not be.
    if name in options:
        return options[name]
    lowered = {str(k).lower(): v for k, v in options.items()}
    return lowered.get(name.lower(), default)


def _int(options: Mapping[str, str], name: str, default: int | None, *, minimum: int = 0) -> int | None:
    raw = _get(options, name)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw).replace("_", ""))
    except ValueError:
        raise OptionError(f"option {name} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise OptionError(f"option {name} must be at least {minimum}, not {value}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise OptionError(f"option {name} must be true or false, not {raw!r}")


@dataclass(frozen=True, slots=True)
class StartPosition:
    """``earliest``, ``latest``, an offset, a time (ms since the epoch), or an offset per partition.

    ``offset`` applies to every partition of the topic (on a topic of one
    partition, the offset, as before). ``partitions`` names a position for
    some partitions (``per_partition``: partition, offset; -2 earliest, -1
    latest); the others take ``value``'s kind, ``earliest`` or ``latest``.
    """

    kind: str  # "earliest" | "latest" | "offset" | "timestamp" | "partitions"
    value: int = 0
    per_partition: tuple[tuple[int, int], ...] = ()
    others: str = "earliest"  # kind "partitions": where partitions not named start (or end)

    def for_partition(self, partition: int) -> StartPosition:
        """The position in one partition."""
        if self.kind != "partitions":
            return self
        offset = dict(self.per_partition).get(partition)
        if offset is None:
            return StartPosition(self.others)
        return _from_int(offset)


def _from_int(value: int) -> StartPosition:
    if value < 0:  # Kafka's -2 / -1 spellings
        return StartPosition({-2: "earliest", -1: "latest"}.get(value, "latest"))
    return StartPosition("offset", value)


def parse_position(name: str, raw: str | None, default: str) -> StartPosition:
    """``earliest`` / ``latest`` / ``1234`` / ``{"offset": 1234}`` / ``{"timestamp": ms}`` / ``{"0": 12, "3": 40}``."""
    text = (raw if raw not in (None, "") else default).strip()
    lowered = text.lower()
    if lowered in ("earliest", "latest"):
        return StartPosition(lowered)
    if lowered.lstrip("-").isdigit():
        return _from_int(int(lowered))
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        if "offset" in parsed:
            return StartPosition("offset", int(parsed["offset"]))
        if "timestamp" in parsed:
            return StartPosition("timestamp", int(parsed["timestamp"]))
        if parsed and all(str(k).isdigit() and type(v) is int for k, v in parsed.items()):
            named = tuple(sorted((int(k), v) for k, v in parsed.items()))
            return StartPosition("partitions", per_partition=named, others=default)
    raise OptionError(
        f'option {name} must be earliest, latest, an offset, {{"timestamp": ms}} '
        f'or an offset per partition ({{"0": 12, "1": 40}}), not {raw!r}'
    )


def default_broker() -> str:
    return os.environ.get("CONVEYOR_BROKER", DEFAULT_BROKER)


@dataclass(frozen=True, kw_only=True)
class CurveOptions:
    """The CURVE keys of a reader or writer, as names: they travel to the executors with it.

    ``curveServerKey`` is the broker's public key (40 Z85 characters) or the
    path of its ``.key`` file; ``curveKey`` the path of this client's
    ``.key_secret`` file, readable where the tasks run. Without the options,
    the driver's ``CONVEYOR_CURVE_SERVER_KEY`` and ``CONVEYOR_CURVE_KEY`` are
    taken when the query is planned: executors are other Python processes,
    and the driver's environment (or ``configure()``) would not reach them.
    """

    curve_server_key: str = ""
    curve_key: str = ""

    def client_keys(self) -> ClientKeys | None:
        """The keys to connect with (read on the executor); None: no CURVE, or the process's own keys."""
        if not self.curve_server_key:
            return None
        try:
            return load_client_keys(self.curve_server_key, self.curve_key)
        except ConfigError as exc:
            raise OptionError(f"options curveServerKey/curveKey: {exc.message}") from None


def _curve(options: Mapping[str, str]) -> dict[str, str]:
    server = str(_get(options, "curveServerKey") or "")
    mine = str(_get(options, "curveKey") or "")
    if not (server or mine):
        server = os.environ.get("CONVEYOR_CURVE_SERVER_KEY", "")
        mine = os.environ.get("CONVEYOR_CURVE_KEY", "")
        if bool(server) != bool(mine):
            raise OptionError("CURVE needs both CONVEYOR_CURVE_SERVER_KEY and CONVEYOR_CURVE_KEY")
    elif not (server and mine):
        raise OptionError(
            "CURVE needs both options: curveServerKey (the broker's public key or its .key file) "
            "and curveKey (this client's .key_secret file)"
        )
    return {"curve_server_key": server, "curve_key": mine}


@dataclass(frozen=True)
class ReadOptions(CurveOptions):
    broker: str
    topic: str
    starting: StartPosition
    ending: StartPosition
    partition_size: int = 250_000
    min_partitions: int = 1
    max_offsets_per_trigger: int | None = None
    fetch_max_bytes: int = 8 << 20
    fetch_max_messages: int = 200_000
    fail_on_data_loss: bool = True
    request_timeout: float = 10.0
    broker_timeout: float = 120.0
    pushdown: bool = True

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = False) -> ReadOptions:
        topic = _get(options, "topic")
        if not topic:
            raise OptionError('the conveyor source needs option("topic", NAME)')
        starting = parse_position(
            "startingOffsets", _get(options, "startingOffsets"), "latest" if streaming else "earliest"
        )
        ending = parse_position("endingOffsets", _get(options, "endingOffsets"), "latest")
        if _get(options, "startingTimestamp") not in (None, ""):
            starting = StartPosition("timestamp", _int(options, "startingTimestamp", 0) or 0)
        if _get(options, "endingTimestamp") not in (None, ""):
            ending = StartPosition("timestamp", _int(options, "endingTimestamp", 0) or 0)
        if streaming and _get(options, "endingOffsets") is not None:
            raise OptionError("endingOffsets is for batch reads; a stream has no end (use trigger(availableNow=True))")
        if ending.kind == "earliest":
            raise OptionError("endingOffsets cannot be earliest")
        return cls(
            broker=str(_get(options, "broker") or default_broker()),
            topic=str(topic),
            starting=starting,
            ending=ending,
            partition_size=_int(options, "partitionSize", 250_000, minimum=1) or 250_000,
            min_partitions=_int(options, "minPartitions", 1, minimum=1) or 1,
            max_offsets_per_trigger=_int(options, "maxOffsetsPerTrigger", None, minimum=1),
            fetch_max_bytes=_int(options, "fetchMaxBytes", 8 << 20, minimum=1024) or 8 << 20,
            fetch_max_messages=_int(options, "fetchMaxMessages", 200_000, minimum=1) or 200_000,
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            request_timeout=(_int(options, "requestTimeoutMs", 10_000, minimum=1) or 10_000) / 1000,
            broker_timeout=(_int(options, "brokerTimeoutMs", 120_000, minimum=0) or 0) / 1000,
            pushdown=_bool(options, "pushdown", True),
            **_curve(options),
        )


@dataclass(frozen=True)
class WriteOptions(CurveOptions):
    broker: str
    topic: str
    batch_size: int = 5000
    batch_bytes: int = 1 << 20
    max_in_flight: int = 4
    idempotent: bool = True
    verify_duplicates: bool = True
    write_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    content_type: str | None = None
    request_timeout: float = 10.0
    delivery_timeout: float = 120.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        topic = _get(options, "topic")
        if not topic:
            raise OptionError('the conveyor sink needs option("topic", NAME)')
        in_flight = _int(options, "maxInFlight", 4, minimum=1) or 4
        if in_flight > 4:
            raise OptionError("maxInFlight must be at most 4, half the broker's window of 8 remembered sequences")
        return cls(
            broker=str(_get(options, "broker") or default_broker()),
            topic=str(topic),
            batch_size=_int(options, "batchSize", 5000, minimum=1) or 5000,
            batch_bytes=_int(options, "batchBytes", 1 << 20, minimum=1024) or 1 << 20,
            max_in_flight=in_flight,
            idempotent=_bool(options, "idempotent", True),
            verify_duplicates=_bool(options, "verifyDuplicates", True),
            write_id=str(_get(options, "writeId") or uuid.uuid4().hex),
            content_type=_get(options, "contentType") or None,
            request_timeout=(_int(options, "requestTimeoutMs", 10_000, minimum=1) or 10_000) / 1000,
            delivery_timeout=(_int(options, "deliveryTimeoutMs", 120_000, minimum=1) or 120_000) / 1000,
            **_curve(options),
        )
