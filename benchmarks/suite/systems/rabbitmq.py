"""RabbitMQ: one ``rabbitmq-server`` for the whole bench (queues per run), when it is installed.

It starts as its own node (a free port, ``HOME`` and data in the bench's
temporary directory, no plugins) and takes a few seconds to boot.

Durability, stated next to the numbers:

- ``persistent``: a durable classic queue, persistent messages
  (``delivery_mode=2``) and publisher confirms (RabbitMQ confirms a persistent
  message once it is written to disk, fsyncing in batches). The match for
  ``fsync=batch``.
- ``transient``: a non-durable queue, transient messages, publisher confirms.
  The match for ``fsync=none``.

Producer: pika's ``SelectConnection`` (callbacks, no thread) with publisher
confirms, up to a window of unconfirmed messages in flight. Consumer: pika's
``BlockingConnection``, ``basic_consume`` with ``prefetch_count`` = credit,
one ``basic_ack(multiple=True)`` per received batch.
With several groups, a fanout exchange feeds one queue per group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

from conveyor.benchmarks.suite.procstat import tree
from conveyor.benchmarks.suite.scenario import Scenario
from conveyor.benchmarks.suite.systems import base

TITLE = "RabbitMQ"
DURABILITY = {
    "persistent": "durable queue, persistent messages, publisher confirms",
    "transient": "transient messages, publisher confirms",
}
SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def _server_binary() -> str | None:
    if os.path.exists(SERVER):
        return SERVER
    return shutil.which("rabbitmq-server")


class RabbitServer:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "rabbitmq"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = base.free_port()
        dist = base.free_port()
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text(f"loopback_users = none\nlisteners.tcp.1 = 127.0.0.1:{self.port}\n")
        self.epmd_before = _epmd_pids()
        env = {
            **os.environ,
            "HOME": str(self.dir),
            "RABBITMQ_NODENAME": f"conveyorbench{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(self.dir / "pid"),
            "ERL_CRASH_DUMP": str(self.dir / "erl_crash.dump"),  # never in the caller's directory
        }
        log = self.dir / "stdout.log"
        binary = _server_binary() or "rabbitmq-server"
        with open(log, "w") as out:
            self.proc = subprocess.Popen([binary], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        self.pids = [self.proc.pid]
        base.wait_port(self.port, self.proc, 90, "rabbitmq-server", log)
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self._conn: Any = None

    def _channel(self) -> Any:
        import pika

        if self._conn is None or not self._conn.is_open:
            self._conn = pika.BlockingConnection(pika.URLParameters(self.url))
        return self._conn.channel()

    def prepare_mode(self, run: str, scenario: Scenario, mode: str) -> dict[str, Any]:
        durable = mode == "persistent"
        queues = [f"bench.{run}.g{i}" for i in range(scenario.groups)]
        exchange = f"bench.{run}" if scenario.groups > 1 else ""
        channel = self._channel()
        if exchange:
            channel.exchange_declare(exchange, exchange_type="fanout", durable=durable)
        for name in queues:
            channel.queue_declare(name, durable=durable)
            if exchange:
                channel.queue_bind(name, exchange)
        channel.close()
        return {
            "url": self.url,
            "exchange": exchange,
            "routing_key": queues[0] if not exchange else "",
            "queues": queues,
            "persistent": durable,
        }

    def sample(self, endpoint: dict[str, Any]) -> dict[str, float | None]:
        try:
            channel = self._channel()
            total = 0
            for name in endpoint["queues"]:
                total += int(channel.queue_declare(name, passive=True).method.message_count)
            channel.close()
        except Exception:
            self._conn = None
            return {"lag": None, "in_flight": None}
        return {"lag": total, "in_flight": None}

    def cleanup(self, endpoint: dict[str, Any]) -> None:
        channel = self._channel()
        for name in endpoint["queues"]:
            channel.queue_delete(name)
        if endpoint["exchange"]:
            channel.exchange_delete(endpoint["exchange"])
        channel.close()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self._conn is not None:
                self._conn.close()
        for pid in reversed(tree(self.proc.pid)):  # the start script, then the Erlang VM it runs
            if pid != self.proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        base.terminate(self.proc, timeout=30)
        for pid in _epmd_pids() - self.epmd_before:  # the epmd daemon this node started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)


def _epmd_pids() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == "epmd":
                    found.add(int(entry.name))
    return found


class System(base.SharedServerSystem):
    name = "rabbitmq"
    title = TITLE

    def unavailable(self) -> str | None:
        if not _server_binary():
            return "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
        try:
            import pika  # noqa: F401
        except ImportError:
            return "the pika client is not installed (pip install pika)"
        return None

    def variants(self, scenario: Scenario) -> list[base.Variant]:
        mode = "persistent" if scenario.fsync == "batch" else "transient"
        return [base.Variant("rabbitmq", mode, TITLE, DURABILITY[mode])]

    def new_server(self, root: Path) -> RabbitServer:
        return RabbitServer(root)

    def version(self) -> str:
        import pika

        version = ""
        with contextlib.suppress(OSError):
            for line in Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"):
                version = line.name.replace("rabbitmq_server-", "RabbitMQ ")
        return f"{version}; pika {pika.__version__}".strip("; ")

    def client_api(self) -> str:
        return "pika: SelectConnection basic_publish with confirms (a window in flight); basic_consume + ack(multiple)"


# --- clients ------------------------------------------------------------------------------------


class Producer(base.ProducerClient):
    api = "pika SelectConnection basic_publish, publisher confirms"

    def __init__(self, endpoint: dict[str, Any], scenario: Scenario) -> None:
        import pika

        self.exchange = endpoint["exchange"]
        self.key = endpoint["routing_key"]
        self.props = pika.BasicProperties(delivery_mode=2 if endpoint["persistent"] else 1)
        self.window = max(1000, 2 * scenario.batch_size)  # unconfirmed messages allowed in flight
        self.pending: deque[bytes] = deque()
        self.sent = self.confirmed = self.nacked = 0
        self.settled_upto = 0  # every delivery tag up to this one is confirmed (or nacked)
        self.settled: set[int] = set()  # tags above settled_upto confirmed out of order
        self.waiting = False  # the loop runs until the window has room (or, flushing, until all is confirmed)
        self.channel: Any = None
        self.error: str = ""
        self.conn = pika.SelectConnection(
            pika.URLParameters(endpoint["url"]),
            on_open_callback=lambda conn: conn.channel(on_open_callback=self._on_channel),
            on_open_error_callback=self._on_error,
        )
        self.conn.ioloop.start()  # until the channel is in confirm mode
        if self.channel is None:
            raise RuntimeError(f"RabbitMQ: no channel: {self.error}")

    def _on_error(self, _conn: Any, exc: Any) -> None:
        self.error = str(exc)
        self.conn.ioloop.stop()

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self.conn.ioloop.stop())

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        # Confirms may come out of order, singly or for "everything up to tag": count each tag once.
        if method.multiple:
            above = {t for t in self.settled if t <= tag}
            done = max(0, tag - self.settled_upto - len(above))
            self.settled -= above
            self.settled_upto = max(self.settled_upto, tag)
        elif tag > self.settled_upto and tag not in self.settled:
            self.settled.add(tag)
            done = 1
        else:
            done = 0
        while self.settled_upto + 1 in self.settled:
            self.settled_upto += 1
            self.settled.remove(self.settled_upto)
        if type(method).__name__ == "Nack":
            self.nacked += done
        else:
            self.confirmed += done
        self._pump()
        if self.waiting and not self.pending and self._unconfirmed() <= self.window:
            self.waiting = False
            self.conn.ioloop.stop()

    def _unconfirmed(self) -> int:
        return self.sent - self.confirmed - self.nacked

    def _pump(self) -> None:
        publish, exchange, key, props = self.channel.basic_publish, self.exchange, self.key, self.props
        pending = self.pending
        room = self.window - self._unconfirmed()
        while pending and room > 0:
            publish(exchange, key, pending.popleft(), props)
            self.sent += 1
            room -= 1

    def _run(self) -> None:
        loop = self.conn.ioloop
        if self.pending or self._unconfirmed() > self.window:
            self.waiting = True  # _on_confirm stops the loop once the window has room
        else:
            loop.call_later(0, loop.stop)  # one pass: write what was published, read confirms already in
        loop.start()

    def send(self, values: list[bytes]) -> None:
        self.pending.extend(values)
        self._pump()
        self._run()

    def flush(self) -> int:
        window, self.window = self.window, 0
        while self.pending or self._unconfirmed() > 0:
            self._run()
        self.window = window
        return self.nacked

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
            self.conn.ioloop.start()


class Consumer(base.ConsumerClient):
    def __init__(self, endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> None:
        import pika

        self.conn = pika.BlockingConnection(pika.URLParameters(endpoint["url"]))
        self.channel = self.conn.channel()
        self.channel.basic_qos(prefetch_count=scenario.consumer_credit)
        self.buffer: list[bytes] = []
        self.last_tag = 0
        self.channel.basic_consume(endpoint["queues"][group], self._on_message)

    def _on_message(self, _channel: Any, method: Any, _props: Any, body: bytes) -> None:
        self.buffer.append(body)
        self.last_tag = method.delivery_tag

    def receive(self, timeout: float) -> list[bytes]:
        self.conn.process_data_events(time_limit=0 if self.buffer else timeout)
        batch, self.buffer = self.buffer, []
        return batch

    def ack(self) -> None:
        if self.last_tag:
            self.channel.basic_ack(self.last_tag, multiple=True)
            self.last_tag = 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def make_producer(endpoint: dict[str, Any], scenario: Scenario, index: int) -> base.ProducerClient:
    return Producer(endpoint, scenario)


def make_consumer(endpoint: dict[str, Any], scenario: Scenario, group: int, index: int) -> base.ConsumerClient:
    return Consumer(endpoint, scenario, group, index)
