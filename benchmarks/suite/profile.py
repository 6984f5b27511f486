"""Summarize ``conveyor bench --py-spy DIR`` output: where each process spent its samples.

    python -m conveyor.benchmarks.suite.profile DIR [--top 12] [--match NAME]

Each file holds py-spy's raw collapsed stacks (``frame;frame;... count``). For
each process this prints the functions with the most samples on top of the
stack (self time) and the most samples anywhere on it (inclusive).
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """``send (broker/client/producer.py:123)`` -> ``send (broker/client/producer.py)``: one entry per function."""
    frame = frame.strip()
    frame = _LINE.sub(")", frame)
    return re.sub(r"\(.*/(site-packages|lib/python3\.\d+)/", "(", frame)


def start_profilers(
    out_dir: Path, stem: str, pids: dict[str, int], *, rate: int = 250, threads: bool = False, gil: bool = False
) -> list[subprocess.Popen[bytes]]:
    """One ``py-spy record --format raw`` per process (collapsed stacks, idle time left out).

    ``threads`` keeps one stack per thread; ``gil`` keeps only samples of the
    thread holding the GIL, closer to CPU time spent in Python code on a
    machine where processes wait for a core.
    """
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    profilers = []
    for name, pid in pids.items():
        out = out_dir / f"{stem}-{name.replace(' ', '').replace('.', '_')}.txt"
        cmd = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate), "--nonblocking"]
        cmd += [*(["--threads"] if threads else []), *(["--gil"] if gil else []), "--output", str(out)]
        profilers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # let py-spy attach before the clock starts
    return profilers


def stop_profilers(profilers: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGINT makes py-spy write its file; one that hangs is killed."""
    for profiler in profilers:
        if profiler.poll() is None:
            profiler.send_signal(signal.SIGINT)
    for profiler in profilers:
        try:
            profiler.wait(20)
        except subprocess.TimeoutExpired:
            profiler.kill()


def summarize(path: Path, top: int = 12) -> str:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_function(f) for f in stack.split(";") if f.strip()]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    if not total:
        return f"{path.name}: no samples"
    out = [f"{path.name}: {total} samples"]
    out.append("  self:")
    out += [f"    {n / total * 100:5.1f}%  {name}" for name, n in own.most_common(top)]
    out.append("  inclusive:")
    out += [f"    {n / total * 100:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(out)


SUMMARY = "summary.txt"  # what ``conveyor bench --py-spy DIR`` writes beside the raw stacks


def profile_files(directory: Path, match: str = "") -> list[Path]:
    """The raw stacks of each profiled process in ``directory`` (not the summary written there)."""
    return sorted(p for p in directory.glob("*.txt") if p.name != SUMMARY and match in p.name)


def write_summary(directory: Path, top: int = 12) -> tuple[Path, int]:
    """Every profiled process's top functions in ``directory/summary.txt``; its path and how many processes."""
    texts = [summarize(path, top) for path in profile_files(directory)]
    summary = directory / SUMMARY
    summary.write_text("\n\n".join(texts) + "\n")
    return summary, len(texts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.suite.profile", description=__doc__)
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--match", default="", help="only files whose name contains this")
    args = parser.parse_args(argv)
    files = profile_files(Path(args.dir), args.match)
    if not files:
        print(f"no py-spy files in {args.dir}", file=sys.stderr)
        return 1
    for path in files:
        print(summarize(path, args.top))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
