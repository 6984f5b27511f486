"""``conveyor cluster local``: etcd and N brokers on this machine, until Ctrl-C (``make cluster`` runs it).

Everything lives in one directory (``./conveyor-cluster`` by default): etcd's
data in ``etcd/``, each node's data in ``n1/``, ``n2/``..., the brokers'
output in ``logs/``, and ``cluster.json``, the ports chosen the first time.
Running the command again on the same directory starts the same cluster on
the same ports, with its topics, so a client's bootstrap list stays valid.

Every child runs in a session of its own: Ctrl-C in the terminal reaches
only this command, which then stops the brokers with SIGTERM one after the
other and etcd last (the brokers need etcd while they stop). A second Ctrl-C
kills whatever is left. A node that dies meanwhile (``kill -9`` of a leader,
to watch a failover) is reported and the others go on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from conveyor.broker.cli.cluster import ACTIONS, cluster_action
from conveyor.broker.config.broker_settings import broker_options

from conveyor import exitcodes
from conveyor.cluster_process import ClusterProcess
from conveyor.errors import ConfigError
from conveyor.etcd_process import free_port

STATE_FILE = "cluster.json"
BOOTSTRAP_FILE = "bootstrap"
LAST_LINES = 8  # of a process's output, when it did not start
LAST_GRACE = 0.5  # seconds the last broker gets before its second SIGTERM: it has nobody to hand off to
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _default(name: str) -> Any:
    return next(opt.default for opt in broker_options() if opt.name == name)


def _setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="brokers to run (default 3, or as many as the directory holds)")
    parser.add_argument("--dir", default="./conveyor-cluster", help="where etcd, the nodes' data and the logs live")
    parser.add_argument("--fsync", default=_default("fsync"), help="each broker's --fsync")
    parser.add_argument(
        "--cluster-lease-ms", type=int, default=_default("cluster-lease-ms"), help="each broker's --cluster-lease-ms"
    )


@dataclass
class LocalState:
    """The ports a local cluster got the first time, kept in ``cluster.json`` for the next start."""

    addresses: dict[str, str] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    etcd_ports: tuple[int, int] = (0, 0)

    @classmethod
    def load(cls, path: Path) -> LocalState:
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
            nodes = data["nodes"]
            return cls(
                {node: str(info["address"]) for node, info in nodes.items()},
                {node: int(info["metrics_port"]) for node, info in nodes.items()},
                (int(data["etcd"]["client_port"]), int(data["etcd"]["peer_port"])),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a local cluster's state ({exc}); use another --dir") from None

    def save(self, path: Path) -> None:
        nodes = {
            node: {"address": self.addresses[node], "metrics_port": self.metrics_ports[node]} for node in self.addresses
        }
        etcd = {"client_port": self.etcd_ports[0], "peer_port": self.etcd_ports[1]}
        path.write_text(json.dumps({"format": 1, "nodes": nodes, "etcd": etcd}, indent=2) + "\n")

    def with_nodes(self, count: int) -> LocalState:
        """The same ports for the nodes it knows, free ones for the others (n1..nCOUNT)."""
        nodes = [f"n{i + 1}" for i in range(count)]
        addresses = {n: self.addresses.get(n) or f"tcp://127.0.0.1:{free_port()}" for n in nodes}
        metrics = {n: self.metrics_ports.get(n) or free_port() for n in nodes}
        return LocalState(addresses, metrics, self.etcd_ports)


def node_count(asked: int | None, known: int) -> int:
    """How many nodes to run: as asked, else as many as the directory holds (3 for a new one); never fewer."""
    count = asked if asked is not None else (known or 3)
    if count < 1:
        raise ConfigError(f"--nodes {count}: a cluster needs at least one node")
    if count < known:
        raise ConfigError(
            f"--nodes {count}: this directory holds a {known}-node cluster; its topics have replicas on every node "
            f"(run it with --nodes {known}, or use another --dir)"
        )
    return count


def _check_tools() -> None:
    if shutil.which("etcd") is None:
        raise ConfigError("etcd not found: `make cluster` installs it (Debian package etcd-server)")
    if importlib.util.find_spec("requests") is None:
        raise ConfigError("cluster mode needs the [cluster] extra: pip install 'conveyor[cluster]' (or `make cluster`)")


class _Stop(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: stop the cluster."""


@cluster_action("local", "etcd and N brokers on this machine until Ctrl-C (what `make cluster` runs)", _setup)
def cmd_local(args: argparse.Namespace) -> int:
    _check_tools()
    directory = Path(args.dir)
    known = LocalState.load(directory / STATE_FILE)
    state = known.with_nodes(node_count(args.nodes, len(known.addresses)))
    cluster = ClusterProcess(
        directory,
        nodes=len(state.addresses),
        fsync=args.fsync,
        lease_ms=args.cluster_lease_ms,
        addresses=state.addresses,
        metrics_ports=state.metrics_ports,
        etcd_ports=state.etcd_ports,
        log_dir=directory / "logs",
        new_session=True,
    )
    wakeup, previous = _install_handlers()
    try:
        try:
            _start(cluster, directory, state)
            _watch(cluster, wakeup)
        except _Stop:
            pass
        print("conveyor cluster: stopping the brokers, then etcd (Ctrl-C again kills them)", flush=True)
        try:
            _stop(cluster)
        except _Stop:
            cluster.kill()
        except Exception as exc:  # a broker that would not stop was killed: say so, the rest stopped
            print(f"conveyor cluster: {exc}", file=sys.stderr, flush=True)
    except BaseException:
        cluster.kill()  # a failed start, or anything else: nothing may stay running
        raise
    finally:
        _restore_handlers(wakeup, previous)
    print("conveyor cluster stopped: every broker and etcd exited", flush=True)
    return exitcodes.OK


