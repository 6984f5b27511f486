"""The import rules of Conveyor's layers, checked on the source (``make lint`` runs this file).

Conveyor's modules form layers, and imports point down only::

    conveyor.errors, names, exitcodes, version     the base: every layer may use it
    broker.config   broker.wire                    what options and frames are
    broker.net      broker.log                     sockets; the topic log on disk
    broker.server   broker.client                  the broker; the clients
    consumers       pipeline                       the runner; Spark
    broker.cli      benchmarks                     the programs

``monitoring`` and ``decorators`` stand beside the broker and use only the base,
so a user's handler module or a metrics test pulls in nothing else. Lazy imports
inside functions count too: a layer that needs a higher one has a design bug,
not an import-order problem.

The same run refuses the names the folders had before they moved under
``conveyor`` (``import broker``, ``from consumers import ...``, ``python -m
consumers``) in code, tests, docs and examples.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {  # folder in the repository -> its installed package
    "conveyor": "conveyor",
    "broker": "conveyor.broker",
    "consumers": "conveyor.consumers",
    "decorators": "conveyor.decorators",
    "monitoring": "conveyor.monitoring",
    "pipeline": "conveyor.pipeline",
    "benchmarks": "conveyor.benchmarks",
}
BASE = {"conveyor.errors", "conveyor.names", "conveyor.exitcodes", "conveyor.version"}
# Each layer, by the longest matching module prefix, and the layers it may import.
LAYERS: dict[str, set[str]] = {
    "base": set(),
    "conveyor.broker.config": set(),
    "conveyor.broker.wire": set(),
    "conveyor.broker.net": {"conveyor.broker.config", "conveyor.broker.wire"},
    "conveyor.broker.log": {"conveyor.broker.config", "conveyor.broker.wire"},
    "conveyor.broker.cluster": {"conveyor.broker.config", "conveyor.broker.wire"},
    "conveyor.broker.server": {
        "conveyor.broker.config",
        "conveyor.broker.wire",
        "conveyor.broker.net",
        "conveyor.broker.log",
        "conveyor.broker.cluster",
        "conveyor.monitoring",
    },
    "conveyor.broker.client": {"conveyor.broker.config", "conveyor.broker.wire", "conveyor.broker.net"},
    "conveyor.monitoring": set(),
    "conveyor.decorators": set(),
    "conveyor.consumers": {
        "conveyor.broker.config",
        "conveyor.broker.wire",
        "conveyor.broker.net",
        "conveyor.broker.client",
        "conveyor.decorators",
        "conveyor.monitoring",
    },
    "conveyor.pipeline": {
        "conveyor.broker.config",
        "conveyor.broker.wire",
        "conveyor.broker.net",
        "conveyor.broker.client",
        "conveyor.testing",
    },
    "conveyor.broker_process": set(),
    "conveyor.etcd_process": set(),
    "conveyor.cluster_process": {"conveyor.broker_process", "conveyor.etcd_process"},
    # runs a test's handlers in the real runner: the one piece of the test kit above the consumers
    "conveyor.consumer_harness": {
        "conveyor.broker_process",
        "conveyor.broker.client",
        "conveyor.consumers",
        "conveyor.decorators",
    },
    "conveyor.pytest_plugin": {"conveyor.broker_process", "conveyor.etcd_process", "conveyor.consumer_harness"},
    "conveyor.testing": {
        "conveyor.broker_process",
        "conveyor.cluster_process",
        "conveyor.etcd_process",
        "conveyor.pytest_plugin",
        "conveyor.consumer_harness",
    },  # hands out all
    "conveyor.broker.cli": {"*", "conveyor.benchmarks"},  # the top: `conveyor bench` runs the benchmarks
    "conveyor.benchmarks": {"*"},
    "conveyor.broker": set(),  # the package's own __init__
    "conveyor": {"*"},  # the facade: ``from conveyor import Producer`` (lazily)
}
TOP = {"conveyor.broker.cli", "conveyor.benchmarks"}  # nothing below imports these
OLD_NAMES = tuple(name for name in FOLDERS if name != "conveyor")
OLD_IMPORT = re.compile(rf"(^|\\n|[\"'])\s*(from|import)\s+({'|'.join(OLD_NAMES)})(\.\w+)*(\s|$)", re.M)
OLD_RUN = re.compile(rf"python3? -m ({'|'.join(OLD_NAMES)})\b|[\"']-m[\"'],\s*[\"']({'|'.join(OLD_NAMES)})[\"'.]")
TEXT_PLACES = ("README.md", "ARCHITECTURE.md", "docs", "examples", "tests", "benchmarks", "Makefile", "grafana")


def module_files(root: Path = ROOT) -> Iterator[tuple[str, Path]]:
    """Every Conveyor module with its installed name (``root``: the repository, or a fake tree in a test)."""
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len, default="")
    if not best:
        raise ValueError(f"{module} is in no layer: add it to tests/architecture/layers.py")
    return best


def imported(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each import of a Conveyor module, lazy ones and relative ones included."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "conveyor" or name.startswith("conveyor."):
                yield node.lineno, name


def layer_problems(root: Path = ROOT) -> list[str]:
    known = {module for module, _ in module_files(root)}
    problems = []
    for module, path in module_files(root):
        mine = layer_of(module)
        allowed = LAYERS[mine]
        seen = set()
        for line, name in imported(module, path):
            while name not in known and "." in name:  # `from pkg import Class`: the module is the prefix
                name = name.rpartition(".")[0]
            if (line, name) in seen:
                continue
            seen.add((line, name))
            if name == "conveyor" and mine != "conveyor":
                problems.append(f"{path.relative_to(root)}:{line}: imports the conveyor facade; import the module")
                continue
            theirs = layer_of(name)
            if theirs in (mine, "base") or (theirs == "conveyor.broker" and name == "conveyor.broker"):
                continue
            if theirs in TOP and theirs not in allowed and mine != "conveyor":
                problems.append(f"{path.relative_to(root)}:{line}: {module} imports {name} (nothing imports {theirs})")
            elif "*" not in allowed and theirs not in allowed:
                problems.append(
                    f"{path.relative_to(root)}:{line}: {module} ({mine}) imports {name} ({theirs}),"
                    " a layer it may not use"
                )
    return problems


# Third-party modules only one module may import: the etcd client stays behind one wrapper,
# so single-node mode never loads it and a change of client touches one file.
CONFINED = {"etcd3gw": "conveyor.broker.cluster.etcd", "requests": "conveyor.broker.cluster.etcd"}


def confined_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for module, path in module_files(root):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                owner = CONFINED.get(name.partition(".")[0])
                if owner and module != owner:
                    problems.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}; only {owner} may")
    return problems


def old_name_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for place in TEXT_PLACES:
        target = root / place
        files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
        for path in files:
            if path.suffix not in (".py", ".md", ".toml", ".json", ".yml", ".yaml", "") or "__pycache__" in path.parts:
                continue
            if path == Path(__file__).resolve():
                continue
            text = path.read_text(errors="replace")
            for pattern in (OLD_IMPORT, OLD_RUN):
                for match in pattern.finditer(text):
                    line = text.count("\n", 0, match.start()) + 1
                    problems.append(
                        f"{path.relative_to(root)}:{line}: {match.group(0).strip()!r}: Conveyor installs as conveyor.*"
                    )
    return problems


def main() -> int:
    problems = layer_problems() + confined_problems() + old_name_problems()
    for problem in problems:
        print(problem)
    print(f"layers: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
