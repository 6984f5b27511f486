"""``conveyor cluster local`` (what ``make cluster`` runs): a real etcd and three real brokers, then Ctrl-C.

The command runs as a subprocess, as a user's terminal runs it. What it
prints is what a user copies: the bootstrap list and the ``topics create``
line. SIGINT must leave no process behind, and a second run on the same
directory must be the same cluster: the same list, the same topics.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conveyor.broker.cli.cluster_local import LocalState, node_count
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.metadata import Metadata
from conveyor.broker.client.producer import Producer

from conveyor.errors import ConfigError
from tests.helpers import wait_for

START_TIMEOUT = 120.0  # etcd and three brokers on two loaded cores
STOP_TIMEOUT = 90.0


@dataclass
class LocalCluster:
    """One run of ``conveyor cluster local``: its process and every line it printed."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(self.lines)

    def bootstrap(self) -> str:
        found = re.search(r"^bootstrap: (\S+)$", self.text(), re.M)
        return found.group(1) if found else ""

    def printed_pids(self) -> set[int]:
        return {int(pid) for pid in re.findall(r"\bpid (\d+)\b", self.text())}


def start(directory: Path) -> LocalCluster:
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "cluster", "local", "--dir", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    run = LocalCluster(proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    wait_for(
        lambda: run.bootstrap() or proc.poll() is not None,
        timeout=START_TIMEOUT,
        message="the bootstrap list",
    )
    assert run.bootstrap(), f"the command exited before it was ready:\n{run.text()}"
    return run


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` now (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def running_in(directory: Path) -> set[int]:
    """Processes whose command line names ``directory`` (etcd's and the brokers' data directories are in it)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(directory).encode() in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def interrupt(run: LocalCluster, pids: set[int]) -> None:
    """Ctrl-C: the command exits 0 and every process it started is gone."""
    run.proc.send_signal(signal.SIGINT)
    code = run.proc.wait(STOP_TIMEOUT)
    assert code == 0, run.text()
    assert "stopped: every broker and etcd exited" in run.text()
    left = wait_for(lambda: not {pid for pid in pids if alive(pid)}, timeout=30, message="no child left")
    assert left


@pytest.fixture
def runs() -> Iterator[list[tuple[LocalCluster, set[int]]]]:
    started: list[tuple[LocalCluster, set[int]]] = []
    yield started
    for run, pids in started:  # a failed test leaves nothing running: only the processes this test started
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(30)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_make_cluster_starts_three_nodes_serves_the_printed_list_and_stops_everything_on_ctrl_c(
    tmp_path: Path, runs: list[tuple[LocalCluster, set[int]]]
) -> None:
    directory = tmp_path / "conveyor-cluster"
    first = start(directory)
    pids = children(first.proc.pid)
    runs.append((first, pids | first.printed_pids()))
    assert len(pids) == 4 and pids == first.printed_pids(), first.text()  # etcd and three brokers
    bootstrap = first.bootstrap()
    assert len(bootstrap.split(",")) == 3

    printed = ["topics", "create", "orders", "--replication-factor", "3", "--broker", bootstrap]
    assert "conveyor " + " ".join(printed) in first.text()  # the line a user copies
    created = subprocess.run(
        [sys.executable, "-m", "conveyor", *printed],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert created.returncode == 0, created.stderr
    with Producer(bootstrap) as producer:
        futures = [producer.send("orders", f"order-{i}".encode()) for i in range(100)]
        producer.flush(60)
        assert sorted(future.result(60) for future in futures) == list(range(100))

    # kill -9 one broker: the command says how to start it again, and that line brings the node back
    n2 = next(pid for pid in pids if b"n2" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    os.kill(n2, signal.SIGKILL)
    again_line = wait_for(
        lambda: re.search(r"^conveyor cluster: to start n2 again: (.+)$", first.text(), re.M),
        timeout=60,
        message="the command to print how to start n2 again",
    )
    restarted = subprocess.Popen(
        shlex.split(again_line.group(1)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        with Producer(bootstrap) as producer:
            assert producer.send("orders", b"after-restart").result(60) == 100
        registered = wait_for(
            lambda: (lambda nodes: nodes if len(nodes) == 3 else None)(Metadata(bootstrap).refresh().nodes),
            timeout=60,
            message="n2 to register again",
        )
        assert "n2" in registered
    finally:
        restarted.terminate()  # ours, by pid: the command's Ctrl-C stops only its own children
        restarted.wait(STOP_TIMEOUT)

    interrupt(first, pids)
    assert not running_in(directory)
    assert (directory / "n1").is_dir() and (directory / "etcd" / "data").is_dir()

    second = start(directory)  # the same cluster again: the same ports, the same topic
    again = children(second.proc.pid)
    runs.append((second, again | second.printed_pids()))
    assert second.bootstrap() == bootstrap
    assert (directory / "bootstrap").read_text().strip() == bootstrap

    def end_offset() -> int:
        with Admin(bootstrap) as admin:
            return int(admin.describe_topic("orders")["end_offset"])

    wait_for(lambda: end_offset() == 101, timeout=60, message="the topic to be there after the restart")
    interrupt(second, again)
    assert not running_in(directory)


def test_the_directory_remembers_its_ports_and_refuses_fewer_nodes(tmp_path: Path) -> None:
    state = LocalState().with_nodes(3)
    state.etcd_ports = (2379, 2380)
    state.save(tmp_path / "cluster.json")
    loaded = LocalState.load(tmp_path / "cluster.json")
    assert loaded == state
    grown = loaded.with_nodes(4)
    assert {n: grown.addresses[n] for n in ("n1", "n2", "n3")} == state.addresses and "n4" in grown.addresses
    assert node_count(None, 0) == 3 and node_count(None, 5) == 5 and node_count(4, 3) == 4
    with pytest.raises(ConfigError, match="3-node cluster"):
        node_count(2, 3)
    (tmp_path / "cluster.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a local cluster"):
        LocalState.load(tmp_path / "cluster.json")


def test_the_command_needs_etcd(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "cluster", "local", "--dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(Path(sys.executable).parent)},  # no etcd on this PATH
    )
    assert done.returncode == 2 and "etcd not found" in done.stderr
    assert not (tmp_path / "c").exists()


def test_a_port_taken_since_the_first_run_is_a_clear_error_and_leaves_nothing_running(tmp_path: Path) -> None:
    directory = tmp_path / "conveyor-cluster"
    directory.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        state = LocalState().with_nodes(3)
        state.addresses["n1"] = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        state.save(directory / "cluster.json")
        done = subprocess.run(
            [sys.executable, "-m", "conveyor", "cluster", "local", "--dir", str(directory)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the cluster did not start" in done.stderr and "Address already in use" in done.stderr
    assert not running_in(directory), "etcd or a broker outlived the failed start"
