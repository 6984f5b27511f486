"""One error hierarchy for the whole project.

Every error that can cross the wire has a stable numeric ``code`` and a
``retriable`` flag, so a client in any language can decide what to do from
the code alone, and ``@retry_policy`` can retry what is retriable by default.
Errors carry fields (topic, offset, limit) as well as a message, because
callers branch on them and metrics label them.
"""

from __future__ import annotations

from typing import Any, ClassVar

_RESERVED = frozenset({"code", "name", "retriable", "message", "fields", "args"})


class ConveyorError(Exception):
    """Base of every error Conveyor raises on purpose."""

    code: ClassVar[int] = 1
    name: ClassVar[str] = "UNKNOWN"
    retriable: ClassVar[bool] = False

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message or self.name)
        self.message = message or self.name
        self.fields = fields
        for key, value in fields.items():
            if key not in _RESERVED:  # a field called "name" must not rename the error
                setattr(self, key, value)

    def __str__(self) -> str:
        return f"[{self.name}] {self.message}"


# --- storage ---------------------------------------------------------------


class LogError(ConveyorError):
    code = 100
    name = "LOG_ERROR"


class OffsetOutOfRange(LogError):
    """The offset is below the log start (retention) or beyond its end."""

    code = 101
    name = "OFFSET_OUT_OF_RANGE"


class SegmentCorrupt(ValueError, LogError):
    """A stored batch failed its CRC or structure check; it is never served."""

    code = 102
    name = "SEGMENT_CORRUPT"

    # ValueError.__init__ comes first in the MRO and rejects keyword fields.
    __init__ = ConveyorError.__init__


class StorageFull(LogError):
    code = 103
    name = "STORAGE_FULL"
    retriable = True


class StorageIOError(LogError):
    """A write or fsync failed: what was not synced is not confirmed."""

    code = 104
    name = "STORAGE_IO_ERROR"
    retriable = True


class DuplicateSequence(LogError):
    """A producer sequence older than the remembered window was resent."""

    code = 105
    name = "DUPLICATE_SEQUENCE"


# 106 is reserved: it once named a producer sequence gap, but gaps are allowed (a
# batch refused for good takes no place), so nothing raises it; codes are never reused.


class MetadataCorrupt(ValueError, LogError):
    """A topic's ``topic.json`` or ``groups.json`` is unreadable or not what it must hold."""

    code = 107
    name = "METADATA_CORRUPT"

    __init__ = ConveyorError.__init__  # as for SegmentCorrupt: keyword fields


class DataDirLocked(LogError):
    """Another process holds the data directory's lock: two brokers on one directory lose data."""

    code = 108
    name = "DATA_DIR_LOCKED"


class TooManyOpenFiles(LogError):
    """The process ran out of file descriptors (EMFILE); retry once topics or connections close."""

    code = 109
    name = "TOO_MANY_OPEN_FILES"
    retriable = True


# --- protocol and requests --------------------------------------------------


class ProtocolError(ConveyorError):
    code = 200
    name = "PROTOCOL_ERROR"


class MalformedFrame(ProtocolError):
    code = 201
    name = "MALFORMED_FRAME"


class UnsupportedVersion(ProtocolError):
    code = 202
    name = "UNSUPPORTED_VERSION"


class UnknownCommand(ProtocolError):
    code = 203
    name = "UNKNOWN_COMMAND"


class MessageTooLarge(ProtocolError):
    code = 204
    name = "MESSAGE_TOO_LARGE"


class BatchTooLarge(ProtocolError):
    code = 205
    name = "BATCH_TOO_LARGE"


class InvalidName(ProtocolError):
    """A topic or group name outside ``[A-Za-z0-9._-]{1,200}``."""

    code = 206
    name = "INVALID_NAME"


class InvalidRequest(ProtocolError):
    code = 207
    name = "INVALID_REQUEST"


class InvalidDeliveryTime(InvalidRequest):
    """A ``delay``, ``not_before`` or ``ttl`` that cannot be kept: negative, not finite, not a time, or a
    ``ttl`` that ends before the message is due. Raised by ``send()``, before anything is queued."""

    code = 208
    name = "INVALID_DELIVERY_TIME"


class UnknownTopic(ConveyorError):
    code = 300
    name = "UNKNOWN_TOPIC"


class TopicExists(ConveyorError):
    code = 301
    name = "TOPIC_EXISTS"


class UnknownGroup(ConveyorError):
    code = 302
    name = "UNKNOWN_GROUP"


class NotSubscribed(ConveyorError):
    code = 303
    name = "NOT_SUBSCRIBED"
    retriable = True


class ReadOnlyTopic(ConveyorError):
    code = 304
    name = "READ_ONLY_TOPIC"


class TopicLimit(ConveyorError):
    """The broker holds as many topics as it is configured (or has descriptors) for."""

    code = 305
    name = "TOPIC_LIMIT"


