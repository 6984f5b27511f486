"""An option's declaration and the value types it is checked against: one schema for flags, variables and TOML.

``Option.check`` turns a raw value (a string from a flag or a variable, or any
TOML value) into the option's value, or says in a ``ValueError`` what is wrong.
``config.sources`` finds the raw values; ``config.broker`` declares the broker's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.broker.config import units

INT32_MAX = 2**31 - 1  # zmq timers, poll timeouts and int socket options take a signed 32-bit count
INT64_MAX = 2**63 - 1  # the wire (msgpack) and the offsets carry signed 64-bit integers


# --- value types: each takes what a flag, a variable or a TOML key holds ------------------------


def text(value: Any) -> str:
    """A string."""
    if not isinstance(value, str):
        raise ValueError(f"must be a string, not {as_toml(value)}")
    return value


def nonempty(value: Any) -> str:
    """A string that is not empty (a path, a host)."""
    if not text(value).strip():
        raise ValueError("must not be empty")
    return str(value)


def number(value: Any) -> float:
    """A finite number."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a boolean ({as_toml(value)})")
    if isinstance(value, int | float):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value)
        except ValueError:
            raise ValueError(f"must be a number, not {value!r}") from None
    else:
        raise ValueError(f"must be a number, not {as_toml(value)}")
    if not math.isfinite(result):
        raise ValueError(f"must be a finite number, not {value!r}")
    return result


_BUILTIN_TYPES: dict[Any, Callable[[Any], Any]] = {
    int: units.integer,
    float: number,
    str: text,
    bool: units.boolean,
}


@dataclass(frozen=True)
class Option:
    """One option's declaration: its name, default, help, and the schema its values are checked against."""

    name: str  # dashes, as on the command line: "data-dir"
    default: Any
    help: str
    type: Callable[[Any], Any] = str  # str, int, float, bool, or a parser such as units.size_bytes
    flag: bool = False  # a boolean switch
    repeat: bool = False  # may be given several times; values are joined with commas
    minimum: float | None = None
    maximum: float | None = None  # integers get a ceiling anyway: INT32_MAX for *_ms, INT64_MAX for others
    choices: tuple[str, ...] = ()  # case-insensitive; the value is the choice as declared

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "CONVEYOR_" + self.dest.upper()

    def command_env(self, command: str) -> str:
        """The variable for this option of one command only: ``CONVEYOR_BROKER_METRICS_PORT``."""
        return f"CONVEYOR_{command.upper()}_{self.dest.upper()}"

    def check(self, raw: Any) -> Any:
        """The option's value from a raw one (a string, or any TOML value); ``ValueError`` says what is wrong."""
        if self.repeat and isinstance(raw, list):
            raw = ",".join(text(item) for item in raw)
        parse = units.boolean if self.flag else _BUILTIN_TYPES.get(self.type, self.type)
        value = parse(raw)
        if self.choices:
            chosen = {c.lower(): c for c in self.choices}.get(str(value).lower())
            if chosen is None:
                raise ValueError(f"must be one of {', '.join(self.choices)}, not {raw!r}")
            return chosen
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be at least {_n(self.minimum)}, not {_n(value)}")
        ceiling = self.maximum
        if ceiling is None and isinstance(value, int):
            ceiling = INT32_MAX if self.dest.endswith("_ms") else INT64_MAX
        if ceiling is not None and value > ceiling:
            raise ValueError(f"must be at most {_n(ceiling)}, not {_n(value)}")
        return value


def as_toml(value: Any) -> str:
    """A value as TOML writes it: true, "text", [1, 2]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(as_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _n(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
