"""Options for every command: a flag, ``CONVEYOR_<OPTION>`` and a TOML key.

Precedence, as in most twelve-factor tools: flag, then environment, then the
``--config`` file (top-level keys or a ``[<command>]`` table), then the
default in the option's declaration.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.errors import ConfigError

DEFAULT_BROKER = "tcp://127.0.0.1:5555"
BROKER_ENV = "CONVEYOR_BROKER"

_ENDPOINT = re.compile(r"^(tcp://[^\s/]+:[0-9]+|ipc://\S+|inproc://\S+)$")


def check_address(address: str) -> str:
    """``address`` if it is an endpoint a client can connect to; else a ``ConfigError`` that says what is.

    ZeroMQ would raise a bare EINVAL ("Invalid argument") for ``127.0.0.1:5555``.
    """
    if not isinstance(address, str) or not _ENDPOINT.match(address):
        raise ConfigError(
            f"{address!r} is not a broker address: use tcp://HOST:PORT (like {DEFAULT_BROKER}) or ipc://PATH",
            address=str(address),
        )
    return address


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


@dataclass(frozen=True)
class Option:
    name: str  # dashes, as on the command line: "data-dir"
    default: Any
    help: str
    type: Callable[[str], Any] = str
    flag: bool = False  # a boolean switch
    repeat: bool = False  # may be given several times; values are joined with commas

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "CONVEYOR_" + self.dest.upper()


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    parser.add_argument("--config", default=os.environ.get("CONVEYOR_CONFIG"), help="TOML file with options")
    for opt in options:
        help_text = f"{opt.help} (env {opt.env}; default {opt.default!r})"
        if opt.flag:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, action="store_const", const=True, help=help_text)
            parser.add_argument(f"--no-{opt.name}", dest=opt.dest, action="store_const", const=False)
        elif opt.repeat:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, action="append", default=None, help=help_text)
        else:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, default=None, help=help_text)


def resolve(args: argparse.Namespace, options: Sequence[Option], command: str) -> dict[str, Any]:
    """Fill every option from flag, env, file or default, converted to its type."""
    file_values = _load_toml(args.config, command) if getattr(args, "config", None) else {}
    values: dict[str, Any] = {}
    for opt in options:
        raw = getattr(args, opt.dest, None)
        if raw is None:
            raw = os.environ.get(opt.env)
        if raw is None:
            raw = file_values.get(opt.name, file_values.get(opt.dest))
        values[opt.dest] = opt.default if raw is None else _convert(opt, raw)
    return values


def _convert(opt: Option, raw: Any) -> Any:
    if opt.repeat and isinstance(raw, list):
        raw = ",".join(str(item) for item in raw)
    if opt.flag or opt.type is bool:
        return raw if isinstance(raw, bool) else parse_bool(raw)
    if not isinstance(raw, str):
        return raw
    try:
        return opt.type(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--{opt.name}: {exc}", option=opt.name) from None


def _load_toml(path: str, command: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}", path=path) from None
    section = data.get(command, {})
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    return {**top, **(section if isinstance(section, dict) else {})}
