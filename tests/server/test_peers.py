"""Peers: liveness by heartbeats, busy members woken when their peer talks, subscriptions by id."""

from __future__ import annotations

import pytest
from conveyor.broker.server.groups import Group, GroupSettings, Member
from conveyor.broker.server.peers import Peers
from conveyor.monitoring.metrics import NullMetrics

from conveyor.errors import NotSubscribed
from tests.server.server_fakes import Clock


def peers_at(clock: Clock) -> tuple[Peers, set[Group]]:
    to_dispatch: set[Group] = set()
    return Peers(clock, to_dispatch, NullMetrics().redelivered_messages), to_dispatch


def subscribed(peers: Peers, identity: bytes, sub_id: int = 1) -> tuple[Group, Member]:
    group = Group("t", "g", GroupSettings(), next_offset=0, clock=Clock())
    member = Member(identity, sub_id, credit=10, batch_size=10)
    peers.touch(identity).members[sub_id] = (group, member)
    return group, member


def test_a_silent_peer_is_gone_after_liveness_intervals_and_a_quiet_subscriber_is_owed_a_heartbeat():
    # Given a subscriber, a plain client and a silent subscriber, with 1 s heartbeats and liveness 3
    clock = Clock(now=0.0)
    peers, _ = peers_at(clock)
    subscribed(peers, b"silent")
    clock.now = 2.0
    subscribed(peers, b"talks")
    peers.touch(b"client")
    # When 3.5 s have passed since the silent one spoke
    clock.now = 3.5
    gone, owed = peers.sweep(clock.now, 1.0, 3)
    # Then it is gone, and only the subscriber that was never written to is owed a HEARTBEAT
    assert gone == [b"silent"] and owed == [b"talks"]
    peers.sent(b"talks")
    assert peers.sweep(clock.now, 1.0, 3) == ([b"silent"], [])


def test_a_busy_member_is_dispatched_again_when_its_peer_talks():
    # Given a member whose DELIVER bounced
    peers, to_dispatch = peers_at(Clock())
    group, member = subscribed(peers, b"p")
    assert peers.mark_busy(b"p", group, member) and member.busy
    assert not to_dispatch
    # When its peer sends anything
    peers.touch(b"p")
    # Then it may be sent to again, and its group is dispatched
    assert not member.busy and to_dispatch == {group} and not peers[b"p"].busy


def test_a_bounce_to_a_peer_that_is_gone_marks_nothing():
    peers, _ = peers_at(Clock())
    group = Group("t", "g", GroupSettings(), next_offset=0, clock=Clock())
    member = Member(b"gone", 1, credit=1, batch_size=1)
    assert not peers.mark_busy(b"gone", group, member) and not member.busy


def test_subscriptions_are_found_by_id_and_forgotten():
    peers, _ = peers_at(Clock())
    group, member = subscribed(peers, b"p", sub_id=7)
    assert peers.subscription(b"p", 7) == (group, member)
    assert peers.subscribers() == [b"p"]
    peers.forget_subscription(b"p", 7)
    with pytest.raises(NotSubscribed):
        peers.subscription(b"p", 7)
    assert peers.subscribers() == []


def test_a_peer_that_goes_leaves_every_group_it_was_in():
    # Given a peer with a subscription in a group
    peers, to_dispatch = peers_at(Clock())
    group, member = subscribed(peers, b"p")
    group.join(member)
    # When it goes
    peers.gone(b"p", "member_gone")
    # Then it is forgotten, left its group, and the group is dispatched (its messages go to others)
    assert b"p" not in peers and member not in group.members + group.joining and to_dispatch == {group}
    peers.gone(b"p", "member_gone")  # twice is nothing
