"""The whole shop with one command: ``make example`` (``python -m examples.shop.demo``).

Starts a broker on a free port with its data in a temporary directory, the runner
(``conveyor run examples.shop.handlers``), places orders
(``python -m examples.shop.place_orders``), shows everything they print, waits until
every order was invoiced and e-mailed or dead-lettered, lists the dead letters
(``conveyor dlq list shop.orders.dlq``), then stops the runner and the broker
cleanly (SIGTERM: in-flight messages drain, the log is fsynced) and deletes the
directory. Exit code 0 when every order got where it should within ``--timeout``.

The same three pieces run by hand, in three terminals: ``make run``;
``conveyor run examples.shop.handlers``; ``python -m examples.shop.place_orders``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from conveyor.broker_process import BrokerProcess
from examples.shop.models import ORDERS

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds examples/: the runner imports from there
EMAILED = re.compile(r"e-mailed \S+: invoice INV-(\d+)")
NOT_BILLED = re.compile(r"order (ord-\d+) not billed")
TRACING: dict[str, str] = {}  # what main() adds to the children's environment for tracing


class Output:
    """A child's output, echoed with a prefix as it comes, and counted for the waits."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.lines: list[str] = []
        self.ended = False

    def pump(self, name: str, proc: subprocess.Popen[str]) -> threading.Thread:
        def run() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                say(name, line.rstrip("\n"))
                with self.changed:
                    self.lines.append(line)
                    self.changed.notify_all()
            with self.changed:  # its end too: a wait on a child that died returns at once
                self.ended = True
                self.changed.notify_all()

        thread = threading.Thread(target=run, name=f"pump-{name}", daemon=True)
        thread.start()
        return thread

    def wait_for(self, done: Callable[[list[str]], bool], timeout: float) -> bool:
        """Wait until ``done(lines)``, for up to ``timeout`` seconds or until the child's output ends."""
        with self.changed:
            self.changed.wait_for(lambda: done(self.lines) or self.ended, timeout=timeout)
            return done(self.lines)


_printing = threading.Lock()  # the children's output is echoed by a thread each


def say(name: str, text: str) -> None:
    _write(f"{name:<7}| {text}\n")


def banner(text: str) -> None:
    _write(f"\n== {text}\n")


def _write(text: str) -> None:
    """One whole line at a time: ``print`` writes the text and the newline apart, so another child's
    line could land between them."""
    with _printing:
        sys.stdout.write(text)
        sys.stdout.flush()


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **TRACING}


def tracing_env() -> dict[str, str]:
    """``OTEL_TRACES_EXPORTER=console`` for the runner and the producer, unless set already (``=none``: off)
    or the OpenTelemetry SDK is not installed."""
    if "OTEL_TRACES_EXPORTER" in os.environ:
        return {}
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        return {}
    return {"OTEL_TRACES_EXPORTER": "console"}


def tracing_note() -> str:
    exporter = {**os.environ, **TRACING}.get("OTEL_TRACES_EXPORTER", "")
    if exporter == "console":
        return "tracing on: each span is a `trace ... span ...` line (OTEL_TRACES_EXPORTER=none turns it off)"
    if exporter:
        return f"tracing as OTEL_TRACES_EXPORTER={exporter} says (the shop prints spans only for `console`)"
    return "tracing off: opentelemetry-sdk is not installed (`make example` installs it)"


def start(args: list[str]) -> subprocess.Popen[str]:
    """A child in its own session, so a Ctrl-C here stops the pieces in order instead of all at once."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=ROOT,
        start_new_session=True,
    )


@contextmanager
def broker(timeout: float) -> Iterator[BrokerProcess]:
    data_dir = tempfile.mkdtemp(prefix="conveyor-shop-")
    try:
        process = BrokerProcess(data_dir, new_session=True).start(timeout)  # killed if it does not get ready
        say("broker", f"ready on {process.address} (data in {data_dir}, deleted at the end)")
        try:
            yield process
        finally:
            code = process.stop()
            say("broker", "stopped cleanly" if code == 0 else f"stopped with exit code {code}")
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


@contextmanager
def runner(address: str, output: Output, timeout: float) -> Iterator[subprocess.Popen[str]]:
    proc = start(["-m", "conveyor", "run", "examples.shop.handlers", "--broker", address, "--metrics-port", "-1"])
    pump = output.pump("runner", proc)
    try:
        if not output.wait_for(lambda lines: any("runner ready" in line for line in lines), timeout):
            raise SystemExit(f"the runner did not get ready within {timeout} s (its output is above)")
        yield proc
    finally:
        stop(proc)
        pump.join(10)


def stop(proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """SIGTERM, as a deployment would: the runner drains in-flight messages and exits; killed only if stuck."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_to_end(args: list[str], name: str, timeout: float) -> int:
    """Run a command to its end, its output shown; one that takes longer than ``timeout`` is stopped (exit 1)."""
    proc = start(args)
    pump = Output().pump(name, proc)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        say(name, f"still running after {timeout} s: stopped")
        stop(proc)
        code = 1
    pump.join(10)
    return code


def settled(count: int, bad: int) -> Callable[[list[str]], bool]:
    """Every good order's invoice was e-mailed and every bad order dead-lettered (a repeat counts once)."""

    def check(lines: list[str]) -> bool:
        text = "".join(lines)
        return len(set(EMAILED.findall(text))) >= count and len(set(NOT_BILLED.findall(text))) >= bad

    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.shop.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=8, help="good orders to place (default 8)")
    parser.add_argument("--bad", type=int, default=2, help="bad orders among them (default 2)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each step (default 60)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    TRACING.update(tracing_env())
    banner("the shop: a broker, the runner with examples.shop.handlers, and orders placed")
    _write(tracing_note() + "\n")
    output = Output()
    with broker(args.timeout) as process, runner(process.address, output, args.timeout):
        place = ["-m", "examples.shop.place_orders", "--broker", process.address]
        orders = [*place, "--count", str(args.count), "--bad", str(args.bad)]
        if run_to_end(orders, "orders", args.timeout) != 0:
            return 1
        if not output.wait_for(settled(args.count, args.bad), args.timeout):
            banner(f"not every order was billed or dead-lettered within {args.timeout} s")
            return 1
        banner(f"dead letters: conveyor dlq list {ORDERS}.dlq")
        run_to_end(["-m", "conveyor", "dlq", "list", f"{ORDERS}.dlq", "--broker", process.address], "dlq", args.timeout)
        banner("stopping: the runner drains and sums up, then the broker")
    took = time.monotonic() - started
    banner(f"done in {took:.1f} s: {args.count} orders invoiced and e-mailed, {args.bad} dead-lettered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
