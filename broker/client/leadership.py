"""Following a topic's leader: the decisions ``Producer`` and ``AsyncProducer`` share.

Pure: no sockets, and no clock of its own (the callers pass ``now``). The
producers keep the I/O (where a batch is sent, when a timer fires); what
they decide the same way lives here, so the two cannot drift apart:

- which broker answers mean "ask who leads now" (``LEADERSHIP_ERRORS``);
- how many batches of a topic may await a confirm (``window``), and when a
  new batch of a topic must wait (``held_back``): a batch a broker refused
  or never got must not be overtaken by its successors on the next leader,
  which would store them first, or refuse it as older than its window;
- which resends go now, together and in sequence order (``resends_due``);
- which leaders are suspect (``Suspects``): a leader the producer follows
  that hung up, cannot be sent to, or did not answer within the request
  timeout gets no batch until METADATA names another leader (asked every
  ``LEADER_POLL``), elects it again at a newer epoch, or ``request_timeout``
  passes. Going back to a dead leader that METADATA still names (its lease
  has not ended yet) would cost a whole request timeout more.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol, TypeVar

from conveyor.broker.net.metadata import ClusterView

from conveyor.errors import FencedLeaderEpoch, NotEnoughReplicas, NotLeader, UnknownLeaderEpoch
from conveyor.names import partition_log

__all__ = [
    "LEADERSHIP_ERRORS",
    "LEADER_POLL",
    "Suspects",
    "epochs_led_by",
    "held_back",
    "in_order",
    "resends_due",
    "window",
]

# Answers that mean "ask who leads now": the topic's unconfirmed batches follow the leader, in order.
LEADERSHIP_ERRORS = (NotLeader, NotEnoughReplicas, FencedLeaderEpoch, UnknownLeaderEpoch)
LEADER_POLL = 0.2  # seconds between METADATA asks while a suspect leader is still the one named


class Sequenced(Protocol):
    """A batch as far as ordering goes: its topic and its sequence number there."""

    @property
    def topic(self) -> str: ...

    @property
    def seq(self) -> int: ...


B = TypeVar("B", bound=Sequenced)
K = TypeVar("K")


def in_order(batch: Sequenced) -> tuple[str, int]:
    """The sort key that puts a producer's batches in the order each topic's leader must see them."""
    return batch.topic, batch.seq


def window(probing: bool, limit: int) -> int:
    """How many batches of a topic may await a confirm: one while its route is not proven (its first batch,
    or after a leadership error, until a leader confirms one), else ``limit``."""
    return 1 if probing else limit


def held_back(in_flight: int, window: int, resend_pending: bool) -> bool:
    """Whether a new batch of a topic must wait: its window is full, or one of its batches awaits a resend."""
    return resend_pending or in_flight >= window


def resends_due(pending: Mapping[K, B], topics: Collection[str] | None = None) -> list[tuple[K, B]]:
    """The batches of ``pending`` whose topic is in ``topics`` (all without), in sequence order per topic.

    A topic's resends go together: its leader sees them in the order it would have.
    """
    chosen = pending.items() if topics is None else ((k, b) for k, b in pending.items() if b.topic in topics)
    return sorted(chosen, key=_by_batch)


def _by_batch(item: tuple[object, Sequenced]) -> tuple[str, int]:
    return in_order(item[1])


def epochs_led_by(view: ClusterView | None, address: str) -> dict[str, int]:
    """The leader epoch of each partition that ``address`` leads in the METADATA answer ``view``, by log
    name (``T`` for partition 0, ``T#k``: the names a producer's batches go by)."""
    if view is None:
        return {}
    return {
        partition_log(topic, number): info.leader_epoch
        for topic, partitions in view.topics.items()
        for number, info in partitions.items()
        if view.leader_address(topic, number) == address
    }


class Suspects:
    """The leaders a producer got no answer from (hung up, could not be sent to, silent past the request
    timeout): when each became suspect and, per topic it led, at which epoch."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # address -> when it became suspect
        self.epochs: dict[tuple[str, str], int] = {}  # (address, topic) -> the epoch it led at then
        self.asked_at = 0.0  # when METADATA was last asked again because of a suspect

    def __bool__(self) -> bool:
        return bool(self.since)

    def hung_up(self, address: str, view: ClusterView | None, now: float) -> None:
        """``address`` gets nothing more until another leader is named (``view``: the last METADATA answer)."""
        self.since[address] = now
        for topic, epoch in epochs_led_by(view, address).items():
            self.epochs[(address, topic)] = epoch

    def heard_from(self, address: str) -> None:
        """``address`` answered: it is not suspect any more."""
        if self.since.pop(address, None) is not None:
            self.epochs = {key: epoch for key, epoch in self.epochs.items() if key[0] != address}

    def hold(self, address: str, topic: str, view: ClusterView | None, now: float, patience: float) -> bool:
        """Whether a batch of ``topic`` that METADATA routes to ``address`` must wait for the next METADATA.

        Not when ``address`` leads the topic at a newer epoch than when it hung up (elected again), nor once
        it has been suspect for ``patience`` seconds (still named after all that time: it may be back).
        """
        since = self.since.get(address)
        if since is None:
            return False
        hung_up_at = self.epochs.get((address, topic))
        if hung_up_at is None or epochs_led_by(view, address).get(topic, -1) > hung_up_at:
            return False
        if now - since >= patience:
            del self.since[address]
            return False
        return True

    def poll_due(self, now: float) -> bool:
        """Whether to ask METADATA again now: a leader is suspect and ``LEADER_POLL`` passed since the last ask."""
        if not self.since or now - self.asked_at < LEADER_POLL:
            return False
        self.asked_at = now
        return True
