"""``layers.py`` (run by ``make lint``) reports an upward import and lets a downward one pass.

The check is only worth its place in CI if it fails: these tests run its
functions on a small fake tree in a temporary directory, so they show what
it reports without touching the real code.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

LAYERS_PY = Path(__file__).with_name("layers.py")


@pytest.fixture(scope="module")
def layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conveyor_layers_check", LAYERS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


PACKAGES = {
    "conveyor/__init__.py": "",
    "conveyor/errors.py": "",
    "broker/__init__.py": "",
    "broker/wire/__init__.py": "",
    "broker/net/__init__.py": "",
    "broker/server/__init__.py": "",
    "broker/cli/__init__.py": "",
    "monitoring/__init__.py": "",
}


def test_a_downward_import_passes(layers, tmp_path):
    root = write(
        tmp_path,
        {
            **PACKAGES,
            "broker/wire/protocol.py": "from conveyor.errors import ConveyorError\n",
            "broker/net/transport.py": "from conveyor.broker.wire import protocol\n",
            "broker/server/loop.py": "from conveyor.broker.net.transport import x\nimport conveyor.monitoring\n",
            "broker/cli/main.py": "from conveyor.broker.server.loop import y\n",
        },
    )
    assert layers.layer_problems(root) == []


def test_an_upward_import_is_reported_with_file_line_and_layers(layers, tmp_path):
    root = write(
        tmp_path,
        {
            **PACKAGES,
            "broker/server/loop.py": "",
            "broker/wire/protocol.py": "import struct\nfrom conveyor.broker.server.loop import Broker\n",
        },
    )
    problems = layers.layer_problems(root)
    assert len(problems) == 1, problems
    assert problems[0].startswith("broker/wire/protocol.py:2: conveyor.broker.wire.protocol (conveyor.broker.wire)")
    assert "conveyor.broker.server" in problems[0]


def test_a_lazy_or_relative_upward_import_counts_too(layers, tmp_path):
    root = write(
        tmp_path,
        {
            **PACKAGES,
            "broker/server/loop.py": "",
            "broker/wire/lazy.py": """
                def later():
                    from conveyor.broker.server import loop
                    return loop
            """,
            "broker/wire/relative.py": "from ..server import loop\n",
        },
    )
    problems = sorted(layers.layer_problems(root))
    assert [p.split(":")[0] for p in problems] == ["broker/wire/lazy.py", "broker/wire/relative.py"], problems


def test_monitoring_may_not_import_the_broker(layers, tmp_path):
    root = write(tmp_path, {**PACKAGES, "monitoring/metrics.py": "from conveyor.broker.wire import protocol\n"})
    assert len(layers.layer_problems(root)) == 1


def test_nothing_below_imports_the_cli(layers, tmp_path):
    root = write(
        tmp_path, {**PACKAGES, "broker/cli/main.py": "", "broker/server/loop.py": "import conveyor.broker.cli.main\n"}
    )
    problems = layers.layer_problems(root)
    assert len(problems) == 1 and "nothing imports conveyor.broker.cli" in problems[0], problems


def test_the_old_top_level_names_are_reported_in_code_and_docs(layers, tmp_path):
    old = "con" + "sumers"  # spelled apart so that this file passes the check it tests
    root = write(
        tmp_path,
        {
            "examples/app.py": f"import json\nfrom {old}.runner import Runner\n",
            "docs/guide.md": f"Run it:\n\n    python -m {old} app\n",
            "README.md": "from conveyor import Producer\n",
        },
    )
    problems = sorted(layers.old_name_problems(root))
    assert [p.split(":")[:2] for p in problems] == [["docs/guide.md", "3"], ["examples/app.py", "2"]], problems


def test_the_real_tree_passes(layers):
    assert layers.layer_problems() == []
    assert layers.old_name_problems() == []
