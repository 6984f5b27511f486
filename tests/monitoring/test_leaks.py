"""Nothing a client leaves behind grows for ever (issue 15, finding 9).

Deleted topics and groups used to keep their metric series on ``/metrics``
for good; the metrics HTTP server waited for a request without a deadline,
so every idle or trickling socket held a thread; a fetch parked on a
deleted topic was never answered.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.monitoring.bounded_http import MAX_CONNECTIONS, PROBE_SLOTS

from conveyor import Admin, Producer
from conveyor.errors import UnknownTopic
from tests.helpers import wait_for
from tests.monitoring.monitoring_helpers import runner_metrics_url

TOPICS = 12


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closed ``sock`` (EOF, after a 503 or nothing); False if it stayed open."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True  # reset by the server


def test_deleted_topics_and_groups_take_their_series_with_them(conveyor_broker):
    address = conveyor_broker.address
    with Producer(address, linger_ms=1) as producer, Admin(address) as admin:
        # Given topics with traffic in every per-topic and per-group family: publish, deliver, ack, nack
        for i in range(TOPICS):
            topic = f"gone-{i}"
            producer.send(topic, b"a").result(timeout=30)
            producer.send(topic, b"b").result(timeout=30)
            with Subscription(topic, "g", address=address) as sub:
                got: list = []
                assert wait_for(lambda: got.extend(sub.receive(timeout=0.05)) or len(got) >= 2, timeout=30)  # noqa: B023
                sub.ack(got[:1])
                sub.nack(got[1:])
        before = urllib.request.urlopen(conveyor_broker.metrics_url, timeout=10).read().decode()
        assert 'topic="gone-0"' in before and 'group="g"' in before
        # When they are deleted (one group first, then every topic)
        admin.delete_group("gone-0", "g")
        for i in range(TOPICS):
            admin.delete_topic(f"gone-{i}")
    # Then no series names them any more
    text = urllib.request.urlopen(conveyor_broker.metrics_url, timeout=10).read().decode()
    stale = [line for line in text.splitlines() if 'topic="gone-' in line]
    assert stale == [], f"{len(stale)} stale lines, e.g. {stale[:3]}"


def _answer_then_close(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing ``sock``, or None if it kept it open for ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except OSError:
        pass
    return data


def test_idle_connections_hold_no_thread_and_are_closed_at_their_deadline(conveyor_broker):
    pid, url = conveyor_broker.pid, conveyor_broker.metrics_url
    base = url.rsplit("/", 1)[0]
    host, port = base.split("//", 1)[1].split(":")
    threads_before = _threads(pid)
    most = [threads_before]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            most[0] = max(most[0], _threads(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # When far more sockets than the server serves at once connect and say nothing
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_CONNECTIONS + PROBE_SLOTS + 40)]
    try:
        # Then the probes and a scrape are still answered while they wait (they hold no slot)
        assert _status(base + "/livez") == 200
        assert _status(url) == 200
        # And every idle one is closed by the server (a deadline 5 s after accept): none stays open
        closed = [_closed_by_server(sock, timeout=30) for sock in idle]
    finally:
        sampling.set()
        sampler.join(10)
        for sock in idle:
            sock.close()
    assert all(closed), f"{closed.count(False)} idle connections stayed open for 30 s"
    # And they never cost a thread each (one waiting room holds them all)
    assert most[0] <= threads_before + 4, (threads_before, most[0])
    assert _status(base + "/livez") == 200


def test_a_trickling_client_is_closed_at_its_deadline_not_per_read(conveyor_broker):
    base = conveyor_broker.metrics_url.rsplit("/", 1)[0]
    host, port = base.split("//", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n")
        # When the client sends one header line every half second, each read well within any per-read timeout
        closed = False
        deadline = time.monotonic() + 30
        lines = 0
        while time.monotonic() < deadline and not closed:
            try:
                sock.sendall(f"X-Slow-{lines}: 1\r\n".encode())
                lines += 1
            except OSError:
                closed = True
                break
            closed = _closed_by_server(sock, timeout=0.5)
        # Then the server closed it anyway, once the connection's deadline passed
        assert closed, "the server kept a trickling connection open for 30 s"
        assert lines >= 3  # it was closed for its deadline, not at once
    finally:
        sock.close()


def test_probes_still_answer_while_the_regular_slots_are_held(conveyor_broker):
    base = conveyor_broker.metrics_url.rsplit("/", 1)[0]
    host, port = base.split("//", 1)[1].split(":")
    # When every regular slot is held by a scrape that never finishes its headers
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_CONNECTIONS + PROBE_SLOTS)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n")
        # Then another scrape gets 503, and the probes are still answered (their slots go by path)
        assert wait_for(lambda: _status(conveyor_broker.metrics_url) == 503, timeout=30)
        assert _status(base + "/livez") == 200
        assert _status(base + "/readyz") in (200, 503)  # answered (its verdict is the health check's)
    finally:
        for sock in held:
            sock.close()


def test_a_fetch_parked_on_a_deleted_topic_is_answered_unknown_topic(conveyor_broker):
    address = conveyor_broker.address
    with Admin(address) as admin:
        admin.create_topic("parked")
    outcome: list[BaseException | object] = []

    def park() -> None:
        with Admin(address) as reader:
            try:
                outcome.append(reader.fetch("parked", 0, wait_ms=25_000))
            except BaseException as exc:  # the outcome is what the test checks
                outcome.append(exc)

    thread = threading.Thread(target=park, daemon=True)
    thread.start()
    time.sleep(0.5)  # let the fetch park (if it has not, it is answered UNKNOWN_TOPIC all the same)
    with Admin(address) as admin:
        admin.delete_topic("parked")
    thread.join(20)  # well before the fetch's own 25 s wait
    assert outcome, "the parked fetch was not answered after its topic was deleted"
    assert isinstance(outcome[0], UnknownTopic), outcome


def test_the_runner_closes_idle_metrics_connections_too(conveyor_broker, runner_factory):
    runner = runner_factory(conveyor_broker.address)
    url = runner_metrics_url(runner)
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        assert _closed_by_server(sock, timeout=30), "the runner kept an idle metrics connection open for 30 s"
    finally:
        sock.close()
    assert _status(url) == 200


@pytest.fixture(autouse=True)
def _short_run():
    started = time.monotonic()
    yield
    assert time.monotonic() - started < 60
