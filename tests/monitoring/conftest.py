"""Fixtures for the monitoring tests: real brokers, real runners, a real Prometheus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.monitoring.monitoring_helpers import RunnerProcess, start_runner


@pytest.fixture
def runner_factory(tmp_path: Path) -> Iterator:
    """Start ``conveyor run app_monitored`` processes; all are killed afterwards."""
    started: list[RunnerProcess] = []

    def start(address: str, *, env: dict[str, str] | None = None, args: list[str] | None = None) -> RunnerProcess:
        runner = start_runner(address, tmp_path / f"runner-{len(started)}", env=env, args=args)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.kill()
