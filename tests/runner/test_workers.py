"""``conveyor run --workers N``: real supervisors of real worker processes against a real broker."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conveyor.broker.cli.run import worker_command
from conveyor.consumers.supervisor import Supervisor, WorkerRole, exit_code, restart_delay, worker_role
from conveyor.consumers.worker_health import STALE_AFTER, merge_reports, read_report, write_report

from conveyor import exitcodes
from tests.helpers import http_get, publish, sample_value, scrape, wait_for
from tests.monitoring.monitoring_helpers import health, runner_metrics_url
from tests.runner.runner_helpers import APPS, RunnerProcess, by_pid, offsets, wait_records

WORKER_STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")
WORK_OK = {"handler": "app_record.work", "topic": "work", "group": "workers", "outcome": "ok"}


def start_pool(address: str, out: Path, workers: int = 2, env: dict[str, str] | None = None) -> RunnerProcess:
    """A supervisor of ``workers`` workers running app_record, its multiprocess files under ``out/tmp``."""
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"TMPDIR": str(out / "tmp"), **(env or {})}
    return RunnerProcess(address, out, args=["--workers", str(workers)], env=env)


def worker_pids(pool: RunnerProcess) -> dict[int, int]:
    """Worker number -> pid of its latest process, from the supervisor's log lines."""
    return {int(m.group(1)): int(m.group(2)) for line in list(pool.lines) for m in WORKER_STARTED.finditer(line)}


def metric(url: str, name: str, **labels: str) -> float | None:
    return sample_value(scrape(url), name, **labels)


def test_two_workers_share_the_groups_and_one_scrape_shows_their_sum(conveyor_broker, tmp_path):
    pool = start_pool(conveyor_broker.address, tmp_path)
    try:
        url = runner_metrics_url(pool)
        # When 400 messages arrive while both workers are subscribed in the group
        publish(conveyor_broker.address, "work", list(range(400)))
        rows = wait_records(tmp_path, "work", 400)
        # Then both handled some, each message once
        assert sorted(offsets(tmp_path, "work")) == list(range(400))
        assert set(map(int, by_pid(rows))) == set(worker_pids(pool).values()), by_pid(rows).keys()
        # And one scrape of the supervisor shows the sum of both workers' counters and histograms
        wait_for(lambda: metric(url, "conveyor_runner_messages_total", **WORK_OK) == 400, message="400 in one scrape")
        labels = {k: v for k, v in WORK_OK.items() if k != "outcome"}
        assert metric(url, "conveyor_runner_handler_duration_seconds_count", **labels) == 400
        assert metric(url, "conveyor_runner_in_process_messages", **labels) == 0  # livesum: one series, no pid
        assert metric(url, "conveyor_runner_workers") == 2
        assert metric(url, "conveyor_runner_worker_restarts_total") == 0
        assert metric(url, "conveyor_build_info", component="runner", version=_version()) == 1
        assert metric(url, "conveyor_health_status", check="workers") == 0
        # And /healthz shows each worker's runner checks, merged under the single runner's names
        found = wait_for(lambda: _both_reported(url), message="both workers' health in /healthz")
        assert found["status"] == "HEALTHY" and found["checks"]["event_loop"]["status"] == "HEALTHY"
        assert found["checks"]["workers"] == {
            "status": "HEALTHY",
            "ready": 2,
            "running": 2,
            "workers": 2,
            "restarts": 0,
        }
        assert http_get(url.replace("/metrics", "/livez"))[0] == 200
        assert http_get(url.replace("/metrics", "/readyz"))[0] == 200
    finally:
        pool.kill()


def _both_reported(url: str) -> dict | None:
    found = health(url)[1]
    work = found["checks"].get("app_record.work", {})
    return found if set(work.get("workers", {})) == {"1", "2"} else None


