"""``conveyor cluster status``: the nodes, the controller, each partition's leader, ISR, HW and follower lag.

``broker/client/cluster_status.py`` gathers it (METADATA, then each node's
``describe_partitions``); here it is printed as JSON or as text: a summary
line, a table of nodes, a table of partitions, built by pure functions so the
layout is tested without a cluster.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.broker.cli.cluster import cluster_action
from conveyor.broker.cli.main import CLIENT_OPTIONS, client_options
from conveyor.broker.config.sources import add_options

from conveyor.errors import ConfigError

NODE_COLUMNS = ["NODE", "ADDRESS", "ALIVE", "CONTROLLER", "NOTE"]
PARTITION_COLUMNS = [
    "TOPIC",
    "PARTITION",
    "LEADER",
    "EPOCH",
    "REPLICAS",
    "ISR",
    "MIN_ISR",
    "HW",
    "END",
    "STATE",
    "FOLLOWER LAG (messages, seconds)",
]


def _status_setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CLIENT_OPTIONS)
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("--timeout-ms", type=int, default=5000, help="how long each node has to answer")


@cluster_action("status", "nodes, controller, and each partition's leader, epoch, ISR, HW and lag", _status_setup)
def cmd_status(args: argparse.Namespace) -> int:
    from conveyor.broker.client.cluster_status import cluster_status

    opts = client_options(args, "status")  # CONVEYOR_STATUS_BROKER: not CONVEYOR_CLUSTER_*, the broker's own
    if args.timeout_ms <= 0:
        raise ConfigError(f"--timeout-ms {args.timeout_ms}: must be positive")
    status = cluster_status(opts["broker"], timeout_ms=args.timeout_ms)
    print(json.dumps(status, indent=2) if args.format == "json" else "\n".join(status_lines(status)))
    return 0


def status_lines(status: Mapping[str, Any]) -> list[str]:
    nodes, partitions = status["nodes"], status["partitions"]
    if status["mode"] == "single":
        node = nodes[0] if nodes else {"id": "?", "address": status["asked"]}
        head = [
            f"single node (no cluster): {node['id']} at {node['address']} leads every topic, "
            f"with one replica and no followers"
        ]
    else:
        alive = sum(1 for n in nodes if n["alive"])
        head = [
            f"cluster: {alive} of {len(nodes)} nodes alive, controller {status['controller'] or 'none'} "
            f"(asked {status['asked']})",
            "",
            *table(NODE_COLUMNS, [_node_row(n) for n in nodes]),
        ]
    rows = [_partition_row(p) for p in partitions]
    under = sum(1 for p in partitions if p["under_replicated"])
    summary = f"{len(partitions)} partition(s), {under} under-replicated"
    return [*head, "", summary, *(table(PARTITION_COLUMNS, rows) if rows else [])]


def table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [[c.ljust(w) for c, w in zip(columns, widths, strict=True)]]
    lines += [[v.ljust(w) for v, w in zip(row, widths, strict=True)] for row in rows]
    return ["  ".join(line).rstrip() for line in lines]


def _node_row(node: Mapping[str, Any]) -> list[str]:
    return [
        node["id"],
        node["address"] or "-",
        "yes" if node["alive"] else "no",
        "yes" if node["controller"] else "",
        node.get("error", "" if node["alive"] else "not registered in etcd"),
    ]


def partition_state(p: Mapping[str, Any]) -> str:
    if p["offline"]:
        return "offline"
    if p.get("error"):
        return "no detail"
    if p["below_min_insync"]:
        return "below min ISR"
    return "under-replicated" if p["under_replicated"] else "ok"


def _partition_row(p: Mapping[str, Any]) -> list[str]:
    lag = "; ".join(
        f"{f['node']} {f['lag_messages']} {f['lag_seconds']:.1f}s{'' if f['in_isr'] else ' (out of ISR)'}"
        for f in p["followers"]
    )
    return [
        p["topic"],
        str(p["partition"]),
        p["leader"] or "-",
        str(p["epoch"]),
        ",".join(p["replicas"]),
        ",".join(p["isr"]),
        _or_dash(p["min_insync_replicas"]),
        _or_dash(p["high_watermark"]),
        _or_dash(p["end_offset"]),
        partition_state(p),
        lag or ("-" if p.get("error") is None else p["error"]),
    ]


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
