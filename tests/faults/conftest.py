"""Fixtures for the fault tests: real brokers that are always killed afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.fault_helpers import Brokers


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[Brokers]:
    started = Brokers(tmp_path)
    yield started
    started.cleanup()
