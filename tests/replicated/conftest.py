"""Three real brokers in cluster mode on a real etcd, per test (``cluster``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.cluster_process import ClusterProcess


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    nodes = ClusterProcess(tmp_path / "cluster", nodes=3).start()
    try:
        yield nodes
    finally:
        nodes.kill()
