"""The group table: stored settings are checked, new groups start where asked, the room is bounded."""

from __future__ import annotations

import pytest
from conveyor.broker.log.data_dir import Store
from conveyor.broker.server.group_table import GroupTable
from conveyor.broker.server.groups import Group, GroupSettings
from conveyor.broker.wire.record import pack_records
from conveyor.monitoring.metrics import NullMetrics

from conveyor.errors import GroupLimit
from tests.server.server_fakes import Clock


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "data", fsync="none")
    store.create_topic("t")
    store.topic("t").append(pack_records([(None, None, b"v")] * 5), 5)
    yield store
    store.close()


def table(store: Store, max_groups: int = 10) -> tuple[GroupTable, set[Group]]:
    to_dispatch: set[Group] = set()
    defaults = GroupSettings(max_deliveries=7, ack_timeout_ms=1000)
    groups = GroupTable(
        store,
        defaults=lambda: defaults,
        max_groups=max_groups,
        metrics=NullMetrics(),
        to_dispatch=to_dispatch,
        clock=Clock(),
    )
    return groups, to_dispatch


def test_a_stored_setting_out_of_range_or_looping_back_is_replaced_by_the_default(store):
    groups, _ = table(store)
    state = {"max_deliveries": 0, "ack_timeout_ms": 500, "dead_letter_topic": "t"}
    settings = groups.stored_settings("t", "g", state)
    assert (settings.max_deliveries, settings.ack_timeout_ms, settings.dead_letter_topic) == (7, 500, "")


def test_a_new_group_starts_where_it_asks_and_is_saved(store):
    groups, _ = table(store)
    group = groups.create("t", "g", "latest", GroupSettings(max_deliveries=3))
    assert groups[("t", "g")] is group and groups.live(group) and group.next_offset == 5
    assert store.group("t", "g")["committed_offset"] == 5
    assert groups.create("t", "h", 2, GroupSettings()).next_offset == 2


def test_a_group_past_the_log_end_starts_at_the_end_and_the_room_is_bounded(store):
    groups, _ = table(store, max_groups=1)
    assert groups.make("t", "g", {"committed_offset": 99}).next_offset == 5  # the log lost a tail
    with pytest.raises(GroupLimit):
        groups.check_room("t", "other")
    with pytest.raises(GroupLimit) as partition:  # a partition's group names the topic and partition, not t#3
        groups.check_room("t#3", "other")
    assert "t partition 3" in partition.value.message and "#" not in partition.value.message
    assert (partition.value.fields["topic"], partition.value.fields["partition"]) == ("t", 3)


def test_a_reset_topic_moves_its_groups_and_dispatches_them(store):
    groups, to_dispatch = table(store)
    group = groups.make("t", "g", {"committed_offset": 1})
    groups.reset_topic("t", 4)
    assert group.next_offset == 4 and to_dispatch == {group}
