"""Run your ``@consumer`` handlers against a real broker inside a test: ``run_consumers``.

::

    from conveyor.testing import run_consumers

    def test_billing():
        with run_consumers(bill) as app:
            app.publish("orders", {"id": 1})
            app.wait_handled(bill, count=1)
            assert app.dead_letters("orders", count=0) == []

The broker is a real one (``BrokerProcess``), started once per test session on a
free port in a temporary directory and reused: starting a broker is the slow part
(about a second), so only the first ``with`` pays it. The consumers run in the real
``Runner`` (its lanes, ``handler_call`` for typed handlers, retries, dead letters,
``@error_handler``, middleware, ``publish`` from handlers) on a background thread of
the test's process, so a handler can use the test's fakes and a failing assertion in
a handler is an ordinary retried or dead-lettered message.

Isolation without a new broker: each ``with`` gives every topic and group it touches
a fresh prefix (``t<n>-<hex>.``). ``app.publish("orders", ...)`` writes to the
prefixed topic the copied consumers read; ``conveyor.publish()`` from a handler and a
custom dead-letter topic get the same prefix; ``app.topic("orders")`` says the real
name. The decorated functions themselves are not changed (the runner gets copies).

Waiting is on what the runner did, not on time: ``wait_handled`` (the handler
returned and its after-hooks ran), ``wait_retried``, ``wait_dead_lettered`` (the
error handlers ran; counted by an error handler the harness adds after yours), and
``messages``/``dead_letters`` read a topic with a fresh group until enough are there.
The harness's hooks are the outermost of each consumer's own middleware, so a wait
returns after the consumer's hooks ran; a runner-wide ``middleware=`` wraps them
and its after-hooks may still be running when a wait returns.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import shutil
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, cast

from conveyor.broker.client.consumer import Consumer as TopicReader
from conveyor.broker.client.message import Message
from conveyor.broker.client.producer import Producer
from conveyor.broker_process import BrokerProcess
from conveyor.consumers.context import Publisher
from conveyor.consumers.loader import load_consumers, load_middleware
from conveyor.consumers.runner import Runner
from conveyor.decorators.consumer import Consumer
from conveyor.names import dead_letter_topic

Target = Consumer | types.ModuleType | str
DEFAULT_TIMEOUT = 30.0  # seconds a wait gives the runner before it fails the test (loaded CI machines)

_session_lock = threading.Lock()
_session: BrokerProcess | None = None
_uses = itertools.count(1)


def session_broker() -> BrokerProcess:
    """The broker shared by every ``run_consumers`` of this process: started on first use, stopped at exit."""
    global _session
    with _session_lock:
        if _session is None or _session.proc is None or _session.proc.poll() is not None:
            data_dir = tempfile.mkdtemp(prefix="conveyor-test-broker-")
            broker = BrokerProcess(data_dir).start()
            atexit.register(_stop_session, broker, data_dir)
            _session = broker
        return _session


def _stop_session(broker: BrokerProcess, data_dir: str) -> None:
    try:
        broker.stop()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


class _Record:
    """What happened to one consumer's messages, told by the hooks the harness adds to its copy."""

    def __init__(self, changed: threading.Condition) -> None:
        self.changed = changed
        self.handled: list[Message] = []
        self.retried: list[Message] = []
        self.dead: list[Message] = []
        self.errors: list[BaseException] = []

    def _add(self, into: list[Any], item: Any) -> None:
        with self.changed:
            into.append(item)
            self.changed.notify_all()

    # middleware hooks (the outermost of the consumer's own: their after-hooks run last)
    def after_handle(self, message: Message, result: Any) -> None:
        self._add(self.handled, message)

    def on_error(self, message: Message, exc: BaseException) -> None:
        self._add(self.errors, exc)

    def on_retry(self, message: Message, exc: BaseException, attempt: int) -> None:
        self._add(self.retried, message)

    # an error handler, after the consumer's own
    def gave_up(self, message: Message, exc: BaseException) -> None:
        self._add(self.dead, message)


