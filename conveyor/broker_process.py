"""A real broker in a subprocess, for tests and benchmarks (``conveyor.testing`` hands it out).

``BrokerProcess`` starts ``python -m conveyor`` on a free loopback port in a
directory of your choice, waits for its ready line, and can stop (SIGTERM),
kill (-9) and restart it on the same port and data. It needs no pytest.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

READY = re.compile(r"ready on (tcp://\S+) .*metrics (\S+)\)")
KEPT_LINES = 1000  # lines of output kept in memory when they also go to a log file


class BrokerProcess:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: str = "batch",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        new_session: bool = False,
    ) -> None:
        """``log_path``: append the broker's output there (``output`` then keeps only its last lines);
        ``new_session``: its own session, so a terminal's Ctrl-C reaches only the process that started it."""
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path) if log_path is not None else None
        self.new_session = new_session
        self.fsync = fsync
        self.extra = list(extra or [])
        self.env = env
        self.address = ""
        self.metrics_url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self._bind = "tcp://127.0.0.1:*"
        self._metrics_port = "0"
        self.command: list[str] = []  # the command line of the last start (to start it again by hand)

    def start(self, timeout: float = 60.0) -> BrokerProcess:
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "--bind",
            self._bind,
            "--data-dir",
            str(self.data_dir),
            "--fsync",
            self.fsync,
            "--metrics-port",
            self._metrics_port,
            *self.extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.command = cmd
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=self.new_session,
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            log = open(self.log_path, "a", encoding="utf-8") if self.log_path is not None else None  # noqa: SIM115
            try:
                for line in self.proc.stdout:
                    self._keep(line, log)
                    match = READY.search(line)
                    if match and not ready.is_set():
                        self.address = match.group(1)
                        self.metrics_url = match.group(2)
                        ready.set()
            finally:
                if log is not None:
                    log.close()

        threading.Thread(target=pump, daemon=True).start()
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("broker did not start:\n" + "".join(self.output))
        # Restarts reuse the same endpoints so clients reconnect to the same place.
        self._bind = self.address
        self._metrics_port = self.metrics_url.rsplit(":", 1)[1].split("/")[0]

    def _keep(self, line: str, log: Any) -> None:
        """A line of output: in ``output``, and in the log file if there is one (``output`` then stays short)."""
        self.output.append(line)
        if log is not None:
            log.write(line)
            log.flush()
            if len(self.output) > KEPT_LINES:
                del self.output[: len(self.output) - KEPT_LINES // 2]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: the broker syncs everything and exits 0."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: no chance to sync, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of the broker's samples of ``name`` whose labels contain ``labels`` (e.g. ``'topic="t"'``)."""
        return scrape_metric(self.metrics_url, name, labels)

    def restart(self, *, kill: bool = False, timeout: float = 60.0) -> BrokerProcess:
        self.kill() if kill else self.stop()
        for _ in range(50):  # the port may take a moment to be free again
            try:
                return self.start(timeout)
            except RuntimeError:
                if "Address already in use" not in "".join(self.output[-5:]):
                    raise
                time.sleep(0.1)
        raise RuntimeError("could not rebind " + self._bind)

    def __enter__(self) -> BrokerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def scrape_metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` at a ``/metrics`` URL whose labels contain ``labels``."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total
