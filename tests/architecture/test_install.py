"""Installing Conveyor adds one top-level package, ``conveyor``, and a user's own modules keep their names.

Conveyor used to install ``broker``, ``consumers``, ``decorators``,
``monitoring``, ``pipeline`` and ``benchmarks`` at top level, so a project
with its own ``consumers.py`` could not even start pytest with Conveyor
installed. These tests build the wheel from a copy of the sources, install
it with ``pip --target`` and look at what lands in site-packages; then they
run a user's project, full of those generic names (test_user_project.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

from tests.architecture.wheel_helpers import FOLDERS, REPO, VERSION

OLD_NAMES = ("broker", "consumers", "decorators", "monitoring", "pipeline", "benchmarks")


def expected_modules() -> set[str]:
    """Every module under the mapped folders, by its path in the wheel (``broker/log/segment.py`` ->
    ``conveyor/broker/log/segment.py``)."""
    found = set()
    for package, folder in FOLDERS.items():
        if package != "conveyor" and "." not in package.removeprefix("conveyor."):
            base = REPO / folder
            for path in base.rglob("*.py"):
                found.add("/".join([*package.split("."), *path.relative_to(base).parts]))
    for path in (REPO / "conveyor").glob("*.py"):
        found.add(f"conveyor/{path.name}")
    return found


def test_site_packages_holds_conveyor_its_metadata_and_the_script_only(site_packages):
    entries = sorted(p.name for p in site_packages.iterdir())
    print("site-packages after installing the wheel:", entries)
    assert entries == sorted(["bin", "conveyor", f"conveyor-{VERSION}.dist-info"])
    assert [p.name for p in (site_packages / "bin").iterdir()] == ["conveyor"]
    packages = sorted(p.name for p in (site_packages / "conveyor").iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(OLD_NAMES), "the repository's folders are subpackages of conveyor"


def test_the_wheel_holds_every_module_of_the_repository_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    print(f"{wheel.name}: {len(names)} files")
    tops = {name.split("/")[0] for name in names}
    assert tops == {"conveyor", f"conveyor-{VERSION}.dist-info"}
    modules = {name for name in names if name.endswith(".py")}
    assert modules == expected_modules()
    assert {"conveyor/py.typed", "conveyor/benchmarks/default.json"} <= set(names)


def test_the_wheel_declares_the_console_script_and_the_pytest_plugin(wheel):
    entry_points = zipfile.ZipFile(wheel).read(f"conveyor-{VERSION}.dist-info/entry_points.txt").decode()
    assert "conveyor = conveyor.broker.cli.main:main" in entry_points
    assert "[pytest11]" in entry_points and "conveyor = conveyor.pytest_plugin" in entry_points


def test_the_installed_wheel_runs_on_its_own(site_packages, tmp_path):
    """From a directory with nothing of Conveyor's in it, ``python -m conveyor`` and the facade work from
    the installed copy (not the repository's)."""
    code = textwrap.dedent(
        """
        import conveyor
        from conveyor import Admin, AsyncProducer, Message, Nack, Producer, Reject, Runner
        from conveyor import consumer, error_handler, retry_policy
        import conveyor.broker.server.broker, conveyor.pipeline, conveyor.benchmarks.cli
        print(conveyor.__file__)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site_packages)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(site_packages / "conveyor" / "__init__.py")
    version = subprocess.run(
        [sys.executable, "-m", "conveyor", "--version"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip() == f"conveyor {VERSION}", version.stderr


def test_a_checkout_finds_its_own_folders_beside_an_installed_copy(site_packages: Path):
    """``pip install .`` then ``python -m pytest`` in the repository: the checkout's ``conveyor/`` comes first.

    Its subpackages are the sibling folders, not inside it; without the source-tree finder in
    ``conveyor/__init__.py`` every ``conveyor.broker`` import failed there with ModuleNotFoundError.
    """
    dependencies = sysconfig.get_paths()["purelib"]  # zmq, msgpack, ... (-S: no .pth, so no editable install)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_packages), dependencies])}
    code = "import conveyor.broker.server.broker as b, conveyor.consumers.runner as r; print(b.__file__, r.__file__)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(REPO / "broker/server/broker.py"), str(REPO / "consumers/runner.py")]
    # And away from the checkout the installed copy is used, whole
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=site_packages, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert all(path.startswith(str(site_packages)) for path in out.stdout.split()), out.stdout
