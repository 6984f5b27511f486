"""Broker addresses: what a client may connect to and a broker may bind, and where a client finds its broker."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from conveyor.broker.config.options import text

from conveyor.errors import ConfigError

DEFAULT_BROKER = "tcp://127.0.0.1:5555"


BROKER_ENV = "CONVEYOR_BROKER"


_ENDPOINT = re.compile(r"^tcp://(?P<host>[^\s/]+):(?P<port>\*|[0-9]+)$|^(ipc|inproc)://\S+$")


def endpoint(value: Any, *, bind: bool = False) -> str:
    """``tcp://HOST:PORT`` (port 1-65535; ``*`` or 0 for any free port when binding) or ``ipc://PATH``."""
    address = text(value)
    match = _ENDPOINT.match(address)
    if not match:
        raise ValueError(
            f"{address!r} is not a broker address: use tcp://HOST:PORT (like {DEFAULT_BROKER}) or ipc://PATH"
        )
    port = match.group("port")
    if port is not None and port != "*":
        low = 0 if bind else 1
        if not low <= int(port) <= 65535:
            raise ValueError(f"port {port} in {address!r} is out of range ({low}-65535{', or *' if bind else ''})")
    elif port == "*" and not bind:
        raise ValueError(f"{address!r}: a client needs the broker's port, not *")
    return address


def endpoint_list(value: Any) -> str:
    """One endpoint to connect to, or several separated by commas (a bootstrap list), as ``a,b``."""
    items = [item.strip() for item in text(value).split(",") if item.strip()]
    if not items:
        raise ValueError(f"{value!r} is not a broker address: use tcp://HOST:PORT (like {DEFAULT_BROKER})")
    return ",".join(dict.fromkeys(endpoint(item) for item in items))


def bind_endpoint(value: Any) -> str:
    """An endpoint to bind: ``tcp://HOST:PORT``, port ``*`` for any free one."""
    return endpoint(value, bind=True)


def optional_endpoint(value: Any) -> str:
    """An endpoint to connect to, or empty for none."""
    return "" if text(value) == "" else endpoint(value)


def optional_endpoint_list(value: Any) -> str:
    """One endpoint to connect to, a bootstrap list of them (``a,b``), or empty for none."""
    return "" if text(value) == "" else endpoint_list(value)


def optional_url(value: Any) -> str:
    """``http://HOST:PORT[/PATH]``, or empty for none."""
    url = text(value)
    if url and not re.fullmatch(r"https?://[^\s/:]+(:[0-9]{1,5})?(/\S*)?", url):
        raise ValueError(f"{url!r} is not an http:// URL (like http://127.0.0.1:8500)")
    return url


def check_address(address: str) -> str:
    """``address`` if it is an endpoint a client can connect to; else a ``ConfigError`` that says what is.

    ZeroMQ would raise a bare EINVAL ("Invalid argument") for ``127.0.0.1:5555``,
    and would wrap a port over 65535 to another one.
    """
    try:
        return endpoint(address)
    except ValueError as exc:
        raise ConfigError(str(exc), address=str(address)) from None


def broker_addresses(addresses: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The brokers a client may ask first (its bootstrap list): ``addresses`` when given, else ``CONVEYOR_BROKER``,
    else the default.

    A list, or one string of endpoints separated by commas
    (``tcp://a:5555,tcp://b:5555``); each is checked as ``broker_address``
    checks one. One address gives a one-element tuple: a client given one
    broker talks to it alone, as before clusters.
    """
    if addresses is None:
        from_env = os.environ.get(BROKER_ENV)
        if not from_env:
            return (DEFAULT_BROKER,)
        try:
            return _address_list(from_env)
        except ConfigError as exc:
            raise ConfigError(f"{BROKER_ENV}: {exc.message}", address=from_env, variable=BROKER_ENV) from None
    return _address_list(addresses)


def _address_list(addresses: str | Sequence[str]) -> tuple[str, ...]:
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    parsed = tuple(dict.fromkeys(check_address(str(item).strip()) for item in items if str(item).strip()))
    if not parsed:
        raise ConfigError(f"no broker address in {addresses!r}", address=str(addresses))
    return parsed


def broker_address(address: str | None = None) -> str:
    """The address a client connects to: ``address`` when given, else ``CONVEYOR_BROKER``, else the default.

    Every client (``Producer``, ``AsyncProducer``, ``Admin``, ``Subscription``,
    ``Runner``) resolves its address here, as the command line does, so one
    variable points a whole deployment at its broker.
    """
    if address is not None:
        return check_address(address)
    from_env = os.environ.get(BROKER_ENV)
    if not from_env:
        return DEFAULT_BROKER
    try:
        return check_address(from_env)
    except ConfigError as exc:
        raise ConfigError(f"{BROKER_ENV}: {exc.message}", address=from_env, variable=BROKER_ENV) from None


_ETCD_MEMBER = re.compile(r"^(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})$")


def cluster_url(value: Any) -> str:
    """``etcd://HOST:PORT[,HOST:PORT…]`` (the etcd members a cluster node talks to), or empty: single node."""
    url = text(value)
    if url:
        etcd_members(url)
    return url


def etcd_members(url: str) -> list[str]:
    """The ``HOST:PORT`` of each etcd member named by ``etcd://a:2379,b:2379``, in order."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "etcd" or not rest:
        raise ValueError(
            f"{url!r} is not an etcd address: use etcd://HOST:PORT[,HOST:PORT...] (like etcd://127.0.0.1:2379)"
        )
    members = [member.strip() for member in rest.split(",") if member.strip()]
    for member in members:
        match = _ETCD_MEMBER.match(member)
        if not match or not 1 <= int(match.group("port")) <= 65535:
            raise ValueError(f"{member!r} in {url!r} is not HOST:PORT with a port 1-65535")
    if not members:
        raise ValueError(f"{url!r} names no etcd member")
    return members
