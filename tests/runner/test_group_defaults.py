"""Safer defaults for consumer groups, on real broker and runner processes.

Each consumer's topic, group and start are logged at start; a new group about to
replay a long topic from earliest is warned about and counted; ``--default-start``
sets where a new group starts when its ``@consumer`` does not say; two consumers of
one topic in one group are refused at load unless each says ``shared_group=True``.
"""

from __future__ import annotations

import os

import pytest
from conveyor.consumers.runner import Runner
from conveyor.consumers.start_check import backlog, replay, start_of
from conveyor.decorators.consumer import shared_group_problems

from conveyor import consumer
from conveyor.errors import ConfigError
from conveyor.testing import scrape_metric
from tests.helpers import publish, wait_for
from tests.monitoring.monitoring_helpers import runner_metrics_url
from tests.runner.runner_helpers import APPS, RunnerProcess, records, wait_records
from tests.runner.test_runner_errors import run, write_app

REPLAYS = "conveyor_runner_new_group_replays_total"
HISTORY = 'group="app_groups.history",handler="app_groups.history",topic="history"'


def stop(runner: RunnerProcess) -> str:
    runner.terminate()
    assert runner.wait(60) == 0, "".join(runner.lines)
    return "".join(runner.lines)


def test_a_new_group_about_to_replay_a_long_topic_is_logged_and_counted_once(conveyor_broker, tmp_path):
    publish(conveyor_broker.address, "history", list(range(30)))
    args = ["--backlog-warning", "20"]
    runner = RunnerProcess(conveyor_broker.address, tmp_path, "app_groups", args=args)
    try:
        assert len(wait_records(tmp_path, "history", 30)) == 30, "earliest: the whole topic"
        assert scrape_metric(runner_metrics_url(runner), REPLAYS, HISTORY) == 1
        assert scrape_metric(runner_metrics_url(runner), REPLAYS, HISTORY.replace("history", "pinned")) == 0
    finally:
        output = stop(runner)
    assert "consumer app_groups.history reads topic history in group app_groups.history" in output, output
    assert "(a new group starts at earliest)" in output, output
    assert "group app_groups.history is new and starts at earliest: it will read all 30 messages" in output, output
    assert "pinned is new" not in output, "an empty topic is no backlog"

    again = RunnerProcess(conveyor_broker.address, tmp_path / "again", "app_groups", args=args)
    try:
        assert scrape_metric(runner_metrics_url(again), REPLAYS, HISTORY) == 0, "the group exists now"
    finally:
        output = stop(again)
    assert "is new" not in output, output


def test_default_start_latest_skips_the_backlog_of_groups_that_do_not_say(conveyor_broker, tmp_path):
    publish(conveyor_broker.address, "history", ["old-1", "old-2"])
    publish(conveyor_broker.address, "pinned", ["old-1", "old-2"])
    runner = RunnerProcess(
        conveyor_broker.address, tmp_path, "app_groups", args=["--default-start", "latest", "--backlog-warning", "1"]
    )
    try:
        publish(conveyor_broker.address, "history", ["new"])
        assert [r[5] for r in wait_records(tmp_path, "history", 1)] == ["new"]
        assert sorted(r[5] for r in wait_records(tmp_path, "pinned", 2)) == ["old-1", "old-2"], "start= wins"
        wait_for(lambda: len(records(tmp_path, "history")) == 1, timeout=30, message="history")
    finally:
        output = stop(runner)
    assert "reads topic history in group app_groups.history (a new group starts at latest)" in output, output
    assert "app_groups.history is new" not in output, "starting at latest replays nothing"
    assert "group app_groups.pinned is new and starts at earliest: it will read all 2 messages" in output, output


SHARING = """\
import os

from conveyor import consumer

def note(name, message):
    with open(os.path.join(os.environ.get("CONVEYOR_TEST_OUT", "."), "shared.log"), "a") as f:
        f.write(f"{{name}} {{message.offset}}\\n")

@consumer("orders", group="billing"{declared})
def bill(message):
    note("bill", message)

@consumer("orders", group="billing"{declared})
def audit(message):
    note("audit", message)

@consumer("refunds", group="billing")  # another topic: its own group, nothing shared
def refund(message):
    pass
"""


def test_two_consumers_sharing_a_group_are_refused_at_load(tmp_path):
    write_app(tmp_path, "sharing", SHARING.format(declared=""))
    result = run(tmp_path, "app.sharing")
    assert result.returncode == 2, result
    assert result.stderr.count("[CONFIG_ERROR]") == 1, result.stderr
    assert (
        "conveyor run: [CONFIG_ERROR] consumers app.sharing.bill, app.sharing.audit all read topic 'orders' in "
        "group 'billing', so each would get only some of its messages: give each its own group=, or declare "
        "shared_group=True on every one of them"
    ) in result.stderr, result.stderr


def test_consumers_that_declare_a_shared_group_split_its_messages(conveyor_broker, tmp_path):
    write_app(tmp_path, "shared", SHARING.format(declared=", shared_group=True"))
    out = tmp_path / "out"
    runner = RunnerProcess(
        conveyor_broker.address, out, "app.shared", env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{APPS}"}
    )
    try:
        publish(conveyor_broker.address, "orders", list(range(200)))
        shared = out / "shared.log"
        wait_for(lambda: shared.exists() and len(shared.read_text().splitlines()) >= 200, timeout=30, message="200")
    finally:
        output = stop(runner)
    rows = [line.split() for line in shared.read_text().splitlines()]
    assert sorted(int(offset) for _, offset in rows) == list(range(200)), "each message once, to one of them"
    assert "consumer app.shared.audit reads topic orders in group billing" in output, output


# --- the pure decisions ---------------------------------------------------------------------------------


def test_the_backlog_is_end_minus_start_over_the_partitions_and_an_existing_group_replays_nothing():
    one = {"start_offset": 5, "end_offset": 30, "groups": ["old"]}
    parts = {"partitions": [{"start_offset": 0, "end_offset": 10}, {"start_offset": 4, "end_offset": 20}]}
    assert (backlog(one), backlog(parts), backlog({})) == (25, 26, 0)
    assert replay(one, "new", 20) == 25
    assert replay(one, "old", 20) is None, "the group exists: it goes on from its committed offset"
    assert replay(one, "new", 25) is None, "not more than the threshold"
    assert replay(one, "new", 0) is None, "0: the check is off"


def test_start_is_the_consumers_own_else_the_runners_default():
    @consumer("t")
    def plain(message):
        pass

    @consumer("t", start="earliest")
    def pinned(message):
        pass

    assert (start_of(plain, "latest"), start_of(pinned, "latest")) == ("latest", "earliest")
    with pytest.raises(ConfigError, match="--default-start must be earliest or latest"):
        Runner([plain], broker="tcp://127.0.0.1:1", metrics_port=-1, default_start="newest")


def test_sharing_needs_every_sharer_to_declare_it():
    def make(name, **options):
        fn = lambda message: None  # noqa: E731
        fn.__qualname__ = name
        return consumer("orders", group="g", **options)(fn)

    assert shared_group_problems([make("a", shared_group=True), make("b", shared_group=True)]) == []
    (problem,) = shared_group_problems([make("a", shared_group=True), make("b")])
    assert problem.endswith(f"(not declared: {__name__}.b)"), problem
    with pytest.raises(ConfigError, match="shared_group=True"):
        Runner([make("a"), make("b")], broker="tcp://127.0.0.1:1", metrics_port=-1)
    with pytest.raises(TypeError, match="shared_group takes True or False"):
        make("c", shared_group="yes")
