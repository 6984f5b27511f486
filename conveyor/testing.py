"""Test your consumers against a real broker: ``BrokerProcess`` and the pytest fixtures.

``BrokerProcess`` (from ``conveyor.broker_process``) starts ``python -m conveyor``
on a free loopback port and can stop, kill and restart it; it needs no pytest, so
benchmarks use it too. ``EtcdProcess`` (from ``conveyor.etcd_process``) does the same for
a one-member etcd, and ``ClusterProcess`` (``conveyor.cluster_process``) for etcd plus N brokers
in cluster mode, for the tests of replicated topics. The fixtures ``conveyor_broker`` and ``conveyor_broker_factory``
are defined in ``conveyor.pytest_plugin``, which pytest loads by itself; importing them
from here (in a conftest.py, or with plugin autoloading off) loads pytest on first use.

``run_consumers`` (from ``conveyor.consumer_harness``) runs your ``@consumer`` handlers in the
real runner against a broker shared by the whole test session, each ``with`` on fresh topic
and group names: publish, wait for the handler, assert (README, "Testing your consumers").
It is imported when first asked for, so a benchmark that only starts brokers loads no runner.
"""

from __future__ import annotations

from typing import Any

from conveyor.broker_process import BrokerProcess, scrape_metric
from conveyor.cluster_process import ClusterProcess
from conveyor.etcd_process import EtcdProcess

FIXTURES = ("conveyor_broker", "conveyor_broker_factory", "conveyor_etcd", "conveyor_consumers")
HARNESS = ("run_consumers", "ConsumerApp", "session_broker")
__all__ = ["BrokerProcess", "ClusterProcess", "EtcdProcess", "scrape_metric", *FIXTURES, *HARNESS]


def __getattr__(name: str) -> Any:
    """The fixtures and the harness, imported when first asked for: a module that only starts brokers
    needs neither pytest nor the runner."""
    if name in HARNESS:
        from conveyor import consumer_harness

        return getattr(consumer_harness, name)
    if name in FIXTURES:
        from conveyor import pytest_plugin

        return getattr(pytest_plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
