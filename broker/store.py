"""The data directory: every topic's log, its config and its groups' offsets.

``DATA_DIR/topics/<topic>/`` holds the segments, ``topic.json`` (config) and
``groups.json`` (committed offsets and group settings). Both JSON files are
replaced atomically. ``sync()`` is the group commit: one fsync per dirty log,
then one atomic write per topic whose groups moved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from broker.errors import ConveyorError, InvalidName, TopicExists, UnknownTopic
from broker.filelog import FileLog
from broker.fsutil import atomic_write, fsync_dir, storage_errors
from broker.memlog import MemoryLog
from broker.storage import FsyncPolicy, TopicConfig, TopicLog

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
TOPIC_FILE = "topic.json"
GROUPS_FILE = "groups.json"

LogFactory = Callable[[str, Path, TopicConfig, FsyncPolicy], TopicLog]
log = logging.getLogger("conveyor.store")


class OffsetWriter:
    """Writes ``groups.json`` files on a thread of their own.

    An atomic write is two fsyncs and a rename: milliseconds the event loop
    would otherwise stall, several times a second while consumers ack. Only
    the newest data per file is kept; ``flush()`` waits for everything.
    """

    def __init__(self) -> None:
        self._pending: dict[Path, bytes] = {}
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: ConveyorError | None = None
        self._thread = threading.Thread(target=self._run, name="conveyor-offsets", daemon=True)
        self._thread.start()

    def submit(self, path: Path, data: bytes) -> None:
        with self._cv:
            self._pending[path] = data
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending:
                    return
                items, self._pending = self._pending, {}
                self._busy = True
            error = None
            for path, data in items.items():
                try:
                    atomic_write(path, data)
                except ConveyorError as exc:  # reported by the next flush() or check()
                    error = error or exc
            with self._cv:
                self._error = self._error or error
                self._busy = False
                self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every submitted file is written; raise the first failure since the last check."""
        with self._cv:
            while self._pending or self._busy:
                self._cv.wait()
        self.check()

    def check(self) -> None:
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()


def _file_backend(name: str, directory: Path, config: TopicConfig, fsync: FsyncPolicy) -> TopicLog:
    return FileLog(name, directory, config, fsync=fsync)


def _memory_backend(name: str, directory: Path, config: TopicConfig, fsync: FsyncPolicy) -> TopicLog:
    return MemoryLog(name, config, fsync=fsync)


BACKENDS: dict[str, LogFactory] = {"file": _file_backend, "memory": _memory_backend}


def register_backend(name: str, factory: LogFactory) -> None:
    """Add a storage backend, selected per topic with ``storage=<name>``."""
    BACKENDS[name] = factory


def check_name(name: str, what: str = "topic") -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidName(f"{what} name must match [A-Za-z0-9._-]{{1,200}}, got {name!r}", name=name)
    return name


class Store:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy | str = "batch",
        defaults: TopicConfig | None = None,
        quarantine: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.topics_dir = self.data_dir / "topics"
        self.fsync = FsyncPolicy.parse(fsync) if isinstance(fsync, str) else fsync
        self.defaults = defaults or TopicConfig()
        self.quarantine = quarantine
        self.logs: dict[str, TopicLog] = {}
        self.groups: dict[str, dict[str, dict[str, Any]]] = {}
        self._dirty_groups: set[str] = set()
        self._offsets = OffsetWriter()
        with storage_errors(str(self.topics_dir)):
            self.topics_dir.mkdir(parents=True, exist_ok=True)
        self._open_topics()

    def _open_topics(self) -> None:
        for directory in sorted(self.topics_dir.iterdir()):
            if directory.is_dir() and (directory / TOPIC_FILE).exists():
                config = TopicConfig.from_dict(json.loads((directory / TOPIC_FILE).read_text()))
                self.logs[directory.name] = self._make_log(directory.name, config)
                self.groups[directory.name] = _read_json(directory / GROUPS_FILE)

    def _make_log(self, name: str, config: TopicConfig) -> TopicLog:
        factory = BACKENDS.get(config.storage)
        if factory is None:
            raise UnknownTopic(f"topic {name} uses unknown storage {config.storage!r}", topic=name)
        if config.storage == "file":
            return FileLog(name, self.topics_dir / name, config, fsync=self.fsync, quarantine=self.quarantine)
        return factory(name, self.topics_dir / name, config, self.fsync)

    # --- topics ----------------------------------------------------------------

    def create_topic(self, name: str, **config: Any) -> TopicLog:
        check_name(name)
        if name in self.logs:
            raise TopicExists(f"topic {name} exists", topic=name)
        merged = {**self.defaults.to_dict(), **config}
        topic_config = TopicConfig.from_dict(merged)
        directory = self.topics_dir / name
        if topic_config.storage != "memory":  # memory topics are ephemeral: nothing on disk
            with storage_errors(str(directory)):
                directory.mkdir(exist_ok=True)
                atomic_write(directory / TOPIC_FILE, json.dumps(topic_config.to_dict(), sort_keys=True).encode())
                fsync_dir(self.topics_dir)
        self.logs[name] = self._make_log(name, topic_config)
        self.groups[name] = {}
        return self.logs[name]

    def get_or_create(self, name: str) -> TopicLog:
        log = self.logs.get(name)
        return log if log is not None else self.create_topic(name)

    def topic(self, name: str) -> TopicLog:
        try:
            return self.logs[name]
        except KeyError:
            raise UnknownTopic(f"no topic {name}", topic=name) from None

    def delete_topic(self, name: str) -> None:
        log = self.topic(name)
        log.close()
        del self.logs[name]
        self.groups.pop(name, None)
        self._dirty_groups.discard(name)
        with storage_errors(name):
            shutil.rmtree(self.topics_dir / name, ignore_errors=True)
            fsync_dir(self.topics_dir)

    def update_topic(self, name: str, **config: Any) -> TopicConfig:
        log = self.topic(name)
        log.config = TopicConfig.from_dict({**log.config.to_dict(), **config})
        atomic_write(self.topics_dir / name / TOPIC_FILE, json.dumps(log.config.to_dict(), sort_keys=True).encode())
        return log.config

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

    def delete_group(self, topic: str, group: str) -> None:
        if self.groups.get(topic, {}).pop(group, None) is not None:
            self._dirty_groups.add(topic)

    # --- durability ------------------------------------------------------------

    def sync(self, *, force: bool = False, wait: bool = True) -> None:
        """The group commit: every dirty log, then the groups that moved.

        ``wait=False`` (the broker's loop) leaves the groups' files to the writer thread.
        """
        for log in self.logs.values():
            if log.dirty or force:
                log.sync(force=force)
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
        else:
            self._offsets.check()

    def next_sync_due(self) -> float | None:
        dues = [d for d in (log.next_sync_due() for log in self.logs.values()) if d is not None]
        return min(dues) if dues else None

    def maybe_sync(self) -> list[TopicLog]:
        """Interval policy: sync the logs whose interval elapsed."""
        return [log for log in self.logs.values() if log.maybe_sync()]

    def apply_retention(self) -> int:
        return sum(log.apply_retention() for log in self.logs.values())

    def close(self) -> None:
        self.sync(force=True)
        self._offsets.close()
        for topic_log in self.logs.values():
            topic_log.close()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}
