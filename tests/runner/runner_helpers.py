"""Start real ``conveyor run`` processes and read what their handlers recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

APPS = Path(__file__).parent / "apps"


class RunnerProcess:
    def __init__(
        self,
        broker: str,
        out: Path,
        module: str = "app_record",
        *,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "run",
            module,
            "--broker",
            broker,
            "--metrics-port",
            "0",
            *(args or []),
        ]
        full_env = {
            **os.environ,
            "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "CONVEYOR_TEST_OUT": str(out),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(60):  # a loaded CI machine starts Python slowly
            self.kill()
            raise RuntimeError("runner did not start:\n" + "".join(self.lines))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "runner ready" in line:
                self.ready.set()

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def records(out: Path, name: str) -> list[list[str]]:
    """Lines a handler wrote: [name, pid, offset, attempt, key, value, extra]."""
    path = out / f"{name}.log"
    if not path.exists():
        return []
    return [line.split(" ", 6) for line in path.read_text().splitlines()]


def offsets(out: Path, name: str) -> list[int]:
    return [int(r[2]) for r in records(out, name)]


def wait_records(out: Path, name: str, count: int, timeout: float = 30.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records(out, name)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    return records(out, name)


def by_pid(rows: list[list[str]]) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        grouped[row[1]].append(int(row[2]))
    return grouped
