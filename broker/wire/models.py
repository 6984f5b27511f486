"""Typed values: pydantic models, dataclasses and msgspec Structs to and from plain msgpack data.

A producer sends a model as the plain map it dumps to (``to_builtins``), so a
consumer in any language reads an ordinary msgpack map; a typed handler gets
the map validated back into its model (``from_value``). pydantic and msgspec
are optional: this module never imports them, it looks them up in
``sys.modules`` (a model of theirs exists only once its library is imported),
so ``import conveyor`` pulls in neither.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import functools
import sys
import types
import typing
import uuid
from typing import Any

PYDANTIC = "pydantic"
MSGSPEC = "msgspec"
DATACLASS = "dataclass"


class ModelError(ValueError):
    """A value that does not fit its model; the message says which model and what is wrong."""

    def __init__(self, model: Any, detail: str) -> None:
        self.model = model
        self.detail = detail
        super().__init__(f"{getattr(model, '__qualname__', model)}: {detail}")


def model_kind(tp: Any) -> str | None:
    """``"pydantic"``, ``"msgspec"``, ``"dataclass"`` for a model class, else None."""
    if not isinstance(tp, type):
        return None
    return _class_kind(tp)


@functools.cache
def _class_kind(tp: type) -> str | None:
    """Once per class: a pydantic model or a Struct exists only once its library was imported."""
    if dataclasses.is_dataclass(tp):
        return DATACLASS
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(tp, pydantic.BaseModel):
        return PYDANTIC
    msgspec = sys.modules.get("msgspec")
    if msgspec is not None and issubclass(tp, msgspec.Struct):
        return MSGSPEC
    return None


def model_name(value: Any) -> str | None:
    """``module.Qualname`` of a model instance (what the content type names), else None."""
    cls = type(value)
    if model_kind(cls) is None:
        return None
    return f"{cls.__module__}.{cls.__qualname__}"


def to_builtins(value: Any) -> Any:
    """A model instance as plain data msgpack encodes (maps, lists, str, numbers, bytes); other values as given.

    Also msgpack's ``default=`` hook: it is called for what msgpack cannot encode, so models nested in
    plain data (a dataclass in a dict, a datetime in a dataclass) encode too.
    """
    kind = model_kind(type(value))
    if kind == PYDANTIC:
        return value.model_dump(mode="json")
    if kind == MSGSPEC:
        return sys.modules["msgspec"].to_builtins(value, builtin_types=(bytes, bytearray))
    if kind == DATACLASS:
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # nested: encoded in turn
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"cannot encode {type(value).__name__}: send bytes, str, msgpack data or a model")


def from_value(model: Any, value: Any) -> Any:
    """``value`` (decoded plain data) validated into ``model``, or ``ModelError`` saying why not."""
    kind = model_kind(model)
    if kind == PYDANTIC:
        pydantic = sys.modules["pydantic"]
        try:
            return model.model_validate(value)
        except pydantic.ValidationError as exc:
            raise ModelError(model, str(exc)) from exc
    if kind == MSGSPEC:
        msgspec = sys.modules["msgspec"]
        try:
            return msgspec.convert(value, model, strict=False)
        except msgspec.ValidationError as exc:
            raise ModelError(model, str(exc)) from exc
    if kind == DATACLASS:
        return _dataclass(model, value, "$", model)
    raise TypeError(f"{model!r} is not a pydantic model, a dataclass or a msgspec Struct")


# --- dataclasses: no validation library, so a small converter of their fields' types ---------


@functools.cache
def _fields(cls: Any) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, hint, required)`` of each init field, worked out once per class (resolving hints is slow)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a hint that does not resolve: take the field's value as it is
        hints = {}
    return tuple(
        (
            field.name,
            hints.get(field.name, Any),
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING,
        )
        for field in dataclasses.fields(cls)
        if field.init
    )


def _dataclass(cls: Any, value: Any, where: str, root: Any) -> Any:
    if not isinstance(value, dict):
        raise ModelError(root, f"{where}: expected a map, got {type(value).__name__}")
    kwargs = {}
    for name, hint, required in _fields(cls):
        if name in value:
            kwargs[name] = _convert(hint, value[name], f"{where}.{name}", root)
        elif required:
            raise ModelError(root, f"{where}.{name}: field required")
    # Fields the model does not have are ignored (as pydantic and msgspec do): a producer may add one first.
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the dataclass's own __post_init__ checks
        raise ModelError(root, f"{where}: {exc}") from exc


_SCALARS: dict[Any, tuple[type, ...]] = {str: (str,), bytes: (bytes,), bool: (bool,)}
# Exact value types a scalar hint takes as they are (an int for a float field becomes a float; a bool is not an int).
_EXACT: dict[Any, tuple[type, ...]] = {int: (int,), float: (float, int), str: (str,), bytes: (bytes,), bool: (bool,)}
_PARSED: dict[Any, Any] = {
    datetime.datetime: datetime.datetime.fromisoformat,
    datetime.date: datetime.date.fromisoformat,
    datetime.time: datetime.time.fromisoformat,
    uuid.UUID: uuid.UUID,
    decimal.Decimal: decimal.Decimal,
}


def _convert(tp: Any, value: Any, where: str, root: Any) -> Any:
    """``value`` as type ``tp`` (a field's hint), converting nested models; ``ModelError`` when it does not fit."""
    if type(tp) is type and type(value) in _EXACT.get(tp, ()):  # the common case, first: a plain field
        return float(value) if tp is float else value
    if tp is Any or tp is object or isinstance(tp, typing.TypeVar):
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return _union(args, value, where, root)
    if origin is typing.Literal:
        if value not in args:
            raise ModelError(root, f"{where}: expected one of {list(args)!r}, got {value!r}")
        return value
    if origin is typing.Annotated:
        return _convert(args[0], value, where, root)
    if origin in (list, set, frozenset, tuple) or tp in (list, set, frozenset, tuple):
        return _sequence(origin or tp, args, value, where, root)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ModelError(root, f"{where}: expected a map, got {type(value).__name__}")
        k, v = args or (Any, Any)
        return {_convert(k, a, where, root): _convert(v, b, f"{where}[{a!r}]", root) for a, b in value.items()}
    if not isinstance(tp, type):
        return value  # NewType, a forward reference that did not resolve, ...: taken as it is
    return _scalar(tp, value, where, root)


def _union(args: tuple[Any, ...], value: Any, where: str, root: Any) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, where, root)
        except ModelError as exc:
            errors.append(exc.detail)
    raise ModelError(root, "; ".join(errors) or f"{where}: expected None, got {type(value).__name__}")


