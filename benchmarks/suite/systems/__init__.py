"""The systems a scenario runs against: Conveyor, its peers, and the floor (a bare pyzmq forwarder).

Each module holds one ``System`` (the server side, run by the orchestrator)
and ``make_producer`` / ``make_consumer`` (the client side, run inside each
producer and consumer process).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from conveyor.benchmarks.suite.systems.base import System

NAMES = ("conveyor", "redis", "nats", "rabbitmq", "forwarder")
MODULES = {
    "conveyor": "conveyor.benchmarks.suite.systems.conveyor",
    "redis": "conveyor.benchmarks.suite.systems.redis_streams",
    "nats": "conveyor.benchmarks.suite.systems.nats_jetstream",
    "rabbitmq": "conveyor.benchmarks.suite.systems.rabbitmq",
    "forwarder": "conveyor.benchmarks.suite.systems.zmq_forwarder",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def system(name: str, **options: object) -> System:
    return module(name).System(**options)


__all__ = ["MODULES", "NAMES", "System", "module", "system"]
