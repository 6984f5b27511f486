"""Finding consumers: ``module`` (every @consumer in it) or ``module:attr``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable

from broker.errors import ConfigError
from decorators.consumer import Consumer


def load_consumers(specs: Iterable[str]) -> list[Consumer]:
    found: list[Consumer] = []
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: the current directory's modules
    for spec in specs:
        found += _load(spec)
    unique = list({id(c): c for c in found}.values())
    if not unique:
        raise ConfigError(f"no @consumer found in {', '.join(specs)}")
    return unique


def _load(spec: str) -> list[Consumer]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}", module=module_name) from exc
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
