"""Where the cluster's state lives in etcd, and the records stored there (pure).

Everything sits under ``/conveyor/<cluster>/`` (design §2)::

    meta                          {"format": 1}
    nodes/<node_id>               NodeRecord, under the node's lease
    controller                    {"node": id}, under the controller's lease
    topics/<t>/config             TopicConfigRecord
    topics/<t>/partitions/<p>     PartitionState, always written by CAS on mod_revision
    requests/create/<t>           CreateRequest
    requests/shutdown/<node_id>   ShutdownRequest, under the asking node's lease
    requests/reassign/<t>/<p>     ReassignRequest
    requests/delete/<t>           DeleteRequest

Records are JSON. A record that does not decode (bad JSON, a missing field, a
wrong type, a leader outside its assignment) raises ``RecordError`` naming the
key and what is wrong: the agent logs it and skips that key, since one damaged
value must never stop the thread that keeps the node's lease.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.names import MAX_PARTITIONS, NAME_RE

FORMAT = 1
NODE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")


class RecordError(ValueError):
    """A key or value under the cluster prefix that does not decode: skipped, never fatal."""


@dataclass(frozen=True, order=True)
class TopicPartition:
    """One partition of a topic: the unit of leadership, replication and every key below ``topics/``."""

    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}"


@dataclass(frozen=True)
class NodeRecord:
    """A live node, as it registered itself: where clients and followers reach it."""

    node_id: str
    advertise: str
    metrics: str = ""
    version: str = ""
    started_ms: int = 0
    curve_public: str = ""  # its CURVE server key (Z85), when it serves CURVE: followers handshake with it


@dataclass(frozen=True)
class TopicConfigRecord:
    """How a replicated topic was made; ``settings`` are its topic settings as given (JSON values).

    ``topic_id`` tells one topic from an earlier one of the same name (Kafka's topic id): a
    node that was away while a topic was deleted, or deleted and made again, finds its local
    copy under another id and drops it rather than serving or registering stale data.
    Records written before it existed have none ("").
    """

    replication_factor: int
    min_insync_replicas: int
    settings: Mapping[str, Any] = field(default_factory=dict)
    topic_id: str = ""
    partitions: int = 1  # each has its own record under partitions/<p>; absent in records of 1


@dataclass(frozen=True)
class PartitionState:
    """Who holds a partition and who leads it.

    ``assignment`` is the ordered replica list (its first live in-sync member is
    the preferred leader), ``isr`` the members known to hold every confirmed
    batch, ``leader`` is ``None`` exactly when ``offline`` (no in-sync member
    is live), and ``leader_epoch`` grows by one at every change of leader.
    """

    assignment: tuple[str, ...]
    leader: str | None
    leader_epoch: int
    isr: tuple[str, ...]
    offline: bool = False


@dataclass(frozen=True)
class CreateRequest:
    """A node asks the controller for a topic; ``None`` means the cluster default. ``refused`` is the answer's error."""

    requester: str
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    refused: tuple[int, str] | None = None  # (error code, message), written by the controller
    # A topic whose data the requester holds already (a single-node directory joining a cluster):
    # these replicas, the first leading at ``leader_epoch``, instead of a placement.
    assignment: tuple[str, ...] | None = None
    leader_epoch: int = 1
    partitions: int = 1


@dataclass(frozen=True)
class ShutdownRequest:
    """A node going down asks the controller to move its leaderships; ``done`` is set once it has.

    ``successors`` names, per partition, the follower the leader saw caught up, which the
    controller prefers when it is still a live in-sync member.
    """

    successors: Mapping[TopicPartition, str] = field(default_factory=dict)
    done: bool = False


@dataclass(frozen=True)
class ReassignRequest:
    """Move a partition to ``assignment``: the new replicas join as followers, the old leave once they are in sync.

    ``min_insync_replicas``, when given, becomes the topic's once the move is done (a topic
    that grows from one replica to three raises it then, not before its new replicas are in sync).
    """

    assignment: tuple[str, ...]
    min_insync_replicas: int | None = None


@dataclass(frozen=True)
class DeleteRequest:
    """A node asks the controller to delete a topic: its config and partition records go in one txn."""

    requester: str


# --- keys ------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedKey:
    """What a key under the cluster prefix names: ``kind`` and the parts that apply."""

    kind: str  # meta | node | controller | config | partition | create | shutdown | reassign | delete
    node_id: str = ""
    topic: str = ""
    tp: TopicPartition | None = None


class Keys:
    """The key layout of one cluster (``--cluster-name``)."""

    def __init__(self, cluster: str = "default") -> None:
        if not NODE_ID_RE.fullmatch(cluster):
            raise RecordError(f"cluster name {cluster!r} must match {NODE_ID_RE.pattern}")
        self.cluster = cluster
        self.prefix = f"/conveyor/{cluster}/"
        self.meta = self.prefix + "meta"
        self.controller = self.prefix + "controller"
        self.nodes = self.prefix + "nodes/"
        self.topics = self.prefix + "topics/"
        self.create_requests = self.prefix + "requests/create/"
        self.shutdown_requests = self.prefix + "requests/shutdown/"
        self.reassign_requests = self.prefix + "requests/reassign/"
        self.delete_requests = self.prefix + "requests/delete/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def topic(self, topic: str) -> str:
        """The prefix of every record of ``topic`` (its config and partitions; not ``<topic>.dlq``'s)."""
        return f"{self.topics}{topic}/"

    def topic_config(self, topic: str) -> str:
        return f"{self.topics}{topic}/config"

    def partition(self, tp: TopicPartition) -> str:
        return f"{self.topics}{tp.topic}/partitions/{tp.partition}"

    def create_request(self, topic: str) -> str:
        return self.create_requests + topic

    def shutdown_request(self, node_id: str) -> str:
        return self.shutdown_requests + node_id

    def reassign_request(self, tp: TopicPartition) -> str:
        return f"{self.reassign_requests}{tp.topic}/{tp.partition}"

    def delete_request(self, topic: str) -> str:
        return self.delete_requests + topic

    def reassign_requests_of(self, topic: str) -> str:
        """The prefix of ``topic``'s reassignment requests (every partition)."""
        return f"{self.reassign_requests}{topic}/"

    def parse(self, key: str) -> ParsedKey:
        """Which record ``key`` holds; ``RecordError`` for a key outside the layout."""
        if not key.startswith(self.prefix):
            raise RecordError(f"{key!r} is not under {self.prefix}")
        parts = key[len(self.prefix) :].split("/")
        match parts:
            case ["meta"]:
                return ParsedKey("meta")
            case ["controller"]:
                return ParsedKey("controller")
            case ["nodes", node_id]:
                return ParsedKey("node", node_id=_node_id(node_id, key))
            case ["topics", topic, "config"]:
                return ParsedKey("config", topic=_topic(topic, key))
            case ["topics", topic, "partitions", partition]:
                tp = TopicPartition(_topic(topic, key), _partition(partition, key))
                return ParsedKey("partition", topic=tp.topic, tp=tp)
            case ["requests", "create", topic]:
                return ParsedKey("create", topic=_topic(topic, key))
            case ["requests", "shutdown", node_id]:
                return ParsedKey("shutdown", node_id=_node_id(node_id, key))
            case ["requests", "delete", topic]:
                return ParsedKey("delete", topic=_topic(topic, key))
            case ["requests", "reassign", topic, partition]:
                tp = TopicPartition(_topic(topic, key), _partition(partition, key))
                return ParsedKey("reassign", topic=tp.topic, tp=tp)
        raise RecordError(f"{key!r} is not a key of the cluster layout")


def _topic(name: str, key: str) -> str:
    if not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise RecordError(f"{key!r}: {name!r} is not a topic name")
    return name


def _node_id(name: str, key: str) -> str:
    if not NODE_ID_RE.fullmatch(name):
        raise RecordError(f"{key!r}: {name!r} is not a node id")
    return name


def _partition(text: str, key: str) -> int:
    if not text.isdigit() or len(text) > 9 or (text != "0" and text.startswith("0")):
        raise RecordError(f"{key!r}: {text!r} is not a partition number")
    return int(text)


# --- encode ----------------------------------------------------------------


def _dump(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def encode_meta() -> bytes:
    return _dump({"format": FORMAT})


def encode_node(record: NodeRecord) -> bytes:
    """The node id is the key's last part, so it is not repeated in the value."""
    body: dict[str, Any] = {
        "advertise": record.advertise,
        "metrics": record.metrics,
        "version": record.version,
        "started_ms": record.started_ms,
    }
    if record.curve_public:
        body["curve_public"] = record.curve_public
    return _dump(body)


def encode_controller(node_id: str) -> bytes:
    return _dump({"node": node_id})


def encode_topic_config(record: TopicConfigRecord) -> bytes:
    body: dict[str, Any] = {
        "replication_factor": record.replication_factor,
        "min_insync_replicas": record.min_insync_replicas,
        "settings": dict(record.settings),
    }
    if record.topic_id:
        body["topic_id"] = record.topic_id
    if record.partitions > 1:
        body["partitions"] = record.partitions
    return _dump(body)


def encode_partition(state: PartitionState) -> bytes:
    return _dump(
        {
            "assignment": list(state.assignment),
            "leader": state.leader,
            "leader_epoch": state.leader_epoch,
            "isr": list(state.isr),
            "offline": state.offline,
        }
    )


def encode_create(request: CreateRequest) -> bytes:
    config: dict[str, Any] = {"settings": dict(request.settings)}
    if request.replication_factor is not None:
        config["replication_factor"] = request.replication_factor
    if request.min_insync_replicas is not None:
        config["min_insync_replicas"] = request.min_insync_replicas
    if request.partitions > 1:
        config["partitions"] = request.partitions
    body: dict[str, Any] = {"from": request.requester, "config": config}
    if request.refused is not None:
        body["refused"] = {"code": request.refused[0], "message": request.refused[1]}
    if request.assignment is not None:
        body["existing"] = {"assignment": list(request.assignment), "leader_epoch": request.leader_epoch}
    return _dump(body)


def encode_shutdown(request: ShutdownRequest) -> bytes:
    body: dict[str, Any] = {"successors": {str(tp): node for tp, node in sorted(request.successors.items())}}
    if request.done:
        body["done"] = True
    return _dump(body)


def encode_reassign(request: ReassignRequest) -> bytes:
    body: dict[str, Any] = {"assignment": list(request.assignment)}
    if request.min_insync_replicas is not None:
        body["min_insync_replicas"] = request.min_insync_replicas
    return _dump(body)


def encode_delete(request: DeleteRequest) -> bytes:
    return _dump({"from": request.requester})


# --- decode ----------------------------------------------------------------


class _Fields:
    """Typed reads from one decoded JSON object, each failure a ``RecordError`` naming the key."""

    def __init__(self, key: str, value: bytes | dict[str, Any]) -> None:
        self.key = key
        try:
            obj = value if isinstance(value, dict) else json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordError(f"{key!r}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{key!r}: expected a JSON object, got {type(obj).__name__}")
        self.obj: dict[str, Any] = obj

    def fail(self, what: str) -> RecordError:
        return RecordError(f"{self.key!r}: {what}")

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if name not in self.obj:
            if default is ...:
                raise self.fail(f"missing field {name!r}")
            return default
        value = self.obj[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise self.fail(f"field {name!r} has the wrong type ({type(value).__name__})")
        return value

    def count(self, name: str, low: int, default: Any = ...) -> Any:
        value = self.get(name, int, default)
        if value is not None and value is not default and value < low:
            raise self.fail(f"field {name!r} must be >= {low}, got {value}")
        return value

    def nodes(self, name: str, *, empty: bool = False) -> tuple[str, ...]:
        value = self.get(name, list)
        if not all(isinstance(n, str) and NODE_ID_RE.fullmatch(n) for n in value):
            raise self.fail(f"field {name!r} must be a list of node ids")
        if len(set(value)) != len(value):
            raise self.fail(f"field {name!r} repeats a node")
        if not value and not empty:
            raise self.fail(f"field {name!r} is empty")
        return tuple(value)


def decode_node(key: str, node_id: str, value: bytes) -> NodeRecord:
    f = _Fields(key, value)
    return NodeRecord(
        node_id=node_id,
        advertise=f.get("advertise", str),
        metrics=f.get("metrics", str, ""),
        version=f.get("version", str, ""),
        started_ms=f.count("started_ms", 0, 0),
        curve_public=f.get("curve_public", str, ""),
    )


def decode_controller(key: str, value: bytes) -> str:
    node = _Fields(key, value).get("node", str)
    return _node_id(node, key)


def decode_topic_config(key: str, value: bytes) -> TopicConfigRecord:
    f = _Fields(key, value)
    rf = f.count("replication_factor", 1)
    min_insync = f.count("min_insync_replicas", 1)
    if min_insync > rf:
        raise f.fail(f"min_insync_replicas {min_insync} > replication_factor {rf}")
    partitions = _partition_count(f)
    return TopicConfigRecord(rf, min_insync, f.get("settings", dict, {}), f.get("topic_id", str, ""), partitions)


def _partition_count(f: _Fields) -> int:
    count = f.count("partitions", 1, 1)
    if count > MAX_PARTITIONS:
        raise f.fail(f"field 'partitions' must be <= {MAX_PARTITIONS}, got {count}")
    return int(count)


def decode_partition(key: str, value: bytes) -> PartitionState:
    f = _Fields(key, value)
    assignment = f.nodes("assignment")
    isr = f.nodes("isr", empty=True)
    leader = f.get("leader", (str, type(None)))
    epoch = f.count("leader_epoch", 0)
    offline = f.get("offline", bool, False)
    if not set(isr) <= set(assignment):
        raise f.fail(f"isr {list(isr)} is not within assignment {list(assignment)}")
    if offline != (leader is None):
        raise f.fail(f"leader {leader!r} with offline={offline}: a partition has a leader exactly when online")
    if leader is not None and leader not in isr:
        raise f.fail(f"leader {leader!r} is not in isr {list(isr)}")
    return PartitionState(assignment, leader, epoch, isr, offline)


def decode_create(key: str, value: bytes) -> CreateRequest:
    f = _Fields(key, value)
    requester = _node_id(f.get("from", str), key)
    config = _Fields(key, f.get("config", dict, {}))
    rf = config.count("replication_factor", 1, None)
    min_insync = config.count("min_insync_replicas", 1, None)
    refused = f.get("refused", dict, None)
    answer = None
    if refused is not None:
        code, message = refused.get("code"), refused.get("message")
        if not isinstance(code, int) or not isinstance(message, str):
            raise f.fail("field 'refused' must hold an int code and a str message")
        answer = (code, message)
    existing = f.get("existing", dict, None)
    assignment, epoch = None, 1
    if existing is not None:
        held = _Fields(key, existing)
        assignment, epoch = held.nodes("assignment"), held.count("leader_epoch", 1, 1)
    settings = config.get("settings", dict, {})
    return CreateRequest(requester, rf, min_insync, settings, answer, assignment, epoch, _partition_count(config))


def decode_shutdown(key: str, value: bytes) -> ShutdownRequest:
    f = _Fields(key, value)
    successors: dict[TopicPartition, str] = {}
    for name, node in f.get("successors", dict, {}).items():
        topic, _, partition = name.rpartition("/")
        if not isinstance(node, str):
            raise f.fail(f"successor of {name!r} is not a node id")
        successors[TopicPartition(_topic(topic, key), _partition(partition, key))] = _node_id(node, key)
    return ShutdownRequest(successors, f.get("done", bool, False))


def decode_reassign(key: str, value: bytes) -> ReassignRequest:
    f = _Fields(key, value)
    assignment = f.nodes("assignment")
    min_insync = f.count("min_insync_replicas", 1, None)
    if min_insync is not None and min_insync > len(assignment):
        raise f.fail(f"min_insync_replicas {min_insync} > {len(assignment)} replicas")
    return ReassignRequest(assignment, min_insync)


def decode_delete(key: str, value: bytes) -> DeleteRequest:
    return DeleteRequest(_node_id(_Fields(key, value).get("from", str), key))
