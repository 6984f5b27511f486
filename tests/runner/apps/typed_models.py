"""The models of tests/runner/test_typed.py, one per kind: imported by the runner's app and by the test."""

from __future__ import annotations

import dataclasses

import msgspec
import pydantic


class PydanticOrder(pydantic.BaseModel):
    id: int
    total: float
    lines: list[str] = []


@dataclasses.dataclass
class DataclassOrder:
    id: int
    total: float
    lines: list[str] = dataclasses.field(default_factory=list)


class StructOrder(msgspec.Struct):
    id: int
    total: float
    lines: list[str] = []
