"""One name for every module: ``conveyor.…``, and the pyproject names every package folder.

The repository's folders (``broker/``, ``consumers/``, ...) install as
subpackages of ``conveyor`` through setuptools' ``package-dir``; a package
folder missing from pyproject's ``packages`` list would be left out of the
wheel without an error, and a folder imported under its own name from the
repository root would load its modules a second time beside ``conveyor.…``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.architecture.wheel_helpers import FOLDERS, PYPROJECT, REPO, VERSION

FACADE = "Producer, AsyncProducer, Admin, consumer, retry_policy, error_handler, Message, Nack, Reject, Runner"


def package_folders() -> set[str]:
    """The installed name of every folder with an ``__init__.py`` under the mapped folders."""
    found = set()
    for package, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([package, *parts]))
    return found


def python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_pyproject_lists_exactly_the_package_folders():
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    assert len(listed) == len(set(listed)), "a package listed twice"
    assert set(listed) == package_folders()


@pytest.mark.parametrize("old", sorted(folder for folder in FOLDERS.values() if folder != "conveyor"))
def test_a_folder_imported_by_its_old_name_from_the_repository_root_refuses(old):
    result = python("-c", f"import {old}")
    assert result.returncode == 1
    assert f"ImportError: import conveyor.{old}, not {old}" in result.stderr


def test_python_m_conveyor_answers_its_version():
    result = python("-m", "conveyor", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"conveyor {VERSION}"


def test_the_common_names_come_from_conveyor():
    result = python("-c", f"from conveyor import {FACADE}; print({FACADE.replace(', ', '.__name__, ')}.__name__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == FACADE.split(", ")
