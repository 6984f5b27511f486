"""``conveyor cluster ACTION``: the command group for a cluster (``local`` runs one on this machine).

Each action registers itself with ``@cluster_action(name, help, setup)``
from its own module, as commands do with ``@command``: ``conveyor cluster
local`` lives in ``broker/cli/cluster_local.py``, and another action (a
status report) sits beside it without touching this file but for its import
in ``ACTION_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from conveyor.broker.cli.main import Handler, command

ACTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {}
ACTION_MODULES = ("conveyor.broker.cli.cluster_local", "conveyor.broker.cli.cluster_status")


def cluster_action(
    name: str, help_text: str, setup: Callable[[argparse.ArgumentParser], None]
) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        ACTIONS[name] = (help_text, setup, handler)
        return handler

    return register


def _setup(parser: argparse.ArgumentParser) -> None:
    for module in ACTION_MODULES:
        importlib.import_module(module)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, (help_text, setup, handler) in ACTIONS.items():
        sub = actions.add_parser(name, help=help_text, description=help_text)
        setup(sub)
        sub.set_defaults(action_handler=handler)


@command(
    "cluster", "cluster commands (local: etcd and brokers on this machine; status: nodes, leaders, ISR, lag)", _setup
)
def cmd_cluster(args: argparse.Namespace) -> int:
    handler: Handler = args.action_handler
    return handler(args)
