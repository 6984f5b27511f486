"""CPU time of processes from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads); 0 when it is gone."""
    try:
        fields = _stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(int(entry.name))[1]) == pid:
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def tree_cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def runtime_seconds(pids: list[int]) -> float:
    """Time on a CPU of every thread of ``pids``, to the nanosecond (``/proc/PID/task/TID/schedstat``).

    utime + stime count 10 ms clock ticks: too coarse for a few seconds of a
    nearly idle process. Threads that already ended are not counted.
    """
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return total / 1e9


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLK_TCK


def self_cpu_seconds() -> float:
    """CPU seconds of this process, all threads (what /proc says for it)."""
    t = os.times()
    return t.user + t.system