def test_a_killed_worker_is_restarted_and_counted_and_the_exit_code_says_workers_died(conveyor_broker, tmp_path):
    pool = start_pool(conveyor_broker.address, tmp_path)
    try:
        url = runner_metrics_url(pool)
        publish(conveyor_broker.address, "work", list(range(100)))
        wait_for(lambda: metric(url, "conveyor_runner_messages_total", **WORK_OK) == 100, message="100 handled")
        first = worker_pids(pool)
        # When one worker is killed with SIGKILL
        os.kill(first[1], signal.SIGKILL)
        # Then the supervisor starts another in its place and counts the restart
        wait_for(lambda: worker_pids(pool)[1] != first[1], message="worker 1 started again")
        wait_for(lambda: metric(url, "conveyor_runner_worker_restarts_total") == 1, message="the restart counted")
        wait_for(lambda: metric(url, "conveyor_health_status", check="workers") == 0, message="both ready again")
        # And the dead worker's counts stay in the sum, and the new worker takes its share
        publish(conveyor_broker.address, "work", list(range(100, 300)))
        # (>=: an ack the killed worker sent as it died may not have reached the broker, which then redelivers)
        wait_for(lambda: (metric(url, "conveyor_runner_messages_total", **WORK_OK) or 0) >= 300, message="300 in sum")
        assert set(offsets(tmp_path, "work")) == set(range(300))
        assert worker_pids(pool)[1] in set(map(int, by_pid(wait_records(tmp_path, "work", 300))))
        # And a SIGTERM afterwards drains, but the exit code says a worker died during the run
        pool.terminate()
        assert pool.wait(60) == exitcodes.WORKERS_DIED
    finally:
        pool.kill()
    assert "1 worker death(s) during the run" in "".join(pool.lines)


def test_sigterm_drains_every_worker_exits_0_and_removes_the_metrics_files(conveyor_broker, tmp_path):
    # Given two workers, each busy with slow messages
    pool = start_pool(conveyor_broker.address, tmp_path, env={"CONVEYOR_TEST_SLOW": "0.2"})
    try:
        assert len(os.listdir(tmp_path / "tmp")) == 1  # the supervisor's multiprocess directory
        publish(conveyor_broker.address, "work", list(range(40)))
        wait_for(lambda: len(by_pid(wait_records(tmp_path, "work", 1, timeout=0.1))) == 2, message="both busy")
        # When the supervisor gets SIGTERM
        pool.terminate()
        # Then every worker drains (finishes what its lanes started) and the supervisor exits 0
        assert pool.wait(60) == exitcodes.OK
    finally:
        pool.kill()
    text = "".join(pool.lines)
    assert text.count("stopped cleanly") == 3, text  # two workers and the supervisor
    assert os.listdir(tmp_path / "tmp") == []


