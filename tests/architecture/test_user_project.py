"""A user's project with its own ``consumers.py``, ``broker.py``, ``decorators.py`` and ``monitoring/`` runs
pytest with Conveyor installed, using Conveyor's ``conveyor_broker`` fixture.

Before Conveyor installed under one name, loading its pytest plugin in such a
project failed with "'consumers' is not a package". The project is written to
a temporary directory and its tests run in a subprocess from there, so the
user's modules come first on ``sys.path``, as they do in the user's checkout:
once with the development install (the project's venv) and once with the
wheel installed on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# The user's generic module names; each says whose it is, and the user's test checks it got its own.
PROJECT = {
    "consumers.py": 'OWNER = "user"  # Django Channels keeps its websocket consumers here\n',
    "broker.py": 'OWNER = "user"\n',
    "decorators.py": 'OWNER = "user"\n',
    "monitoring/__init__.py": 'OWNER = "user"\n',
    "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\n",
    "test_orders.py": '''
        """The user's test: its own modules, and Conveyor's fixture and clients."""

        from importlib import import_module

        import conveyor
        from conveyor import Admin, Producer


        def test_my_modules_are_mine():
            for name in ("consumers", "broker", "decorators", "monitoring"):
                assert import_module(name).OWNER == "user", name


        def test_publish_and_fetch(conveyor_broker):
            with Producer(conveyor_broker.address) as producer:
                offset = producer.send("orders", {"id": 1}).result(timeout=30)
            with Admin(conveyor_broker.address) as admin:
                (message,) = admin.fetch("orders", offset, 1)
            assert message.value == {"id": 1}
            print("CONVEYOR_FROM", conveyor.__file__)
    ''',
}


def write_project(root: Path) -> Path:
    for name, text in PROJECT.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def run_pytest(project: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CONVEYOR_"))}
    env.pop("PYTHONPATH", None)
    return {**env, **extra}


def check(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "2 passed" in output, output
    return next(line.split()[-1] for line in output.splitlines() if "CONVEYOR_FROM" in line)


def test_a_user_project_runs_pytest_with_the_development_install(tmp_path):
    project = write_project(tmp_path / "shop")
    conveyor_from = check(run_pytest(project, clean_env()))
    assert not conveyor_from.startswith(str(project))


def test_a_user_project_runs_pytest_with_the_wheel(tmp_path, site_packages):
    project = write_project(tmp_path / "shop")
    conveyor_from = check(run_pytest(project, clean_env(PYTHONPATH=str(site_packages))))
    assert conveyor_from == str(site_packages / "conveyor" / "__init__.py")
