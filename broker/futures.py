"""Cheap futures for per-message offsets.

``concurrent.futures.Future`` builds a Condition per instance, which costs
more than sending the message. The futures of one batch share a single
Condition and are resolved together, in one pass, when the batch's confirm
arrives. They are real ``Future`` objects: ``result()``, ``add_done_callback``,
``wait`` and ``as_completed`` work as usual.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures._base import FINISHED, PENDING
from typing import Any


class OffsetFuture(Future[int]):
    def __init__(self, condition: threading.Condition) -> None:  # noqa: super-init skipped on purpose
        self._condition = condition
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []


class BatchFutures:
    """The futures of one batch: created one per message, settled all at once."""

    __slots__ = ("condition", "futures")

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.futures: list[OffsetFuture] = []

    def new(self) -> OffsetFuture:
        future = OffsetFuture(self.condition)
        self.futures.append(future)
        return future

    def resolve(self, base_offset: int) -> None:
        with self.condition:
            for i, future in enumerate(self.futures):
                if future._state == PENDING:
                    future._result = base_offset + i
                    future._state = FINISHED
            self.condition.notify_all()
        self._after()

    def fail(self, exc: BaseException) -> None:
        with self.condition:
            for future in self.futures:
                if future._state == PENDING:
                    future._exception = exc
                    future._state = FINISHED
            self.condition.notify_all()
        self._after()

    def _after(self) -> None:
        for future in self.futures:
            if future._waiters or future._done_callbacks:
                for waiter in future._waiters:
                    if future._exception is None:
                        waiter.add_result(future)
                    else:
                        waiter.add_exception(future)
                future._invoke_callbacks()  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.futures)
