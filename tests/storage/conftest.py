"""Fixtures for the storage tests only (shared fixtures belong in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def topic_dir(tmp_path: Path) -> Path:
    return tmp_path / "topics" / "t"
