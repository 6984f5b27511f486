"""The one table of topic settings: the type, range and meaning of each.

Every way a topic setting arrives goes through it before anything is
written: ``conveyor topics create/alter --set``, ``Admin.create_topic`` /
``alter_topic``, the broker's own topic defaults (flags, variables, TOML) and
``topic.json`` when the broker starts. A value is stored in its checked form
(``7d`` as 604800000), so a stored setting is always the type the log
compares it as.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.broker.config.units import boolean, duration_ms, or_unlimited, size_bytes

from conveyor.errors import ConfigError

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1  # segment positions and index entries are 32-bit

# Storage backends a topic may name; ``conveyor.broker.log.data_dir.register_backend`` adds to it.
STORAGES: set[str] = {"file", "memory"}


def storage(value: Any) -> str:
    """A registered storage backend."""
    if not isinstance(value, str) or value not in STORAGES:
        shown = repr(value) if not isinstance(value, bool) else str(value).lower()
        raise ValueError(f"must be one of {', '.join(sorted(STORAGES))}, not {shown}")
    return value


@dataclass(frozen=True)
class TopicSetting:
    name: str
    parse: Callable[[Any], Any]
    help: str
    minimum: int | None = None
    maximum: int | None = None
    unlimited: bool = False  # -1 (``unlimited``) means no limit

    def check(self, value: Any) -> Any:
        """The stored form of ``value``, or ``ValueError`` saying which bound it broke."""
        parsed = self.parse(value)
        if self.unlimited and parsed == -1:
            return parsed
        if self.minimum is not None and parsed < self.minimum:
            no_limit = " (or unlimited, -1)" if self.unlimited else ""
            raise ValueError(f"must be at least {self.minimum}{no_limit}, not {parsed}")
        if self.maximum is not None and parsed > self.maximum:
            raise ValueError(f"must be at most {self.maximum}, not {parsed}")
        return parsed


TOPIC_SETTINGS: dict[str, TopicSetting] = {
    s.name: s
    for s in (
        TopicSetting("storage", storage, "file (segments on disk) or memory (ephemeral); fixed at creation"),
        TopicSetting("segment_bytes", size_bytes, "segment size before the log rolls to a new file", 1024, INT32_MAX),
        TopicSetting("index_interval_bytes", size_bytes, "bytes between two index entries", 1, INT32_MAX),
        TopicSetting(
            "retention_bytes",
            or_unlimited(size_bytes),
            "size limit: whole sealed segments are deleted past it (unlimited: -1)",
            0,
            INT64_MAX,
            unlimited=True,
        ),
        TopicSetting(
            "retention_ms",
            or_unlimited(duration_ms),
            "age limit: sealed segments older than this are deleted (unlimited: -1)",
            0,
            INT64_MAX,
            unlimited=True,
        ),
        TopicSetting("cache_bytes", size_bytes, "recent batches kept in memory", 0, INT64_MAX),
        TopicSetting("read_only", boolean, "refuse publishes (mirrored topics are read-only)"),
    )
}
FIXED_AT_CREATION = frozenset({"storage"})


def check_topic_setting(name: str, value: Any) -> Any:
    """The stored form of one setting; ``ConfigError`` naming it and what is wrong."""
    setting = TOPIC_SETTINGS.get(name) if isinstance(name, str) else None
    if setting is None:
        raise ConfigError(unknown_setting(name), setting=str(name))
    try:
        return setting.check(value)
    except ValueError as exc:
        raise ConfigError(f"topic setting {name}: {exc}", setting=name) from None


def check_topic_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting in ``values`` in its stored form; one ``ConfigError`` with a line per bad one."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"topic settings must be a map of name to value, not {type(values).__name__}")
    checked: dict[str, Any] = {}
    problems: list[str] = []
    for name, value in values.items():
        try:
            checked[name] = check_topic_setting(name, value)
        except ConfigError as exc:
            problems.append(exc.message)
    if problems:
        raise ConfigError("\n".join(problems), settings=sorted(map(str, values)))
    return checked


def unknown_setting(name: Any) -> str:
    close = difflib.get_close_matches(str(name), TOPIC_SETTINGS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown topic setting {name!r}{hint}; known: {', '.join(TOPIC_SETTINGS)}"
