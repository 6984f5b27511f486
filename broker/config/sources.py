"""Where an option's value comes from: the flag, ``CONVEYOR_<OPTION>`` variables, the TOML file, the default.

Precedence, as in most twelve-factor tools: the flag, then
``CONVEYOR_<COMMAND>_<OPTION>`` (``CONVEYOR_BROKER_METRICS_PORT``), then the
shared ``CONVEYOR_<OPTION>``, then the ``--config`` file (the command's own
``[<command>]`` table, then ``[client]`` for the options every client command
shares, then top-level keys), then the default in the option's declaration.

The whole configuration is checked before a command starts: every source of
every option (a shadowed variable too), and every key and table of the TOML
file. Each problem is one line naming where it came from; a misspelt key gets a
did-you-mean. One ``ConfigError`` carries them all, so the user fixes everything in one go.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.broker.config.addresses import BROKER_ENV
from conveyor.broker.config.options import Option, as_toml

from conveyor.errors import ConfigError

CLIENT_TABLE = "client"


# Every command's options, recorded as their parsers are built, so a config file is checked as a whole.
COMMAND_OPTIONS: dict[str, Sequence[Option]] = {}


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option], command: str | None = None) -> None:
    command = command or parser.prog.split()[-1]
    COMMAND_OPTIONS[command] = options
    parser.add_argument("--config", default=os.environ.get("CONVEYOR_CONFIG"), help="TOML file with options")
    for opt in options:
        help_text = f"{opt.help} (env {opt.command_env(command)} or {opt.env}; default {opt.default!r})"
        if opt.flag:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, action="store_const", const=True, help=help_text)
            parser.add_argument(f"--no-{opt.name}", dest=opt.dest, action="store_const", const=False)
        elif opt.repeat:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, action="append", default=None, help=help_text)
        else:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, default=None, help=help_text)


def resolve(args: argparse.Namespace, options: Sequence[Option], command: str) -> dict[str, Any]:
    """Every option's value from the first source that has one; ``ConfigError`` listing every problem found."""
    problems: list[str] = []
    config = ConfigFile.load(args.config, command, problems) if getattr(args, "config", None) else None
    problems += _unknown_command_variables(options, command)
    for warning in _unknown_shared_variables(options, command):
        print(f"conveyor {command}: warning: {warning}", file=sys.stderr, flush=True)
    values: dict[str, Any] = {}
    for opt in options:
        found = False
        for label, raw in _sources(args, opt, command):
            try:
                value = opt.check(raw)
            except (ValueError, ConfigError) as exc:
                problems.append(f"{label}: {getattr(exc, 'message', exc)}")
                continue
            if not found:
                values[opt.dest], found = value, True
        if not found and config is not None:
            found, value = config.value(opt)
            if found:
                values[opt.dest] = value
        if not found:
            values[opt.dest] = opt.default
    if problems:
        raise ConfigError("\n".join(problems), problems=problems)
    return values


def _sources(args: argparse.Namespace, opt: Option, command: str) -> Iterator[tuple[str, Any]]:
    """Flag and variables that give ``opt`` a value, best first; all are checked, the first wins."""
    raw = getattr(args, opt.dest, None)
    if raw is not None:
        if opt.flag:
            yield f"--{opt.name if raw else 'no-' + opt.name}", raw
        elif opt.repeat:
            yield " ".join(f"--{opt.name} {shlex.quote(str(item))}" for item in raw), raw
        else:
            yield f"--{opt.name} {shlex.quote(str(raw))}", raw
    for name in (opt.command_env(command), opt.env):
        if name in os.environ:
            yield f"{name}={os.environ[name]}", os.environ[name]


def _unknown_command_variables(options: Sequence[Option], command: str) -> list[str]:
    """``CONVEYOR_<COMMAND>_<X>`` where X is none of the command's options: a misspelt variable."""
    prefix = f"CONVEYOR_{command.upper()}_"
    known = {opt.command_env(command) for opt in options}
    problems = []
    for name in sorted(os.environ):
        if name.startswith(prefix) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name}: conveyor {command} has no such option{hint}")
    return problems


# Variables Conveyor reads that are not options: the client's address and keys, the Spark session's
# cache, the test and soak harnesses, the fault-injecting file layer, a `conveyor run --workers` worker's role.
OTHER_VARIABLES = frozenset(
    {
        BROKER_ENV,
        "CONVEYOR_CONFIG",
        "CONVEYOR_CURVE_KEY",
        "CONVEYOR_CURVE_SERVER_KEY",
        "CONVEYOR_SPARK_CDS",
        "CONVEYOR_SPARK_CDS_DIR",
        "CONVEYOR_SOAK_SECONDS",
        "CONVEYOR_FAULT_REPORT",
        "CONVEYOR_FSIO_JOURNAL",
        "CONVEYOR_FSIO_FAULTS",
        "CONVEYOR_FSIO_CONTROL",
        "CONVEYOR_WORKER",
    }
)


OTHER_PREFIXES = ("CONVEYOR_TEST_",)  # the test suite's handler apps


