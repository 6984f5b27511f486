"""The error hierarchy: stable codes, the code table and retriable flags."""

from __future__ import annotations

import pytest

from conveyor import errors
from conveyor.errors import (
    ALL_ERRORS,
    ConveyorError,
    InvalidName,
    LogError,
    OffsetOutOfRange,
    SegmentCorrupt,
    error_for_code,
    is_retriable,
)

RETRIABLE = {
    "StorageFull",
    "StorageIOError",
    "NotSubscribed",
    "BrokerUnavailable",
    "RequestTimeout",
    "ShuttingDown",
    "BufferFull",
    "TooManyOpenFiles",
    "RateLimited",
    "ClusterError",
    "NotLeader",
    "NotEnoughReplicas",
    "FencedLeaderEpoch",
    "UnknownLeaderEpoch",
    "EtcdError",
}


def test_every_error_class_in_the_module_is_in_the_table():
    defined = {obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, ConveyorError)}
    assert defined == set(ALL_ERRORS)


def test_codes_are_unique():
    codes = [cls.code for cls in ALL_ERRORS]
    assert len(codes) == len(set(codes))


def test_names_are_unique_upper_case_constants():
    names = [cls.name for cls in ALL_ERRORS]
    assert len(names) == len(set(names))
    assert all(name.isupper() and " " not in name for name in names)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_error_for_code_round_trips(cls):
    assert error_for_code(cls.code) is cls


def test_unknown_code_maps_to_the_base_class():
    assert error_for_code(999_999) is ConveyorError


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_retriable_flags(cls):
    assert cls.retriable is (cls.__name__ in RETRIABLE)
    assert is_retriable(cls("x")) is (cls.__name__ in RETRIABLE)


def test_is_retriable_is_false_for_foreign_exceptions():
    assert not is_retriable(RuntimeError("boom"))


def test_fields_become_attributes_and_the_message_carries_the_name():
    exc = OffsetOutOfRange("offset 9 is out of range", topic="t", offset=9)
    assert (exc.topic, exc.offset) == ("t", 9)
    assert exc.fields == {"topic": "t", "offset": 9}
    assert str(exc) == "[OFFSET_OUT_OF_RANGE] offset 9 is out of range"


def test_segment_corrupt_is_both_a_value_error_and_a_log_error_and_takes_fields():
    exc = SegmentCorrupt("CRC mismatch", path="/x/0.log", position=96)
    assert isinstance(exc, ValueError)
    assert isinstance(exc, LogError)
    assert (exc.code, exc.path, exc.position) == (102, "/x/0.log", 96)
    assert str(exc) == "[SEGMENT_CORRUPT] CRC mismatch"


def test_a_field_named_like_a_class_attribute_does_not_rename_the_error():
    exc = InvalidName("bad name", name="a/b")
    assert (exc.name, exc.code) == ("INVALID_NAME", 206)
    assert exc.fields["name"] == "a/b"
    assert str(exc) == "[INVALID_NAME] bad name"


def test_an_empty_message_falls_back_to_the_name():
    assert str(OffsetOutOfRange()) == "[OFFSET_OUT_OF_RANGE] OFFSET_OUT_OF_RANGE"