class GroupLimit(ConveyorError):
    """The broker holds as many consumer groups as it is configured for."""

    code = 306
    name = "GROUP_LIMIT"


class UnknownPartition(ConveyorError):
    """The topic has fewer partitions than the one named (``partitions`` says how many it has)."""

    code = 307
    name = "UNKNOWN_PARTITION"


class PartitionsUnsupported(ConveyorError):
    """A partition operation this broker does not offer in its mode (docs/partitions.md)."""

    code = 308
    name = "PARTITIONS_UNSUPPORTED"


class BrokerUnavailable(ConveyorError):
    """No answer from the broker in time; safe to retry with idempotence."""

    code = 400
    name = "BROKER_UNAVAILABLE"
    retriable = True


class RequestTimeout(ConveyorError, TimeoutError):
    """No answer from the broker in time; names the broker it waited for.

    Also a ``TimeoutError``, so ``future.result(timeout=...)`` callers that
    catch the standard class keep working.
    """

    code = 401
    name = "REQUEST_TIMEOUT"
    retriable = True


class BufferFull(ConveyorError):
    """The producer's buffer stayed full for ``max_block_ms``: the broker confirms slower than the caller sends."""

    code = 403
    name = "BUFFER_FULL"
    retriable = True


class ShuttingDown(ConveyorError):
    code = 402
    name = "SHUTTING_DOWN"
    retriable = True


class AuthFailed(ConveyorError):
    """The broker refused the client's CURVE handshake (unknown or mismatched key)."""

    code = 404
    name = "AUTH_FAILED"


class RateLimited(ConveyorError):
    """A rate limit refused the request; ``retry_after_ms`` says when to try again."""

    code = 405
    name = "RATE_LIMITED"
    retriable = True


class ConfigError(ConveyorError):
    code = 500
    name = "CONFIG_ERROR"


class ClusterError(ConveyorError):
    """The class of the errors of a replicated topic; a client refreshes its metadata and tries again."""

    code = 600
    name = "CLUSTER_ERROR"
    retriable = True


class NotLeader(ClusterError):
    """This node does not lead the partition; ``leader`` and ``leader_addr`` name the one that does, if known."""

    code = 601
    name = "NOT_LEADER"


class NotEnoughReplicas(ClusterError):
    """Fewer in-sync replicas than ``min_insync_replicas``: nothing was appended, so a resend is safe."""

    code = 602
    name = "NOT_ENOUGH_REPLICAS"


class FencedLeaderEpoch(ClusterError):
    """The request carries a leader epoch newer than this node knows: this node's view is stale."""

    code = 603
    name = "FENCED_LEADER_EPOCH"


class UnknownLeaderEpoch(ClusterError):
    """The request carries a leader epoch older than this node's: the sender's view is stale."""

    code = 604
    name = "UNKNOWN_LEADER_EPOCH"


class EtcdError(ClusterError):
    """etcd did not answer, timed out or answered something unexpected (never sent: the node retries or steps down).

    ``fields`` may carry ``grpc_code`` (etcd's status code) and ``status`` (the HTTP status).
    After a read timeout a write may or may not have been applied: the caller re-reads before it decides again.
    """

    code = 610
    name = "ETCD_UNAVAILABLE"


def buffer_full(held: int, buffer_memory: int, max_block: float) -> BufferFull:
    """What a producer's send raises when ``held`` bytes stayed over ``buffer_memory`` for ``max_block`` seconds."""
    return BufferFull(
        f"{held:,} bytes unconfirmed (buffer_memory {buffer_memory:,}) for {max_block * 1000:.0f} ms",
        held=held,
        buffer_memory=buffer_memory,
    )


def delivery_timed_out(address: str, topic: str, last: ConveyorError | None, attempts: int) -> ConveyorError:
    """What a batch fails with when its producer's delivery timeout ran out.

    The broker's last retriable answer (its class and code: STORAGE_FULL says
    more than a timeout), or REQUEST_TIMEOUT when no answer ever came.
    """
    if last is None:
        return RequestTimeout(f"no confirm from {address} in time", topic=topic)
    fields = {"topic": topic, **last.fields, "attempts": attempts}
    fields.pop("message", None)
    return type(last)(f"delivery timed out after {attempts} attempts; last error: {last.message}", **fields)


def _all_subclasses(cls: type[ConveyorError]) -> list[type[ConveyorError]]:
    found: list[type[ConveyorError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


ALL_ERRORS: list[type[ConveyorError]] = [ConveyorError, *_all_subclasses(ConveyorError)]
ERRORS_BY_CODE: dict[int, type[ConveyorError]] = {cls.code: cls for cls in ALL_ERRORS}


def error_for_code(code: int) -> type[ConveyorError]:
    """The class for a wire code; unknown codes map to the base class."""
    return ERRORS_BY_CODE.get(code, ConveyorError)


def is_retriable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retriable", False))
