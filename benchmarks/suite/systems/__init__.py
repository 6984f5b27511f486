"""The systems a scenario runs against: Conveyor and its peers.

Each module holds one ``System`` (the server side, run by the orchestrator)
and ``make_producer`` / ``make_consumer`` (the client side, run inside each
producer and consumer process).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from conveyor.benchmarks.suite.systems.base import System

NAMES = ("conveyor", "redis", "nats", "rabbitmq")
MODULES = {
    "conveyor": "conveyor.benchmarks.suite.systems.conveyor",
    "redis": "conveyor.benchmarks.suite.systems.redis_streams",
    "nats": "conveyor.benchmarks.suite.systems.nats_jetstream",
    "rabbitmq": "conveyor.benchmarks.suite.systems.rabbitmq",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def system(name: str, **options: object) -> System:
    return module(name).System(**options)


__all__ = ["MODULES", "NAMES", "System", "module", "system"]
