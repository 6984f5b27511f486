"""The docs say what the code does: every name, flag and command they show is checked against the code.

Docs drift silently: a flag renamed, an admin op added, an error code
nobody listed. These tests read the Markdown (the README, ``docs/``,
``grafana/README.md``, ``benchmarks/README.md``) and check, without
starting anything:

- every ``conveyor …`` command parses with the real CLI parser;
- every flag, metric, ``CONVEYOR_`` variable, client method or attribute,
  dotted name, ``python -m`` module, repository path and cited test exists;
- ``docs/protocol.md`` lists every command, admin op and error code (and
  nothing else); the README links every doc and its exit-code table is
  ``conveyor/exitcodes.py``; ``grafana/README.md`` lists each dashboard's
  variables; ``docs/spark.md`` lists exactly the options the source and
  sink read;
- every Python block imports and calls what exists (keywords included),
  and ``import conveyor.pipeline; conveyor.pipeline.session.local_session``
  style chains work in a fresh interpreter;
- Python names are the installed ones: ``conveyor.broker.log.data_dir``,
  ``from conveyor import Producer``. The repository's folder names
  (``broker.log``, ``import pipeline``) are checked too, and fail: those
  folders refuse to import under any name but ``conveyor.…``.

When one fails, fix the doc (or the code): the message names the file and
what it says.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    REPO / "ARCHITECTURE.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "grafana" / "README.md",
    REPO / "benchmarks" / "README.md",
]
# The repository's folders with Python code. All but examples/ install under ``conveyor`` (pyproject's package-dir).
FOLDERS = ("conveyor", "broker", "consumers", "decorators", "monitoring", "pipeline", "benchmarks", "examples")
# First names of the Python names the docs are checked for: the installed package and the examples, and the
# folders' own names, which must fail (a doc saying ``broker.log.segment`` names a module that does not import).
PACKAGES = FOLDERS
TOP_DIRS = (*FOLDERS, "tests", "grafana", "docs")

# Flags of other tools that the docs show next to ours: spark-submit's, py-spy's (the benchmarks profile with it).
FOREIGN_FLAGS = {"--master", "--conf", "--py-files", "--archives", "--gil", "--native", "--threads", "--pid"}
FOREIGN_FLAGS |= {"--secret", "--pull", "--profile"}  # docker/podman build and compose (docs/operations.md)
# Lines of these commands give their own flags.
FOREIGN_COMMANDS = ("docker", "podman", "sudo", "pip", "apt", "curl", "git", "make", "etcd")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --- reading Markdown ---------------------------------------------------------------------------------------

FENCE = re.compile(r"^[ \t]*```([\w-]*)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")


@dataclass(frozen=True)
class Block:
    doc: str
    lang: str
    text: str


@cache
def blocks() -> tuple[Block, ...]:
    return tuple(Block(rel(doc), m.group(1), m.group(2)) for doc in DOCS for m in FENCE.finditer(doc.read_text()))


@cache
def prose(doc: Path) -> str:
    """A doc without its fenced code blocks."""
    return FENCE.sub("", doc.read_text())


def spans() -> Iterator[tuple[str, str]]:
    """``(doc, text)`` of every inline code span outside code blocks."""
    for doc in DOCS:
        for match in SPAN.finditer(prose(doc)):
            yield rel(doc), match.group(1).strip()


def shell_lines(block: Block) -> Iterator[str]:
    """Commands of a shell (or unlabelled) block, continuation lines joined."""
    if block.lang not in ("", "sh", "bash", "shell", "console"):
        return
    for line in block.text.replace("\\\n", " ").splitlines():
        yield line.strip().removeprefix("$ ")


# --- the real command line ----------------------------------------------------------------------------------


@cache
def parser() -> argparse.ArgumentParser:
    from conveyor.broker.cli.main import build_parser

    built = build_parser()
    for each in [built, *_subparsers_of(built).values()]:
        each.allow_abbrev = False  # a doc's `--form` must not pass for `--format`
    return built


def subparsers() -> dict[str, argparse.ArgumentParser]:
    return _subparsers_of(parser())


def _subparsers_of(built: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in built._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


@cache
def conveyor_flags() -> frozenset[str]:
    flags = {s for a in parser()._actions for s in a.option_strings}
    for sub in subparsers().values():
        flags |= {s for a in sub._actions for s in a.option_strings}
    return frozenset(flags)


@cache
def declared_flags() -> frozenset[str]:
    """Flags declared anywhere in the project's code (the benchmarks' and jobs' own parsers too)."""
    found = set(conveyor_flags())
    for path in source_files():
        found |= set(re.findall(r"""add_argument\(\s*["'](--[a-z][a-z0-9-]*)""", path.read_text()))
    return frozenset(found)


