"""Conveyor: a message broker for Python teams.

The names most programs need are here::

    from conveyor import Producer, consumer, retry_policy, Message, Nack
    from conveyor import Consumer  # a plain loop over a topic, for scripts

Everything else lives in the subpackages: ``conveyor.broker`` (wire format,
network, log, server, clients, CLI), ``conveyor.consumers`` (the runner),
``conveyor.decorators``, ``conveyor.monitoring``, ``conveyor.pipeline``
(Spark) and ``conveyor.testing`` (a real broker for your tests).

Each name is imported on first use, so ``import conveyor.broker.wire`` in the
broker process does not load the clients, tenacity or the runner.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from conveyor.version import __version__

if TYPE_CHECKING:
    from conveyor.broker.client.admin import Admin
    from conveyor.broker.client.async_consumer import AsyncConsumer
    from conveyor.broker.client.async_producer import AsyncProducer
    from conveyor.broker.client.consumer import Consumer
    from conveyor.broker.client.message import Message
    from conveyor.broker.client.producer import Producer
    from conveyor.broker.client.subscription import DeadLettered, Subscription
    from conveyor.consumers.context import Context, PublishFailed, context, publish
    from conveyor.consumers.middleware import Middleware
    from conveyor.consumers.runner import Runner
    from conveyor.decorators.consumer import consumer, error_handler
    from conveyor.decorators.exceptions import InvalidMessage, Nack, Reject
    from conveyor.decorators.retry import retry_policy
    from conveyor.errors import ConveyorError

# Where each public name is defined.
_EXPORTS = {
    "Admin": "conveyor.broker.client.admin",
    "AsyncConsumer": "conveyor.broker.client.async_consumer",
    "AsyncProducer": "conveyor.broker.client.async_producer",
    "Consumer": "conveyor.broker.client.consumer",
    "Context": "conveyor.consumers.context",
    "ConveyorError": "conveyor.errors",
    "DeadLettered": "conveyor.broker.client.subscription",
    "InvalidMessage": "conveyor.decorators.exceptions",
    "Message": "conveyor.broker.client.message",
    "Middleware": "conveyor.consumers.middleware",
    "Nack": "conveyor.decorators.exceptions",
    "Producer": "conveyor.broker.client.producer",
    "PublishFailed": "conveyor.consumers.context",
    "Reject": "conveyor.decorators.exceptions",
    "Runner": "conveyor.consumers.runner",
    "Subscription": "conveyor.broker.client.subscription",
    "consumer": "conveyor.decorators.consumer",
    "context": "conveyor.consumers.context",
    "error_handler": "conveyor.decorators.consumer",
    "publish": "conveyor.consumers.context",
    "retry_policy": "conveyor.decorators.retry",
}

__all__ = [
    "Admin",
    "AsyncConsumer",
    "AsyncProducer",
    "Consumer",
    "Context",
    "ConveyorError",
    "DeadLettered",
    "InvalidMessage",
    "Message",
    "Middleware",
    "Nack",
    "Producer",
    "PublishFailed",
    "Reject",
    "Runner",
    "Subscription",
    "__version__",
    "consumer",
    "context",
    "error_handler",
    "publish",
    "retry_policy",
]


class _SourceTree(importlib.abc.MetaPathFinder):
    """Finds ``conveyor.broker`` and its siblings in the repository's folders when this file was loaded from there.

    In a checkout, ``python -m pytest`` or ``python -c`` puts the repository root first on ``sys.path``, so this
    ``conveyor/`` folder is found before an installed (non-editable) copy; its subpackages are not inside it but
    beside it, as pyproject's ``package-dir`` maps them. An installed copy never needs this finder.
    """

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _find_source_tree() -> None:
    root = Path(__file__).resolve().parent.parent
    names = ("broker", "consumers", "decorators", "monitoring", "pipeline", "benchmarks")
    if not (root / "pyproject.toml").is_file() or not (root / "broker" / "server" / "broker.py").is_file():
        return  # an installed copy: the subpackages are inside this folder
    folders = {f"conveyor.{name}": root / name for name in names}
    if not any(isinstance(finder, _SourceTree) for finder in sys.meta_path):
        sys.meta_path.append(_SourceTree(folders))


_find_source_tree()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
