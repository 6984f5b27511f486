"""Finding consumers: ``module`` (every @consumer in it) or ``module:attr``.

A module that fails to import is the user's code failing, not ours: the
error shows that module's own traceback (file and line), without the
import machinery's frames. A file path where a module name belongs
(``app/handlers.py``) gets the dotted name to type instead.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from conveyor.decorators.consumer import Consumer, shared_group_problems

from conveyor.errors import ConfigError


def load_consumers(specs: Iterable[str]) -> list[Consumer]:
    found: list[Consumer] = []
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: the current directory's modules
    for spec in specs:
        found += _load(spec)
    unique = list({id(c): c for c in found}.values())
    if not unique:
        raise ConfigError(f"no @consumer found in {', '.join(specs)}")
    problems = shared_group_problems(unique)  # refused here, before anything subscribes
    if problems:
        raise ConfigError("\n".join(problems), problems=problems)
    return unique


def load_middleware(specs: Iterable[str]) -> list[Any]:
    """The ``middleware = [...]`` of each module named (after ``load_consumers`` imported them), in order."""
    found: list[Any] = []
    for spec in specs:
        name = spec.partition(":")[0]
        declared = getattr(sys.modules.get(name), "middleware", None)
        if declared is None:
            continue
        if not isinstance(declared, list | tuple):
            raise ConfigError(f"{name}.middleware must be a list of middleware, not {declared!r}")
        found += [m for m in declared if all(m is not f for f in found)]
    return found


def _load(spec: str) -> list[Consumer]:
    module_name, _, attr = spec.partition(":")
    if _looks_like_a_path(module_name):  # not imported at all: `app.handlers.py` would run app.handlers first
        raise ConfigError(_not_found(module_name, attr), module=module_name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_the_module_itself(exc, module_name):
            raise ConfigError(_not_found(module_name, attr), module=module_name) from None
        raise _import_failed(module_name, exc) from None
    except Exception as exc:  # the module's own code raised while importing
        raise _import_failed(module_name, exc) from None
    if not attr:
        return [v for v in vars(module).values() if isinstance(v, Consumer)]
    try:
        target = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{module_name} has no attribute {attr!r}", module=module_name) from None
    if isinstance(target, Consumer):
        return [target]
    if isinstance(target, list | tuple) and all(isinstance(t, Consumer) for t in target):
        return list(target)
    raise ConfigError(f"{spec} is not a @consumer (nor a list of them)", module=module_name)


def _looks_like_a_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.endswith(".py")


def _is_the_module_itself(exc: ModuleNotFoundError, module_name: str) -> bool:
    """True when what is missing is ``module_name`` (or a package above it), not something it imports."""
    missing = exc.name or ""
    return module_name == missing or module_name.startswith(missing + ".")


def _not_found(module_name: str, attr: str) -> str:
    suffix = f":{attr}" if attr else ""
    dotted = dotted_name(module_name)
    if dotted != module_name:
        return (
            f"{module_name!r} is a file path; conveyor run takes a module name: "
            f"conveyor run {dotted}{suffix} (from the directory that holds {dotted.split('.')[0]!r})"
        )
    return (
        f"no module named {module_name!r} (looked in the current directory {Path.cwd()} and on PYTHONPATH; "
        "run from the directory that holds it, or add that directory to PYTHONPATH)"
    )


def dotted_name(text: str) -> str:
    """``app/handlers.py`` -> ``app.handlers``; a name that is already dotted comes back as it is."""
    path = text.replace("\\", "/").removeprefix("./")
    if path.endswith(".py"):
        path = path[: -len(".py")]
    elif "/" not in path:
        return text
    return ".".join(part for part in path.strip("/").split("/") if part)


def _import_failed(module_name: str, exc: BaseException) -> ConfigError:
    """A ``CONFIG_ERROR`` that carries the failing module's traceback, from its own frames on."""
    tb = _user_frames(exc.__traceback__)
    frames = traceback.extract_tb(tb) if tb is not None else []
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({exc.filename}, line {exc.lineno})"
    text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    return ConfigError(
        f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{where}\n{text}",
        module=module_name,
    )


_IMPORTLIB = str(Path(importlib.__file__).parent)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip this loader's and importlib's leading frames: the first frame left is the user's module."""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        ours = filename == __file__ or filename.startswith(("<frozen importlib", _IMPORTLIB))
        if not ours:
            return tb
        tb = tb.tb_next
    return None
