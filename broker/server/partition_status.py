"""What this node knows of each partition it holds: role, epoch, in-sync set, high watermark, follower lag.

One description serves three readers: the ADMIN op ``describe_partitions``
(``conveyor cluster status`` asks each node for it), the cluster metrics
and the ``replication`` health check. Only a leader knows its followers'
offsets and the high watermark (etcd holds neither), so each node describes
what it leads and follows, and the command puts the nodes' answers together.

The metrics and health read this on the HTTP thread: every value read is
written whole by the loop, and the collections are copied before they are
walked. A single-node broker has no ``Partitions``: it leads every topic,
alone, at epoch 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.group_log import is_group_log
from conveyor.broker.server.replication import FollowerState, PartitionLeader

from conveyor.names import split_log

if TYPE_CHECKING:
    from conveyor.broker.server.partitions import Partitions


def follower_lag(state: FollowerState, leader_end: int, now: float) -> tuple[int, float]:
    """How far a follower is behind: messages below the leader's end, and seconds since it was last caught up.

    Seconds are 0 while it is at the end (Kafka's ``lastCaughtUpTime``): a dead
    follower's lag grows in both, a busy but keeping-up one reads near zero.
    """
    messages = max(0, leader_end - state.fetch_offset)
    seconds = 0.0 if messages == 0 else max(0.0, now - state.last_caught_up)
    return messages, seconds


def describe_led(leader: PartitionLeader, end_offset: int, now: float) -> dict[str, Any]:
    """A partition this node leads, with each follower's offsets and lag."""
    isr = sorted(set(leader.isr))
    replicas = list(leader.replicas)
    followers = []
    for node, state in sorted(list(leader.followers.items())):
        if node not in replicas:
            continue  # a replica moved away (topics reassign): no longer a follower
        messages, seconds = follower_lag(state, end_offset, now)
        followers.append(
            {
                "node": node,
                "in_isr": node in isr,
                "fetch_offset": state.fetch_offset,
                "durable_offset": state.durable,
                "lag_messages": messages,
                "lag_seconds": round(seconds, 3),
            }
        )
    return {
        "topic": leader.topic,
        "partition": leader.partition,
        "role": "leader",
        "leader": leader.node,
        "epoch": leader.epoch,
        "replicas": replicas,
        "isr": isr,
        "min_insync_replicas": leader.min_insync,
        "high_watermark": leader.hw,
        "end_offset": end_offset,
        "under_replicated": len(isr) < len(replicas),
        "below_min_insync": len(isr) < leader.min_insync,
        "followers": followers,
    }


def describe_partition(partitions: Partitions, store: Store, topic: str, number: int = 0) -> dict[str, Any]:
    """One partition as this node holds it: leading (with each follower's lag), following, or ``role: none``."""
    log = store.logs.get(topic)
    end = log.end_offset if log is not None else 0
    leader = partitions.leading.get((topic, number))
    if leader is not None:
        return describe_led(leader, end, partitions.clock())
    following = partitions.following.get((topic, number))
    if following is None:
        return {"topic": topic, "partition": number, "role": "none"}
    followed = partitions.replicas.followed(topic, number)
    return {
        "topic": topic,
        "partition": number,
        "role": "follower",
        "leader": following.leader,
        "leader_addr": following.address,
        "epoch": following.epoch,
        "high_watermark": partitions.hw(topic, number),
        "end_offset": end,
        "durable_offset": log.durable_offset if log is not None else 0,
        "truncations": followed.truncations if followed is not None else 0,
    }


def describe_partitions(
    partitions: Partitions | None, store: Store, node_id: str, topic: str | None = None
) -> dict[str, Any]:
    """This node's partitions (``topic`` None: all), as the ADMIN op ``describe_partitions`` answers."""
    if partitions is None:
        rows = [
            _named(_single(name, node_id, single.visible_offset, single.end_offset), name)
            for name, single in sorted(list(store.logs.items()))
            if topic in (None, split_log(name)[0])
        ]
        return {"node": node_id, "cluster": False, "partitions": rows}
    held = sorted(list(partitions.leading)) + sorted(list(partitions.following))  # what it leads first
    rows = [
        _named(describe_partition(partitions, store, name, number), name)
        for name, number in held
        if topic in (None, split_log(name)[0]) and name in store.logs and not is_group_log(name)
    ]
    return {"node": node_id, "cluster": True, "partitions": rows}


def _named(row: dict[str, Any], log_name: str) -> dict[str, Any]:
    """A row about the log ``T#k`` (how a node holds partition k of T) as partition k of topic T."""
    topic, number = split_log(log_name)
    return {**row, "topic": topic, "partition": number}


def _single(topic: str, node_id: str, visible: int, end: int) -> dict[str, Any]:
    return {
        "topic": topic,
        "partition": 0,
        "role": "leader",
        "leader": node_id,
        "epoch": 0,
        "replicas": [node_id],
        "isr": [node_id],
        "min_insync_replicas": 1,
        "high_watermark": visible,
        "end_offset": end,
        "under_replicated": False,
        "below_min_insync": False,
        "followers": [],
    }
