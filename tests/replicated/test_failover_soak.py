"""The failover bound over many kills (``make soak``): kill -9 of the leader to the first confirm by the next."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor.benchmarks.failover_bench import run


@pytest.mark.soak
def test_twenty_leader_kills_fail_over_within_the_bounds(tmp_path: Path) -> None:
    result = run(kills=20, lease_ms=2000, rate=2000, directory=tmp_path / "cluster")
    print(f"failover p50 {result['p50_s']:.2f} s, max {result['max_s']:.2f} s over {result['kills']} kills")
    assert result["kills"] == 20
    assert result["failed_sends"] == 0  # every send was confirmed in the end, across 20 failovers
    assert result["p50_s"] <= 3.0, result["rounds"]
    assert result["max_s"] <= 6.0, result["rounds"]
    assert all(r["new_epoch"] > r["epoch"] for r in result["rounds"])
