"""Models to and from plain msgpack data (broker/wire/models.py) and their content type (broker/wire/values.py)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import re
import subprocess
import sys
import uuid

import msgspec
import pydantic
import pytest
from conveyor.broker.wire.models import ModelError, from_value, model_kind, to_builtins
from conveyor.broker.wire.values import CONTENT_TYPE, MSGPACK, decode_value, encode_value, make_record


class Size(enum.Enum):
    SMALL = "s"
    LARGE = "l"


@dataclasses.dataclass
class Line:
    sku: str
    quantity: int = 1


@dataclasses.dataclass
class Order:
    id: int
    total: float
    lines: list[Line]
    placed: datetime.datetime
    ref: uuid.UUID
    size: Size = Size.SMALL
    note: str | None = None
    tags: dict[str, int] = dataclasses.field(default_factory=dict)


class PydanticOrder(pydantic.BaseModel):
    id: int
    placed: datetime.datetime
    lines: list[str] = []


class StructOrder(msgspec.Struct):
    id: int
    placed: datetime.datetime
    data: bytes = b""


PLACED = datetime.datetime(2026, 11, 27, 10, 30, tzinfo=datetime.UTC)
REF = str(uuid.UUID(int=1))


def round_trip(value):
    body, content_type = encode_value(value)
    return decode_value(body, content_type), content_type


@pytest.mark.parametrize(
    "value",
    [
        Order(1, 9.5, [Line("a"), Line("b", 3)], PLACED, uuid.UUID(int=7), Size.LARGE, "gift", {"x": 1}),
        PydanticOrder(id=1, placed=PLACED, lines=["a"]),
        StructOrder(id=1, placed=PLACED, data=b"\x00\xff"),
    ],
    ids=["dataclass", "pydantic", "msgspec"],
)
def test_a_model_goes_out_as_a_plain_map_and_comes_back_equal(value):
    plain, content_type = round_trip(value)
    assert isinstance(plain, dict) and plain["id"] == 1
    assert content_type == f"{MSGPACK}; model={__name__}.{type(value).__qualname__}"
    assert from_value(type(value), plain) == value


def test_model_kind_names_each_kind_and_nothing_else():
    assert [model_kind(t) for t in (Order, PydanticOrder, StructOrder)] == ["dataclass", "pydantic", "msgspec"]
    assert [model_kind(t) for t in (dict, int, Order(1, 1, [], PLACED, uuid.UUID(int=0)), list[Order])] == [None] * 4


def test_plain_values_keep_their_content_type_and_models_nested_in_them_encode():
    assert round_trip({"id": 1}) == ({"id": 1}, MSGPACK)
    assert round_trip([Line("a")]) == ([{"sku": "a", "quantity": 1}], MSGPACK)
    assert round_trip({"at": PLACED, "size": Size.SMALL}) == ({"at": PLACED.isoformat(), "size": "s"}, MSGPACK)
    key, headers, _body = make_record(Line("a"), "k", {"trace": "1"})
    assert key == "k" and headers == {"trace": "1", CONTENT_TYPE: f"{MSGPACK}; model={__name__}.Line"}
    with pytest.raises(TypeError, match="cannot encode object"):
        encode_value(object())


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"id": "x", "total": 1, "lines": [], "placed": "2026-01-01", "ref": REF}, "$.id: expected int"),
        ({"id": 1, "lines": [], "placed": "2026-01-01", "ref": REF}, "$.total: field required"),
        ({"id": 1, "total": 1, "lines": [{}], "placed": "2026-01-01", "ref": "r"}, "$.lines[0].sku: field required"),
        ({"id": 1, "total": 1, "lines": [], "placed": "soon", "ref": REF}, "$.placed: Invalid"),
        ({"id": 1, "total": 1, "lines": [], "placed": "2026-01-01", "ref": "r", "size": "m"}, "badly formed"),
        (b"raw", "$: expected a map, got bytes"),
    ],
)
def test_a_dataclass_that_does_not_fit_says_where(value, error):
    with pytest.raises(ModelError, match=re.escape(error)) as caught:
        from_value(Order, value)
    assert str(caught.value).startswith("Order: ")


def test_a_dataclass_ignores_fields_it_does_not_have_and_converts_what_it_can():
    value = {"id": 1, "total": 2, "lines": [], "placed": "2026-11-27T10:30:00+00:00", "ref": str(uuid.UUID(int=3))}
    order = from_value(Order, {**value, "added_later": True, "size": "l"})
    assert order == Order(1, 2.0, [], PLACED, uuid.UUID(int=3), Size.LARGE)
    assert isinstance(order.total, float)


def test_pydantic_and_msgspec_errors_are_model_errors():
    with pytest.raises(ModelError, match="PydanticOrder: 1 validation error"):
        from_value(PydanticOrder, {"id": 1})
    with pytest.raises(ModelError, match="StructOrder: Object missing required field `placed`"):
        from_value(StructOrder, {"id": 1})
    with pytest.raises(TypeError, match="not a pydantic model"):
        from_value(dict, {})
    assert to_builtins(Size.LARGE) == "l"


def test_importing_conveyor_imports_neither_pydantic_nor_msgspec():
    code = (
        "import sys, conveyor, conveyor.broker.client.producer, conveyor.consumers.runner, conveyor.consumers.typed;"
        "from conveyor import Producer, Message, consumer;"
        "print(sorted(m for m in ('pydantic', 'msgspec') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
