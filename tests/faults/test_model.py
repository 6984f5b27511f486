"""A model-based test: hypothesis drives a real broker process through publish,
subscribe, receive, ack, nack, unsubscribe, crash (kill -9) and restart (SIGTERM).

The model keeps what the broker confirmed, what it delivered and what the
group committed, and checks after every step that touches the broker:

- no confirmed message is lost or moved: after any crash or restart, FETCH
  returns every confirmed value at its confirmed offset;
- committed offsets (``Admin.describe_group``) never go backwards while the
  broker runs, and across a crash at most to what was persisted: a committed
  offset seen, then given ``--offsets-commit-ms`` to reach the disk, survives
  a kill -9; a clean restart keeps the last one exactly;
- delivery counts (``Message.attempt``) grow with each redelivery of an
  offset. They live in the broker's memory: a broker restart starts them
  again at 1 (see docs/reliability.md), so the model checks them per broker
  lifetime.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time

import pytest
from conveyor.broker.client.subscription import Subscription
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor import Admin, Message, Producer
from conveyor.testing import BrokerProcess
from tests.faults.fault_helpers import fetch_all, report, soak_seconds

TOPIC, GROUP = "model", "g"
COMMIT_MS = 50
TOTALS = {"examples": 0, "steps": 0, "crashes": 0, "restarts": 0, "confirmed": 0, "delivered": 0, "redelivered": 0}
_values = itertools.count()


class BrokerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="conveyor-model-")
        self.broker = BrokerProcess(
            self.dir, extra=["--heartbeat-ms", "300", "--offsets-commit-ms", str(COMMIT_MS)]
        ).start()
        self.admin = Admin(self.broker.address)
        self.confirmed: dict[int, str] = {}  # offset -> value
        self.sub: Subscription | None = None
        self.held: list[Message] = []  # delivered, not settled
        self.attempts: dict[int, int] = {}  # offset -> last delivery count, this broker lifetime
        self.committed = 0  # the highest committed offset seen, this broker lifetime
        self.calm = 0  # steps since the last crash or restart: faults come after some traffic
        TOTALS["examples"] += 1

    # --- helpers ------------------------------------------------------------------------

    def _committed(self) -> int:
        try:
            return int(self.admin.describe_group(TOPIC, GROUP)["committed_offset"])
        except Exception as exc:  # the group exists once someone subscribed
            if "UNKNOWN" in str(exc):
                return 0
            raise

    def _drop_subscription(self) -> None:
        if self.sub is not None:
            self.sub.close()
        self.sub = None
        self.held = []

    def _check_log(self) -> None:
        stored = dict(fetch_all(self.broker.address, TOPIC)) if self.confirmed else {}
        lost = {o: v for o, v in self.confirmed.items() if stored.get(o) != v}
        assert not lost, f"confirmed messages lost or moved: {sorted(lost.items())[:5]}"

    def _new_lifetime(self) -> None:
        self.calm = -1  # the invariant counts this step
        self.admin.close()
        self.admin = Admin(self.broker.address)
        self.attempts = {}

    # --- rules ----------------------------------------------------------------------------

    @rule(count=st.integers(1, 30))
    def publish(self, count: int) -> None:
        values = [f"v{next(_values)}" for _ in range(count)]
        with Producer(self.broker.address, request_timeout_ms=2000) as producer:
            futures = [producer.send(TOPIC, v) for v in values]
            producer.flush(timeout=20)
        for value, future in zip(values, futures, strict=True):
            offset = future.result()
            assert offset not in self.confirmed, f"offset {offset} confirmed twice"
            self.confirmed[offset] = value
        TOTALS["confirmed"] += count

    @precondition(lambda self: self.sub is None)
    @rule(credit=st.integers(1, 25))
    def subscribe(self, credit: int) -> None:
        self.sub = Subscription(TOPIC, GROUP, address=self.broker.address, credit=credit, heartbeat_ms=300)

    @precondition(lambda self: self.sub is not None)
    @rule()
    def receive(self) -> None:
        assert self.sub is not None
        batch: list[Message] = []
        for _ in range(3):
            batch = self.sub.receive(timeout=0.2)
            if batch:
                break
        for message in batch:
            before = self.attempts.get(message.offset)
            assert before is None or message.attempt > before, (
                f"offset {message.offset} delivered with attempt {message.attempt} after {before}"
            )
            self.attempts[message.offset] = message.attempt
            if message.offset in self.confirmed:
                assert message.value == self.confirmed[message.offset]
            TOTALS["redelivered" if message.attempt > 1 else "delivered"] += 1
        self.held += batch

    @precondition(lambda self: self.sub is not None and self.held)
    @rule(n=st.integers(1, 30))
    def ack(self, n: int) -> None:
        assert self.sub is not None
        self.sub.ack(self.held[:n])
        del self.held[:n]

    @precondition(lambda self: self.sub is not None and self.held)
    @rule(n=st.integers(1, 30))
    def nack(self, n: int) -> None:
        assert self.sub is not None
        self.sub.nack(self.held[:n], error="model says no")
        del self.held[:n]

    @precondition(lambda self: self.sub is not None)
    @rule()
    def unsubscribe(self) -> None:
        self._drop_subscription()

    @precondition(lambda self: self.calm >= 4)
    @rule(wait=st.booleans())
    def crash(self, wait: bool) -> None:
        """kill -9; when ``wait``, first give the committed offset time to reach the disk."""
        floor = 0
        if wait:
            floor = self._committed()
            time.sleep(4 * COMMIT_MS / 1000)
        self.broker.kill()
        self._drop_subscription()
        self.broker.restart(kill=True)
        self._new_lifetime()
        after = self._committed()
        assert after >= floor, f"committed offset {floor} went back to {after} across a crash"
        self.committed = after
        self._check_log()
        TOTALS["crashes"] += 1

    @precondition(lambda self: self.calm >= 4)
    @rule()
    def restart(self) -> None:
        before = self._committed()
        self._drop_subscription()
        self.broker.restart(kill=False)
        self._new_lifetime()
        after = self._committed()
        assert after >= before, f"committed offset {before} went back to {after} across a clean restart"
        self.committed = after
        self._check_log()
        TOTALS["restarts"] += 1

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def committed_offset_never_goes_backwards(self) -> None:
        TOTALS["steps"] += 1
        self.calm += 1
        now = self._committed()
        assert now >= self.committed, f"committed offset went from {self.committed} back to {now}"
        assert now <= max(self.confirmed, default=-1) + 1
        self.committed = now

    def teardown(self) -> None:
        try:
            self._check_log()
        finally:
            self._drop_subscription()
            self.admin.close()
            self.broker.kill()
            shutil.rmtree(self.dir, ignore_errors=True)


def run_model(examples: int, steps: int, name: str, *, derandomize: bool) -> None:
    started = time.monotonic()
    test = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=derandomize,
    )(BrokerModel).TestCase
    test("runTest").runTest()
    report(name, seconds=round(time.monotonic() - started, 1), **TOTALS)


def test_the_broker_model_holds_through_crashes_and_restarts():
    run_model(examples=6, steps=20, name="model", derandomize=True)


@pytest.mark.soak
def test_soak_the_broker_model():
    examples = max(6, int(soak_seconds() * 0.15 / 3))
    run_model(examples=examples, steps=20, name="soak-model", derandomize=False)