def test_a_worker_that_cannot_start_stops_the_pool_with_exit_2(conveyor_broker, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(APPS)}
    argv = [sys.executable, "-m", "conveyor", "run", "no_such_handlers", "--workers", "2"]
    done = subprocess.run(
        [*argv, "--broker", conveyor_broker.address, "--metrics-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == exitcodes.ERROR, done.stdout + done.stderr
    assert "failed to start (exit 2)" in done.stderr


# --- the supervisor on its own, with stand-in workers ---------------------------------------------------


def stop_after(supervisor: Supervisor, check, timeout: float = 30.0) -> threading.Thread:
    """Call ``supervisor.stop()`` once ``check()`` holds (or at ``timeout``), from another thread."""

    def watch() -> None:
        try:
            wait_for(check, timeout, message="the supervisor's state")
        finally:
            supervisor.stop()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_crash_looping_worker_is_restarted_with_a_growing_backoff():
    supervisor = Supervisor([sys.executable, "-c", "raise SystemExit(1)"], 1, metrics_port=-1)
    stop_after(supervisor, lambda: supervisor.restarts >= 2)
    assert supervisor.run() == exitcodes.WORKERS_DIED
    # two restarts take 0.5 s + 1 s of backoff; a spinning loop would have restarted it many times more
    assert supervisor.restarts == 2 and supervisor.died in (2, 3)
    assert supervisor.workers[0].quick_deaths == supervisor.died


def test_workers_stopped_before_they_were_ready_stopped_cleanly():
    # Given workers still starting (they hold no message yet) when the stop comes
    supervisor = Supervisor([sys.executable, "-c", "import time; time.sleep(60)"], 2, metrics_port=-1)
    stop_after(supervisor, lambda: len(supervisor.pids()) == 2)
    # Then SIGTERM's default action ending them is a clean stop, and the metrics directory is gone
    assert supervisor.run() == exitcodes.OK
    assert supervisor.codes == [0, 0] and not os.path.exists(supervisor.metrics_dir)


def test_a_worker_killed_at_the_stop_deadline_makes_the_exit_code_say_workers_died(monkeypatch):
    import conveyor.consumers.supervisor as supervisor_module

    # Given a worker that ignores SIGTERM and says it is ready, and no time to drain
    monkeypatch.setattr(supervisor_module, "KILL_MARGIN", 0.0)
    code = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "fd = int(os.environ['CONVEYOR_WORKER'].split(':')[1]); os.write(fd, b'R'); time.sleep(60)"
    supervisor = Supervisor([sys.executable, "-c", code], 1, metrics_port=-1, graceful_timeout=0.0)
    stop_after(supervisor, lambda: supervisor.serving)
    # Then it is killed at once, counted, and the exit code says a worker died
    assert supervisor.run() == exitcodes.WORKERS_DIED
    assert supervisor.killed == 1 and supervisor.died == 0


def test_restart_delay_doubles_up_to_the_cap():
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert restart_delay(100) == 30.0


@pytest.mark.parametrize(
    ("died", "killed", "codes", "boot", "expected"),
    [
        (0, 0, [0, 0], None, exitcodes.OK),
        (0, 0, [0, 3], None, exitcodes.HANDLERS_ABANDONED),
        (1, 0, [0, 0], None, exitcodes.WORKERS_DIED),
        (0, 1, [0], None, exitcodes.WORKERS_DIED),
        (0, 0, [0, -9], None, exitcodes.WORKERS_DIED),
        (1, 0, [3, 0], None, exitcodes.WORKERS_DIED),
        (0, 0, [0], exitcodes.ERROR, exitcodes.ERROR),
    ],
)
def test_exit_code(died, killed, codes, boot, expected):
    assert exit_code(died=died, killed=killed, codes=codes, boot_error=boot) == expected


def test_worker_role_round_trips_through_the_environment():
    role = WorkerRole(3, 17, 4242)
    assert worker_role({"CONVEYOR_WORKER": str(role)}) == role
    assert worker_role({}) is None


def test_worker_command_repeats_the_flags_given_and_nothing_else():
    args = argparse.Namespace(
        config="conveyor.toml",
        modules=["app.handlers", "app.more:billing"],
        broker="tcp://10.0.0.1:5555",
        workers="4",
        graceful_timeout="30",
        middleware=["app.mw:Timing", "app.mw:Audit"],
    )
    assert worker_command(args)[1:] == [
        "-m",
        "conveyor",
        "run",
        "--config",
        "conveyor.toml",
        "--broker",
        "tcp://10.0.0.1:5555",
        "--workers",
        "4",
        "--graceful-timeout",
        "30",
        "--middleware",
        "app.mw:Timing",
        "--middleware",
        "app.mw:Audit",
        "--",
        "app.handlers",
        "app.more:billing",
    ]


def test_worker_reports_merge_into_the_worst_of_each_check(tmp_path):
    healthy = {"status": "HEALTHY", "checks": {"event_loop": {"status": "HEALTHY"}, "bill": {"status": "HEALTHY"}}}
    degraded = {"status": "DEGRADED", "checks": {"event_loop": {"status": "HEALTHY"}, "bill": {"status": "DEGRADED"}}}
    write_report(str(tmp_path / "health-1.json"), degraded)
    found, age = read_report(str(tmp_path / "health-1.json"))
    assert found == degraded and 0 <= age < STALE_AFTER
    assert read_report(str(tmp_path / "health-2.json"))[0] is None
    merged = merge_reports({1: (healthy, 0.5), 2: (found, age)})
    assert merged["bill"] == {
        "status": "DEGRADED",
        "workers": {"1": {"status": "HEALTHY"}, "2": {"status": "DEGRADED"}},
    }
    assert merged["event_loop"]["status"] == "HEALTHY"
    # A worker whose report stopped coming is wedged: its event_loop is UNHEALTHY (and /livez fails)
    stale = merge_reports({1: (healthy, 0.5), 2: (degraded, STALE_AFTER + 1)})
    assert stale["event_loop"]["status"] == "UNHEALTHY"
    assert stale["event_loop"]["workers"]["2"]["silent_seconds"] == STALE_AFTER + 1


def _version() -> str:
    from conveyor.version import __version__

    return __version__
