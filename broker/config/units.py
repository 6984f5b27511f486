"""Human forms of sizes, durations and switches, turned into the numbers Conveyor stores.

Settings are typed by people (``7d``, ``500ms``, ``1GB``, ``64MiB``, ``yes``)
and stored as plain numbers, so a stored setting is never a string a later
comparison trips over. Every parser raises ``ValueError`` with a reason that
does not name the setting: the caller knows where the value came from
(a flag, a variable, a TOML key, ``--set``) and says so.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
DURATION_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
UNLIMITED = "unlimited"

_FORM = re.compile(r"\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def integer(value: Any) -> int:
    """An int, or the digits of one; never a bool or a float."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a boolean ({_show(value)})")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        return int(value)
    raise ValueError(f"must be an integer, not {_show(value)}")


def size_bytes(value: Any) -> int:
    """Bytes: an integer, or a number with a unit (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)."""
    return _with_unit(value, BYTE_UNITS, "a size", _size_hint)


def duration_ms(value: Any) -> int:
    """Milliseconds: an integer, or a number with ms, s, m, h, d or w."""
    return _with_unit(value, DURATION_UNITS, "a duration", lambda number, unit: None)


def boolean(value: Any) -> bool:
    """True or false, or one of the words people use for them (yes/no, on/off, 1/0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in TRUE_WORDS:
            return True
        if lowered in FALSE_WORDS:
            return False
    if isinstance(value, str):
        raise ValueError(f"must be true or false (or yes/no, on/off, 1/0), not {_show(value)}")
    # The words are for text (a flag, a variable, --set); a number in JSON or TOML is not a boolean.
    what = "the number " if isinstance(value, int | float) else ""
    raise ValueError(f"must be true or false (a boolean), not {what}{_show(value)}")


def or_unlimited(parse: Any) -> Any:
    """``parse``, with ``unlimited`` (and the bare -1) meaning no limit, stored as -1.

    Only those two forms: ``-1ms``, ``-1B`` or ``-0.001s`` would become -1 by
    arithmetic, and a typo must not turn retention off.
    """

    def parse_limit(value: Any) -> int:
        if isinstance(value, str) and value.strip().lower() == UNLIMITED:
            return -1
        if isinstance(value, str) and value.strip() not in ("-1", "") and value.strip().startswith("-"):
            parsed = int(parse(value))  # a unit, or a fraction: refused by ``parse`` with its reason
            if parsed == -1:  # "-1.0", "- 1": only the bare -1 means no limit
                raise ValueError(f"{value!r}: write the bare -1 or {UNLIMITED} for no limit")
            return parsed
        return int(parse(value))

    parse_limit.__doc__ = f"{parse.__doc__} Or ``unlimited`` (-1)."
    return parse_limit


def _with_unit(value: Any, units: dict[str, int], what: str, hint: Any) -> int:
    if not isinstance(value, str):
        try:
            return integer(value)
        except ValueError:
            raise ValueError(
                f"must be {what}: an integer or a string such as {_example(units)}, not {_show(value)}"
            ) from None
    match = _FORM.fullmatch(value)
    unit = match.group(2).lower() if match else ""
    if match and unit and match.group(1).startswith("-"):
        raise ValueError(
            f"{value!r} is negative: {what} with a unit cannot be below 0 "
            f"(where a setting allows no limit, write the bare -1 or {UNLIMITED})"
        )
    if match and (not unit or unit in units):
        number = Fraction(match.group(1)) * units.get(unit, 1)
        if number.denominator == 1:
            return int(number)
        raise ValueError(f"{value!r} is not a whole number of {'bytes' if units is BYTE_UNITS else 'milliseconds'}")
    if match and (special := hint(match.group(1), match.group(2))):
        raise ValueError(special)
    raise ValueError(f"{value!r} is not {what}: write an integer, or a number with {_unit_list(units)}")


def _size_hint(number: str, unit: str) -> str | None:
    if unit.lower() in ("k", "m", "g", "t"):
        letter = unit.upper()
        return f"{number}{unit} is ambiguous: write {number}{letter}B (powers of 1000) or {number}{letter}iB (of 1024)"
    return None


def _unit_list(units: dict[str, int]) -> str:
    if units is BYTE_UNITS:
        return "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
    return "ms, s, m, h, d or w"


def _example(units: dict[str, int]) -> str:
    return '"64MiB" or "1GB"' if units is BYTE_UNITS else '"500ms" or "7d"'


def _show(value: Any) -> str:
    """A value as the user wrote it, in JSON/TOML words: true, null, 'text', [1, 2]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
