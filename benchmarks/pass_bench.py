"""The broker's CPU per small batch: what sets latency at a paced rate.

One client process, one real broker, one batch at a time: publish a batch of
``--batch`` 100-byte messages, wait for its confirm and its delivery to a
low-level consumer, ack it; repeat. The broker's main-thread CPU (utime and
stime from /proc) divided by the cycles is what each small batch costs it:
at a paced 5,000 msg/s every loop pass looks like this, and that cost, not
throughput, decides p99 on a small machine.

    python -m conveyor.benchmarks.pass_bench [--cycles 5000] [--batch 5] [--fsync none]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from conveyor.broker.client.admin import Admin
from conveyor.broker.client.producer import _array_header, _record_prefix
from conveyor.broker.client.subscription import Subscription
from conveyor.broker.net.transport import recv_frames_blocking, send_frames
from conveyor.broker.wire import commands
from conveyor.broker.wire.protocol import decode

from conveyor.testing import BrokerProcess


def thread_cpu(pid: int) -> tuple[float, float]:
    """(user, system) seconds of a process's main thread."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=5, help="messages per batch")
    parser.add_argument("--fsync", default="none")
    args = parser.parse_args(argv)
    value = b"x" * 100
    body = _array_header(args.batch) + (_record_prefix(len(value)) + value) * args.batch
    with tempfile.TemporaryDirectory() as tmp, BrokerProcess(Path(tmp) / "data", fsync=args.fsync) as broker:
        Admin(broker.address).create_topic("pass")
        sub = Subscription("pass", "g", address=broker.address, credit=10 * args.batch)
        while not sub.subscribed:
            sub.receive(timeout=0.05)
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(broker.address)

        def cycle(i: int) -> None:
            send_frames(sock, commands.publish("pass", body, pid=7, seq=i, rid=i))
            decode(recv_frames_blocking(sock))
            got: list[Any] = []
            while len(got) < args.batch:
                more = sub.receive(timeout=5)
                if not more:
                    raise RuntimeError("no delivery within 5 s")
                got += more
            sub.ack(got)

        warmup = min(500, args.cycles)
        for i in range(warmup):
            cycle(i)
        time.sleep(0.2)
        (user0, sys0), wall0 = thread_cpu(broker.pid), time.monotonic()
        for i in range(warmup, warmup + args.cycles):
            cycle(i)
        time.sleep(0.3)  # the last ack
        (user1, sys1), wall = thread_cpu(broker.pid), time.monotonic() - wall0 - 0.3
        sub.close()
        sock.close(linger=0)
    per = 1e6 / args.cycles
    print(
        f"fsync={args.fsync}, {args.batch} messages per batch, {args.cycles:,} cycles: broker main thread "
        f"{(user1 - user0) * per:.0f} µs user + {(sys1 - sys0) * per:.0f} µs system per publish+deliver+ack cycle; "
        f"{wall * per:.0f} µs wall per cycle"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
