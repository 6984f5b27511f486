"""What a benchmarked system provides: its server, the variants it runs, and its clients."""

from __future__ import annotations

import abc
import contextlib
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import tree
from conveyor.benchmarks.suite.scenario import Scenario


@dataclass(frozen=True, slots=True)
class Variant:
    """A system with one durability setting, e.g. Redis with ``appendfsync always``."""

    system: str  # conveyor, redis, nats, rabbitmq
    mode: str  # batch / none (Conveyor), always / everysec / none (Redis), file / memory, persistent / transient
    title: str  # "Redis Streams"
    durability: str  # stated next to the numbers
    matches: bool = True  # the durability that matches the scenario's fsync policy (the fair comparison)
    explicit: bool = False  # runs only where a scenario's ``systems`` or ``--systems`` names its id (``nats:r3``)
    fsync: str = ""  # the scenario's fsync policy, for a server that takes it at start (``start`` sees no scenario)

    @property
    def id(self) -> str:
        return f"{self.system}:{self.mode}"

    @property
    def label(self) -> str:
        return f"{self.title} ({self.durability})"


class Server(abc.ABC):
    """A running server; ``endpoint`` is what the client processes are given (picklable)."""

    pids: list[int]
    external: bool = False

    @abc.abstractmethod
    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        """Create what a run needs (topic, stream, queues, groups); return the endpoint for the clients."""

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        """Queue depth as the server sees it: ``lag`` (not yet delivered) and ``in_flight`` (delivered, unacked)."""
        return {"lag": None, "in_flight": None}

    def cleanup(self, endpoint: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Drop what ``prepare`` made (for servers reused across runs)."""

    @abc.abstractmethod
    def stop(self) -> None: ...

    def cpu_pids(self) -> list[int]:
        """The server's processes (and their children) right now, for CPU accounting."""
        out: list[int] = []
        for pid in self.pids:
            out += tree(pid)
        return out

    def processes(self) -> dict[str, list[int]]:
        """Each server process by name, with its children: ``{"server": [...]}`` for one process.

        A system of several servers (a three-node cluster, its etcd) names each
        one, e.g. ``{"nats 1": [...], "nats 2": [...], "nats 3": [...]}``: the
        report then gives each its CPU seconds and CPU per message, and finds the
        busiest process among them rather than in their sum.
        """
        return {"server": self.cpu_pids()}

    def stored(self, endpoint: dict[str, Any]) -> dict[str, int] | None:
        """How many of the run's messages each server process stored (``{"broker n1": 150000, ...}``); None: unknown.

        Asked once after the run. A server that answers gets CPU per *stored*
        message for each process (its CPU over what it stored, not over the
        run's total): the scale-out benchmark compares that across partition counts.
        """
        return None

    def details(self, endpoint: dict[str, Any]) -> dict[str, dict[str, float]] | None:
        """What each server process did during the run, by its own counters (asked after the run); None: nothing.

        Kept in the result as ``server_details``; the scale-out section reads
        a broker's batches, loop passes and group commits from it.
        """
        return None

    def background(self, endpoint: dict[str, Any]) -> dict[str, float] | None:
        """CPU seconds per second each server process used while idle (measured in ``prepare``); None: not measured.

        A broker spends some CPU whatever the load (lease renewals, timers). Where
        it is known, the run also reports CPU per stored message without it.
        """
        return None

    def leaders(self, endpoint: dict[str, Any]) -> dict[str, str] | None:
        """Who leads each replicated part of this run right now, e.g. ``{"stream": "nats-2"}``; None: no leaders.

        Sampled with the queue depth (5 times a second) and at the start and end
        of the run; every change of a value between two samples counts as a
        leader change. Put the leader epoch in the value (``"node-b@7"``) when
        there is one, so that a re-election of the same node counts too.
        """
        return None

    def leader_elections(self) -> int | None:
        """A count of leader elections the servers keep themselves (a log, a metric); None when there is none.

        When given, the run's ``leader_changes`` is this count's increase from
        the start signal to the end, which also sees elections quicker than
        the sampling; otherwise it is what ``leaders`` showed.
        """
        return None


class System(abc.ABC):
    name: str
    title: str
    reuse_server = False  # one server for the whole bench (slow to start), or a fresh one per run
    variant_settings: dict[str, dict[str, Any]] = {}  # replaced, never changed in place, by ``configure``

    def configure(self, variants: dict[str, dict[str, Any]]) -> None:
        """Take this system's entries of the config's ``settings.variants`` (keyed by variant id)."""
        self.variant_settings = {k: dict(v) for k, v in variants.items() if k.split(":", 1)[0] == self.name}

    def settings_for(self, mode: str) -> dict[str, Any]:
        """The config's settings for the variant ``<name>:<mode>`` (empty when the config has none)."""
        return self.variant_settings.get(f"{self.name}:{mode}", {})

    def why_not(self, variant: str) -> str | None:
        """Why this system offers no ``variant`` (an id a scenario names) here, e.g. a missing etcd; None: no reason.

        The bench then falls back to the config's ``settings.variants[id].pending``.
        """
        return None

    @abc.abstractmethod
    def unavailable(self) -> str | None:
        """Why this system cannot run here (a missing server binary or client library), or None."""

    @abc.abstractmethod
    def variants(self, scenario: Scenario) -> list[Variant]: ...

    @abc.abstractmethod
    def start(self, variant: Variant, workdir: Path) -> Server: ...

    def version(self) -> str:
        return ""

    def client_api(self) -> str:
        return ""


# --- helpers for servers started as subprocesses ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f} s")


def terminate(proc: subprocess.Popen[Any] | None, timeout: float = 20.0) -> None:
    """SIGTERM, wait, then SIGKILL: only the process this suite started."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


# --- the client side (inside producer and consumer processes) -------------------------------------


class ModeView(Server):
    """A server shared by every run of a bench, seen through one durability mode.

    Its ``stop`` does nothing: the shared server stops with its system
    (``SharedServerSystem.close``).
    """

    def __init__(self, server: Any, mode: str) -> None:
        self.server = server
        self.mode = mode
        self.pids = server.pids

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        return dict(self.server.prepare_mode(run, scenario, self.mode))

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        return dict(self.server.sample(endpoint))

    def processes(self) -> dict[str, list[int]]:
        named = getattr(self.server, "processes", None)
        return dict(named()) if named is not None else super().processes()

    def leaders(self, endpoint: dict[str, Any]) -> dict[str, str] | None:
        sampled = getattr(self.server, "leaders", None)
        return sampled(endpoint) if sampled is not None else None

    def leader_elections(self) -> int | None:
        counted = getattr(self.server, "leader_elections", None)
        return counted() if counted is not None else None

    def cleanup(self, endpoint: dict[str, Any]) -> None:
        self.server.cleanup(endpoint)

    def stop(self) -> None:
        pass


class SharedServerSystem(System):
    """A system whose server is slow to start: started once, on the first run, and shared by all."""

    def __init__(self) -> None:
        self.server: Any = None

    @abc.abstractmethod
    def new_server(self, root: Path) -> Any:
        """Start the shared server, keeping its data under ``root``."""

    def start(self, variant: Variant, workdir: Path) -> Server:
        if self.server is None:
            self.server = self.new_server(workdir.parent)
        return ModeView(self.server, variant.mode)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ProducerClient(abc.ABC):
    api = ""  # which client call sends, e.g. "Producer.send_many()"

    @abc.abstractmethod
    def send(self, values: list[bytes]) -> None:
        """Hand a batch of values to the client (it may send now or batch further)."""

    @abc.abstractmethod
    def flush(self) -> int:
        """Wait until everything sent is confirmed by the server; return how many failed."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class ConsumerClient(abc.ABC):
    @abc.abstractmethod
    def receive(self, timeout: float) -> list[bytes]:
        """The next delivered batch's values (possibly empty after ``timeout``)."""

    @abc.abstractmethod
    def ack(self) -> None:
        """Acknowledge everything received so far."""

    def close(self) -> None:  # noqa: B027 - optional
        pass
