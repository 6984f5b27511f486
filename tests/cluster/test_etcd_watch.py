"""Watches against a real etcd: order, resume after an etcd restart or pause, compaction, close."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from conveyor.broker.cluster.etcd import Etcd, Op, WatchEvent, _shutdown

from conveyor.etcd_process import EtcdProcess, free_port
from tests.cluster.etcd_helpers import Collected
from tests.helpers import stays_false, wait_for


def watch(client: Etcd, prefix: str, start_revision: int, **options: float) -> Collected:
    collected = Collected()
    client.watch(
        prefix,
        start_revision=start_revision,
        on_event=collected.on_event,
        on_resync=collected.on_resync,
        **options,  # type: ignore[arg-type]
    )
    return collected


def test_puts_and_deletes_arrive_in_order(etcd_client: Etcd) -> None:
    start = etcd_client.put("/c/other", b"not watched") + 1
    collected = watch(etcd_client, "/c/nodes/", start)
    etcd_client.put("/c/nodes/a", b"1")
    etcd_client.put("/c/nodes/b", b"2")
    etcd_client.put("/c/nodes/a", b"3")
    etcd_client.delete("/c/nodes/a")
    etcd_client.txn([], [Op.put("/c/nodes/c", b"4"), Op.delete("/c/nodes/b"), Op.put("/c/nodesX", b"outside")])
    assert collected.wait(6) == [
        ("PUT", "/c/nodes/a", b"1"),
        ("PUT", "/c/nodes/b", b"2"),
        ("PUT", "/c/nodes/a", b"3"),
        ("DELETE", "/c/nodes/a", b""),
        ("PUT", "/c/nodes/c", b"4"),
        ("DELETE", "/c/nodes/b", b""),
    ]
    revisions = [event.kv.mod_revision for event in collected.events]
    assert revisions == sorted(revisions) and revisions[-1] == revisions[-2]  # one txn, one revision


def test_a_watch_from_an_old_revision_replays_the_history(etcd_client: Etcd) -> None:
    first = etcd_client.put("/c/t/a", b"1")
    etcd_client.put("/c/t/a", b"2")
    collected = watch(etcd_client, "/c/t/", first)
    assert collected.wait(2) == [("PUT", "/c/t/a", b"1"), ("PUT", "/c/t/a", b"2")]


def test_the_watch_resumes_after_an_etcd_restart(etcd: EtcdProcess, etcd_client: Etcd) -> None:
    collected = watch(etcd_client, "/c/nodes/", 1)
    etcd_client.put("/c/nodes/a", b"before")
    collected.wait(1)
    for round_ in range(2):  # a clean stop, then a kill -9
        etcd.restart(kill=bool(round_))
        etcd_client.put("/c/nodes/a", f"after {round_}".encode())
        etcd_client.delete("/c/nodes/a")
    assert collected.wait(5) == [
        ("PUT", "/c/nodes/a", b"before"),
        ("PUT", "/c/nodes/a", b"after 0"),
        ("DELETE", "/c/nodes/a", b""),
        ("PUT", "/c/nodes/a", b"after 1"),
        ("DELETE", "/c/nodes/a", b""),
    ]
    time.sleep(0.2)  # nothing to wait for: no event may come twice
    assert len(collected.events) == 5 and collected.resyncs == []


def test_the_watch_resumes_after_etcd_was_paused(etcd: EtcdProcess, etcd_client: Etcd) -> None:
    collected = Collected()
    handle = etcd_client.watch(
        "/c/nodes/", start_revision=1, on_event=collected.on_event, on_resync=collected.on_resync, idle_timeout=1.0
    )
    wait_for(handle.connected.is_set, message="the watch to be created")
    streams = handle.streams
    etcd.pause()
    time.sleep(2.5)  # the fault lasts longer than the watch's idle timeout: it reconnects meanwhile
    etcd.resume()
    etcd_client.put("/c/nodes/a", b"after the pause")
    assert collected.wait(1) == [("PUT", "/c/nodes/a", b"after the pause")]
    assert handle.streams > streams


def test_compaction_makes_the_watch_resync(etcd_client: Etcd) -> None:
    first = etcd_client.put("/c/t/a", b"1")
    etcd_client.put("/c/t/a", b"2")
    current = etcd_client.put("/c/t/b", b"3")
    etcd_client.compact(current)
    collected = watch(etcd_client, "/c/t/", first)  # its history is gone
    wait_for(lambda: collected.resyncs, message="on_resync")
    assert collected.resyncs == [current] and collected.events == []
    kvs, _ = etcd_client.get_prefix("/c/t/", revision=collected.resyncs[0])  # what the owner re-reads
    assert [(kv.key, kv.value) for kv in kvs] == [("/c/t/a", b"2"), ("/c/t/b", b"3")]
    etcd_client.put("/c/t/c", b"4")  # and the watch goes on after the resync revision
    assert collected.wait(1) == [("PUT", "/c/t/c", b"4")]


def test_close_stops_the_watch_at_once(etcd_client: Etcd) -> None:
    collected = Collected()
    handle = etcd_client.watch("/c/", start_revision=1, on_event=collected.on_event, on_resync=collected.on_resync)
    wait_for(handle.connected.is_set, message="the watch to be created")
    started = time.monotonic()
    handle.close()
    assert time.monotonic() - started < 5  # cut by a socket shutdown, not by the 10 s idle timeout
    etcd_client.put("/c/x", b"1")
    time.sleep(0.2)  # nothing to wait for: no event may come after close
    assert collected.events == []


def test_a_watch_that_reconnects_into_compacted_history_resyncs(etcd_client: Etcd) -> None:
    """The stream drops while the owner is busy; meanwhile etcd compacts past where the watch stood."""
    collected = Collected()
    busy = threading.Event()
    release = threading.Event()

    def on_event(event: WatchEvent) -> None:
        collected.on_event(event)
        if event.kv.key == "/c/t/block":
            busy.set()
            release.wait(30)

    start = etcd_client.put("/c/other", b"x") + 1
    handle = etcd_client.watch("/c/t/", start_revision=start, on_event=on_event, on_resync=collected.on_resync)
    etcd_client.put("/c/t/block", b"1")
    assert busy.wait(30)
    _shutdown(handle._response)  # the connection drops
    etcd_client.put("/c/t/a", b"missed")  # written while the watch is away...
    current = etcd_client.put("/c/t/b", b"missed too")
    etcd_client.compact(current)  # ...and compacted before it comes back
    release.set()

    wait_for(lambda: collected.resyncs, message="on_resync")
    assert collected.resyncs[0] >= current
    etcd_client.put("/c/t/c", b"after")
    events = collected.wait(2)
    assert events[0] == ("PUT", "/c/t/block", b"1") and events[-1] == ("PUT", "/c/t/c", b"after")
    assert ("PUT", "/c/t/a", b"missed") not in events  # the owner re-reads it instead


def test_the_watch_uses_the_next_endpoint_when_one_is_down(etcd: EtcdProcess) -> None:
    with Etcd([f"http://127.0.0.1:{free_port()}", etcd.endpoint], timeout=1.0) as client:
        collected = watch(client, "/c/", 1)
        client.put("/c/x", b"1")
        assert collected.wait(1) == [("PUT", "/c/x", b"1")]


def test_progress_notifications_keep_an_idle_watch_open_and_move_its_revision(tmp_path: Path) -> None:
    """With etcd's progress notifications (``--experimental-watch-progress-notify-interval``, 10 min by
    default) more often than the idle timeout, an idle watch is never reopened, and its resume revision
    follows etcd's even when only other keys change, so a compaction does not force a resync."""
    extra = ["--experimental-watch-progress-notify-interval", "500ms"]
    with EtcdProcess(tmp_path / "etcd", extra=extra) as etcd, Etcd([etcd.endpoint]) as client:
        collected = Collected()
        handle = client.watch(
            "/c/nodes/",
            start_revision=1,
            on_event=collected.on_event,
            on_resync=collected.on_resync,
            idle_timeout=2,
        )
        wait_for(handle.connected.is_set, message="the watch to be created")
        last = client.put("/c/other", b"elsewhere")
        wait_for(lambda: handle.next_revision > last, message="a progress notification")
        # Longer than the idle timeout: the notifications keep the stream open.
        stays_false(lambda: handle.streams != 1, 3, message="a reconnection")
        assert collected.events == [] and collected.resyncs == []
