"""Topic and group names: the pattern, and names derived from others that always fit it.

A name the broker derives (a dead-letter topic ``<topic>.dlq``) or a client
derives (``@consumer``'s default group, ``module.qualname``) must still be a
valid name, or the write it is for can never succeed: a 197-character topic
gave a 201-character dead-letter topic, refused for ever. ``fit_name`` keeps
a name that fits as it is (so existing topics and groups keep theirs), and
otherwise replaces what the pattern does not allow and shortens it, with a
SHA-256 suffix of the full name so that different names stay different.
"""

from __future__ import annotations

import hashlib
import re

from conveyor.errors import ConfigError, InvalidName

MAX_NAME = 200
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._-]")
DIGEST_CHARS = 16  # 64 bits of SHA-256, hex


def check_name(name: str, what: str = "topic") -> str:
    """``name`` if it is a valid topic (or group) name, else ``InvalidName`` (206).

    Clients check a topic's name before they route it: a partition's log is named
    ``T#k`` inside the broker, so a name with ``#`` must never reach an encoder
    that would read it as partition k of ``T``.
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidName(f"{what} name must match [A-Za-z0-9._-]{{1,200}}, got {name!r}", name=name)
    return name


def fit_name(base: str, suffix: str = "") -> str:
    """``base + suffix`` if it is a valid name, else a valid name made from it (same input, same name)."""
    name = base + suffix
    if NAME_RE.fullmatch(name) and name not in (".", ".."):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]
    keep = MAX_NAME - len(suffix) - 1 - DIGEST_CHARS
    return f"{_NOT_ALLOWED.sub('_', base)[:keep]}.{digest}{suffix}"


def dead_letter_topic(topic: str, configured: str = "") -> str:
    """The group's dead-letter topic: ``configured``, else ``<topic>.dlq``, shortened if that is too long."""
    return configured or fit_name(topic, ".dlq")


# --- partitions -----------------------------------------------------------------------------
#
# Partition 0 of topic ``T`` is the log ``T`` (so every single-partition topic and data
# directory stays as it was); partition k > 0 is the log ``T#k``. ``#`` is not allowed in a
# topic name, so a partition's log never clashes with a topic (docs/partitions.md).

PARTITION_MARK = "#"
MAX_PARTITIONS = 1024
LOG_RE = re.compile(r"[A-Za-z0-9._-]{1,200}(#[1-9][0-9]{0,3})?")


def partition_log(topic: str, partition: int) -> str:
    """The name of the log that holds ``partition`` of ``topic``: ``topic`` itself for partition 0."""
    return topic if partition == 0 else f"{topic}{PARTITION_MARK}{partition}"


def check_partition(partition: object, what: str = "partition") -> int:
    """``partition`` if it is a partition number (an int of 0 or more, not a bool), else ``ConfigError`` (500).

    Clients check it before routing: a string failed deep inside with a ``TypeError``, and a
    negative number went to the broker.
    """
    if not isinstance(partition, int) or isinstance(partition, bool) or partition < 0:
        raise ConfigError(f"{what} must be an int of 0 or more, not {partition!r}", partition=repr(partition))
    return partition


def log_label(name: str) -> str:
    """How a message to a user names a log: ``"orders"``, or ``"orders partition 3"`` for ``orders#3``."""
    topic, partition = split_log(name)
    return f"{topic} partition {partition}" if partition else topic


def log_fields(name: str) -> dict[str, object]:
    """An error's fields for a log: ``topic`` (the topic's name), and ``partition`` when it is not 0."""
    topic, partition = split_log(name)
    return {"topic": topic, "partition": partition} if partition else {"topic": topic}


def split_log(name: str) -> tuple[str, int]:
    """``(topic, partition)`` of a log name (``"orders#3"`` -> ``("orders", 3)``; ``"orders"`` -> partition 0)."""
    topic, mark, number = name.rpartition(PARTITION_MARK)
    if mark and number.isdigit():
        return topic, int(number)
    return name, 0


def is_log_name(name: str) -> bool:
    """A topic name, or a partition log's (``topic#k``, 1 <= k < MAX_PARTITIONS)."""
    return bool(LOG_RE.fullmatch(name)) and split_log(name)[0] not in (".", "..")


def dead_letter_log(log: str, configured: str = "") -> str:
    """Where dead letters of the log ``log`` go: the same partition of the dead-letter topic."""
    topic, partition = split_log(log)
    return partition_log(dead_letter_topic(topic, configured), partition)
