"""``cluster_status``: the nodes, the controller, and each partition's leader, in-sync set, HW and follower lag.

Two kinds of answer make it up. METADATA from any node gives what etcd
holds: the registered nodes, the controller, each partition's leader,
epoch, replicas and in-sync set. Only a partition's leader knows its high
watermark and how far each follower is (no one writes them to etcd: they
move with every batch), so the ADMIN op ``describe_partitions`` is asked of
every registered node, one at a time, and each leader's rows are joined to
the METADATA view. A node that does not answer is reported with its error,
and its partitions without the leader's detail. Asking the nodes from the
client keeps the broker's loop out of it: no broker waits on another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import ClusterView

from conveyor.errors import ConveyorError


def cluster_status(bootstrap: str | Sequence[str] | None = None, *, timeout_ms: int = 5000) -> dict[str, Any]:
    """Ask METADATA of the first node of ``bootstrap`` that answers, then ``describe_partitions`` of every node."""
    with Admin(bootstrap, timeout_ms=timeout_ms) as admin:
        view = admin.metadata.refresh()
    answers: dict[str, Mapping[str, Any]] = {}
    errors: dict[str, str] = {}
    for node, address in sorted(view.nodes.items()):
        try:
            with Admin(address, timeout_ms=timeout_ms) as one:
                answers[node] = one.describe_partitions()
        except ConveyorError as exc:
            errors[node] = f"[{exc.name}] {exc.message}"
    return combine(view, answers, errors)


def combine(view: ClusterView, answers: Mapping[str, Mapping[str, Any]], errors: Mapping[str, str]) -> dict[str, Any]:
    """The status from a METADATA view and the nodes' ``describe_partitions`` answers (pure)."""
    led = {
        (row["topic"], row["partition"]): row
        for answer in answers.values()
        for row in answer.get("partitions", [])
        if row.get("role") == "leader"
    }
    partitions = []
    named: set[str] = set()
    for topic, parts in sorted(view.topics.items()):
        for number, info in sorted(parts.items()):
            named.update(info.replicas)
            row = led.get((topic, number))
            if row is not None and row.get("leader") != info.leader:
                row = None  # an old leader's answer, from before a failover: not this partition's state
            partitions.append(_partition(topic, number, info, row, errors))
    single = any(answer.get("cluster") is False for answer in answers.values())
    return {
        "mode": "single" if single else "cluster",
        "asked": view.source,
        "controller": view.controller,
        "nodes": [_node(node, view, errors) for node in sorted(set(view.nodes) | named)],
        "partitions": partitions,
    }


def _node(node: str, view: ClusterView, errors: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {
        "id": node,
        "address": view.nodes.get(node),
        "alive": node in view.nodes,
        "controller": node == view.controller,
    }
    if node in errors:
        found["error"] = errors[node]
    return found


def _partition(
    topic: str, number: int, info: Any, row: Mapping[str, Any] | None, errors: Mapping[str, str]
) -> dict[str, Any]:
    """One partition: METADATA's fields, then the leader's own (fresher) in-sync set, HW and lag."""
    found: dict[str, Any] = {
        "topic": topic,
        "partition": number,
        "leader": info.leader,
        "epoch": info.leader_epoch,
        "replicas": list(info.replicas),
        "isr": list(info.isr),
        "offline": info.offline,
        "min_insync_replicas": None,
        "high_watermark": None,
        "end_offset": None,
        "under_replicated": len(info.isr) < len(info.replicas),
        "below_min_insync": None,
        "followers": [],
    }
    if row is not None:
        for key in ("epoch", "isr", "min_insync_replicas", "high_watermark", "end_offset", "followers"):
            found[key] = row[key]
        found["under_replicated"] = row["under_replicated"]
        found["below_min_insync"] = row["below_min_insync"]
    elif info.leader is not None:
        found["error"] = errors.get(info.leader, "the leader did not describe it (a leadership change under way?)")
    return found
