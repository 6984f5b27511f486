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


# Under pytest-xdist (`make test` runs two workers) each test file stays on one worker: its
# module fixtures start once, and a file whose last test checks what the earlier ones did (the
# protocol fuzzer's counters) sees all of them. Folders whose tests share one expensive session
# fixture (a Spark JVM, a built wheel) stay on one worker as a whole. Without xdist the marks do
# nothing.
_ONE_WORKER = ("spark", "architecture")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        parts = path.split("/")
        group = parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in _ONE_WORKER else path
        item.add_marker(pytest.mark.xdist_group(group))
