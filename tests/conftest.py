"""Fixtures shared by every test folder (a folder's own fixtures stay in its conftest.py).

The real broker comes from Conveyor's pytest plugin (``conveyor.testing``): ``conveyor_broker`` and
``conveyor_broker_factory``. Helpers that are plain functions are in ``tests/helpers.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    """A clock the test moves by hand, for code that takes ``clock=`` (the topic log, consumer groups)."""
    return FakeClock()