class _RenamingProducer:
    """The runner's producer with this ``with``'s prefix put on every topic a handler publishes to."""

    def __init__(self, producer: Producer, rename: Callable[[str], str]) -> None:
        self._producer = producer
        self._rename = rename

    def send(self, topic: str, value: Any, **options: Any) -> Future[int]:
        return self._producer.send(self._rename(topic), value, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


class _RenamingPublisher(Publisher):
    def __init__(self, broker: str, rename: Callable[[str], str]) -> None:
        super().__init__(broker)
        self._rename = rename

    @property
    def producer(self) -> Producer:
        return cast(Producer, _RenamingProducer(super().producer, self._rename))


class ConsumerApp:
    """The running consumers of one ``with run_consumers(...)``: publish, wait, read topics."""

    def __init__(
        self,
        broker: BrokerProcess,
        prefix: str,
        runner: Runner,
        records: dict[int, _Record],
        copies: dict[int, Consumer],
    ) -> None:
        self.broker = broker
        self.prefix = prefix
        self.runner = runner
        self._records = records
        self._copies = copies
        self._changed = next(iter(records.values())).changed
        self._producer: Producer | None = None

    def topic(self, name: str) -> str:
        """The real name of topic ``name`` in this ``with`` (the prefix put on)."""
        return name if name.startswith(self.prefix) else self.prefix + name

    def consumer(self, original: Consumer) -> Consumer:
        """The copy of ``original`` the runner runs (its real topic and group)."""
        self._record(original)
        return self._copies[id(original)]

    def publish(
        self,
        topic: str,
        value: Any,
        *,
        key: str | bytes | None = None,
        headers: dict[str, str] | None = None,
        partition: int | None = None,
        delay: float | timedelta | None = None,
        not_before: datetime | float | None = None,
        ttl: float | timedelta | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        """Send ``value`` to ``topic`` (prefixed) and wait until it is durable; its offset.

        ``partition``, ``delay``, ``not_before`` and ``ttl`` are ``Producer.send``'s."""
        if self._producer is None:
            self._producer = Producer(self.broker.address, linger_ms=0)
        future = self._producer.send(
            self.topic(topic),
            value,
            key=key,
            headers=headers,
            partition=partition,
            delay=delay,
            not_before=not_before,
            ttl=ttl,
        )
        return int(future.result(timeout=timeout))

    def handled(self, consumer: Consumer) -> list[Message]:
        """Messages ``consumer``'s handler returned for, so far (a batch handler's: each of the batch)."""
        return list(self._record(consumer).handled)

    def retried(self, consumer: Consumer) -> list[Message]:
        """Deliveries that failed and will come again (one entry per failed attempt)."""
        return list(self._record(consumer).retried)

    def dead_lettered(self, consumer: Consumer) -> list[Message]:
        """Messages given up on (dead-lettered, or dropped with ``dead_letter=False``): error handlers ran."""
        return list(self._record(consumer).dead)

    def errors(self, consumer: Consumer) -> list[BaseException]:
        """What the handler raised, in order (every failed attempt)."""
        return list(self._record(consumer).errors)

    def wait_handled(self, consumer: Consumer, count: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        """Wait until ``consumer`` has handled ``count`` messages in all; those messages."""
        return self._wait(consumer, "handled", count, timeout)

    def wait_retried(self, consumer: Consumer, count: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        return self._wait(consumer, "retried", count, timeout)

    def wait_dead_lettered(self, consumer: Consumer, count: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        """Wait until ``count`` messages of ``consumer`` were given up on and its error handlers have run."""
        return self._wait(consumer, "dead", count, timeout)

    def _record(self, consumer: Consumer) -> _Record:
        record = self._records.get(id(consumer))
        if record is None:
            raise ValueError(f"{getattr(consumer, 'name', consumer)!r} is not one of the consumers of this run")
        return record

    def _wait(self, consumer: Consumer, what: str, count: int, timeout: float) -> list[Message]:
        record = self._record(consumer)
        found: list[Message] = getattr(record, what)
        with self._changed:
            if not self._changed.wait_for(lambda: len(found) >= count, timeout=timeout):
                raise TimeoutError(
                    f"{consumer.name}: {len(found)} of {count} message(s) {what} after {timeout} s "
                    f"(handled {len(record.handled)}, retried {len(record.retried)}, "
                    f"dead-lettered {len(record.dead)}; errors: {record.errors[-3:]!r})"
                )
            return list(found)

    def messages(self, topic: str, count: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        """Read ``topic`` (prefixed) from its start in a fresh group until ``count`` messages are there.

        ``count=0`` reads what is there now and returns at once when nothing comes (a short wait)."""
        found: list[Message] = []
        deadline = time.monotonic() + timeout
        group = f"{self.prefix}reader-{uuid.uuid4().hex[:8]}"
        idle = 0.2 if count == 0 else timeout
        with TopicReader(self.topic(topic), group=group, address=self.broker.address, timeout=idle) as reader:
            for message in reader:
                found.append(message)
                reader.ack(message)
                if (count and len(found) >= count) or time.monotonic() > deadline:
                    break
        if len(found) < count:
            raise TimeoutError(f"{self.topic(topic)}: {len(found)} of {count} message(s) after {timeout} s")
        return found

    def dead_letters(self, topic: str, count: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        """The dead letters of ``topic`` (its consumers' dead-letter topic, ``<topic>.dlq`` unless one names
        another), read as ``messages`` does: each carries the reason and history in its headers."""
        real = self.topic(topic)
        named = [
            c.policy.dead_letter
            for c in self.runner.consumers
            if c.topic == real and isinstance(c.policy.dead_letter, str)
        ]
        return self.messages(named[0] if named else dead_letter_topic(real), count, timeout)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=5.0)
            self._producer = None


def consumers_of(targets: Iterable[Target]) -> list[Consumer]:
    """``@consumer`` functions as they are, every one of a module, or of a ``module[:attr]`` name."""
    found: list[Consumer] = []
    for target in targets:
        if isinstance(target, Consumer):
            found.append(target)
        elif isinstance(target, types.ModuleType):
            found += [v for v in vars(target).values() if isinstance(v, Consumer)]
        elif isinstance(target, str):
            found += load_consumers([target])
        else:
            raise TypeError(f"run_consumers takes @consumer functions, modules or module names, not {target!r}")
    unique = list({id(c): c for c in found}.values())
    if not unique:
        raise ValueError("run_consumers found no @consumer to run")
    return unique


def modules_middleware(targets: Iterable[Target]) -> list[Any]:
    """The ``middleware = [...]`` of each module (or ``module[:attr]`` name) among ``targets``, in order:
    what ``conveyor run`` would wrap their consumers in. A ``@consumer`` function alone brings none."""
    modules = [t for t in targets if isinstance(t, str | types.ModuleType)]
    names = [t.__name__ if isinstance(t, types.ModuleType) else t for t in modules]
    return load_middleware(names)


def new_prefix() -> str:
    """A prefix no earlier ``with`` of any process used: topics and groups of one run see only their own."""
    return f"t{next(_uses)}-{uuid.uuid4().hex[:8]}."


def isolated(consumer: Consumer, prefix: str, record: _Record) -> Consumer:
    """A copy of ``consumer`` on prefixed names, with the harness's hooks outside its own."""
    policy = consumer.retry
    if policy is not None and isinstance(policy.dead_letter, str):
        policy = dataclasses.replace(policy, dead_letter=prefix + policy.dead_letter)
    return dataclasses.replace(
        consumer,
        topic=prefix + consumer.topic,
        group=prefix + consumer.group,
        retry=policy,
        error_handlers=[*consumer.error_handlers, record.gave_up],
        middleware=[record, *consumer.middleware],
    )


@contextmanager
def run_consumers(
    *targets: Target,
    broker: BrokerProcess | None = None,
    middleware: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT,
    **runner_options: Any,
) -> Iterator[ConsumerApp]:
    """Run ``targets``' consumers in a real ``Runner`` against ``broker`` (the session's by default).

    Yields once every consumer is subscribed; on exit the runner drains and stops (a handler still
    running is waited for up to ``graceful_timeout``, 5 s here). ``runner_options`` go to ``Runner``.
    """
    found = consumers_of(targets)
    broker = broker or session_broker()
    prefix = new_prefix()
    changed = threading.Condition()
    records = {id(c): _Record(changed) for c in found}
    copies = {id(c): isolated(c, prefix, records[id(c)]) for c in found}
    options = {"metrics_port": -1, "graceful_timeout": 5.0, **runner_options}
    runner_wide = [*middleware, *modules_middleware(targets)]  # as `--middleware`, then the modules' own
    runner = Runner(list(copies.values()), broker=broker.address, middleware=runner_wide, **options)
    runner.publisher = _RenamingPublisher(
        runner.broker, lambda topic: topic if topic.startswith(prefix) else prefix + topic
    )
    app = ConsumerApp(broker, prefix, runner, records, copies)
    subscribed = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            runner.run(install_signals=False, ready=lambda _runner: subscribed.set())
        except BaseException as exc:  # told to the test, not lost in a thread
            failure.append(exc)
            subscribed.set()

    thread = threading.Thread(target=run, name="conveyor-test-runner", daemon=True)
    thread.start()
    try:
        if not subscribed.wait(timeout):
            raise TimeoutError(f"the runner did not subscribe within {timeout} s")
        if failure:
            raise RuntimeError("the runner failed to start") from failure[0]
        yield app
    finally:
        runner.stop()
        thread.join(timeout + options["graceful_timeout"])
        app.close()
    if failure:
        raise RuntimeError("the runner failed") from failure[0]
