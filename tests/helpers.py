"""The helpers every test folder uses: publish, wait for a condition, a free port, scrape /metrics, a fake clock.

One copy each, imported as ``from tests.helpers import ...``. Folder-specific helpers stay in
their folder's ``*_helpers.py``; fixtures shared across folders are in ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from conveyor import Producer

T = TypeVar("T")

# CI runs on two loaded cores: a condition another process reaches gets this long by default.
TIMEOUT = 30.0


def wait_for(
    check: Callable[[], T], timeout: float = TIMEOUT, interval: float = 0.05, *, message: str = "condition"
) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something true, and return that.

    At ``timeout`` it raises ``AssertionError`` naming ``message`` and the last answer, so a test
    that waits for another process (a broker, a runner) fails saying what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message} (last: {last!r})")
        time.sleep(interval)


def stays_false(check: Callable[[], Any], seconds: float, interval: float = 0.05, *, message: str = "it") -> None:
    """Assert that ``check`` stays false for ``seconds``: something that must not happen (a retry too soon).

    Only the negative of ``wait_for``: a pass proves nothing happened within the window, not forever.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        last = check()
        assert not last, f"{message} happened within {seconds:g} s (got {last!r})"
        time.sleep(interval)


class FakeClock:
    """A clock the test moves by hand (seconds, like ``time.time``): for in-process tests of code that
    takes a ``clock`` (the topic log, consumer groups), so that time-outs are steps, not waits."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def publish(
    address: str,
    topic: str,
    values: Iterable[Any],
    *,
    keys: Sequence[Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
    **producer_options: Any,
) -> list[int]:
    """Send ``values`` (with ``keys[i]`` when given) and wait for every confirm; their offsets, in order.

    ``producer_options`` go to ``Producer``: unless given, ``linger_ms=1`` and ``eager=False``, so a
    few values sent together go as one batch, now (tests that read delivery order or attempts across a
    runner's death rely on that; the eager default would send the first value alone).
    """
    values = list(values)
    if keys is not None and len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys for {len(values)} values")
    with Producer(address, **{"linger_ms": 1, "eager": False, **producer_options}) as producer:
        futures = [
            producer.send(topic, value, key=None if keys is None else keys[i], headers=headers)
            for i, value in enumerate(values)
        ]
        producer.flush(timeout=timeout)
    return [future.result(timeout=timeout) for future in futures]


def free_port() -> int:
    """A loopback TCP port nothing listens on (just now: bind to it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_address() -> str:
    """A loopback ZeroMQ address where nothing listens (a broker that is down)."""
    return f"tcp://127.0.0.1:{free_port()}"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """``(status, body)`` of a GET; an HTTP error status is an answer too, not an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(url: str) -> str:
    """The text of a ``/metrics`` page, which must answer 200."""
    status, body = http_get(url)
    assert status == 200, f"{url} answered {status}: {body[:500]}"
    return body


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition: ``(name, frozenset of label pairs) -> value``."""
    return {
        (sample.name, frozenset(sample.labels.items())): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in an exposition, or None when it is absent."""
    return samples(text).get((name, frozenset(labels.items())))


def curve_keys(directory: Path) -> Path:
    """CURVE certificates for a broker test: the broker's, an authorized client's (alice), a stranger's (mallory).

    ``directory/authorized`` holds alice's public key only, for ``--curve-authorized-keys``.
    """
    from conveyor.broker.net import security

    security.generate(directory / "server", "broker")
    security.generate(directory / "clients", "alice")
    security.generate(directory / "strangers", "mallory")
    authorized = directory / "authorized"
    authorized.mkdir()
    shutil.copy(directory / "clients" / "alice.key", authorized / "alice.key")
    return directory
