"""What the packaging tests share: the project's metadata and pip."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
FOLDERS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # installed package -> folder in the repository
PIP_TIMEOUT = 300


def pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=PIP_TIMEOUT, check=False
    )
    assert result.returncode == 0, f"pip {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
