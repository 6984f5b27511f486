"""The wheel of Conveyor, built once per session for the architecture tests that install it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.architecture.wheel_helpers import FOLDERS, REPO, pip


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what the package is made of (a stale build/ in the tree could leak in)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for folder in sorted(set(FOLDERS.values())):
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    pip("wheel", str(source), "--no-deps", "--quiet", "--wheel-dir", str(out))
    (built,) = out.glob("conveyor-*.whl")
    return built


@pytest.fixture(scope="session")
def site_packages(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed on its own, as ``pip install .`` puts it into a venv's site-packages."""
    target = tmp_path_factory.mktemp("site-packages")
    pip("install", "--no-deps", "--no-index", "--quiet", "--target", str(target), str(wheel))
    return target
