"""Scenarios: what one run of one workload is, read from JSON."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

HEADER_BYTES = 12  # the stamp every value starts with (see ``payload``)
FSYNC_POLICIES = ("batch", "none")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload. ``rate`` is ``"max"`` or the total msg/s of all producers together."""

    name: str
    producers: int = 1
    consumers: int = 2  # per group
    groups: int = 1
    messages: int = 100_000  # in all, split between the producers
    message_size: int = 100
    batch_size: int = 1000  # messages per producer batch (and the consumers' credit)
    rate: str | float = "max"
    fsync: str = "batch"
    duration: float = 30.0  # producers stop sending after this many seconds even if messages are left
    credit: int = 0  # unacked messages each consumer may hold (0: twice the batch size)
    linger_ms: float | None = None  # Conveyor producer linger (None: the producer's default)
    eager: bool | None = None  # Conveyor producer eager sends (None: the producer's default)
    send_many: bool = False  # Conveyor producer: send_many() per list of values instead of send() per value
    systems: tuple[str, ...] = ()  # system ids to run (``conveyor``, ``redis:always``...); empty: every match
    description: str = ""
    quick: dict[str, Any] = field(default_factory=dict)  # overrides under --quick

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,80}", self.name):
            raise ValueError(f"scenario name {self.name!r}: letters, digits, '.', '_' and '-' only")
        if self.producers < 1 or self.consumers < 1 or self.groups < 1:
            raise ValueError(f"{self.name}: producers, consumers and groups must be at least 1")
        if self.messages < self.producers:
            raise ValueError(f"{self.name}: fewer messages than producers")
        if self.message_size < HEADER_BYTES:
            raise ValueError(f"{self.name}: message_size must be at least {HEADER_BYTES} bytes (the stamp)")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"{self.name}: fsync must be one of {', '.join(FSYNC_POLICIES)}")
        if self.rate != "max" and (not isinstance(self.rate, int | float) or self.rate <= 0):
            raise ValueError(f'{self.name}: rate must be "max" or a positive number of msg/s')
        if self.batch_size < 1 or self.duration <= 0:
            raise ValueError(f"{self.name}: batch_size and duration must be positive")

    @property
    def paced(self) -> bool:
        return self.rate != "max"

    @property
    def total_rate(self) -> float:
        return 0.0 if self.rate == "max" else float(self.rate)

    @property
    def participants(self) -> int:
        return self.producers + self.consumers * self.groups

    @property
    def per_producer(self) -> list[int]:
        """How many messages each producer sends (the first ones take the remainder)."""
        share, extra = divmod(self.messages, self.producers)
        return [share + (1 if i < extra else 0) for i in range(self.producers)]

    @property
    def consumer_credit(self) -> int:
        return self.credit or 2 * self.batch_size

    @property
    def conveyor_producer_options(self) -> dict[str, Any]:
        """What the scenario sets of the Conveyor producer; the rest stays at the defaults a user gets."""
        options: dict[str, Any] = {"batch_size": self.batch_size}
        if self.linger_ms is not None:
            options["linger_ms"] = self.linger_ms
        if self.eager is not None:
            options["eager"] = self.eager
        return options

    def label(self) -> str:
        pace = "max rate" if not self.paced else f"{self.total_rate:,.0f} msg/s"
        groups = f" x {self.groups} groups" if self.groups > 1 else ""
        return (
            f"{self.producers}P -> {self.consumers}C{groups}, {_size(self.message_size)}, {pace}, "
            f"fsync={self.fsync}, {self.messages:,} msgs"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["systems"] = list(self.systems)
        d.pop("quick")
        return d


def _size(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"


@dataclass(frozen=True, slots=True)
class Config:
    scenarios: tuple[Scenario, ...]
    settings: dict[str, Any]
    source: str


_FIELDS = {f.name for f in fields(Scenario)}


_NUMBER = (int, float)
_KINDS: dict[str, Any] = {
    "name": str,
    "producers": int,
    "consumers": int,
    "groups": int,
    "messages": int,
    "message_size": int,
    "batch_size": int,
    "rate": (str, *_NUMBER),
    "fsync": str,
    "duration": _NUMBER,
    "credit": int,
    "linger_ms": (*_NUMBER, type(None)),
    "eager": (bool, type(None)),
    "send_many": bool,
    "systems": list,
    "description": str,
    "quick": dict,
}


def _check_keys(where: str, values: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    """Unknown keys (with a did-you-mean) and values of the wrong JSON type: a ``ValueError`` naming each."""
    problems = []
    for key, value in values.items():
        if key in extra:
            continue
        kind = _KINDS.get(key)
        if kind is None:
            close = difflib.get_close_matches(key, list(_KINDS), n=1)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        elif not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
            problems.append(f"{key} = {json.dumps(value)} has the wrong type")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def _tuple(kind: Any) -> tuple[Any, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def scenario_from_dict(item: dict[str, Any], defaults: dict[str, Any], quick: bool) -> Scenario | None:
    """The scenario, with its ``quick`` overrides under --quick; None when ``quick`` says ``"skip": true``."""
    merged = {**defaults, **item}
    _check_keys(f"scenario {merged.get('name', '?')}", merged)
    _check_keys(f"scenario {merged.get('name', '?')}, quick", dict(merged.get("quick", {})), extra=("skip",))
    if "systems" in merged:
        merged["systems"] = tuple(merged["systems"])
    scenario = Scenario(**merged)
    if quick and scenario.quick:
        overrides = dict(scenario.quick)
        if overrides.pop("skip", False):
            return None
        if "systems" in overrides:
            overrides["systems"] = tuple(overrides["systems"])
        scenario = replace(scenario, **overrides)
    return scenario


def load_config(path: str | Path, *, quick: bool = False) -> Config:
    """``{"settings": {...}, "defaults": {...}, "scenarios": [{...}, ...]}``; see ``benchmarks/default.json``."""
    raw = json.loads(Path(path).read_text())
    if isinstance(raw, list):
        raw = {"scenarios": raw}
    defaults = raw.get("defaults", {})
    loaded = [scenario_from_dict(item, defaults, quick) for item in raw.get("scenarios", [])]
    scenarios = [s for s in loaded if s is not None]
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ValueError("scenario names must be unique")
    if not scenarios:
        raise ValueError(f"{path}: no scenarios")
    return Config(tuple(scenarios), dict(raw.get("settings", {})), str(path))