def _unknown_shared_variables(options: Sequence[Option], command: str) -> list[str]:
    """``CONVEYOR_X`` that no command reads: a warning, not an error, as other tools may share the prefix.

    ``CONVEYOR_METRCS_PORT=5`` would otherwise be ignored without a word.
    """
    tables = {**COMMAND_OPTIONS, command: options}
    known = set(OTHER_VARIABLES) | {opt.env for opts in tables.values() for opt in opts}
    prefixes = (*OTHER_PREFIXES, *(f"CONVEYOR_{name.upper()}_" for name in tables))
    warnings = []
    for name in sorted(os.environ):
        if name.startswith("CONVEYOR_") and name not in known and not name.startswith(prefixes):
            close = difflib.get_close_matches(name[9:], [k[9:] for k in known], n=1, cutoff=0.75)
            hint = f"did you mean CONVEYOR_{close[0]}?" if close else "no Conveyor command reads it"
            warnings.append(f"{name} is ignored ({hint})")
    return warnings


@dataclass
class ConfigFile:
    """A ``--config`` TOML file, checked as a whole: unknown keys and tables, and every value's type and range."""

    path: str
    tables: dict[str, dict[str, Any]]  # "" is the top level; values already checked
    command: str

    @classmethod
    def load(cls, path: str, command: str, problems: list[str]) -> ConfigFile:
        try:
            raw_text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found", path=path) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: cannot be read ({exc})", path=path) from None
        try:
            data = tomllib.loads(raw_text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {_toml_problem(raw_text, exc)}", path=path) from None
        config = cls(path, {"": {}}, command)
        config._check(data, problems)
        return config

    def _check(self, data: dict[str, Any], problems: list[str]) -> None:
        tables = {**COMMAND_OPTIONS, CLIENT_TABLE: _client_options()}
        every = {opt.dest: opt for options in tables.values() for opt in options}
        mine = {opt.dest: opt for opt in COMMAND_OPTIONS.get(self.command, ())}
        for key, value in data.items():
            if isinstance(value, dict):
                if key not in tables:
                    problems.append(f"{self.path}: unknown table [{key}]{_did_you_mean(key, tables, '[{}]')}")
                    continue
                known = {opt.dest: opt for opt in tables[key]}
                self.tables[key] = self._check_table(f"[{key}] ", value, known, problems)
            else:
                opt = mine.get(_dest(key)) or every.get(_dest(key))
                if opt is None:
                    problems.append(f"{self.path}: unknown key {key}{_did_you_mean(_dest(key), every)}")
                    continue
                self.tables[""].update(self._check_table("", {key: value}, {opt.dest: opt}, problems))

    def _check_table(
        self, where: str, values: dict[str, Any], known: dict[str, Option], problems: list[str]
    ) -> dict[str, Any]:
        checked: dict[str, Any] = {}
        for key, raw in values.items():
            opt = known.get(_dest(key))
            if opt is None:
                problems.append(f"{self.path}: unknown key {where}{key}{_did_you_mean(_dest(key), known)}")
                continue
            try:
                checked[opt.dest] = opt.check(raw)
            except (ValueError, ConfigError) as exc:
                problems.append(f"{self.path}: {where}{key} = {as_toml(raw)}: {getattr(exc, 'message', exc)}")
        return checked

    def value(self, opt: Option) -> tuple[bool, Any]:
        """``opt``'s value from the command's table, ``[client]`` or the top level, in that order."""
        for table in (self.command, CLIENT_TABLE, ""):
            if table == CLIENT_TABLE and opt.dest not in {o.dest for o in _client_options()}:
                continue
            values = self.tables.get(table, {})
            if opt.dest in values:
                return True, values[opt.dest]
        return False, None


def _client_options() -> Sequence[Option]:
    """The options every client command shares, the ones a ``[client]`` table holds."""
    shared: set[str] | None = None
    by_dest: dict[str, Option] = {}
    for options in COMMAND_OPTIONS.values():
        dests = {opt.dest for opt in options}
        if "broker" in dests:  # a client command
            shared = dests if shared is None else shared & dests
            by_dest.update({opt.dest: opt for opt in options})
    return [by_dest[d] for d in sorted(shared or ())]


def _toml_problem(raw_text: str, exc: tomllib.TOMLDecodeError) -> str:
    if _top_level_broker_key(raw_text) and re.search(r"(?m)^\s*\[\s*broker\s*\]", raw_text):
        return (
            "a top-level `broker = ...` (the address clients connect to) and a [broker] table (the broker's "
            'options) cannot both be in one TOML file: put the address in a [client] table (broker = "tcp://...")'
        )
    return f"not valid TOML ({exc})"


def _top_level_broker_key(raw_text: str) -> bool:
    for line in raw_text.splitlines():
        if re.match(r"\s*\[", line):
            return False  # top-level keys come before the first table
        if re.match(r"\s*broker\s*=", line):
            return True
    return False


def _did_you_mean(name: str, known: Any, form: str = "{}") -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {form.format(close[0])}?)" if close else ""


def _dest(key: str) -> str:
    return key.replace("-", "_")
