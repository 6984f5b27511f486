"""The data directory: every topic's log, its config and its groups' offsets.

``DATA_DIR/topics/<topic>/`` holds the segments, ``topic.json`` (config) and
``groups.json`` (committed offsets and group settings). Both JSON files are
replaced atomically. ``sync()`` is the group commit: one fsync per dirty log,
then one atomic write per topic whose groups moved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from conveyor.broker.config.fsync import FsyncPolicy
from conveyor.broker.config.topic_settings import FIXED_AT_CREATION, STORAGES, TOPIC_SETTINGS
from conveyor.broker.log import syscalls
from conveyor.broker.log.data_dir_lock import DataDirLock
from conveyor.broker.log.durable import atomic_write, free_name, fsync_dir, make_dirs, remove_temp_files, storage_errors
from conveyor.broker.log.file_log import QUARANTINE_DIR, FileLog
from conveyor.broker.log.io_health import IoHealth
from conveyor.broker.log.memory_log import MemoryLog
from conveyor.broker.log.topic_creator import TopicCreator
from conveyor.broker.log.topic_log import StoredSettingError, TopicConfig, TopicLog

from conveyor.errors import (
    ConfigError,
    ConveyorError,
    InvalidName,
    MetadataCorrupt,
    StorageIOError,
    TopicExists,
    UnknownTopic,
)
from conveyor.names import NAME_RE, is_log_name, partition_log
from conveyor.names import check_name as check_name  # where the broker's modules import it from

TOPIC_FILE = "topic.json"
DELETED_MARK = "~deleted"  # a topic directory being deleted: '~' is not allowed in topic names
GROUPS_FILE = "groups.json"
CREATION_WAIT_S = 10.0  # how long an alter waits for a new topic's first topic.json write

LogFactory = Callable[[str, Path, TopicConfig, FsyncPolicy], TopicLog]
log = logging.getLogger("conveyor.store")


class OffsetWriter:
    """Writes ``groups.json`` files on a thread of their own.

    An atomic write is two fsyncs and a rename: milliseconds the event loop
    would otherwise stall, several times a second while consumers ack. Only
    the newest data per file is kept. A write that fails (EIO, ENOSPC) keeps
    its data pending, unless newer data came meanwhile, and is tried again
    after a backoff that doubles up to ``max_backoff``: logged once per
    failure streak, counted in ``on_error`` at every failure. ``flush()``
    tries every pending file once more, now, and raises if one still fails.
    """

    def __init__(
        self,
        *,
        on_error: Callable[[Path, ConveyorError], None] | None = None,
        on_written: Callable[[Path], None] | None = None,
        backoff: float = 0.25,
        max_backoff: float = 2.0,
    ) -> None:
        self._pending: dict[Path, bytes] = {}
        self._failing: dict[Path, _Streak] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._flush_asked = self._flush_done = 0  # flush generations: asked by flush(), done by the thread
        self._on_error = on_error
        self._on_written = on_written
        self._backoff, self._max_backoff = backoff, max_backoff
        self._thread = threading.Thread(target=self._run, name="conveyor-offsets", daemon=True)
        self._thread.start()

    def submit(self, path: Path, data: bytes) -> None:
        with self._cv:
            self._pending[path] = data
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                items, flushing = self._take()
                if items is None:
                    return
            failures = {path: error for path, data in items.items() if (error := self._write(path, data))}
            with self._cv:
                for path, data in items.items():
                    self._settle(path, data, failures.get(path))
                self._flush_done = max(self._flush_done, flushing)
                self._cv.notify_all()

    def _take(self) -> tuple[dict[Path, bytes] | None, int]:
        """Under the lock: wait for files due (all of them when a flush asks), or None once closed."""
        while True:
            flushing = self._flush_asked if self._flush_asked > self._flush_done else 0
            now = time.monotonic()
            due = [p for p in self._pending if flushing or p not in self._failing or self._failing[p].retry_at <= now]
            if due or flushing:
                return {path: self._pending.pop(path) for path in due}, flushing
            if self._closed:
                return None, 0
            retries = [self._failing[p].retry_at for p in self._pending]
            self._cv.wait(max(0.0, min(retries) - now) if retries else None)

    @staticmethod
    def _write(path: Path, data: bytes) -> ConveyorError | None:
        try:
            atomic_write(path, data)
        except ConveyorError as exc:
            return exc
        except FileNotFoundError:
            if path.parent.is_dir():
                return StorageIOError(f"{path.parent} lost the temp file writing {path}", path=str(path))
            log.info("offsets file %s not written: its topic was deleted", path)
        except Exception as exc:  # a bug must not end the thread: flush() would wait for it forever
            log.exception("writing offsets file %s failed", path)
            return StorageIOError(f"{type(exc).__name__}: {exc} writing {path}", path=str(path))
        return None

    def _settle(self, path: Path, data: bytes, error: ConveyorError | None) -> None:
        """Under the lock: after one write of ``path``, end its failure streak or extend it."""
        streak = self._failing.get(path)
        if error is None:
            if self._on_written is not None:
                self._on_written(path)
            if streak is not None:
                del self._failing[path]
                log.warning("offsets file %s written again after %d failed attempt(s)", path, streak.failures)
            return
        self._pending.setdefault(path, data)  # newer data submitted meanwhile wins
        if streak is None:
            streak = self._failing[path] = _Streak(error)
            log.error("cannot write offsets file %s: %s; retrying with backoff until it works", path, error)
        streak.failures += 1
        streak.error = error
        delay = min(self._max_backoff, self._backoff * 2 ** (streak.failures - 1))
        streak.retry_at = time.monotonic() + delay
        if self._on_error is not None:
            self._on_error(path, error)

    def discard(self, path: Path) -> None:
        """Forget what is pending for ``path`` (its topic is being deleted)."""
        with self._cv:
            self._pending.pop(path, None)
            self._failing.pop(path, None)

    def flush(self) -> None:
        """Write every pending file now and wait; raise if one of them still fails (it stays pending)."""
        with self._cv:
            self._flush_asked += 1
            asked = self._flush_asked
            self._cv.notify_all()
            while self._flush_done < asked:
                self._cv.wait()
            failing = [streak.error for path, streak in self._failing.items() if path in self._pending]
        if failing:  # a new instance: the stored one is raised again at every flush of the streak
            raise type(failing[0])(failing[0].message, **failing[0].fields) from failing[0]

    def close(self) -> None:
        """Stop the thread; files still failing are given up (``flush()`` first to try them once more)."""
        with self._cv:
            self._closed = True
            self._pending.clear()
            self._cv.notify_all()
        self._thread.join()


@dataclass
class _Streak:
    """Consecutive failed writes of one file."""

    error: ConveyorError
    failures: int = 0
    retry_at: float = 0.0


def _file_backend(name: str, directory: Path, config: TopicConfig, fsync: FsyncPolicy) -> TopicLog:
    return FileLog(name, directory, config, fsync=fsync)


def _memory_backend(name: str, directory: Path, config: TopicConfig, fsync: FsyncPolicy) -> TopicLog:
    return MemoryLog(name, config, fsync=fsync)


BACKENDS: dict[str, LogFactory] = {"file": _file_backend, "memory": _memory_backend}


def register_backend(name: str, factory: LogFactory) -> None:
    """Add a storage backend, selected per topic with ``storage=<name>``."""
    BACKENDS[name] = factory
    STORAGES.add(name)


def altered(
    name: str, config: TopicConfig, changes: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None
) -> TopicConfig:
    """``config`` with ``changes`` (each checked by the settings table); a setting fixed at creation may not move.

    ``Store.alter_topic`` and a cluster's alter (checked on the node asked, before etcd) share it.
    """
    new = config.with_settings(changes, extra=extra)
    for fixed in FIXED_AT_CREATION:
        if getattr(new, fixed) != getattr(config, fixed):
            raise ConfigError(
                f"topic setting {fixed} cannot be changed after creation ({name} is {getattr(config, fixed)!r})",
                setting=fixed,
                topic=name,
            )
    return new


def check_log_name(name: str) -> str:
    """A topic name or a partition log's (``topic#k``): the names the broker itself gives logs."""
    if not isinstance(name, str) or not is_log_name(name):
        raise InvalidName(f"topic name must match [A-Za-z0-9._-]{{1,200}}, got {name!r}", name=name)
    return name


