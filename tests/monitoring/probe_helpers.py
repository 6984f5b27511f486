"""Probing /healthz, /livez and /readyz of real processes without racing their HTTP servers.

A process's HTTP server may not listen yet (it was just started) or may be
between a stop and a restart: every probe here retries a refused, reset or
timed-out connection until its deadline, and only an HTTP answer counts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.testing import scrape_metric
from tests.helpers import wait_for

APPS = Path(__file__).parent / "apps"
PHASE = 45.0  # every phase of a probe test gets this long: CI runs on 2 busy cores
METRICS_URL = re.compile(r"metrics (http://\S+/metrics)")


def probe(base: str, path: str, *, method: str = "GET", deadline: float = PHASE) -> tuple[int, Any]:
    """``(status, body)`` of ``base + path``; JSON bodies are decoded, HEAD bodies are ``b""``."""
    end = time.monotonic() + deadline
    while True:
        request = urllib.request.Request(base + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, _body(response.read(), response.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as exc:
            return exc.code, _body(exc.read(), exc.headers.get("Content-Type", ""))
        except (urllib.error.URLError, OSError) as exc:  # not listening (yet, or any more): try again
            if time.monotonic() > end:
                raise AssertionError(f"{base}{path} never answered: {exc}") from None
            time.sleep(0.1)


def _body(raw: bytes, content_type: str) -> Any:
    if raw and content_type.startswith("application/json"):
        return json.loads(raw)
    return raw


def health_is(base: str, status: str) -> tuple[int, dict[str, Any]] | None:
    code, report = probe(base, "/healthz")
    return (code, report) if report["status"] == status else None


def health_status_metric(base: str, check: str) -> float:
    """``conveyor_health_status{check=...}`` (0 healthy, 1 degraded, 2 unhealthy), -1 when absent."""
    deadline = time.monotonic() + PHASE
    while True:
        try:
            text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
            break
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    found = re.search(rf'^conveyor_health_status\{{check="{re.escape(check)}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


def base_url(metrics_url: str) -> str:
    return metrics_url.rsplit("/", 1)[0]


class ProbedRunner:
    """``conveyor run app_probe`` that need not reach its broker to be probed.

    It does not wait for the runner's ready line (a runner whose broker is down
    never prints it): the metrics URL is read from the first line naming it.
    """

    def __init__(self, broker: str, *, args: list[str] | None = None) -> None:
        cmd = [sys.executable, "-m", "conveyor", "run", "app_probe", "--broker", broker, "--metrics-port", "0"]
        env = {**os.environ, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [*cmd, *(args or [])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = base_url(wait_for(self._metrics_url, PHASE, message="the runner's metrics URL"))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _metrics_url(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError("runner exited:\n" + "".join(self.lines))
        for line in list(self.lines):
            found = METRICS_URL.search(line)
            if found:
                return found.group(1)
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def broker_metric(metrics_url: str, name: str, labels: str = "") -> float:
    return scrape_metric(metrics_url, name, labels)
