"""The connections the broker knows: when each was last heard and written to, what it subscribed.

Liveness as in the zguide's Majordomo broker: any message from a peer counts
as a heartbeat; a peer silent for ``liveness`` heartbeat intervals is gone;
a peer holding subscriptions that the broker has not written to for an
interval is sent a HEARTBEAT. A peer whose socket was full when a DELIVER
went out is "busy" until it talks again (it reads, then): its groups are
dispatched again at that moment, not on a timer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.broker.server.groups import Group, Member
from conveyor.broker.server.limits import TokenBucket

from conveyor.errors import NotSubscribed

log = logging.getLogger("conveyor.broker")


@dataclass(slots=True)
class Peer:
    identity: bytes
    last_seen: float
    last_sent: float = 0.0
    members: dict[int, tuple[Group, Member]] = field(default_factory=dict)
    busy: list[tuple[Group, Member]] = field(default_factory=list)  # members whose last DELIVER bounced
    creations: TokenBucket | None = None  # its auto-create rate, made at its first auto-creation


class Peers(dict[bytes, Peer]):
    """``{identity: Peer}``; ``to_dispatch`` is the loop's set of groups to dispatch this pass.

    ``redelivered`` counts the messages a leaving member held (labelled topic, group, reason).
    """

    def __init__(self, clock: Callable[[], float], to_dispatch: set[Group], redelivered: Any) -> None:
        super().__init__()
        self.clock = clock
        self.to_dispatch = to_dispatch
        self.redelivered = redelivered

    def touch(self, identity: bytes) -> Peer:
        """A message came from ``identity``: it lives, and it reads (its busy members may be sent to again)."""
        peer = self.get(identity)
        now = self.clock()
        if peer is None:
            peer = self[identity] = Peer(identity, now)
        peer.last_seen = now
        if peer.busy:
            for group, member in peer.busy:
                if member.busy:
                    member.busy = False
                    self.to_dispatch.add(group)
            peer.busy.clear()
        return peer

    def sent(self, identity: bytes) -> None:
        known = self.get(identity)
        if known is not None:
            known.last_sent = self.clock()

    def mark_busy(self, identity: bytes, group: Group, member: Member) -> bool:
        """A DELIVER to ``member`` bounced: hold its deliveries until its peer talks. False if the peer is gone."""
        peer = self.get(identity)
        if peer is None:
            return False
        member.busy = True
        peer.busy.append((group, member))
        return True

    def subscription(self, identity: bytes, sub_id: int) -> tuple[Group, Member]:
        found = self[identity].members.get(sub_id)
        if found is None:
            raise NotSubscribed(f"no subscription {sub_id} on this connection; subscribe again", sub=sub_id)
        return found

    def forget_subscription(self, identity: bytes, sub_id: int) -> None:
        peer = self.get(identity)
        if peer is not None:
            peer.members.pop(sub_id, None)

    def subscribers(self) -> list[bytes]:
        """The peers holding subscriptions (the ones told BYE at shutdown)."""
        return [identity for identity, peer in self.items() if peer.members]

    def sweep(self, now: float, interval: float, liveness: int) -> tuple[list[bytes], list[bytes]]:
        """(peers gone silent for ``liveness`` intervals, subscribers owed a HEARTBEAT)."""
        dead_after = interval * liveness
        gone: list[bytes] = []
        ping: list[bytes] = []
        for identity, peer in self.items():
            if now - peer.last_seen > dead_after:
                if peer.members:
                    log.info("peer %s missed its heartbeats: evicting", identity.hex())
                gone.append(identity)
            elif peer.members and now - peer.last_sent >= interval:
                ping.append(identity)
        return gone, ping

    def gone(self, identity: bytes, reason: str) -> None:
        """The peer left (BYE, silence, unreachable): each of its members leaves its group."""
        peer = self.pop(identity, None)
        if peer is not None:
            for group, member in peer.members.values():
                self.leave(group, member, reason)

    def leave(self, group: Group, member: Member, reason: str) -> None:
        """What the member held is redelivered (to another member where there is one)."""
        held = member.in_flight
        group.leave(member, reason=reason)
        if held:
            self.redelivered.labels(group.topic, group.name, reason).inc(held)
        self.to_dispatch.add(group)
