"""Discovery: a child reads its parent from `conveyor registry` and follows a change."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from conveyor.testing import BrokerProcess
from tests.helpers import publish
from tests.mirror.test_hierarchy import read_all


def test_child_follows_a_parent_change_without_losing_offsets(tmp_path):
    root = BrokerProcess(tmp_path / "root").start()
    l2 = BrokerProcess(tmp_path / "l2", extra=["--upstream", root.address, "--mirror", "*"]).start()
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps({"nodes": {"leaf": {"role": "L3", "parent": l2.address}}}))
    registry = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "registry", "--topology", str(topology), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    leaf = None
    try:
        line = registry.stdout.readline() if registry.stdout else ""
        url = line.split("ready on ")[1].split()[0]
        leaf = BrokerProcess(
            tmp_path / "leaf", extra=["--registry", url, "--node", "leaf", "--mirror", "*", "--registry-poll-ms", "300"]
        ).start()
        publish(root.address, "orders", list(range(1000)))
        assert len(read_all(leaf.address, "orders", 1000)) == 1000
        # When the operator moves the leaf under the root and stops its old parent
        topology.write_text(json.dumps({"nodes": {"leaf": {"role": "L2", "parent": root.address}}}))
        time.sleep(1.0)
        l2.stop()
        publish(root.address, "orders", list(range(1000, 2000)))
        # Then it continues from its own end offset at the new parent
        at_root = read_all(root.address, "orders", 2000)
        at_leaf = read_all(leaf.address, "orders", 2000, timeout=30)
        assert at_leaf == at_root
    finally:
        registry.kill()
        registry.wait(10)
        for broker in (leaf, l2, root):
            if broker is not None:
                broker.stop()
