"""``conveyor run --workers N``: N runner processes under one supervisor, as gunicorn's arbiter does.

Each worker is a whole runner (``consumers/runner.py``) in its own process, started from the same
command line with ``CONVEYOR_WORKER`` set; all join the same consumer groups, so the broker spreads
batches between them as between any members of a group. The supervisor handles no message: it
starts the workers, watches them, serves the one metrics port, and stops them.

- A worker that exits with 2 (``exitcodes.ERROR``: a config error, a module that does not import)
  before it was ready stops the pool with 2, as ``--workers 1`` would: starting it again cannot help.
- A worker that dies otherwise (killed, out of memory, a crash) is started again, after a backoff
  that doubles (0.5 s to 30 s) while it keeps dying within a minute of its start, so a crash-looping
  handler module does not spin; each restart counts in ``conveyor_runner_worker_restarts_total``.
- SIGTERM/SIGINT: every worker gets SIGTERM and drains as a single runner does (``--graceful-timeout``);
  one still running 5 s after that is killed. A second signal kills them at once.
- ``run()`` returns 0 when every worker drained cleanly, 3 (``HANDLERS_ABANDONED``) when some gave
  messages back at their graceful timeout, and 4 (``WORKERS_DIED``) when a worker died during the
  run or had to be killed at the end: the messages it held went back to the broker for redelivery.

Metrics: workers write theirs to prometheus-client's multiprocess files in a directory the
supervisor makes and removes (``PROMETHEUS_MULTIPROC_DIR``); one scrape of the supervisor shows
them merged (counters and histograms summed; gauges as their ``multiprocess_mode`` says), with
the supervisor's own ``WorkerPoolMetrics``. Nothing polls: the loop sleeps in ``select`` on the
signal wake-up pipe (SIGCHLD, SIGTERM, SIGINT) and the workers' ready pipes, with a timeout
only for a restart's backoff or the stop's deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from conveyor.consumers.worker_health import merge_reports, read_report, report_path
from conveyor.monitoring.health import DEGRADED, HEALTHY, UNHEALTHY, live, ready, report
from conveyor.monitoring.http import MetricsServer
from conveyor.monitoring.metrics import HealthCollector, WorkerPoolMetrics
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from conveyor import exitcodes

log = logging.getLogger("conveyor.supervisor")

WORKER_ENV = "CONVEYOR_WORKER"  # "<index>:<ready fd>:<supervisor pid>", set in each worker's environment
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FIRST_BACKOFF = 0.5  # seconds before the first restart of a worker that died
MAX_BACKOFF = 30.0
STABLE_AFTER = 60.0  # a worker that ran this long before dying starts again from the first backoff
KILL_MARGIN = 5.0  # seconds past --graceful-timeout before a worker still running is killed


def restart_delay(quick_deaths: int) -> float:
    """Seconds before starting a worker again, after it died ``quick_deaths`` times in a row soon after its start."""
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** max(0, quick_deaths - 1))


def exit_code(*, died: int, killed: int, codes: Sequence[int], boot_error: int | None = None) -> int:
    """The supervisor's exit code from what became of its workers (the README's table).

    ``died``: workers that died during the run; ``killed``: workers killed at the stop's deadline;
    ``codes``: the exit codes of the workers that stopped when asked.
    """
    if boot_error is not None:
        return boot_error
    if died or killed or any(code not in (exitcodes.OK, exitcodes.HANDLERS_ABANDONED) for code in codes):
        return exitcodes.WORKERS_DIED
    if exitcodes.HANDLERS_ABANDONED in codes:
        return exitcodes.HANDLERS_ABANDONED
    return exitcodes.OK


def describe_exit(code: int) -> str:
    """``exit 1`` or ``killed by SIGKILL``: how a worker ended, for the log."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


# --- the worker's side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRole:
    """What a worker process learns from ``CONVEYOR_WORKER``: its number, its ready pipe, its supervisor."""

    index: int
    ready_fd: int
    supervisor: int

    @classmethod
    def parse(cls, text: str) -> WorkerRole:
        index, ready_fd, supervisor = (int(part) for part in text.split(":"))
        return cls(index, ready_fd, supervisor)

    def __str__(self) -> str:
        return f"{self.index}:{self.ready_fd}:{self.supervisor}"


def worker_role(environ: Mapping[str, str] = os.environ) -> WorkerRole | None:
    """This process's role when a supervisor started it, else None."""
    text = environ.get(WORKER_ENV)
    return WorkerRole.parse(text) if text else None