def _sequence(kind: Any, args: tuple[Any, ...], value: Any, where: str, root: Any) -> Any:
    if not isinstance(value, list | tuple):
        raise ModelError(root, f"{where}: expected an array, got {type(value).__name__}")
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ModelError(root, f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]", root) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    item = args[0] if args else Any
    return kind(_convert(item, v, f"{where}[{i}]", root) for i, v in enumerate(value))


def _scalar(tp: type, value: Any, where: str, root: Any) -> Any:
    if model_kind(tp) == DATACLASS:
        return _dataclass(tp, value, where, root)
    if model_kind(tp) is not None:
        try:
            return from_value(tp, value)
        except ModelError as exc:
            raise ModelError(root, f"{where}: {exc.detail}") from exc
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in _SCALARS and isinstance(value, _SCALARS[tp]):
        return value
    if issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError as exc:
            raise ModelError(root, f"{where}: {exc}") from exc
    for parsed, parse in _PARSED.items():
        if tp is parsed and isinstance(value, str | int | float):
            try:
                return parse(value) if tp is not decimal.Decimal else parse(str(value))
            except (ValueError, decimal.InvalidOperation) as exc:
                raise ModelError(root, f"{where}: {exc}") from exc
    if tp in (int, float, str, bytes, bool) or tp in _PARSED or not isinstance(value, tp):
        raise ModelError(root, f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r:.60}")
    return value