def _install_handlers() -> tuple[int, dict[int, Any]]:
    """A stop signal raises ``_Stop`` wherever the command is; every signal (SIGCHLD too) also writes a byte
    to the wake-up pipe whose read end ``_watch`` blocks on. Returns that read end and the old handlers."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    def child(signum: int, frame: FrameType | None) -> None:
        """Only the wake-up byte matters: ``_watch`` looks at the children."""

    read, write = os.pipe()
    os.set_blocking(write, False)
    previous: dict[int, Any] = {-1: signal.set_wakeup_fd(write, warn_on_full_buffer=False)}
    previous |= {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, child)
    return read, previous


def _restore_handlers(read: int, previous: dict[int, Any]) -> None:
    write = signal.set_wakeup_fd(previous.pop(-1))
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    os.close(read)
    os.close(write)


def _start(cluster: ClusterProcess, directory: Path, state: LocalState) -> None:
    print(f"conveyor cluster: starting etcd and {len(cluster.node_ids)} brokers in {directory}", flush=True)
    try:
        cluster.start()
    except RuntimeError as exc:  # a port taken since the first run, etcd or a broker that exits at once
        lines = str(exc).strip().splitlines()
        raise ConfigError("the cluster did not start: " + "\n".join(lines[-LAST_LINES:])) from None
    state = LocalState(state.addresses, state.metrics_ports, (cluster.etcd.client_port, cluster.etcd.peer_port))
    state.save(directory / STATE_FILE)
    (directory / BOOTSTRAP_FILE).write_text(cluster.bootstrap + "\n")
    print(_report(cluster, directory), flush=True)


def _report(cluster: ClusterProcess, directory: Path) -> str:
    etcd = cluster.etcd
    lines = [f"etcd  {etcd.endpoint}  pid {etcd.pid}  data {etcd.data_dir}  log {etcd.log_path}"]
    for node in cluster.node_ids:
        broker = cluster.node(node)
        lines.append(
            f"{node}    {broker.address}  pid {broker.pid}  data {broker.data_dir}  log {broker.log_path}  "
            f"metrics {broker.metrics_url}"
        )
    bootstrap = cluster.bootstrap
    lines += [
        "",
        f"bootstrap: {bootstrap}",
        f"(also in {directory / BOOTSTRAP_FILE})",
        "",
        "Try, in another terminal (. .venv/bin/activate first):",
        f"  conveyor topics create orders --replication-factor 3 --broker {bootstrap}",
        f"  conveyor publish orders hello --broker {bootstrap}",
        f"  conveyor tail orders --from earliest --count 1 --broker {bootstrap}",
    ]
    if "status" in ACTIONS:
        lines.append(f"  conveyor cluster status --broker {bootstrap}")
    lines += [
        f'  python -c \'from conveyor import Producer; print(Producer("{bootstrap}").send("orders", b"hi").result())\'',
        "",
        f"kill -9 a broker's pid to watch a failover. Ctrl-C stops them all; the data stays in {directory},",
        "and running this again restarts the same cluster on the same ports.",
    ]
    return "\n".join(lines)


def _stop(cluster: ClusterProcess) -> None:
    """SIGTERM each broker in turn, then etcd.

    Each broker's controlled shutdown hands what it leads to the brokers still
    running. The last one has nobody left to hand off to and would wait for a
    successor until its deadlines: a second SIGTERM, after ``LAST_GRACE``,
    stops it at once (it still syncs and exits cleanly).
    """
    brokers = [cluster.node(node) for node in cluster.node_ids]
    running = [broker for broker in brokers if broker.proc is not None and broker.proc.poll() is None]
    failures: list[str] = []
    for position, broker in enumerate(running):
        try:
            if position == len(running) - 1 and broker.proc is not None:
                broker.signal(signal.SIGTERM)
                try:
                    broker.proc.wait(LAST_GRACE)
                except subprocess.TimeoutExpired:
                    broker.signal(signal.SIGTERM)
            broker.stop()
        except subprocess.TimeoutExpired:
            failures.append(f"{broker.data_dir.name} did not stop in time and was killed")
    cluster.stop()  # the brokers have exited: this stops etcd
    if failures:
        raise RuntimeError("; ".join(failures))


def _watch(cluster: ClusterProcess, wakeup: int) -> None:
    """Until a stop signal: report each child that exits on its own (the others go on)."""
    reported: set[int] = set()
    while True:
        os.read(wakeup, 512)  # blocks until a signal; a stop signal's handler raises out of it
        processes = [
            ("etcd", cluster.etcd.proc, []),
            *((n, cluster.node(n).proc, cluster.node(n).command) for n in cluster.node_ids),
        ]
        for name, proc, command in processes:
            if proc is not None and proc.pid not in reported and proc.poll() is not None:
                reported.add(proc.pid)
                print(f"conveyor cluster: {name} (pid {proc.pid}) exited with {proc.returncode}", flush=True)
                if command:  # a broker killed to watch a failover: how to bring it back without the others
                    print(f"conveyor cluster: to start {name} again: {shlex.join(command)}", flush=True)


__all__ = ["LocalState", "cmd_local", "node_count"]
