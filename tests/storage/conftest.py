"""Fixtures for the storage tests only (shared fixtures belong in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.storage.storage_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
