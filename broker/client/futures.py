"""Cheap futures for per-message offsets.

``concurrent.futures.Future`` builds a Condition per instance, and settling
thousands of futures one by one costs more than sending the messages. The
futures of one batch share a ``BatchState`` (the state, the base offset, a
Condition made only if someone waits): settling a batch is O(1) plus one step
per future someone actually waits on or added a callback to. A future holds
only its batch and its index and the producer keeps no reference to it, so a
discarded future is freed at once and the garbage collector never sees it.
They are real ``Future`` objects: ``result()``, ``add_done_callback``,
``wait`` and ``as_completed`` work as usual.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import FINISHED, PENDING
from typing import Any

_CONDITION_LOCK = threading.Lock()  # creates a batch's Condition the first time one is needed


class Offset(int):
    """A message's offset (an ``int``: ``== 3`` and arithmetic work as before) that also says its ``partition``."""

    partition = 0  # a class default: only an offset in another partition carries its own

    def __new__(cls, value: int, partition: int = 0) -> Offset:
        offset = super().__new__(cls, value)
        if partition:
            offset.partition = partition
        return offset

    def __repr__(self) -> str:
        return int.__repr__(self) if not self.partition else f"Offset({int(self)}, partition={self.partition})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Offset, (int(self), self.partition))


class BatchState:
    __slots__ = ("_condition", "base_offset", "exception", "explain_timeout", "observed", "partition", "state")

    def __init__(
        self, explain_timeout: Callable[[float | None], BaseException] | None = None, partition: int = 0
    ) -> None:
        self._condition: threading.Condition | None = None  # most batches never need one
        self.state = PENDING
        self.partition = partition
        self.base_offset = 0
        self.exception: BaseException | None = None
        self.observed: list[OffsetFuture] = []  # futures with waiters or callbacks
        # What ``result(timeout)`` raises when the wait runs out: an error naming the broker,
        # not the bare ``TimeoutError()`` of ``concurrent.futures``.
        self.explain_timeout = explain_timeout

    @property
    def condition(self) -> threading.Condition:
        condition = self._condition
        if condition is None:
            with _CONDITION_LOCK:
                condition = self._condition
                if condition is None:
                    condition = self._condition = threading.Condition()
        return condition

    def resolve(self, base_offset: int) -> None:
        self.base_offset = base_offset
        self._settle(FINISHED, None)

    def fail(self, exc: BaseException) -> None:
        self.exception = exc
        self._settle(FINISHED, exc)

    def _settle(self, state: str, exc: BaseException | None) -> None:
        # The state changes before the condition is looked at: whoever creates the
        # condition after this reads the new state under it, so nobody waits forever.
        self.state = state
        condition = self._condition
        if condition is None:
            return  # nobody waited or added a callback
        with condition:
            observed = [f for f in self.observed if not f._own]
            for future in observed:
                for waiter in future._waiters:
                    if exc is None:
                        waiter.add_result(future)
                    else:
                        waiter.add_exception(future)
            condition.notify_all()
        for future in observed:
            if future._own_callbacks:
                future._invoke_callbacks()  # type: ignore[attr-defined]


class OffsetFuture(Future[int]):
    """A real ``Future`` (``result()``, callbacks, ``wait``, ``as_completed``) of a message's offset.

    Its state lives on the batch until something sets it directly (``cancel()``,
    ``set_result()``...): from then on the future keeps its own.
    """

    __slots__ = ("_batch", "_index")
    _own: dict[str, Any] | None = None  # per-future state, once detached from the batch
    _own_waiters: list[Any] | None = None
    _own_callbacks: list[Any] | None = None

    def __init__(self, batch: BatchState, index: int) -> None:  # super().__init__ skipped on purpose
        self._batch = batch
        self._index = index

    def _set(self, name: str, value: Any) -> None:
        own = self._own
        if own is None:
            batch = self._batch
            own = {"state": batch.state, "result": self._batch_result(), "exception": batch.exception}
            self._own = own
        own[name] = value

    def result(self, timeout: float | None = None) -> int:
        try:
            return super().result(timeout)
        except TimeoutError as exc:
            explained = self._explained(exc, timeout)
            if explained is exc:
                raise
            raise explained from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        except TimeoutError as exc:
            explained = self._explained(exc, timeout)
            if explained is exc:
                raise
            raise explained from None

    def _explained(self, exc: TimeoutError, timeout: float | None) -> BaseException:
        """The waiter's own timeout (a bare ``TimeoutError``) as an error that names the broker."""
        explain = self._batch.explain_timeout
        if type(exc) is not TimeoutError or explain is None:
            return exc  # the future's own failure (a RequestTimeout already says where)
        return explain(timeout)

    def _batch_result(self) -> int | None:
        batch = self._batch
        if batch.state == FINISHED and batch.exception is None:
            return Offset(batch.base_offset + self._index, batch.partition)
        return None

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        return self._batch.condition

    @property
    def _state(self) -> str:
        return self._batch.state if self._own is None else self._own["state"]

    @_state.setter
    def _state(self, value: str) -> None:
        self._set("state", value)

    @property
    def _result(self) -> int | None:
        return self._batch_result() if self._own is None else self._own["result"]

    @_result.setter
    def _result(self, value: int | None) -> None:
        self._set("result", value)

    @property
    def _exception(self) -> BaseException | None:
        return self._batch.exception if self._own is None else self._own["exception"]

    @_exception.setter
    def _exception(self, value: BaseException | None) -> None:
        self._set("exception", value)

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        if self._own_waiters is None:
            self._own_waiters = []
            self._observe()
        return self._own_waiters

    @property
    def _done_callbacks(self) -> list[Any]:
        if self._own_callbacks is None:
            self._own_callbacks = []
            self._observe()
        return self._own_callbacks

    def _observe(self) -> None:
        # Called under the condition (Future's own methods hold it when they touch these lists).
        if self._own_waiters is None or self._own_callbacks is None:  # the first of the two
            self._batch.observed.append(self)


_new_future = OffsetFuture.__new__
_set_batch = OffsetFuture.__dict__["_batch"].__set__
_set_index = OffsetFuture.__dict__["_index"].__set__


def _futures(batch: BatchState, first: int, count: int) -> list[OffsetFuture]:
    """``[OffsetFuture(batch, i) for i in range(first, first + count)]`` in three C-level loops."""
    futures = list(map(_new_future, itertools.repeat(OffsetFuture, count)))
    deque(map(_set_batch, futures, itertools.repeat(batch, count)), 0)
    deque(map(_set_index, futures, range(first, first + count)), 0)
    return futures


_set_batch = OffsetFuture.__dict__["_batch"].__set__
_set_index = OffsetFuture.__dict__["_index"].__set__


def new_future(batch: BatchState, index: int) -> OffsetFuture:
    """``OffsetFuture(batch, index)`` without the ``__init__`` call (this runs once per message)."""
    future = _new_future(OffsetFuture)
    future._batch = batch
    future._index = index
    return future


def batch_futures(batch: BatchState, first: int, count: int) -> list[OffsetFuture]:
    """``[OffsetFuture(batch, i) for i in range(first, first + count)]`` in three C-level loops."""
    futures = list(map(_new_future, itertools.repeat(OffsetFuture, count)))
    deque(map(_set_batch, futures, itertools.repeat(batch, count)), 0)
    deque(map(_set_index, futures, range(first, first + count)), 0)
    return futures