@cache
def source_files() -> tuple[Path, ...]:
    files = [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]
    return tuple(files + list((REPO / "tests").rglob("*.py")) + [REPO / "Makefile"])


def parse(argv: list[str]) -> str | None:
    """None when the real parser accepts ``argv``; else what it said."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else f"exit {exc.code}"
    return None


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\[[^\]]*\])?(\.\.\.)?$|^\.\.\.$|^[A-Z]+=[A-Z]+$")
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "&"}


def conveyor_argv(command: str) -> list[str] | None:
    """The arguments after ``conveyor`` (placeholders such as ``TOPIC`` or ``N`` filled in), or None."""
    if re.match(r"^conveyor [\w-]+: ", command):
        return None  # what a command prints (`conveyor broker: [CONFIG_ERROR] ...`), not a command
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:
        return None
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value conveyor ...
        tokens.pop(0)
    if not tokens or tokens[0] != "conveyor":
        return None
    argv: list[str] = []
    for token in tokens[1:]:
        if token in SHELL_OPERATORS:
            break
        argv.append("1" if PLACEHOLDER.match(token) else token)
    return argv


def block_commands() -> list[tuple[str, str]]:
    return [(b.doc, line) for b in blocks() for line in shell_lines(b) if conveyor_argv(line) is not None]


def span_commands() -> list[tuple[str, str]]:
    return [(doc, text) for doc, text in spans() if text.startswith("conveyor ") and conveyor_argv(text)]


@pytest.mark.parametrize(("doc", "command"), block_commands(), ids=lambda v: v[:60])
def test_every_command_in_a_code_block_parses(doc, command):
    argv = conveyor_argv(command)
    assert argv is not None
    problem = parse(argv)
    assert problem is None, f"{doc}: `{command}`: {problem}"


@pytest.mark.parametrize(("doc", "command"), span_commands(), ids=lambda v: v[:60])
def test_every_command_in_the_text_parses_as_far_as_it_goes(doc, command):
    """Inline spans may name a command without its arguments (`conveyor run`); what they give must parse."""
    problem = parse(conveyor_argv(command) or [])
    if problem and "the following arguments are required" in problem:
        problem = None
    assert problem is None, f"{doc}: `{command}`: {problem}"


def test_the_docs_show_a_command_for_every_subcommand():
    shown = {argv[0] for _, c in block_commands() + span_commands() if (argv := conveyor_argv(c))}
    assert set(subparsers()) - shown == set(), "subcommands no doc shows"


def test_every_flag_the_docs_name_exists():
    missing = set()
    commands = [(b.doc, line) for b in blocks() for line in shell_lines(b) if not line.startswith(FOREIGN_COMMANDS)]
    for doc, text in [*spans(), *commands]:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text):
            if flag not in declared_flags() and flag not in FOREIGN_FLAGS:
                missing.add(f"{doc}: {flag} (in `{text}`)")
    assert not missing, "flags no parser declares:\n" + "\n".join(sorted(missing))


# --- metrics and variables ----------------------------------------------------------------------------------

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


@cache
def exposed_metrics() -> frozenset[str]:
    from conveyor.monitoring.metrics import BrokerMetrics, RunnerMetrics, StateCollector
    from prometheus_client import CollectorRegistry

    broker, runner = CollectorRegistry(), CollectorRegistry()
    BrokerMetrics(broker)
    broker.register(StateCollector(lambda: {}))
    RunnerMetrics(runner)
    families = {f.name: f.type for registry in (broker, runner) for f in registry.collect()}
    samples = {name + suffix for name, kind in families.items() for suffix in SUFFIXES.get(kind, ("",))}
    # Collectors the processes register on their own (health, ...): named in monitoring/metrics.py, the one place.
    source = (REPO / "monitoring" / "metrics.py").read_text()
    for name in set(re.findall(r"""["'](conveyor_[a-z0-9_]*[a-z0-9])["']""", source)) - set(families):
        samples |= {name + suffix for suffixes in SUFFIXES.values() for suffix in suffixes}
    return frozenset(samples | set(families))  # a histogram is named by its family


def test_every_metric_the_docs_name_exists():
    from conveyor import pytest_plugin

    fixtures = {name for name in vars(pytest_plugin) if name.startswith("conveyor_")}
    missing = set()
    for doc in DOCS:
        for name in set(re.findall(r"\bconveyor_[a-z0-9_]*[a-z0-9]\b", doc.read_text())) - fixtures:
            if name not in exposed_metrics():
                missing.add(f"{rel(doc)}: {name}")
    assert not missing, "metrics neither the broker nor the runner exposes:\n" + "\n".join(sorted(missing))


@cache
def known_variables() -> frozenset[str]:
    """Variables an option reads (as its --help says) or that the code names."""
    helps = [a.help or "" for sub in [parser(), *subparsers().values()] for a in sub._actions]
    found = {v for text in helps for v in re.findall(r"\bCONVEYOR_[A-Z0-9_]+", text)}
    for path in source_files():
        found |= set(re.findall(r"\bCONVEYOR_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return frozenset(found)


def test_every_conveyor_variable_the_docs_name_is_read_by_the_code():
    missing = set()
    for doc in DOCS:
        for name in set(re.findall(r"\bCONVEYOR_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text())):
            if name not in known_variables():
                missing.add(f"{rel(doc)}: {name}")
    assert not missing, "variables nothing reads:\n" + "\n".join(sorted(missing))


# --- Python names -------------------------------------------------------------------------------------------


def resolve(dotted: str) -> Any:
    """Import the longest module prefix of ``dotted``, then walk the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # something the module imports is missing: a real error
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(dotted)


DOTTED = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)(\(.*\))?$")


def test_every_dotted_name_the_docs_name_exists():
    missing = set()
    for doc, text in spans():
        match = DOTTED.match(text)
        if not match:
            continue
        try:
            resolve(match.group(1))
        except (ImportError, AttributeError) as exc:
            missing.add(f"{doc}: `{text}`: {type(exc).__name__}: {exc}")
    assert not missing, "\n".join(sorted(missing))


def test_every_python_module_the_docs_run_exists():
    missing = set()
    texts = [(b.doc, line) for b in blocks() for line in shell_lines(b)] + list(spans())
    for doc, text in texts:
        for module in re.findall(r"python3? -m ([\w.]*\w)\b(?!\.<)", text):
            if module.split(".")[0] in PACKAGES and not _finds(module):
                missing.add(f"{doc}: python -m {module}")
    assert not missing, "\n".join(sorted(missing))


def _finds(module: str) -> bool:
    """``python -m module`` would find it (a folder's old name refuses to import: not found)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@cache
def client_classes() -> dict[str, type]:
    from conveyor.broker.client.async_producer import AsyncProducer

    from conveyor import Admin, Message, Producer, Runner, Subscription
    from conveyor.testing import BrokerProcess

    return {
        "Producer": Producer,
        "AsyncProducer": AsyncProducer,
        "Admin": Admin,
        "Subscription": Subscription,
        "Runner": Runner,
        "Message": Message,
        "BrokerProcess": BrokerProcess,
    }


# What the docs call instances of each class in the text (`producer.flush()`, `message.attempt`).
INSTANCE_NAMES = {
    "producer": "Producer",
    "admin": "Admin",
    "subscription": "Subscription",
    "runner": "Runner",
    "message": "Message",
    "conveyor_broker": "BrokerProcess",
}


def has_member(cls: type, name: str) -> bool:
    """A class attribute, a dataclass field, an ``__init__`` parameter or an attribute ``__init__`` sets."""
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    with contextlib.suppress(TypeError, OSError):
        source = inspect.getsource(cls)
        return re.search(rf"\bself\.{re.escape(name)}\s*[:=]", source) is not None
    return False


def test_every_client_method_the_text_names_exists():
    missing = set()
    for doc, text in spans():
        match = re.match(r"^(\w+)\.(\w+)(\(.*\))?$", text)
        if not match:
            continue
        owner, member = match.group(1), match.group(2)
        cls = client_classes().get(owner) or client_classes().get(INSTANCE_NAMES.get(owner, ""))
        if cls is not None and not has_member(cls, member):
            missing.add(f"{doc}: `{text}`: {cls.__name__} has no {member!r}")
    assert not missing, "\n".join(sorted(missing))


class _PythonBlock(ast.NodeVisitor):
    """Imports, instances of the client classes, and what the block calls on them.

    ``import conveyor.pipeline`` followed by ``conveyor.pipeline.session.local_session()``
    only works if ``conveyor.pipeline`` makes ``session`` reachable: such chains are
    collected in ``chains`` and tried in a fresh interpreter (this one has
    imported every submodule by now).
    """

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.instances: dict[str, type] = {}
        self.modules: dict[str, str] = {}  # local name -> dotted name bound by ``from X import Y``
        self.imports: list[str] = []  # the block's own ``import X`` statements, for the project's packages
        self.bare: set[str] = set()  # names bound by those statements
        self.chains: set[str] = set()  # ``X.a.b`` used on them

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in PACKAGES:
                self._check(alias.name)
                self.imports.append(f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
                self.bare.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                self._check(dotted)
                local = alias.asname or alias.name
                if _is_module(dotted):  # ``from conveyor import pipeline``: its chains are walked like an import's
                    self.imports.append(f"from {node.module} import {alias.name} as {local}")
                    self.bare.add(local)
                else:
                    self.modules[local] = dotted

    def _check(self, dotted: str) -> None:
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as exc:
            self.problems.append(f"{dotted}: {type(exc).__name__}: {exc}")

    def _class_of_call(self, node: ast.expr) -> type | None:
        if isinstance(node, ast.Await):
            node = node.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return client_classes().get(node.func.id) if node.func.id in self.modules else None
        return None

    def visit_withitem(self, node: ast.withitem) -> None:
        cls = self._class_of_call(node.context_expr)
        if cls is not None and isinstance(node.optional_vars, ast.Name):
            self.instances[node.optional_vars.id] = cls
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        cls = self._class_of_call(node.value)
        for target in node.targets:
            if cls is not None and isinstance(target, ast.Name):
                self.instances[target.id] = cls
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        annotation = node.annotation
        if isinstance(annotation, ast.Name) and annotation.id in client_classes() and annotation.id in self.modules:
            self.instances[node.arg] = client_classes()[annotation.id]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        if chain and chain.split(".")[0] in self.bare:
            self.chains.add(chain)
            return  # the whole chain is checked at once
        if isinstance(node.value, ast.Name):
            cls = self.instances.get(node.value.id)
            if cls is not None and not has_member(cls, node.attr):
                self.problems.append(f"{node.value.id}.{node.attr}: {cls.__name__} has no {node.attr!r}")
            elif node.value.id in self.modules:
                self._check(f"{self.modules[node.value.id]}.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = self._callee(node.func)
        if function is not None:
            self._check_keywords(function, node)
        self.generic_visit(node)

    def _callee(self, func: ast.expr) -> Any:
        if isinstance(func, ast.Name) and func.id in self.modules:
            with contextlib.suppress(ImportError, AttributeError):
                return resolve(self.modules[func.id])
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            cls = self.instances.get(func.value.id)
            if cls is not None:
                return getattr(cls, func.attr, None)
        return None

    def _check_keywords(self, function: Any, node: ast.Call) -> None:
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return
        for keyword in node.keywords:
            if keyword.arg is not None and keyword.arg not in parameters:
                name = getattr(function, "__qualname__", repr(function))
                self.problems.append(f"{name}() takes no {keyword.arg}=")


def _is_module(dotted: str) -> bool:
    with contextlib.suppress(ImportError, AttributeError):
        return inspect.ismodule(resolve(dotted))
    return False


def _chain(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


REACHABLE = """
import json, sys
failed = []
for chain in json.loads(sys.argv[2]):
    root, *attrs = chain.split(".")
    value = namespace[root]
    try:
        for attr in attrs:
            value = getattr(value, attr)
    except AttributeError as exc:
        failed.append(f"{chain}: {exc}")
print(json.dumps(failed))
"""


def unreachable(imports: list[str], chains: set[str]) -> list[str]:
    """The chains a fresh interpreter cannot walk after running only ``imports``."""
    code = "namespace = {}\n" + "".join(f"exec({i!r}, namespace)\n" for i in imports) + REACHABLE
    result = subprocess.run(
        [sys.executable, "-c", code, "", json.dumps(sorted(chains))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in ("python", "py")]


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: f"{b.doc}:{b.text.splitlines()[0][:40]}")
def test_every_python_block_uses_names_the_code_has(block):
    try:
        tree = ast.parse(block.text)
    except SyntaxError as exc:
        pytest.fail(f"{block.doc}: a python block that does not parse: {exc}")
    checker = _PythonBlock()
    checker.visit(tree)
    if checker.chains:
        checker.problems += unreachable(checker.imports, checker.chains)
    assert not checker.problems, f"{block.doc}:\n" + "\n".join(checker.problems)


# --- paths and cited tests ----------------------------------------------------------------------------------

PATH = re.compile(rf"^((?:{'|'.join(TOP_DIRS)})/[\w./*-]*)(?:::([\w]+)(?:\[.*\])?)?$")


def test_every_path_and_test_the_docs_cite_exists():
    missing = set()
    for doc in DOCS:
        last_file: Path | None = None
        for match in SPAN.finditer(prose(doc)):
            text = match.group(1).strip()
            if text.startswith("::") and last_file is not None:  # `::test_name`: the file cited before it
                name = re.match(r"::(\w+)", text)
                if name and not _defines(last_file, name.group(1)):
                    missing.add(f"{rel(doc)}: {rel(last_file)}::{name.group(1)}")
                continue
            found = PATH.match(text)
            if not found:
                continue
            path = REPO / found.group(1)
            if "*" in found.group(1):
                if not list(REPO.glob(found.group(1))):
                    missing.add(f"{rel(doc)}: {found.group(1)}")
                continue
            if not path.exists():
                missing.add(f"{rel(doc)}: {found.group(1)}")
                continue
            if path.suffix == ".py":
                last_file = path
            if found.group(2) and not _defines(path, found.group(2)):
                missing.add(f"{rel(doc)}: {found.group(1)}::{found.group(2)}")
    assert not missing, "paths or tests that do not exist:\n" + "\n".join(sorted(missing))


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(async )?def {re.escape(name)}\(", path.read_text(), re.M) is not None


def test_every_relative_link_in_the_docs_resolves():
    broken = set()
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(doc)):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.add(f"{rel(doc)}: ({target})")
    assert not broken, "\n".join(sorted(broken))


# --- tables that must list the code's own ---------------------------------------------------------------------


def section(doc: Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    text = doc.read_text()
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"{rel(doc)} has no section {heading!r}"
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


PROTOCOL = REPO / "docs" / "protocol.md"


def test_the_protocol_lists_every_command_with_its_code():
    from conveyor.broker.wire.protocol import Command

    rows = re.findall(r"^\| (0x[0-9A-Fa-f]{2}) \| (\w+) \|", section(PROTOCOL, "Commands"), re.M)
    documented = {name: int(code, 16) for code, name in rows}
    assert documented == {c.name: int(c) for c in Command}


def test_the_protocol_lists_every_admin_op():
    from conveyor.broker.server.admin import OPS

    documented = re.findall(r"^\| `(\w+)` \|", section(PROTOCOL, "ADMIN operations"), re.M)
    assert sorted(documented) == sorted(OPS), "docs/protocol.md's ADMIN table and broker/server/admin.py OPS differ"


def test_the_protocol_lists_every_error_code_with_its_name_and_retriable_flag():
    from conveyor.errors import ALL_ERRORS

    rows = re.findall(r"^\| (\d+) \| ([A-Z_]+) \| (yes|no) \|", section(PROTOCOL, "Errors"), re.M)
    documented = {(int(code), name, retriable == "yes") for code, name, retriable in rows}
    assert documented == {(cls.code, cls.name, cls.retriable) for cls in ALL_ERRORS}


def test_the_readme_links_every_doc():
    readme = (REPO / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#\s]+)", readme))
    assert {rel(doc) for doc in DOCS[1:]} - linked == set(), "docs the README does not link"


def test_the_readme_exit_codes_are_the_codes_of_broker_exitcodes():
    from conveyor import exitcodes

    codes = {v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)}
    rows = {int(c) for c in re.findall(r"^\| (\d+) \|", section(REPO / "README.md", "Exit codes"), re.M)}
    assert rows - {1} == codes, "README's exit-code table and conveyor/exitcodes.py differ (1 is Python's own)"


def test_grafana_readme_lists_each_dashboards_variables():
    table = section(REPO / "grafana" / "README.md", "Conveyor dashboards for Grafana")
    rows = re.findall(r"^\| `([\w-]+)` \| ((?:`\w+`(?:, )?)+) \|", table, re.M)
    documented = {uid: set(re.findall(r"`(\w+)`", names)) for uid, names in rows}
    actual = {}
    for path in (REPO / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        variables = board.get("templating", {}).get("list", [])
        actual[board["uid"]] = {v["name"] for v in variables if v.get("type") != "datasource"}
    assert documented == actual


def test_the_spark_options_tables_list_exactly_the_options_the_source_and_sink_read():
    spark = REPO / "docs" / "spark.md"
    table = section(spark, "Options")
    documented = set()
    for cell in re.findall(r"^\| ([^|]+) \|", table, re.M):
        documented |= set(re.findall(r"`(\w+)`", cell))
    code = (REPO / "pipeline" / "options.py").read_text()
    read = set(re.findall(r"""_(?:get|int|bool)\(options, "(\w+)\"""", code))
    assert len(read) > 10, "the option readers of pipeline/options.py were not found"
    assert documented == read, "docs/spark.md's option tables and pipeline/options.py differ"


def test_the_cluster_flags_table_lists_every_cluster_setting():
    """docs/cluster.md's flags table names every cluster option of broker/config/broker_settings.py, and no other."""
    from dataclasses import fields

    from conveyor.broker.config.broker_settings import CLUSTER_ONLY, BrokerSettings

    table = section(REPO / "docs" / "cluster.md", "Flags")
    documented = set()
    for cell in re.findall(r"^\| ([^|]+) \|", table, re.M):
        documented |= {flag.removeprefix("--").replace("-", "_") for flag in re.findall(r"`(--[a-z-]+)`", cell)}
    extra = {"replica_lag_max_ms", "default_replication_factor", "min_insync_replicas", *CLUSTER_ONLY}
    cluster = {f.name for f in fields(BrokerSettings) if f.name.startswith(("cluster", "etcd_")) or f.name in extra}
    assert documented == cluster
