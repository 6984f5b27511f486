"""Group offsets files (``groups.json``) under a real broker: damaged at start, failing to be written.

A damaged file stops the broker with one clear line and exit code 2, or with
``--quarantine`` is moved aside and the topic's groups start again from the
log start (redelivery, never loss). A write that fails is kept and retried
with a backoff until it works, logged once per failure streak and counted in
``conveyor_offsets_write_errors_total``.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.log.syscalls import ENV_CONTROL, ENV_JOURNAL, read_journal

from conveyor import Admin
from conveyor.errors import UnknownGroup
from tests.faults.fault_helpers import consumers, drain_group, report
from tests.faults.test_files import consume_all, publish_batches
from tests.helpers import wait_for

TOPIC = "offsets"
ERRORS = "conveyor_offsets_write_errors_total"


def groups_file(broker):
    return broker.data_dir / "topics" / TOPIC / "groups.json"


def committed_on_disk(broker, group: str = "g") -> int | None:
    try:
        return json.loads(groups_file(broker).read_text())[group]["committed_offset"]
    except (OSError, ValueError, KeyError):
        return None


def lines(broker, text: str) -> list[str]:
    return [line for line in broker.output if text in line]


def wait_for_exit(broker, timeout: float = 10.0) -> int:
    """The exit code of a broker that refused to start, once all of its output is read."""
    assert broker.proc is not None
    code = broker.proc.wait(timeout)
    with contextlib.suppress(AssertionError):  # read by another thread; the caller checks the lines
        wait_for(lambda: any("conveyor broker:" in line for line in broker.output), 5)
    return code


def a_group_that_consumed_everything(brokers, **kwargs):
    """A broker whose topic holds 100 messages, consumed by groups g and h; then stopped cleanly."""
    broker = brokers.start(**kwargs)
    publish_batches(broker.address, TOPIC, [[f"m{i}" for i in range(100)]])
    consume_all(broker, TOPIC, "g", 100)
    consume_all(broker, TOPIC, "h", 100)
    assert broker.stop() == 0
    assert committed_on_disk(broker) == 100
    return broker


CORRUPT = {
    "bytes": (b"\x9c\x00\xffnot json at all", "not valid JSON"),
    "torn": (b'{"g": {"committed_offset": 100, "max_deli', "not valid JSON"),
    "wrong-type": (b'{"g": {"committed_offset": "100"}}', "committed_offset must be an integer"),
}


@pytest.mark.parametrize("content,says", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_groups_file_stops_the_broker_with_one_clear_line_and_exit_code_2(brokers, content, says):
    # Given a topic whose groups file is damaged while the broker is down
    broker = a_group_that_consumed_everything(brokers)
    groups_file(broker).write_bytes(content)
    # When the broker starts, it refuses with exit code 2 and one line naming the file and the fault
    with pytest.raises(RuntimeError, match="did not start"):
        broker.start()
    assert wait_for_exit(broker) == 2
    output = "".join(broker.output)
    assert "Traceback" not in output, output
    [line] = lines(broker, "conveyor broker:")
    assert line.startswith(f"conveyor broker: [METADATA_CORRUPT] {groups_file(broker)}: "), line
    assert says in line and "--quarantine" in line
    # And the file is left as it was
    assert groups_file(broker).read_bytes() == content
    report("groups-file-corrupt", corruption=says, exit_code=2, error=line.strip())


def test_with_quarantine_a_corrupt_groups_file_is_moved_aside_and_its_groups_start_from_the_log_start(
    brokers, tmp_path
):
    # Given a corrupt groups file, in a broker whose directory syncs are journaled
    journal = tmp_path / "fsio.journal"
    broker = a_group_that_consumed_everything(brokers, env={ENV_JOURNAL: str(journal)})
    groups_file(broker).write_bytes(b"\x00" * 64)
    # When the broker starts with --quarantine
    broker.extra.append("--quarantine")
    broker.start()
    # Then the file is in the topic's quarantine folder, durably, and a warning says so
    kept = groups_file(broker).parent / "quarantine" / "groups.json"
    assert kept.read_bytes() == b"\x00" * 64
    [warning] = lines(broker, "quarantined corrupt offsets file")
    assert "WARNING" in warning and str(kept) in warning and "not valid JSON" in warning
    dirsyncs = [e for e in read_journal(journal) if e["op"] == "dirsync"]
    assert any(e["path"] == str(kept.parent.resolve()) and "groups.json" in e["entries"] for e in dirsyncs)
    # And the topic's groups are forgotten: they start again from the log start, so everything is
    # delivered again (at-least-once), nothing is skipped
    with Admin(broker.address) as admin:
        for group in ("g", "h"):
            with pytest.raises(UnknownGroup):
                admin.describe_group(TOPIC, group)
    with consumers(broker.address, TOPIC, "g", n=1) as members:
        assert drain_group(broker.address, TOPIC, "g", members, timeout=20)
    assert sorted(o for o, _v, _a in members[0].deliveries) == list(range(100))
    # Even a group asking for ``latest`` starts at the log start: it may be one the lost file knew
    with Subscription(TOPIC, "h", address=broker.address, start="latest") as sub:
        seen: list[int] = []
        deadline = time.monotonic() + 20
        while len(seen) < 100 and time.monotonic() < deadline:
            batch = sub.receive(timeout=0.5)
            seen += [m.offset for m in batch]
            sub.ack(batch)
    assert sorted(seen) == list(range(100))
    # (the broker's output is read by another thread: the line may land a moment after the subscribe)
    assert wait_for(lambda: lines(broker, "offsets file was quarantined and this may be an old group"), 10)
    # And the group's new offsets are written to a new, valid file, kept across a restart
    assert wait_for(lambda: committed_on_disk(broker) == 100)
    broker.restart(kill=True)
    with Admin(broker.address) as admin:
        assert admin.describe_group(TOPIC, "g")["committed_offset"] == 100
    report("groups-file-quarantined", redelivered=len(members[0].deliveries))


def test_a_failing_offsets_write_is_retried_until_it_works_logged_once_and_counted(brokers, tmp_path):
    # Given a group whose committed offset 100 is on disk
    control = tmp_path / "faults"
    broker = brokers.start(env={ENV_CONTROL: str(control)}, extra=["--offsets-commit-ms", "50"])
    publish_batches(broker.address, TOPIC, [[f"m{i}" for i in range(100)]])
    consume_all(broker, TOPIC, "g", 100)
    assert wait_for(lambda: committed_on_disk(broker) == 100)
    # When writing the offsets file fails (EIO) while the group moves to 150, then stops moving
    control.write_text("write_eio,match=groups.json")
    publish_batches(broker.address, TOPIC, [[f"n{i}" for i in range(50)]])
    consume_all(broker, TOPIC, "g", 150)
    # Then the failed write is retried: counted each time, logged once for the whole streak
    assert wait_for(lambda: broker.metric(ERRORS, f'topic="{TOPIC}"') >= 3, timeout=10)
    time.sleep(1.0)
    assert committed_on_disk(broker) == 100
    failures = broker.metric(ERRORS, f'topic="{TOPIC}"')
    injected = len(lines(broker, "injected write_eio"))
    assert injected <= 15, f"{injected} attempts: a busy loop, not a backoff"
    assert len(lines(broker, "cannot write offsets file")) == 1
    # And once writes work again the newest offset reaches the disk without the group moving
    control.write_text("")
    assert wait_for(lambda: committed_on_disk(broker) == 150, timeout=10), "the failed write was dropped"
    assert wait_for(lambda: len(lines(broker, "written again after")) == 1)
    settled = broker.metric(ERRORS, f'topic="{TOPIC}"')
    time.sleep(0.3)
    assert broker.metric(ERRORS, f'topic="{TOPIC}"') == settled
    # And a later failure (the rename this time) is a new streak: logged again, retried again
    control.write_text("rename_eio,match=groups.json")
    publish_batches(broker.address, TOPIC, [[f"o{i}" for i in range(10)]])
    consume_all(broker, TOPIC, "g", 160)
    assert wait_for(lambda: broker.metric(ERRORS, f'topic="{TOPIC}"') > settled, timeout=10)
    assert wait_for(lambda: len(lines(broker, "cannot write offsets file")) == 2)
    control.write_text("")
    assert wait_for(lambda: committed_on_disk(broker) == 160, timeout=10)
    total = broker.metric(ERRORS, f'topic="{TOPIC}"')
    # And after a crash the group resumes from what was finally written
    broker.restart(kill=True)
    with Admin(broker.address) as admin:
        assert admin.describe_group(TOPIC, "g")["committed_offset"] == 160
    report(
        "offsets-write-retried",
        failures_first_streak=int(failures),
        injected_first_streak=injected,
        failures_total=int(total),
    )
