"""Fixtures for the fault tests: real brokers that are always killed afterwards."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The frame strategies of the protocol fuzzer live with the broker tests; share them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "broker"))

from fault_helpers import Brokers


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[Brokers]:
    started = Brokers(tmp_path)
    yield started
    started.cleanup()
