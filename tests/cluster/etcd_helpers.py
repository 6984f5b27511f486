"""Helpers of the etcd tests: a lease holder in another process, and a watch that collects its events."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field

from conveyor.broker.cluster.etcd import WatchEvent

# A process that grants a lease, puts KEY under it, prints "ready <lease> <create_revision>" and keeps it alive.
HOLDER = """
import sys, threading
from conveyor.broker.cluster.etcd import Etcd
endpoint, key, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = Etcd([endpoint])
lease = client.lease(ttl, on_lost=lambda: print("lost", flush=True))
result = client.put_if_absent(key, b"holder", lease=lease.id)
assert result.succeeded, result
print("ready", lease.id, result.revision, flush=True)
threading.Event().wait()
"""


def start_holder(endpoint: str, key: str, ttl: int) -> tuple[subprocess.Popen[str], int, int]:
    """Start a lease holder; returns (process, lease id, the key's create revision) once the key is written."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, endpoint, key, str(ttl)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child prints it or exits (and the pipe ends): never blocks for ever
    if not line.startswith("ready"):
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"lease holder did not start: {line!r}")
    _, lease_id, revision = line.split()
    return proc, int(lease_id), int(revision)


@dataclass
class Collected:
    """What a watch delivered, in order, and the revisions it was told to resync at."""

    events: list[WatchEvent] = field(default_factory=list)
    resyncs: list[int] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def on_event(self, event: WatchEvent) -> None:
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def on_resync(self, revision: int) -> None:
        with self.changed:
            self.resyncs.append(revision)
            self.changed.notify_all()

    def summary(self) -> list[tuple[str, str, bytes]]:
        with self.changed:
            return [(event.kind, event.kv.key, event.kv.value) for event in self.events]

    def wait(self, count: int, timeout: float = 30.0) -> list[tuple[str, str, bytes]]:
        """Wait until ``count`` events arrived (AssertionError naming what came if they do not)."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.events) >= count, timeout):
                raise AssertionError(f"{len(self.events)} of {count} events after {timeout} s: {self.summary()}")
        return self.summary()
