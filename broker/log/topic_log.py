"""The storage interface the broker talks to, and what every backend shares.

A backend implements a handful of primitives (``_write``, ``_read_stored``,
``_sync``, ``_truncate``, ``_drop_segments_before``); this base class adds
idempotent producers, the durable watermark, the tail cache and the fsync
policy, so a new backend gets them for free and the broker never changes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.config.topic_settings import TOPIC_SETTINGS, check_topic_setting, check_topic_settings
from conveyor.broker.log.epochs import LeaderEpochCache
from conveyor.broker.log.idempotence import ProducerState
from conveyor.broker.log.tail_cache import TailCache
from conveyor.broker.wire.record import NO_PRODUCER, Batch, encode_header

from conveyor.errors import ConfigError, ConveyorError, OffsetOutOfRange, StorageIOError
from conveyor.names import log_label, split_log

if TYPE_CHECKING:
    from conveyor.broker.log.io_health import IoHealth

MiB = 1 << 20


@dataclass(slots=True)
class TopicConfig:
    """Per-topic settings, stored beside the topic's segments (``topic.json``).

    Each field is checked and normalised by the table in
    ``conveyor.broker.config.topic_settings`` when the config is made, so ``retention_ms`` is
    an int here even when it was given as ``"7d"``. ``extra`` holds what the
    broker itself records (a mirrored topic's upstream), not user settings.
    """

    storage: str = "file"
    segment_bytes: int = 128 * MiB
    index_interval_bytes: int = 4096
    retention_bytes: int = -1
    retention_ms: int = -1
    cache_bytes: int = 16 * MiB
    read_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in TOPIC_SETTINGS:
            setattr(self, name, check_topic_setting(name, getattr(self, name)))
        if not isinstance(self.extra, dict):
            raise ConfigError(f"topic extra must be a map, not {type(self.extra).__name__}")

    def with_settings(self, settings: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None) -> TopicConfig:
        """This config with ``settings`` applied, all checked first (one ``ConfigError`` naming every bad one)."""
        checked = check_topic_settings(settings)
        return replace(self, **checked, extra={**self.extra, **(extra or {})})

    @classmethod
    def from_stored(
        cls, data: Mapping[str, Any], defaults: TopicConfig
    ) -> tuple[TopicConfig, list[StoredSettingError]]:
        """The config in ``topic.json``; a bad setting falls back to ``defaults`` and is returned as an error.

        A broker never stops because of a stored setting: it reports it
        (the caller logs and counts each) and serves the topic with the default.
        """
        values: dict[str, Any] = {}
        errors: list[StoredSettingError] = []
        for name, value in data.items():
            if name == "extra":
                if isinstance(value, dict):
                    values["extra"] = dict(value)
                else:
                    errors.append(StoredSettingError(name, value, {}, "must be a map"))
                continue
            try:
                values[name] = check_topic_setting(name, value)
            except ConfigError as exc:
                used = getattr(defaults, name, None) if name in TOPIC_SETTINGS else None
                reason = exc.message.removeprefix(f"topic setting {name}: ")
                errors.append(StoredSettingError(name, value, used, reason))
        values.setdefault("extra", {})
        return replace(defaults, **values), errors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def settings(self) -> dict[str, Any]:
        """The user-visible settings (no ``extra``)."""
        return {name: getattr(self, name) for name in TOPIC_SETTINGS}


@dataclass(frozen=True, slots=True)
class StoredSettingError:
    """A setting in ``topic.json`` the table refused; the topic uses ``used`` instead."""

    setting: str
    stored: Any
    used: Any
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "stored": self.stored, "used": self.used, "error": self.error}


@dataclass(frozen=True, slots=True)
class AppendResult:
    base_offset: int
    count: int
    duplicate: bool = False


class TopicLog(ABC):
    """One topic's append-only log. Subclass to add a storage backend."""

    def __init__(
        self,
        name: str,
        config: TopicConfig,
        *,
        fsync: FsyncPolicy,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: wall time, for batch timestamps and age retention; ``monotonic``: for the fsync interval,
        which a step of the wall clock (NTP, an operator) must neither stall nor hurry."""
        self.name = name
        self.config = config
        self.fsync = fsync
        self.clock = clock
        self.monotonic = monotonic
        self.start_offset = 0
        self.end_offset = 0
        self.durable_offset = 0
        self.high_watermark: int | None = None  # set by a replication leader (see ``visible_offset``)
        self.truncated_bytes = 0  # torn tails cut when the log opened
        self.quarantined_segments = 0  # corrupt segments moved aside when it opened (--quarantine)
        # Offsets that existed (a group committed past them, an index named them) but were not found when it
        # opened: confirmed data lost; never given again. One entry per range: start, end and the evidence.
        self.lost_ranges: list[dict[str, Any]] = []
        self.producers = ProducerState()
        self.epochs = LeaderEpochCache()  # where each leader epoch began (a FileLog saves it beside its segments)
        self.cache = TailCache(config.cache_bytes)
        self._last_sync = monotonic()
        self.io_health: IoHealth | None = None  # the store's: writes and syncs report their outcome there
        # Called after each append: the store keeps the logs a pass touched, so that the group
        # commit and retention look at those and not at every topic the broker holds.
        self.on_write: Callable[[TopicLog], None] | None = None
        # A new topic whose creation is not durable yet: its durable offset stays put, so nothing
        # in it is confirmed, delivered or served until the store's creation thread has synced it.
        self.held = False

    # --- the primitives a backend provides ------------------------------------

    @abstractmethod
    def _write(self, header: bytes, body: bytes, base_offset: int, count: int, timestamp_ms: int) -> None: ...

    @abstractmethod
    def _read_stored(self, offset: int, max_bytes: int, until: int | None = None) -> list[Batch]:
        """Batches from the one holding ``offset`` (which is in range), none past the one holding ``until - 1``."""

    @abstractmethod
    def _sync(self) -> None: ...

    @abstractmethod
    def _truncate(self, offset: int) -> int:
        """Drop every batch holding ``offset`` or later; return the new end."""

    @abstractmethod
    def _drop_segments_before(self, now_ms: int) -> int:
        """Apply retention; return the new start offset."""

    @abstractmethod
    def size_bytes(self) -> int: ...

    @abstractmethod
    def segment_count(self) -> int: ...

    @abstractmethod
    def offset_for_timestamp(self, timestamp_ms: int) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook: a memory backend holds no files
        """Release files; called after a final ``sync``."""

    # --- the interface the broker uses -----------------------------------------

    def append(
        self,
        body: bytes,
        count: int,
        *,
        producer_id: int = NO_PRODUCER,
        sequence: int = -1,
        timestamp_ms: int | None = None,
        base_offset: int | None = None,
        leader_epoch: int | None = None,
    ) -> AppendResult:
        """Append one batch: one header, one CRC, one write.

        A batch resent by an idempotent producer is recognised by its sequence
        and answered with the offsets it was first stored at. A mirror or a
        follower passes ``base_offset`` (and the leader's timestamp, producer
        id, sequence and epoch): the batch keeps the offsets it has upstream,
        the leader already deduplicated it, and its producer id and sequence
        are remembered as for a local append, so that a resend after a
        failover is still recognised here. ``leader_epoch`` None (or 0) writes
        a magic 1 header, as outside a cluster; an epoch >= 1 writes magic 2.
        """
        if base_offset is not None:
            if base_offset != self.end_offset:
                raise OffsetOutOfRange(
                    f"{self.name}: a replicated batch at {base_offset} does not follow the end {self.end_offset}",
                    topic=self.name,
                    offset=base_offset,
                )
        elif producer_id != NO_PRODUCER:
            seen = self.producers.check(producer_id, sequence, count)
            if seen is not None:
                return AppendResult(seen, count, duplicate=True)
        base = self.end_offset
        ts = int(self.clock() * 1000) if timestamp_ms is None else timestamp_ms
        header = encode_header(
            base, count, ts, body, producer_id=producer_id, sequence=sequence, leader_epoch=leader_epoch
        )
        try:
            self._write(header, body, base, count, ts)
        except ConveyorError as exc:
            self._io_outcome("append", exc)
            raise
        self._io_outcome("append")
        self.end_offset = base + count
        self.cache.add(Batch(base, count, ts, body, producer_id, sequence, leader_epoch or 0))
        if producer_id != NO_PRODUCER:
            self.producers.record(producer_id, sequence, base, count)
        if leader_epoch and leader_epoch != self.epochs.latest_epoch:
            self.epochs.assign(leader_epoch, base)  # once per leader change, not per batch
        if self.fsync.mode == "none" and not self.held:
            self.durable_offset = self.end_offset
        elif self.fsync.mode == "interval":
            self.maybe_sync()
        if self.on_write is not None:
            self.on_write(self)
        return AppendResult(base, count)

    def read(self, offset: int, *, max_bytes: int = 1 * MiB, max_messages: int | None = None) -> list[Batch]:
        """Batches covering ``offset`` onwards; the first may start before it.

        Recent batches come from memory; a read below the log start raises
        ``OffsetOutOfRange``; a read at the end returns nothing.
        """
        if offset < self.start_offset or offset > self.end_offset:
            topic, partition = split_log(self.name)  # a user's names: "orders partition 3", never the log orders#3
            raise OffsetOutOfRange(
                f"offset {offset} is outside [{self.start_offset}, {self.end_offset}] of {log_label(self.name)}",
                topic=topic,
                **({"partition": partition} if partition else {}),
                offset=offset,
                start_offset=self.start_offset,
                end_offset=self.end_offset,
            )
        if offset == self.end_offset:
            return []
        batches = self.cache.read(offset, max_bytes, max_messages)
        if batches is None:
            until = None if max_messages is None else offset + max(1, max_messages)
            batches = self._read_from_storage(offset, max_bytes, until)
        if max_messages is not None:
            batches = _limit_messages(batches, offset, max_messages)
        return batches

    def _read_from_storage(self, offset: int, max_bytes: int, until: int | None = None) -> list[Batch]:
        """``_read_stored``, its errors naming the topic and offset (an OSError is a ``StorageIOError``)."""
        try:
            return self._read_stored(offset, max_bytes, until)
        except ConveyorError as exc:
            exc.fields.setdefault("topic", self.name)
            exc.fields.setdefault("offset", offset)
            raise
        except OSError as exc:
            raise StorageIOError(
                f"{exc.strerror or exc} reading {self.name} at offset {offset}",
                topic=self.name,
                offset=offset,
                errno=exc.errno,
            ) from exc

    @property
    def visible_offset(self) -> int:
        """The offset below which readers see data: confirms, deliveries, consumer FETCH, dead-letter settlement.

        Outside a cluster it is ``durable_offset``. A partition leader caps it at its high
        watermark (what every in-sync replica holds durably), so nothing is confirmed or
        delivered that a failover could lose. Replica fetches are the one reader past it.
        """
        hw = self.high_watermark
        return self.durable_offset if hw is None else min(self.durable_offset, hw)

    def set_high_watermark(self, offset: int | None) -> None:
        """Cap ``visible_offset`` at ``offset`` (a replication leader's HW); None lifts the cap (single node)."""
        self.high_watermark = offset

    @property
    def dirty(self) -> bool:
        return self.durable_offset < self.end_offset

    def sync(self, *, force: bool = False) -> None:
        """Group commit: make everything appended so far durable, in one fsync.

        Under ``none`` this only flushes in-memory indexes, unless forced
        (shutdown, roll). Under ``interval`` the broker calls ``maybe_sync``.
        A held log (its creation not durable yet) is left as it is.
        """
        if self.held:
            return
        if (self.fsync.mode != "none" and self.dirty) or force:
            try:
                self._sync()
            except ConveyorError as exc:
                self._io_outcome("fsync", exc)
                raise
            self._io_outcome("fsync")
        self.durable_offset = self.end_offset
        self._last_sync = self.monotonic()

    def _io_outcome(self, op: str, error: ConveyorError | None = None) -> None:
        """Tell the store's ``IoHealth`` how a real write or sync went."""
        if self.io_health is not None:
            if error is None:
                self.io_health.worked(op, self.name)
            else:
                self.io_health.failed(op, self.name, error)

    def maybe_sync(self) -> bool:
        """Sync if the interval policy says it is due; return whether it did."""
        if not self.dirty or self.held:
            return False
        if self.fsync.mode == "interval" and (self.monotonic() - self._last_sync) * 1000 < self.fsync.interval_ms:
            return False
        self.sync()
        return True

    def next_sync_due(self) -> float | None:
        """When the interval policy wants the next sync (``monotonic`` seconds)."""
        if self.fsync.mode != "interval" or not self.dirty or self.held:
            return None
        return self._last_sync + self.fsync.interval_ms / 1000

    def truncate_to(self, offset: int) -> None:
        """Drop every batch at or after ``offset``, e.g. to resync a mirror."""
        offset = max(offset, self.start_offset)
        if offset >= self.end_offset:
            # No batch to cut, but epochs a leader assigned here without writing go (a follower told to
            # truncate at its end would otherwise name that epoch again in every replica FETCH).
            self.epochs.truncate_from_end(offset)
            return
        offset = self._truncate(offset)
        self.end_offset = offset
        self.durable_offset = min(self.durable_offset, offset)
        self.cache.truncate(offset)
        self.producers.truncate(offset)
        self.epochs.truncate_from_end(offset)

    # --- leader epochs ---------------------------------------------------------------------------

    @property
    def last_epoch(self) -> int:
        """The epoch of the newest leader this log knows of (0: it never held a replicated batch)."""
        return self.epochs.latest_epoch

    def assign_epoch(self, epoch: int) -> None:
        """A new leader's epoch starts at the log end, before its first publish is accepted."""
        self.epochs.assign(epoch, self.end_offset)

    def epoch_end_offset(self, epoch: int) -> tuple[int, int]:
        """``LeaderEpochCache.end_offset_for`` with this log's end: where ``epoch`` ended here.

        ``(-1, -1)`` when this log knows no epoch as old as or older than the one asked.
        """
        return self.epochs.end_offset_for(epoch, self.end_offset)

    def reconfigure(self, config: TopicConfig) -> None:
        """Apply altered settings live: retention at its next pass, segment size at the next roll."""
        self.config = config
        self.cache.resize(config.cache_bytes)

    def reset_to(self, offset: int) -> None:
        """Drop everything and start empty at ``offset`` (a mirror resync or refresh)."""
        self._reset(offset)
        self.start_offset = self.end_offset = self.durable_offset = offset
        self.cache = TailCache(self.config.cache_bytes)
        self.producers = ProducerState()
        self.epochs.clear()

    def _reset(self, offset: int) -> None:
        """Backends with storage override this to delete their files."""
        self._truncate(self.start_offset)

    def apply_retention(self, now_ms: int | None = None) -> int:
        """Delete whole sealed segments past the size or age limits."""
        now_ms = int(self.clock() * 1000) if now_ms is None else now_ms
        new_start = self._drop_segments_before(now_ms)
        dropped = max(0, new_start - self.start_offset)
        self.start_offset = max(self.start_offset, new_start)
        self.cache.drop_before(self.start_offset)
        if dropped:
            self.epochs.truncate_from_start(self.start_offset)
        return dropped


def _limit_messages(batches: list[Batch], offset: int, max_messages: int) -> list[Batch]:
    """Keep just enough whole batches to cover ``max_messages`` from ``offset``."""
    kept: list[Batch] = []
    remaining = max_messages
    for batch in batches:
        if remaining <= 0:
            break
        kept.append(batch)
        remaining -= batch.next_offset - max(offset, batch.base_offset)
    return kept
