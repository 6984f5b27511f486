"""Small helpers for tests that drive a real broker with real clients."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from conveyor.broker.client.subscription import Subscription

from conveyor import Message


def drain(
    subs: Sequence[Subscription],
    expected: int,
    *,
    timeout: float = 15.0,
    ack: bool = True,
    on_batch: Callable[[int, list[Message]], None] | None = None,
) -> list[list[Message]]:
    """Receive from every subscription until ``expected`` messages arrived in all."""
    got: list[list[Message]] = [[] for _ in subs]
    deadline = time.monotonic() + timeout
    while sum(map(len, got)) < expected and time.monotonic() < deadline:
        for i, sub in enumerate(subs):
            batch = sub.receive(timeout=0.02)
            if batch:
                got[i] += batch
                if on_batch:
                    on_batch(i, batch)
                if ack:
                    sub.ack(batch)
    return got


def quiet(subs: Sequence[Subscription], seconds: float) -> list[Message]:
    """Whatever arrives in ``seconds`` (acked), to show nothing more comes."""
    extra: list[Message] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sub in subs:
            batch = sub.receive(timeout=0.02)
            extra += batch
            if batch:
                sub.ack(batch)
    return extra


REPO = Path(__file__).resolve().parents[2]


def conveyor_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """The real ``conveyor`` entry point (``python -m conveyor``), as a user runs it.

    ``CONVEYOR_*`` variables of the test process are left out so a developer's
    environment cannot change the outcome; pass them in ``env``.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**base, **(env or {})},
    )


def config_errors(result: subprocess.CompletedProcess[str], *needles: str) -> list[str]:
    """The ``[CONFIG_ERROR]`` lines of a command that had to exit 2 with no traceback, each needle in them."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "[CONFIG_ERROR]" in line]
    assert lines, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return lines
