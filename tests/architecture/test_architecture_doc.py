"""ARCHITECTURE.md stays true: it has a line for every module, and its layer table is the one layers.py enforces.

A map that misses a file, or shows a rule the check no longer has, sends
the next person the wrong way. The paths it names must exist, its commands
parse and its Python names import: tests/docs/test_docs_match_the_code.py
reads it with the other docs.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "ARCHITECTURE.md"
# Folders whose every module has its own line; benchmarks/ may be summed up by folder.
ONE_LINE_EACH = ("conveyor", "broker", "consumers", "decorators", "monitoring", "pipeline")


@pytest.fixture(scope="module")
def layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conveyor_layers_doc", Path(__file__).with_name("layers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def named_paths() -> set[str]:
    return set(re.findall(r"`([\w./-]+)`", DOC.read_text()))


def modules() -> list[str]:
    """Every module file of the folders above, an ``__init__.py`` with nothing in it excepted."""
    found = []
    for folder in ONE_LINE_EACH:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue
            found.append(str(path.relative_to(REPO)))
    return found


def only_a_docstring(module: str) -> bool:
    body = ast.parse((REPO / module).read_text()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)


def mentioned(module: str) -> bool:
    """Named by its path; a package's ``__init__.py`` that only describes the package may be named by its folder."""
    if module in named_paths():
        return True
    folder = module.removesuffix("__init__.py")
    return folder != module and folder in named_paths() and only_a_docstring(module)


def test_every_module_has_a_line():
    missing = [module for module in modules() if not mentioned(module)]
    assert not missing, "ARCHITECTURE.md has no line for these modules (add one saying what each holds):\n" + "\n".join(
        missing
    )


def test_every_benchmarks_folder_is_named():
    folders = sorted({str(p.parent.relative_to(REPO)) + "/" for p in (REPO / "benchmarks").rglob("__init__.py")})
    missing = [folder for folder in folders if folder not in named_paths()]
    assert not missing, f"ARCHITECTURE.md does not name {missing}"


def layer_table() -> dict[str, set[str]]:
    """The ``| layer | may import |`` rows of the section "The rule", as layers.py spells them."""
    text = DOC.read_text()
    section = text[text.index("## The rule") :]
    end = section.find("\n## ")
    section = section if end < 0 else section[:end]
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.M)
    table = {}
    for layer, allowed in rows:
        names = re.findall(r"`([\w.]+)`", layer)
        if not names:
            continue  # the heading row
        key = "base" if len(names) > 1 else names[0]
        table[key] = set(re.findall(r"`([\w.]+)`", allowed)) | ({"*"} if "anything" in allowed else set())
    return table


def test_the_layer_table_is_the_rule_layers_py_enforces(layers):
    assert layer_table() == layers.LAYERS, (
        "ARCHITECTURE.md's table under 'The rule' and LAYERS in tests/architecture/layers.py differ: change both"
    )


def test_the_base_row_names_the_base(layers):
    text = DOC.read_text()
    base_row = next(line for line in text.splitlines() if line.startswith("| the base"))
    assert set(re.findall(r"`([\w.]+)`", base_row)) == layers.BASE