def follow_supervisor(role: WorkerRole) -> bool:
    """Ask Linux for SIGTERM (a graceful drain) when the supervisor dies; False if it is gone already."""
    with contextlib.suppress(Exception):  # elsewhere than Linux, the worker outlives a killed supervisor
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    return os.getppid() == role.supervisor


def notify_ready(role: WorkerRole) -> None:
    """Tell the supervisor this worker is subscribed (called once, from the runner's ``ready``)."""
    with contextlib.suppress(OSError):
        os.write(role.ready_fd, b"R")
    with contextlib.suppress(OSError):
        os.close(role.ready_fd)


# --- the supervisor -----------------------------------------------------------------------------------


@dataclass(eq=False)
class Worker:
    """One worker slot: the process now in it (if any) and how it has been dying."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready_r: int | None = None
    ready: bool = False
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None


class Supervisor:
    def __init__(
        self,
        command: Sequence[str],
        workers: int,
        *,
        graceful_timeout: float = 15.0,
        metrics_port: int = 9101,
        metrics_bind: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``command``: the argv that starts one worker (a ``conveyor run`` that will find ``CONVEYOR_WORKER``)."""
        if workers < 1:
            raise ValueError(f"workers must be 1 or more, not {workers}")
        self.command = list(command)
        self.workers = [Worker(i) for i in range(1, workers + 1)]
        self.graceful_timeout = graceful_timeout
        self.env = dict(os.environ if env is None else env)
        self.metrics_dir = tempfile.mkdtemp(prefix="conveyor-metrics-")
        self.registry = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(self.registry, path=self.metrics_dir)
        self.metrics = WorkerPoolMetrics(self.registry, self.pids)
        self.registry.register(HealthCollector(self.health))
        self.metrics_server: MetricsServer | None = None
        if metrics_port >= 0:
            try:
                self.metrics_server = MetricsServer(
                    self.registry,
                    self.health,
                    host=metrics_bind,
                    port=metrics_port,
                    live=lambda: live(self.health()),
                    ready=self.readiness,
                )
            except BaseException:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
                raise
        self.died = 0  # workers that died without being asked
        self.restarts = 0
        self.killed = 0  # workers killed at the stop's deadline
        self.codes: list[int] = []  # exit codes of workers that stopped when asked
        self.boot_error: int | None = None
        self.signals = 0
        self.serving = False
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    # --- the loop ---------------------------------------------------------------------------------

    def run(self, *, ready: Callable[[Supervisor], None] | None = None) -> int:
        """Start the workers and keep them running until SIGTERM/SIGINT; then stop them all. The exit code."""
        previous = self._install_signals()
        try:
            if self.metrics_server:
                self.metrics_server.start()
            for worker in self.workers:
                self._spawn(worker)
            while not self.signals and self.boot_error is None:
                self._wait(self._next_restart())
                self._reap()
                self._restart_due()
                if not self.serving and all(w.ready for w in self.workers):
                    self.serving = True
                    if ready is not None:
                        ready(self)
            self._stop_all()
        except BaseException:
            self._kill_all("the supervisor failed")  # never leave workers behind without their supervisor
            raise
        finally:
            self._restore_signals(previous)
            self._close()
        return exit_code(died=self.died, killed=self.killed, codes=self.codes, boot_error=self.boot_error)

    def stop(self) -> None:
        """Begin the stop, as SIGTERM does; a second call kills the workers at once."""
        self.signals += 1
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {
            sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
        }
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select through the wake-up fd
        previous[-1] = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return previous

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        signal.set_wakeup_fd(previous.pop(-1))
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _wait(self, timeout: float | None) -> None:
        """Sleep until a signal, a worker's ready byte, or ``timeout``."""
        for key, _events in self._selector.select(timeout):
            if key.fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 512):
                        pass
            else:
                self._read_ready(key.data, key.fd)

    def _read_ready(self, worker: Worker, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            if os.read(fd, 16) and worker.proc is not None:
                worker.ready = True
                log.info("worker %d (pid %d) ready", worker.index, worker.proc.pid)
        self._close_ready_pipe(worker)

    def _close_ready_pipe(self, worker: Worker) -> None:
        if worker.ready_r is not None:
            self._selector.unregister(worker.ready_r)
            os.close(worker.ready_r)
            worker.ready_r = None

    # --- starting and restarting ----------------------------------------------------------------

    def _spawn(self, worker: Worker) -> None:
        read_end, write_end = os.pipe()
        env = {**self.env, MULTIPROC_ENV: self.metrics_dir, WORKER_ENV: f"{worker.index}:{write_end}:{os.getpid()}"}
        try:
            # Its own process group: a terminal's Ctrl-C reaches the supervisor alone, which stops them in order.
            worker.proc = subprocess.Popen(self.command, env=env, pass_fds=(write_end,), process_group=0)
        finally:
            os.close(write_end)
        os.set_blocking(read_end, False)
        worker.ready_r, worker.ready, worker.started, worker.restart_at = read_end, False, time.monotonic(), None
        self._selector.register(read_end, selectors.EVENT_READ, worker)
        self.metrics.workers.set(len(self.pids()))
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    def _next_restart(self) -> float | None:
        dues = [w.restart_at for w in self.workers if w.restart_at is not None]
        return max(0.0, min(dues) - time.monotonic()) if dues else None

    def _restart_due(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.restart_at is not None and worker.restart_at <= now:
                self.restarts += 1
                self.metrics.worker_restarts.inc()
                self._spawn(worker)

    def _reap(self) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is not None:
                self._exited(worker, worker.proc)

    def _exited(self, worker: Worker, proc: subprocess.Popen[bytes]) -> None:
        code = proc.returncode
        self._forget(proc.pid)
        self._close_ready_pipe(worker)
        worker.proc = None
        self.metrics.workers.set(len(self.pids()))
        if self._stopping:
            # One not ready yet holds no message: ended by the SIGTERM it got before its handlers, it stopped cleanly.
            self.codes.append(exitcodes.OK if code == -signal.SIGTERM and not worker.ready else code)
            log.info("worker %d (pid %d) stopped: %s", worker.index, proc.pid, describe_exit(code))
        elif code == exitcodes.ERROR and not worker.ready:
            self.boot_error = code
            log.error("worker %d (pid %d) failed to start (exit %d): stopping", worker.index, proc.pid, code)
        else:
            self.died += 1
            quick = time.monotonic() - worker.started < STABLE_AFTER
            worker.quick_deaths = worker.quick_deaths + 1 if quick else 1
            delay = restart_delay(worker.quick_deaths)
            worker.restart_at = time.monotonic() + delay
            log.warning(
                "worker %d (pid %d) died (%s): starting it again in %.1f s; its unsettled messages go back to the "
                "broker for redelivery",
                worker.index,
                proc.pid,
                describe_exit(code),
                delay,
            )

    # --- stopping ---------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        """SIGTERM to every worker, wait for their drains, kill what is left at the deadline."""
        self._stopping = True
        self.serving = False
        for worker in self.workers:
            worker.restart_at = None
        running = [w for w in self.workers if w.proc is not None]
        log.info("stopping %d worker(s): up to %.1f s for in-flight messages", len(running), self.graceful_timeout)
        for worker in running:
            assert worker.proc is not None
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
        signals = self.signals
        deadline = time.monotonic() + self.graceful_timeout + KILL_MARGIN
        while self.pids():
            late = time.monotonic() >= deadline
            if late or self.signals > max(signals, 1):
                self._kill_all("still running past the deadline" if late else "a second signal")
                break
            self._wait(max(0.0, deadline - time.monotonic()))
            self._reap()

    def _kill_all(self, why: str) -> None:
        for worker in self.workers:
            proc = worker.proc
            if proc is None:
                continue
            log.warning("worker %d (pid %d) killed: %s", worker.index, proc.pid, why)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            self.killed += 1
            self._forget(proc.pid)
            self._close_ready_pipe(worker)
            worker.proc = None
        self.metrics.workers.set(0)

    def _forget(self, pid: int) -> None:
        """A worker ended: its live gauges leave the sums (its counters stay), its health report goes."""
        mark_process_dead(pid, self.metrics_dir)
        with contextlib.suppress(OSError):
            os.remove(report_path(self.metrics_dir, pid))

    def _close(self) -> None:
        if self.metrics_server:
            self.metrics_server.stop()
        for worker in self.workers:
            self._close_ready_pipe(worker)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    # --- health ---------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The ready workers' checks merged (each the worst of theirs: consumers/worker_health.py), and
        ``workers``: HEALTHY while every worker is up and ready, DEGRADED while some are (re)starting,
        UNHEALTHY when none is."""
        ready_ones = [(w.index, w.proc.pid) for w in self.workers if w.proc is not None and w.ready]
        checks = merge_reports({i: read_report(report_path(self.metrics_dir, pid)) for i, pid in ready_ones})
        up = len(ready_ones)
        status = HEALTHY if up == len(self.workers) else DEGRADED if up else UNHEALTHY
        check = {
            "status": status,
            "ready": up,
            "running": len(self.pids()),
            "workers": len(self.workers),
            "restarts": self.restarts,
        }
        return report({**checks, "workers": check})

    def readiness(self) -> dict[str, Any]:
        """Ready once every worker was ready, until the stop begins; not while none is up."""
        return ready(self.health(), serving=self.serving)
