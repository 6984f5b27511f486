"""What the last real write of each kind did: the broker's storage health.

An ``os.access`` check says nothing about a disk whose fsyncs fail. This
records the outcome of the operations that matter (``append``: writing a
batch; ``fsync``: making a log durable; ``offsets``: writing a topic's
``groups.json``; ``create_topic``: a new topic's directory and config), per
topic. A failure stays until the same operation on the same topic works
again (or the topic is deleted): UNHEALTHY for that long, since until then
nothing proves the disk takes writes.

Cheap on the hot path: a success costs one dict lookup while nothing fails.
The offsets writer reports from its own thread, hence the lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from conveyor.errors import StorageFull, StorageIOError

STORAGE_ERRORS = (StorageIOError, StorageFull)


class IoHealth:
    def __init__(self) -> None:
        self._failing: dict[tuple[str, str], tuple[str, float]] = {}  # (op, topic) -> (error, since: wall clock)
        self._lock = threading.Lock()

    def failed(self, op: str, topic: str, error: BaseException) -> None:
        """``op`` on ``topic`` failed; storage errors only (a full disk, EIO) are the disk's fault."""
        if not isinstance(error, STORAGE_ERRORS):
            return
        with self._lock:
            since = self._failing.get((op, topic), ("", time.time()))[1]
            self._failing[(op, topic)] = (str(error), since)

    def worked(self, op: str, topic: str) -> None:
        if not self._failing:  # the common case, without the lock
            return
        with self._lock:
            self._failing.pop((op, topic), None)

    def forget(self, topic: str) -> None:
        """The topic is gone: its failures say nothing about the disk any more."""
        with self._lock:
            for key in [k for k in self._failing if k[1] == topic]:
                del self._failing[key]

    def check(self) -> dict[str, Any]:
        """The ``storage`` health check: UNHEALTHY while any operation's last attempt failed."""
        with self._lock:
            failing: dict[str, dict[str, Any]] = {}
            for (op, topic), (error, since) in sorted(self._failing.items()):
                failing.setdefault(op, {})[topic] = {"error": error, "since": round(since, 3)}
        return {"status": "UNHEALTHY" if failing else "HEALTHY", "failing": failing}
