"""The floor: a bare pyzmq forwarder (``conveyor.benchmarks.forwarder``), a fresh process per run.

It is Conveyor's transport and fsync discipline without anything else (no
groups, leases, redelivery): in the same run as Conveyor and its peers it
shows how far Conveyor's own path is above what the transport, the
interpreter and the disk cost (issue #19). See the forwarder's docstring.

Variants, stated next to the numbers:

- ``fsync``: every batch appended to a log file, one fdatasync per read burst
  before forwarding and acking (group commit). The match for ``fsync=batch``.
- ``ram``: no log. The match for ``fsync=none``; shown as an extra row next
  to ``fsync`` in ``fsync=batch`` scenarios.

Only one consumer group (the forwarder round-robins over every consumer): a
scenario of several groups gets no forwarder run.

Producer: a ``DEALER`` sending one frame per ``send()`` call (the harness's
batch, values length-prefixed), at most ``WINDOW`` batches unacknowledged.
Consumer: a ``DEALER`` that says hello and then receives batches; ``ack`` is
a no-op (the forwarder keeps no delivery state).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conveyor.benchmarks.forwarder import HELLO, WELCOME, decode, encode
from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base

TITLE = "bare pyzmq forwarder"
DURABILITY = {
    "fsync": "log file, one fdatasync per read burst before ack (group commit)",
    "ram": "no log (RAM only)",
}
WINDOW = 64  # batches a producer keeps unacknowledged; then send() waits for acks
BATCH_ID = struct.Struct("<Q")


class ForwarderServer(base.Server):
    def __init__(self, mode: str, workdir: Path) -> None:
        self.dir = workdir / f"forwarder-{mode}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.in_port, self.out_port = base.free_port(), base.free_port()
        cmd = [sys.executable, "-m", "conveyor.benchmarks.forwarder", "--in", str(self.in_port)]
        cmd += ["--out", str(self.out_port)]
        if mode == "fsync":
            cmd += ["--log", str(self.dir / "forwarder.log")]
        stderr = self.dir / "forwarder.err"
        with stderr.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        self.pids = [self.proc.pid]
        for port in (self.in_port, self.out_port):
            base.wait_port(port, self.proc, 30, "forwarder", stderr)

    def prepare(self, run: str, scenario: Scenario) -> dict[str, Any]:
        return {"in": f"tcp://127.0.0.1:{self.in_port}", "out": f"tcp://127.0.0.1:{self.out_port}"}

    def stop(self) -> None:
        base.terminate(self.proc)


class System(base.System):
    name = "forwarder"
    title = TITLE

    def unavailable(self) -> str | None:
        return None  # pyzmq is a dependency of Conveyor itself

    def variants(self, scenario: Scenario) -> list[base.Variant]:
        if scenario.groups != 1:
            return []
        if scenario.fsync == "batch":
            return [
                base.Variant("forwarder", "fsync", TITLE, DURABILITY["fsync"]),
                base.Variant("forwarder", "ram", TITLE, DURABILITY["ram"], matches=False),
            ]
        return [base.Variant("forwarder", "ram", TITLE, DURABILITY["ram"])]

    def start(self, variant: base.Variant, workdir: Path) -> base.Server:
        return ForwarderServer(variant.mode, workdir)

    def version(self) -> str:
        import zmq

        return f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}"

    def client_api(self) -> str:
        return "pyzmq DEALER: one length-prefixed frame per batch, acked after forwarding; DEALER consumers"


# --- clients ------------------------------------------------------------------------------------


class Producer(base.ProducerClient):
    api = "DEALER send (one frame per batch)"

    def __init__(self, endpoint: dict[str, Any]) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint["in"])
        self.next_id = 0
        self.unacked: set[bytes] = set()

    def send(self, values: list[bytes]) -> None:
        batch_id = BATCH_ID.pack(self.next_id)
        self.next_id += 1
        self.sock.send_multipart([batch_id, encode(values)])
        self.unacked.add(batch_id)
        self._acks(block=len(self.unacked) >= WINDOW)

    def _acks(self, block: bool, timeout_ms: int = 60_000) -> bool:
        """Take every ack ready; with ``block``, wait (up to ``timeout_ms``) for at least one. False: none came."""
        if block and not self.sock.poll(timeout_ms):
            return False
        while True:
            try:
                self.unacked.discard(self.sock.recv(self.zmq.NOBLOCK))
            except self.zmq.Again:
                return True

    def flush(self) -> int:
        deadline = time.monotonic() + 120
        while self.unacked and time.monotonic() < deadline:
            self._acks(block=True, timeout_ms=max(1, int((deadline - time.monotonic()) * 1000)))
        return len(self.unacked)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class Consumer(base.ConsumerClient):
    def __init__(self, endpoint: dict[str, Any]) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint["out"])
        self.sock.send(HELLO)
        if not self.sock.poll(30_000) or self.sock.recv() != WELCOME:
            raise RuntimeError(f"forwarder at {endpoint['out']}: no welcome within 30 s (pid {os.getpid()})")

    def receive(self, timeout: float) -> list[bytes]:
        if not self.sock.poll(max(1, int(timeout * 1000))):
            return []
        return decode(self.sock.recv())

    def ack(self) -> None:
        pass  # the forwarder keeps no delivery state: nothing to acknowledge

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def make_producer(endpoint: dict[str, Any], scenario: Scenario, index: int) -> base.ProducerClient:
    return Producer(endpoint)


def make_consumer(endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> base.ConsumerClient:
    return Consumer(endpoint)
