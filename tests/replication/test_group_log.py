"""The group log's records: replay from the latest snapshot, tombstones, and what a record holds of a group."""

from __future__ import annotations

from pathlib import Path

from conveyor.broker.log.data_dir import Store
from conveyor.broker.server import group_log as gl
from conveyor.broker.server.groups import Group, GroupSettings


def test_replay_starts_at_the_latest_snapshot_and_keeps_each_groups_latest_state(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        log_ = store.create_topic(gl.group_log_name("orders"), gl.SETTINGS)
        assert gl.replay(log_) is None  # no record yet: the caller starts from groups.json
        log_.append(gl.encode_record({"a": {"next_offset": 5}, "old": {"next_offset": 1}}, snapshot=True, since=0), 1)
        log_.append(gl.encode_record({"a": {"next_offset": 9}}, snapshot=False, since=0), 1)
        assert gl.replay(log_) == {"a": {"next_offset": 9}, "old": {"next_offset": 1}}
        log_.append(gl.encode_record({"old": None}, snapshot=False, since=0), 1)  # a group that is gone
        assert gl.replay(log_) == {"a": {"next_offset": 9}}
        log_.append(gl.encode_record({"a": {"next_offset": 12}}, snapshot=True, since=3), 1)
        log_.append(gl.encode_record({"b": {"next_offset": 2}}, snapshot=False, since=3), 1)
        assert gl.latest_snapshot(log_) == 3
        assert gl.replay(log_) == {"a": {"next_offset": 12}, "b": {"next_offset": 2}}
    finally:
        store.close()


def test_a_groups_record_holds_its_settings_offsets_and_counted_deliveries() -> None:
    group = Group("orders", "billing", GroupSettings(max_deliveries=3), next_offset=10, clock=lambda: 100.0)
    group.restore([[4, 6, 2, 0, 0, 0]], 100.0, 1_000)  # two messages delivered twice, in flight when saved
    state = gl.group_state(group, 100.0, 1_000)
    assert state["max_deliveries"] == 3
    assert state["next_offset"] == 10
    assert state["committed_offset"] == 4
    assert [row[:3] for row in state["unsettled"]] == [[4, 6, 2]]
    assert gl.is_group_log(gl.group_log_name("orders")) and not gl.is_group_log("orders")