class Store:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy | str = "batch",
        defaults: TopicConfig | None = None,
        quarantine: bool = False,
        offsets_write_errors: Any = None,
        topic_config_errors: Any = None,
        create_in_background: bool = False,
    ) -> None:
        """``create_in_background``: the broker's loop creates topics without an fsync (see ``topic_creator``).

        ``offsets_write_errors``: a counter labelled by topic, incremented at each failed ``groups.json`` write.

        ``topic_config_errors``: a counter labelled by topic and setting, incremented for each stored
        setting ``topic.json`` holds that the table refuses (the topic uses the default instead).
        """
        self.data_dir = Path(data_dir)
        self.topics_dir = self.data_dir / "topics"
        self.fsync = FsyncPolicy.parse(fsync) if isinstance(fsync, str) else fsync
        self.defaults = defaults or TopicConfig()
        self.quarantine = quarantine
        self.create_in_background = create_in_background
        self.logs: dict[str, TopicLog] = {}
        self.groups: dict[str, dict[str, dict[str, Any]]] = {}
        self._dirty_groups: set[str] = set()
        # Per-pass work follows what changed: logs appended to and not yet synced, logs appended
        # to since the last retention pass, and logs that time-based retention may shorten.
        self._unsynced: dict[str, TopicLog] = {}
        self._touched: dict[str, TopicLog] = {}
        self._aging: dict[str, TopicLog] = {}
        # Topics whose groups.json was quarantined at this start: any group created there may be an old one.
        self.groups_quarantined: set[str] = set()
        self._offsets_write_errors = offsets_write_errors
        self.io_health = IoHealth()
        self._topic_config_errors = topic_config_errors
        # Stored settings refused at this start, per topic, until an alter rewrites its topic.json.
        self.config_errors: dict[str, list[StoredSettingError]] = {}
        # Before anything is read or recovered: a second process on this directory would cut our tail.
        self.lock = DataDirLock(self.data_dir)
        try:
            with storage_errors(str(self.topics_dir)):
                make_dirs(self.topics_dir)
            self._open_topics()
        except BaseException:
            for topic_log in self.logs.values():
                topic_log.close()
            self.lock.release()
            raise
        self._offsets = OffsetWriter(on_error=self._offsets_failed, on_written=self._offsets_written)
        self._creator = TopicCreator(self.topics_dir)

    def _open_topics(self) -> None:
        for directory in sorted(self.topics_dir.iterdir()):
            if not directory.is_dir():
                continue
            name = directory.name
            if DELETED_MARK in name:  # a deletion a crash cut short ('~' is not allowed in topic names)
                self._remove_deleted(directory)
                continue
            for leftover in remove_temp_files(directory):
                log.info("%s: removed a temp file an interrupted write left", leftover)
            config = self._stored_config(name, directory)
            if config is None:
                continue
            groups = self._read_groups(name, directory / GROUPS_FILE)
            self.logs[name] = self._make_log(name, config, committed=_committed_offsets(groups))
            self.groups[name] = groups

    def _stored_config(self, name: str, directory: Path) -> TopicConfig | None:
        """The settings of the topic in ``directory``, or None if it is no topic (yet).

        A topic whose ``topic.json`` is missing but whose segments hold data is
        adopted with the default settings, never skipped: a later create would
        take its directory. An unparsable ``topic.json`` stops the start, or with
        ``quarantine`` is moved aside and the topic adopted the same way. Only an
        unfinished creation (no ``topic.json``, no data) is left to be replaced.
        """
        path = directory / TOPIC_FILE
        if not is_log_name(name):
            log.warning("%s: not a topic name; the directory is left alone", directory)
            return None
        if path.exists():
            try:
                return self._read_config(name, path)
            except MetadataCorrupt as exc:
                if not self.quarantine:
                    raise MetadataCorrupt(
                        f"{exc.message}; start with --quarantine to move it aside "
                        "(the topic is then adopted with the default settings)",
                        **exc.fields,
                    ) from None
                moved = self._quarantine_file(path)
                return self._adopt(name, path, f"{TOPIC_FILE} was unreadable ({exc.message}), moved to {moved}")
        if _holds_data(directory):
            return self._adopt(name, path, f"{TOPIC_FILE} is missing but the segments hold data")
        return None

    def _adopt(self, name: str, path: Path, why: str) -> TopicConfig:
        """Keep a topic whose settings are lost: the defaults, reported, counted and written down."""
        config = replace(self.defaults, storage="file")
        log.error(
            "topic %s: %s; adopted with the default settings (check them: conveyor topics describe %s; "
            "change them: conveyor topics alter %s --set KEY=VALUE)",
            name,
            why,
            name,
            name,
        )
        if self._topic_config_errors is not None:
            self._topic_config_errors.labels(name, TOPIC_FILE).inc()
        self.config_errors.setdefault(name, []).append(StoredSettingError(TOPIC_FILE, None, "defaults", why))
        with storage_errors(str(path)):
            atomic_write(path, json.dumps(config.to_dict(), sort_keys=True).encode())
        return config

    def _quarantine_file(self, path: Path) -> Path:
        """Move a damaged file to its topic's ``quarantine/`` durably (never over an earlier one)."""
        folder = path.parent / QUARANTINE_DIR
        with storage_errors(str(folder)):
            make_dirs(folder)
            target = free_name(folder, path.name)
            syscalls.rename(path, target)
            fsync_dir(folder)
            fsync_dir(path.parent)
        return target

    def _remove_deleted(self, directory: Path) -> None:
        log.warning("%s: finishing a topic deletion that was cut short", directory)
        with storage_errors(str(directory)):
            shutil.rmtree(directory)
            fsync_dir(self.topics_dir)

    def _read_config(self, topic: str, path: Path) -> TopicConfig:
        """A topic's stored settings; each one the table refuses is reported, counted, and replaced by the default."""
        config, errors = TopicConfig.from_stored(_read_json(path), self.defaults)
        if config.storage == "memory":  # a memory topic has no directory: this one's segments must stay served
            errors.append(StoredSettingError("storage", "memory", "file", "a topic stored on disk is a file topic"))
            config = replace(config, storage="file")
        for error in errors:
            if error.used is None:  # not a setting this version knows: dropped at the next rewrite
                log.error("topic %s: stored setting %s in %s is ignored (%s)", topic, error.setting, path, error.error)
            else:
                self._log_refused(topic, path, error)
            if self._topic_config_errors is not None:
                self._topic_config_errors.labels(topic, error.setting).inc()
        if errors:
            self.config_errors[topic] = errors
        return config

    @staticmethod
    def _log_refused(topic: str, path: Path, error: StoredSettingError) -> None:
        log.error(
            "topic %s: stored setting %s = %s in %s is refused (%s); using %r instead (%s)",
            topic,
            error.setting,
            _short(error.stored),
            path,
            error.error,
            error.used,
            _fix_hint(topic, path, error.setting),
        )

    def _read_groups(self, topic: str, path: Path) -> dict[str, dict[str, Any]]:
        """A topic's groups; a corrupt file stops the start, or with ``quarantine`` is moved aside."""
        try:
            return _check_groups(path, _read_json(path))
        except MetadataCorrupt as exc:
            if not self.quarantine:
                raise MetadataCorrupt(
                    f"{exc.message}; start with --quarantine to move it aside "
                    "(the topic's groups then start again from the log start)",
                    **exc.fields,
                ) from None
            self._quarantine_groups(topic, path, exc)
            self.groups_quarantined.add(topic)
            return {}

    def _quarantine_groups(self, topic: str, path: Path, reason: MetadataCorrupt) -> None:
        """Move a corrupt ``groups.json`` to the topic's ``quarantine/``: its groups restart at the log start."""
        target = self._quarantine_file(path)
        log.warning(
            "%s: quarantined corrupt offsets file as %s (%s); its groups start again from the log start "
            "(their messages are delivered again)",
            topic,
            target,
            reason.message,
        )

    def _offsets_failed(self, path: Path, error: ConveyorError) -> None:
        if self._offsets_write_errors is not None:
            self._offsets_write_errors.labels(path.parent.name).inc()
        self.io_health.failed("offsets", path.parent.name, error)

    def _offsets_written(self, path: Path) -> None:
        self.io_health.worked("offsets", path.parent.name)

    def _make_log(
        self, name: str, config: TopicConfig, *, new: bool = False, committed: Mapping[str, int] | None = None
    ) -> TopicLog:
        factory = BACKENDS.get(config.storage)
        if factory is None:
            raise UnknownTopic(f"topic {name} uses unknown storage {config.storage!r}", topic=name)
        log: TopicLog
        if config.storage == "file":
            log = FileLog(
                name,
                self.topics_dir / name,
                config,
                fsync=self.fsync,
                quarantine=self.quarantine,
                sync_new_directory=not new,
                committed=committed,
            )
        else:
            log = factory(name, self.topics_dir / name, config, self.fsync)
        log.io_health = self.io_health
        log.on_write = self._written
        self._check_aging(log)
        return log

    def _written(self, log: TopicLog) -> None:
        """A log took an append: the next group commit syncs it, the next retention pass looks at it."""
        if log.dirty:
            self._unsynced[log.name] = log
        self._touched[log.name] = log

    def _check_aging(self, log: TopicLog) -> None:
        if log.config.retention_ms >= 0 and log.end_offset > log.start_offset:
            self._aging[log.name] = log
        else:
            self._aging.pop(log.name, None)

    def _forget(self, name: str) -> None:
        for tracked in (self._unsynced, self._touched, self._aging):
            tracked.pop(name, None)

    # --- topics ----------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        settings: Mapping[str, Any] | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        background: bool = False,
        **more: Any,
    ) -> TopicLog:
        """A new topic with the broker's defaults and ``settings``; every one is checked before anything is written."""
        check_log_name(name)
        if name in self.logs:
            raise TopicExists(f"topic {name} exists", topic=name)
        topic_config = self.defaults.with_settings({**(settings or {}), **more}, extra=extra)
        directory = self.topics_dir / name
        if topic_config.storage == "memory":  # memory topics are ephemeral: nothing on disk
            self.logs[name] = self._make_log(name, topic_config)
        elif not (background and self.create_in_background):  # the broker's own topics (dead letters, mirrors)
            try:
                with storage_errors(str(directory)):
                    make_dirs(directory)  # its entry in topics/ is synced: a power cut keeps the new topic
                    atomic_write(directory / TOPIC_FILE, json.dumps(topic_config.to_dict(), sort_keys=True).encode())
            except ConveyorError as exc:
                self.io_health.failed("create_topic", name, exc)
                raise
            self.io_health.worked("create_topic", name)
            self.logs[name] = self._make_log(name, topic_config)
        else:
            # No fsync here (the event loop): the creator thread writes topic.json and syncs the
            # directories; until it has, the log is held and nothing in it is confirmed or served.
            try:
                with storage_errors(str(directory)):
                    directory.mkdir(exist_ok=True)
                topic_log = self._make_log(name, topic_config, new=True)
            except ConveyorError as exc:
                self.io_health.failed("create_topic", name, exc)
                raise
            topic_log.held = True
            self.logs[name] = topic_log
            self._creator.submit(name, json.dumps(topic_config.to_dict(), sort_keys=True).encode())
        self.groups[name] = {}
        return self.logs[name]

    def finish_creations(self) -> list[str]:
        """Release the topics the creator made durable since the last call; return their names.

        Called by the broker's loop each pass: the released logs are synced by
        the next group commit, which then confirms and delivers what they hold.
        """
        released = []
        for name, error in self._creator.outcomes():
            if error is not None:
                self.io_health.failed("create_topic", name, error)
                continue
            self.io_health.worked("create_topic", name)
            topic_log = self.logs.get(name)
            if topic_log is not None and topic_log.held:
                topic_log.held = False
                if topic_log.dirty:
                    self._unsynced[name] = topic_log
                released.append(name)
        return released

    @property
    def creator(self) -> TopicCreator:
        return self._creator

    def get_or_create(self, name: str) -> TopicLog:
        log = self.logs.get(name)
        return log if log is not None else self.create_topic(name)

    def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has (``partitions`` in its topic.json's extra; 1 when absent)."""
        log_ = self.logs.get(topic)
        count = log_.config.extra.get("partitions", 1) if log_ is not None else 1
        return count if isinstance(count, int) and count >= 1 else 1

    def partition_logs(self, topic: str) -> list[TopicLog]:
        """The logs of ``topic``'s partitions that exist, in partition order (partition 0 first)."""
        found = (self.logs.get(partition_log(topic, p)) for p in range(self.partition_count(topic)))
        return [log_ for log_ in found if log_ is not None]

    def topic(self, name: str) -> TopicLog:
        try:
            return self.logs[name]
        except KeyError:
            raise UnknownTopic(f"no topic {name}", topic=name) from None

    def delete_topic(self, name: str) -> None:
        """Delete a topic: renamed out of the way durably first, so a crash never brings back part of it."""
        log_ = self.topic(name)
        self._creator.forget(name)  # a creation still being written must not bring the directory back
        directory = self.topics_dir / name
        doomed = free_name(self.topics_dir, f"{name}{DELETED_MARK}")
        log_.close()  # flushes what it buffers into files named by path
        if directory.is_dir():  # a memory topic has none
            try:
                with storage_errors(str(directory)):
                    syscalls.rename(directory, doomed)
                    fsync_dir(self.topics_dir)
            except ConveyorError:
                if not doomed.exists():  # not renamed: the topic stays, open again
                    self.logs[name] = self._make_log(name, log_.config)
                    raise
        del self.logs[name]
        self._forget(name)
        self.groups.pop(name, None)
        self._dirty_groups.discard(name)
        self._offsets.discard(directory / GROUPS_FILE)
        self.io_health.forget(name)
        self._forget_config_errors(name)
        with storage_errors(name):
            shutil.rmtree(doomed, ignore_errors=True)
            fsync_dir(self.topics_dir)

    def alter_topic(
        self,
        name: str,
        settings: Mapping[str, Any] | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        **more: Any,
    ) -> TopicConfig:
        """Change a topic's settings live; ``topic.json`` is replaced atomically before they apply.

        Every setting is checked first; nothing changes if one is refused. The
        rewritten file holds the values in use, so settings refused at the last
        start are gone from it (and from ``config_errors``).
        """
        topic_log = self.topic(name)
        config = altered(name, topic_log.config, {**(settings or {}), **more}, extra=extra)
        if config.storage == "file":
            self._wait_for_creation(name)
            with storage_errors(str(self.topics_dir / name)):
                atomic_write(self.topics_dir / name / TOPIC_FILE, json.dumps(config.to_dict(), sort_keys=True).encode())
        topic_log.reconfigure(config)
        self._touched[name] = topic_log  # new retention settings apply at the next retention pass
        if self._forget_config_errors(name):
            log.warning(
                "topic %s: topic.json rewritten; the settings refused at start are replaced by those in use", name
            )
        return config

    def _wait_for_creation(self, name: str) -> None:
        """Order a rewrite of ``topic.json`` after the creator's first write of it.

        Until the creator thread has written a new topic's ``topic.json`` it is
        that file's only writer; a rewrite racing it could be overwritten by
        the older settings (lost at the next start) or tear the file.
        """
        if not self._creator.owns(name):
            return
        self._creator.settle(name, timeout=CREATION_WAIT_S)
        if self._creator.owns(name):
            raise StorageIOError(
                f"topic {name} is still being created (its {TOPIC_FILE} cannot be written yet); retry",
                path=str(self.topics_dir / name),
            )

    def _forget_config_errors(self, topic: str) -> bool:
        errors = self.config_errors.pop(topic, [])
        if self._topic_config_errors is not None:
            for error in errors:
                with contextlib.suppress(KeyError):  # the series goes with the error it counted
                    self._topic_config_errors.remove(topic, error.setting)
        return bool(errors)

    def __iter__(self) -> Iterator[TopicLog]:
        return iter(list(self.logs.values()))

    # --- groups ------------------------------------------------------------

    def group(self, topic: str, group: str) -> dict[str, Any] | None:
        return self.groups.get(topic, {}).get(group)

    def save_group(self, topic: str, group: str, state: dict[str, Any]) -> None:
        """Stage a group's state (committed offset, settings) for the next sync."""
        self.topic(topic)
        self.groups.setdefault(topic, {})[group] = state
        self._dirty_groups.add(topic)

    def commit_offsets(self, offsets: dict[tuple[str, str], int]) -> None:
        """Stage many groups' committed offsets; ``sync()`` writes them."""
        for (topic, group), offset in offsets.items():
            state = self.groups.setdefault(topic, {}).setdefault(group, {})
            if state.get("committed_offset") != offset:
                state["committed_offset"] = offset
                self._dirty_groups.add(topic)

    def commit_groups(self, states: dict[tuple[str, str], dict[str, Any]]) -> None:
        """Stage groups' positions (committed offset, unsettled ranges with their counts); ``sync()`` writes them."""
        for (topic, group), saved in states.items():
            state = self.groups.setdefault(topic, {}).setdefault(group, {})
            if any(state.get(key) != value for key, value in saved.items()):
                state.update(saved)
                self._dirty_groups.add(topic)

    def delete_group(self, topic: str, group: str) -> None:
        if self.groups.get(topic, {}).pop(group, None) is not None:
            self._dirty_groups.add(topic)

    # --- durability ------------------------------------------------------------

    def sync(self, *, force: bool = False, wait: bool = True) -> None:
        """The group commit: every dirty log, then the groups that moved.

        ``wait=False`` (the broker's loop) leaves the groups' files to the writer thread.
        Only logs appended to since their last sync are looked at, unless ``force``,
        which first waits for the topics still being created.
        """
        if force:
            self._creator.settle()
            self.finish_creations()
        for log in list(self.logs.values() if force else self._unsynced.values()):
            if log.dirty or force:
                log.sync(force=force)
            self._unsynced.pop(log.name, None)
        self.write_groups(wait=wait or force)

    def write_groups(self, *, wait: bool = True) -> None:
        """Hand the groups that moved to the writer thread; ``wait`` until they are on disk."""
        for topic in sorted(self._dirty_groups):
            if topic in self.logs and self.logs[topic].config.storage == "file":
                data = json.dumps(self.groups.get(topic, {}), sort_keys=True).encode()
                self._offsets.submit(self.topics_dir / topic / GROUPS_FILE, data)
        self._dirty_groups.clear()
        if wait:
            self._offsets.flush()

    def next_sync_due(self) -> float | None:
        dues = [d for d in (log.next_sync_due() for log in self._unsynced.values()) if d is not None]
        return min(dues) if dues else None

    def maybe_sync(self) -> list[TopicLog]:
        """Interval policy: sync the logs whose interval elapsed."""
        synced = [log for log in list(self._unsynced.values()) if log.maybe_sync()]
        for log in list(self._unsynced.values()):
            if not log.dirty:
                del self._unsynced[log.name]
        return synced

    def apply_retention(self) -> list[TopicLog]:
        """Retention for the logs appended to since the last call, and those that age with time.

        Returns the logs whose start moved: their groups may have to skip what was deleted.
        """
        candidates = list({**self._aging, **self._touched}.values())
        self._touched = {}
        moved: list[TopicLog] = []
        for i, log in enumerate(candidates):
            try:
                if log.apply_retention():
                    moved.append(log)
            except BaseException:
                self._touched.update((later.name, later) for later in candidates[i:])  # looked at again next time
                raise
            self._check_aging(log)
        return moved

    def close(self) -> None:
        try:
            self.sync(force=True)
        finally:
            try:
                self._offsets.close()
                self._creator.close()
                for topic_log in self.logs.values():
                    topic_log.close()
            finally:
                self.lock.release()


GROUP_FIELDS: dict[str, type] = {
    "committed_offset": int,
    "next_offset": int,
    "skipped_by_retention": int,
    "unsettled": list,
    "max_deliveries": int,
    "ack_timeout_ms": int,
    "dead_letter_topic": str,
    "key_affinity": bool,
}


def _committed_offsets(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Each group's highest offset it was given: all below were confirmed (recovery must not lose or reuse them)."""
    found = {}
    for group, state in groups.items():
        offsets = [state.get(key) for key in ("committed_offset", "next_offset")]
        known = [int(o) for o in offsets if isinstance(o, int) and not isinstance(o, bool)]
        if known:
            found[group] = max(known)
    return found


def _holds_data(directory: Path) -> bool:
    """Whether any segment in ``directory`` holds bytes (an unfinished creation holds none)."""
    return any(p.stat().st_size > 0 for p in directory.glob("*.log"))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` ({} when there is no file); anything else is ``MetadataCorrupt``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise StorageIOError(f"{exc.strerror} reading {path}", path=str(path), errno=exc.errno) from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise MetadataCorrupt(f"{path}: not valid JSON ({_one_line(exc)})", path=str(path)) from None
    if not isinstance(data, dict):
        raise MetadataCorrupt(f"{path}: expected a JSON object, found {_json_kind(data)}", path=str(path))
    return data


def _check_groups(path: Path, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``data`` if it is what ``groups.json`` holds: valid group names, each an object with well-typed fields."""

    def corrupt(what: str) -> MetadataCorrupt:
        return MetadataCorrupt(f"{path}: {what}", path=str(path))

    for group, state in data.items():
        if not NAME_RE.fullmatch(group) or group in (".", ".."):
            raise corrupt(f"{_short(group)} is not a valid group name")
        if not isinstance(state, dict):
            raise corrupt(f"group {group!r} is {_json_kind(state)}, not an object")
        for key, kind in GROUP_FIELDS.items():
            value = state.get(key, kind())
            if type(value) is not kind:
                raise corrupt(f"group {group!r}: {key} must be {_json_kind(kind())}, found {_short(value)}")
        for key in ("committed_offset", "next_offset", "skipped_by_retention"):
            if state.get(key, 0) < 0:
                raise corrupt(f"group {group!r}: {key} {state[key]} is negative")
        problem = _unsettled_problem(state.get("unsettled", []))
        if problem:
            raise corrupt(f"group {group!r}: unsettled {problem}")
    return data


def _unsettled_problem(rows: list[Any]) -> str:
    """What is wrong with saved unsettled ranges ([start, end, deliveries, first_ms, due_ms, dead], sorted, apart)."""
    previous_end = 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 6 and all(type(v) is int and v >= 0 for v in row)):
            return f"row {_short(row)} is not six non-negative integers"
        start, end, _deliveries, _first_ms, _due_ms, dead = row
        if not previous_end <= start < end or dead not in (0, 1, 2):
            return f"row {_short(row)} is out of order, empty or of an unknown kind"
        previous_end = end
    return ""


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer"}
    return kinds.get(type(value), "a number" if isinstance(value, float) else "null")


def _fix_hint(topic: str, path: Path, setting: str) -> str:
    """How to fix a refused stored setting, naming only a command that accepts it."""
    if setting in TOPIC_SETTINGS and setting not in FIXED_AT_CREATION:
        return f"fix it with: conveyor topics alter {topic} --set {setting}=VALUE"
    if setting in TOPIC_SETTINGS:
        return f"{setting} is fixed at creation: correct it in {path} while the broker is stopped"
    return f"{setting} is not a setting `topics alter` changes: remove it from {path} while the broker is stopped"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
