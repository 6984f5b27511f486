"""/healthz, /livez and /readyz of real brokers and runners, and the conveyor_health_status gauge.

Storage health follows real writes: a failed append, fsync or offsets write
is UNHEALTHY until that same operation works again. A runner without its
broker is DEGRADED, then UNHEALTHY after ``--unhealthy-after``, and HEALTHY
again once the broker is back. Every probe retries until the process's HTTP
server answers (see ``probe_helpers``), so no test races a server that is not
listening yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.log.syscalls import ENV_CONTROL
from conveyor.consumers.runner import Runner
from prometheus_client import CollectorRegistry

from conveyor import Producer, consumer
from conveyor.testing import BrokerProcess
from tests.helpers import wait_for
from tests.monitoring.probe_helpers import PHASE, ProbedRunner, base_url, health_is, health_status_metric, probe

ENDPOINTS = ("/healthz", "/livez", "/readyz", "/metrics")


@pytest.fixture
def faulty_broker(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Path]]:
    """A broker whose file I/O fails as the control file says (empty: no faults)."""
    control = tmp_path / "faults"
    broker = BrokerProcess(tmp_path / "data", env={ENV_CONTROL: str(control)}).start()
    yield broker, control
    broker.kill()


@pytest.fixture
def runners() -> Iterator[Any]:
    started: list[ProbedRunner] = []

    def start(address: str, *args: str) -> ProbedRunner:
        runner = ProbedRunner(address, args=list(args))
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.kill()


def test_every_endpoint_answers_get_and_head(faulty_broker: tuple[BrokerProcess, Path]) -> None:
    broker, _control = faulty_broker
    base = base_url(broker.metrics_url)
    for path in ENDPOINTS:
        # Given a healthy broker, GET and HEAD agree on the status; HEAD has no body
        got, body = probe(base, path)
        assert got == 200, (path, body)
        head, empty = probe(base, path, method="HEAD")
        assert (head, empty) == (200, b""), path
    assert probe(base, "/nothing")[0] == probe(base, "/nothing", method="HEAD")[0] == 404
    assert probe(base, "/livez")[1]["live"] is True
    assert probe(base, "/readyz")[1]["ready"] is True
    # Every check has a status and a series of its own, and so has the whole
    report = probe(base, "/healthz")[1]
    assert {"storage", "disk_space", "fsync_latency", "event_loop"} <= set(report["checks"])
    for check, detail in report["checks"].items():
        assert detail["status"] == "HEALTHY", (check, detail)
        assert health_status_metric(base, check) == 0, check
    assert health_status_metric(base, "overall") == 0


def test_a_broker_whose_fsyncs_fail_is_unhealthy_until_an_fsync_works(
    faulty_broker: tuple[BrokerProcess, Path],
) -> None:
    broker, control = faulty_broker
    base = base_url(broker.metrics_url)
    with Producer(broker.address, linger_ms=1, request_timeout_ms=2000) as producer:
        assert producer.send("disk", b"before").result(timeout=PHASE) == 0
        assert wait_for(lambda: health_is(base, "HEALTHY"), PHASE, message="HEALTHY")[0] == 200
        # When every fsync fails, the producer's batch is refused (STORAGE_IO_ERROR) and retried
        control.write_text("fsync_eio\n")
        pending = producer.send("disk", b"during")
        # Then the broker is UNHEALTHY (503), not ready, still live, and says which operation failed
        code, report = wait_for(lambda: health_is(base, "UNHEALTHY"), PHASE, message="UNHEALTHY after failed fsyncs")
        assert code == 503
        storage = report["checks"]["storage"]
        assert storage["status"] == "UNHEALTHY" and "fsync" in storage["failing"], storage
        assert report["checks"]["disk_space"]["status"] == "HEALTHY"
        assert probe(base, "/readyz")[0] == 503
        assert probe(base, "/livez")[0] == 200
        assert health_status_metric(base, "storage") == 2
        assert health_status_metric(base, "overall") == 2
        # When fsyncs work again, the resent batch is stored and health follows
        control.write_text("")
        assert pending.result(timeout=PHASE) == 1
        assert wait_for(lambda: health_is(base, "HEALTHY"), PHASE, message="HEALTHY once an fsync worked")[0] == 200
        assert probe(base, "/readyz")[0] == 200
        assert health_status_metric(base, "storage") == 0


def test_a_broker_whose_offsets_writes_fail_is_unhealthy_until_one_works(
    faulty_broker: tuple[BrokerProcess, Path],
) -> None:
    broker, control = faulty_broker
    base = base_url(broker.metrics_url)
    with Producer(broker.address, linger_ms=1) as producer:
        producer.send_many("offsets", [b"x"] * 10)
        producer.flush(timeout=PHASE)
    # Given a consumer whose acks move the group's committed offset
    control.write_text("rename_eio\nmatch=groups.json\n")
    with Subscription("offsets", "g", address=broker.address) as sub:
        got: list[Any] = []
        wait_for(lambda: got.extend(sub.receive(timeout=0.2)) or len(got) >= 10, PHASE, message="10 messages")
        sub.ack(got)
        # When groups.json cannot be written, the broker says so
        code, report = wait_for(
            lambda: health_is(base, "UNHEALTHY"), PHASE, message="UNHEALTHY after a failed offsets write"
        )
        assert code == 503 and "offsets" in report["checks"]["storage"]["failing"], report
        # Then the writer's retry works once the disk does, and health follows
        control.write_text("")
        wait_for(lambda: health_is(base, "HEALTHY"), PHASE, message="HEALTHY once the offsets were written")
        sub.receive(timeout=0.1)  # keep the subscription alive


def test_a_runner_whose_broker_stays_down_turns_unhealthy_then_recovers(
    faulty_broker: tuple[BrokerProcess, Path], runners: Any
) -> None:
    broker, _control = faulty_broker
    runner = runners(broker.address, "--unhealthy-after", "2")
    # Given a runner subscribed to a live broker: healthy, ready, live
    wait_for(lambda: health_is(runner.url, "HEALTHY"), PHASE, message="runner HEALTHY")
    assert probe(runner.url, "/readyz")[0] == 200
    assert probe(runner.url, "/livez")[0] == 200
    # When the broker goes away, the runner is DEGRADED (200) at first...
    broker.stop()
    code, _report = wait_for(lambda: health_is(runner.url, "DEGRADED"), PHASE, message="runner DEGRADED")
    assert code == 200
    # ...and UNHEALTHY (503) once it has been without its broker for --unhealthy-after; still live
    code, report = wait_for(lambda: health_is(runner.url, "UNHEALTHY"), PHASE, message="runner UNHEALTHY")
    assert code == 503
    assert report["checks"]["app_probe.probed"]["status"] == "UNHEALTHY", report
    assert probe(runner.url, "/readyz")[0] == 503
    assert probe(runner.url, "/livez")[0] == 200
    assert health_status_metric(runner.url, "overall") == 2
    assert health_status_metric(runner.url, "app_probe.probed") == 2
    # Then it recovers when the broker is back
    broker.start()
    code, _report = wait_for(lambda: health_is(runner.url, "HEALTHY"), PHASE, message="runner HEALTHY again")
    assert code == 200
    assert wait_for(lambda: probe(runner.url, "/readyz")[0] == 200, PHASE, message="runner ready again")
    assert health_status_metric(runner.url, "overall") == 0


def test_a_runner_that_never_reached_its_broker_is_not_ready(runners: Any, tmp_path: Path) -> None:
    # Given a runner pointed at an address where no broker listens
    nowhere = BrokerProcess(tmp_path / "never").start()
    address = nowhere.address
    nowhere.stop()
    runner = runners(address, "--unhealthy-after", "1")
    # Then it is not ready from the start, and UNHEALTHY once --unhealthy-after has passed
    assert probe(runner.url, "/readyz")[0] == 503
    assert probe(runner.url, "/livez")[0] == 200
    code, report = wait_for(lambda: health_is(runner.url, "UNHEALTHY"), PHASE, message="runner UNHEALTHY")
    assert code == 503 and report["checks"]["app_probe.probed"]["subscribed"] is False


def test_a_runner_whose_io_loop_is_wedged_fails_livez(tmp_path: Path) -> None:
    # Given an in-process runner whose I/O loop last passed a minute ago
    noop = consumer("wedged", group="wedged")(lambda message: None)
    with BrokerProcess(tmp_path / "data") as broker:
        runner = Runner([noop], broker=broker.address, metrics_port=0, registry=CollectorRegistry())
        runner._start()
        try:
            assert runner.metrics_server is not None
            base = f"http://127.0.0.1:{runner.metrics_server.port}"
            assert probe(base, "/livez")[0] == 200
            runner._last_pass -= 60
            # Then /livez fails (a restart helps), and /healthz says so
            code, body = probe(base, "/livez")
            assert code == 503 and body["live"] is False
            code, report = probe(base, "/healthz")
            assert (code, report["checks"]["event_loop"]["status"]) == (503, "UNHEALTHY"), report
        finally:
            runner._close()
