"""Makes new topics durable on a thread of its own, so creating one costs the event loop no fsync.

A new topic's directory, first segment and ``topic.json`` must survive a
power cut before anything in it is confirmed: that is an fsync of the new
``topic.json``, of the topic's directory and of ``topics/`` (four before,
all on the loop; a client subscribing to thousands of new topics stalled
every other client for seconds). The loop now makes the directory and opens
the segment, marks the log *held* (its durable offset does not move, so
nothing in it is confirmed, delivered or served), and hands the topic
here. This thread writes ``topic.json`` atomically, syncs each topic's
directory, then ``topics/`` once for the whole batch, and reports back;
the loop then releases the hold. A write that fails is retried with a
backoff (doubling to 2 s) and reported each time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from conveyor.broker.log.durable import atomic_write, fsync_dir, storage_errors

from conveyor.errors import ConveyorError, StorageIOError

log = logging.getLogger("conveyor.store")

Outcome = tuple[str, ConveyorError | None]


class TopicCreator:
    def __init__(self, topics_dir: Path, *, backoff: float = 0.25, max_backoff: float = 2.0) -> None:
        self.topics_dir = topics_dir
        self.wake: Callable[[], None] | None = None  # wakes the broker's loop when outcomes wait
        self._pending: dict[str, tuple[bytes, float, int]] = {}  # name -> (topic.json, retry at, failures)
        self._busy: set[str] = set()
        self._failures: dict[str, int] = {}  # failed attempts of the topics being written
        self._done: deque[Outcome] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._backoff, self._max_backoff = backoff, max_backoff
        self._thread = threading.Thread(target=self._run, name="conveyor-topic-creator", daemon=True)
        self._thread.start()

    def submit(self, name: str, config_json: bytes) -> None:
        with self._cv:
            self._pending[name] = (config_json, 0.0, 0)
            self._cv.notify_all()

    def outcomes(self) -> list[Outcome]:
        """Topics made durable (error None) or that failed this time (retried), since the last call."""
        out: list[Outcome] = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def settle(self, name: str | None = None, *, timeout: float | None = None) -> None:
        """Wait until ``name`` (every topic, if None) is written, and not being written, or has failed once more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            failed_before = self._pending[name][2] if name in self._pending else self._failures.get(name or "", 0)
            for item in list(self._pending) if name is None else [name]:
                if item in self._pending:
                    config, _retry, failures = self._pending[item]
                    self._pending[item] = (config, 0.0, failures)  # now, not after its backoff
            self._cv.notify_all()
            while (name is None and (self._pending or self._busy)) or (name is not None and self.owns(name)):
                if self._closed or not self._thread.is_alive():
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                if name is None and self._pending and not self._busy and self._all_failing():
                    return  # every one left is failing: give up waiting (they stay held)
                if name is not None and name not in self._busy and self._pending[name][2] > failed_before:
                    return  # it failed once more: the caller decides
                self._cv.wait(0.1)

    def owns(self, name: str) -> bool:
        """Whether ``name``'s ``topic.json`` is still to be written (or being written) here.

        While it is, this thread is the topic's only metadata writer: anyone
        else who would rewrite ``topic.json`` (an alter) waits for ``settle``.
        """
        with self._cv:
            return name in self._pending or name in self._busy

    def _all_failing(self) -> bool:
        return all(failures > 0 for _c, _r, failures in self._pending.values())

    def forget(self, name: str) -> None:
        """The topic is being deleted: wait for a write in progress, drop a pending one."""
        with self._cv:
            while name in self._busy:
                self._cv.wait(0.1)
            self._pending.pop(name, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            with self._cv:
                batch = self._take()
                if batch is None:
                    return
            outcomes = [(name, self._write(name, config)) for name, config in batch.items()]
            if any(error is None for _n, error in outcomes):
                try:
                    with storage_errors(str(self.topics_dir)):
                        fsync_dir(self.topics_dir)  # every new topic's entry, in one fsync
                except ConveyorError as exc:
                    outcomes = [(name, error or exc) for name, error in outcomes]
            with self._cv:
                for name, error in outcomes:
                    self._busy.discard(name)
                    if error is not None and name not in self._pending:
                        self._retry(name, batch[name], error)
                    self._done.append((name, error))
                self._cv.notify_all()
            if self.wake is not None:
                self.wake()

    def _take(self) -> dict[str, bytes] | None:
        """Under the lock: the topics due now (waiting for one), or None once closed."""
        while True:
            if self._closed:
                return None
            now = time.monotonic()
            due = {name: config for name, (config, retry_at, _f) in self._pending.items() if retry_at <= now}
            if due:
                for name in due:
                    self._busy.add(name)
                    self._failures[name] = self._pending.pop(name)[2]
                return due
            retries = [retry_at for _c, retry_at, _f in self._pending.values()]
            self._cv.wait(max(0.0, min(retries) - now) if retries else None)

    def _retry(self, name: str, config: bytes, error: ConveyorError) -> None:
        failures = self._failures.pop(name, 0) + 1
        if failures == 1:
            log.error("topic %s: cannot make its creation durable (%s); retrying until it works", name, error)
        delay = min(self._max_backoff, self._backoff * 2 ** (failures - 1))
        self._pending[name] = (config, time.monotonic() + delay, failures)

    def _write(self, name: str, config: bytes) -> ConveyorError | None:
        directory = self.topics_dir / name
        try:
            atomic_write(directory / "topic.json", config)  # also syncs the directory: the segment's entry too
            self._failures.pop(name, None)
            return None
        except ConveyorError as exc:
            return exc
        except FileNotFoundError:
            return StorageIOError(f"{directory} vanished while the topic was being created", path=str(directory))
        except Exception as exc:  # a bug must not end the thread: topics would stay held for ever
            log.exception("creating topic %s failed", name)
            return StorageIOError(f"{type(exc).__name__}: {exc} creating {directory}", path=str(directory))
