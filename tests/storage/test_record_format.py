"""The record batch format: header encoding, CRC checks and body validation."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest
from conveyor.broker.wire.record import (
    HEADER_SIZE,
    HEADER_SIZE_V2,
    MAGIC,
    MAGIC_EPOCH,
    NO_PRODUCER,
    Batch,
    check_batch,
    decode_batch,
    decode_header,
    encode_batch,
    encode_header,
    pack_records,
    unpack_records,
    validate_body,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import BatchTooLarge, InvalidRequest, MalformedFrame, SegmentCorrupt

LIMIT = 1024

records_st = st.lists(
    st.tuples(
        st.one_of(st.none(), st.binary(max_size=20), st.text(max_size=20)),
        st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)),
        st.binary(max_size=300),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=100, deadline=None)
@given(
    records=records_st,
    base=st.integers(0, 2**63),
    ts=st.integers(0, 2**62),
    pid=st.integers(-1, 2**62),
    seq=st.integers(-1, 2**31 - 1),
)
def test_batch_round_trips_through_encode_and_decode(records, base, ts, pid, seq):
    body = pack_records(records)
    batch = Batch(base, len(records), ts, body, pid, seq)

    data = encode_batch(batch)

    assert len(data) == HEADER_SIZE + len(body)
    assert decode_batch(data) == batch
    assert validate_body(body, max_message_bytes=LIMIT) == len(records)
    decoded = unpack_records(decode_batch(data).body)
    assert [r[2] for r in decoded] == [r[2] for r in records]
    assert [r[0].encode() if isinstance(r[0], str) else r[0] for r in records] == [
        r[0].encode() if isinstance(r[0], str) else r[0] for r in decoded
    ]


def test_decode_reads_a_batch_at_a_position_inside_a_buffer():
    first = encode_batch(Batch(7, 1, 1, pack_records([(None, None, b"a")])))
    second = encode_batch(Batch(8, 2, 2, pack_records([(None, None, b"b"), (b"k", None, b"c")]), 5, 0))

    batch = decode_batch(first + second, len(first))

    assert (batch.base_offset, batch.count, batch.producer_id, batch.sequence) == (8, 2, 5, 0)


def test_header_defaults_mark_a_batch_as_not_idempotent():
    header = decode_header(encode_header(0, 1, 0, b"\x91\x93\xc0\xc0\xc4\x00"))
    assert (header.producer_id, header.sequence) == (NO_PRODUCER, -1)


@pytest.mark.parametrize("position", range(HEADER_SIZE + 12))
def test_check_batch_rejects_any_flipped_byte(position):
    body = pack_records([(b"key", {"h": 1}, b"value-1"), (None, None, b"v2")])
    data = bytearray(encode_batch(Batch(3, 2, 1234, body, 9, 4)))
    base_offset_field = position < 8
    data[position] ^= 0x01

    if base_offset_field:
        # The base offset sits outside the CRC (as in Kafka): recovery checks it against the expected offset.
        assert check_batch(bytes(data)).base_offset == 3 ^ (1 << (8 * (7 - position)))
    else:
        with pytest.raises(SegmentCorrupt):
            check_batch(bytes(data))


@pytest.mark.parametrize("cut", [0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 3])
def test_check_batch_rejects_a_short_buffer(cut):
    data = encode_batch(Batch(0, 1, 0, pack_records([(None, None, b"0123456789")])))
    with pytest.raises(SegmentCorrupt):
        check_batch(data[:cut])


def test_segment_corrupt_is_a_value_error_with_a_position():
    data = bytearray(encode_batch(Batch(0, 1, 0, pack_records([(None, None, b"x")]))))
    data[-1] ^= 0xFF

    with pytest.raises(ValueError) as info:
        check_batch(bytes(data))

    assert isinstance(info.value, SegmentCorrupt)
    assert info.value.position == 0
    assert "CRC" in str(info.value)


# --- validate_body -------------------------------------------------------------------


@pytest.mark.parametrize(
    "records",
    [
        [(None, None, b"")],
        [(b"k", {"a": "b"}, b"v")],
        [("text key", None, "text value")],
        [(None, {}, b"x" * LIMIT)],
        [(None, None, b"v")] * 500,
    ],
)
def test_validate_body_accepts_records_and_returns_the_count(records):
    assert validate_body(pack_records(records), max_message_bytes=LIMIT) == len(records)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", MalformedFrame),  # no msgpack value at all
        (b"\xc1", MalformedFrame),  # a byte msgpack never uses
        (b"\x93\xc0", MalformedFrame),  # a truncated array
        (pack_records([(None, None, b"v")]) + b"\x00", MalformedFrame),  # trailing data
        (msgpack.packb({"not": "an array"}), InvalidRequest),
        (msgpack.packb(b"just bytes"), InvalidRequest),
        (msgpack.packb([]), InvalidRequest),  # an empty batch
        (msgpack.packb([[None, None]]), InvalidRequest),  # two fields, not three
        (msgpack.packb([[None, None, b"v", b"extra"]]), InvalidRequest),
        (msgpack.packb([b"not a record"]), InvalidRequest),
        (msgpack.packb([[None, None, 42]]), InvalidRequest),  # value not bytes
        (msgpack.packb([[None, None, None]]), InvalidRequest),
        (msgpack.packb([[None, None, [b"v"]]]), InvalidRequest),
        (msgpack.packb([[7, None, b"v"]]), InvalidRequest),  # key not bytes
        (msgpack.packb([[None, [1], b"v"]]), InvalidRequest),  # headers not a map
        (msgpack.packb([[None, None, b"ok"], [None, None, 1.5]]), InvalidRequest),  # one bad record among good
        (msgpack.packb([[None, {"n": 1}, b"v"]]), InvalidRequest),  # a header value that is not a string
        (msgpack.packb([[None, {1: "x"}, b"v"]]), InvalidRequest),  # a header name that is not a string
        (msgpack.packb([[None, {"a": "b"}, b"v"], [None, {"c": None}, b"v"]]), InvalidRequest),
        (b"\x91\x93\xa2\xff\xfe\xc0\xc4\x01v", InvalidRequest),  # a str key that is not UTF-8
        (b"\x91\x93\xc0\x81\xa2\xc3\x28\xa1x\xc4\x01v", InvalidRequest),  # a header name that is not UTF-8
        (b"\x91\x93\xc0\x81\xa1x\xa1\xff\xc4\x01v", InvalidRequest),  # a header value that is not UTF-8
        (b"\x91\x93\xc0\xc0\xa1\xff", InvalidRequest),  # a str value that is not UTF-8
        (b"\x91\x93\xc0\x81\x81\xa1a\xa1b\xa1x\xc4\x01v", InvalidRequest),  # a map as a header name
    ],
)
def test_validate_body_rejects(body, error):
    with pytest.raises(error):
        validate_body(body, max_message_bytes=LIMIT)


@pytest.mark.parametrize("value", [b"x" * (LIMIT + 1), "y" * (LIMIT + 1)])
def test_validate_body_rejects_a_value_over_max_message_bytes(value):
    body = pack_records([(None, None, b"small"), (None, None, value)])
    with pytest.raises(MalformedFrame):
        validate_body(body, max_message_bytes=LIMIT)


def test_validate_body_rejects_more_records_than_max_records():
    body = pack_records([(None, None, b"v")] * 11)
    assert validate_body(body, max_message_bytes=LIMIT, max_records=11) == 11
    with pytest.raises(BatchTooLarge, match="11 items"):  # the count it declares, not a malformed frame
        validate_body(body, max_message_bytes=LIMIT, max_records=10)


def test_validate_body_errors_are_the_documented_wire_errors():
    assert MalformedFrame.code == 201
    assert InvalidRequest.code == 207


# --- magic 2: the leader epoch -------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    records=records_st,
    base=st.integers(0, 2**63),
    ts=st.integers(0, 2**62),
    pid=st.integers(-1, 2**62),
    seq=st.integers(-1, 2**31 - 1),
    epoch=st.integers(0, 2**31 - 1),
)
def test_batch_of_either_magic_round_trips_with_its_epoch(records, base, ts, pid, seq, epoch):
    body = pack_records(records)
    batch = Batch(base, len(records), ts, body, pid, seq, epoch)

    data = encode_batch(batch)

    assert data[12] == (MAGIC_EPOCH if epoch else MAGIC)
    assert len(data) == (HEADER_SIZE_V2 if epoch else HEADER_SIZE) + len(body)
    assert decode_batch(data) == batch
    header = check_batch(data)
    assert (header.leader_epoch, header.size) == (epoch, len(data))


def test_no_epoch_writes_magic_1_byte_for_byte_as_before():
    body = pack_records([(b"k", None, b"v")])
    old = struct.pack(">QIBBHIIqqiI", 5, 36 + len(body), 1, 0, 0, 0, 1, 99, 7, 3, len(body))
    crc = zlib.crc32(body, zlib.crc32(old[20:]))
    expected = old[:16] + struct.pack(">I", crc) + old[20:]

    assert encode_header(5, 1, 99, body, producer_id=7, sequence=3) == expected
    assert encode_header(5, 1, 99, body, producer_id=7, sequence=3, leader_epoch=None) == expected
    assert encode_header(5, 1, 99, body, producer_id=7, sequence=3, leader_epoch=0) == expected
    assert decode_header(expected + body).leader_epoch == 0


def test_magic_2_puts_the_epoch_after_the_sequence():
    body = pack_records([(None, None, b"v")])
    data = encode_header(5, 1, 99, body, producer_id=7, sequence=3, leader_epoch=12) + body

    assert struct.unpack_from(">qiiI", data, 32) == (7, 3, 12, len(body))
    assert struct.unpack_from(">I", data, 8)[0] == len(data) - 12


@pytest.mark.parametrize("position", range(HEADER_SIZE_V2 + 12))
def test_check_batch_rejects_any_flipped_byte_of_a_magic_2_batch(position):
    body = pack_records([(b"key", {"h": "1"}, b"value-1"), (None, None, b"v2")])
    data = bytearray(encode_batch(Batch(3, 2, 1234, body, 9, 4, 77)))
    data[position] ^= 0x01

    if position < 8:
        assert check_batch(bytes(data)).base_offset == 3 ^ (1 << (8 * (7 - position)))
    else:  # the epoch (bytes 44-47) included: the CRC covers it
        with pytest.raises(SegmentCorrupt):
            check_batch(bytes(data))


@pytest.mark.parametrize("cut", [0, HEADER_SIZE, HEADER_SIZE_V2 - 1, HEADER_SIZE_V2, HEADER_SIZE_V2 + 3])
def test_check_batch_rejects_a_short_magic_2_buffer(cut):
    data = encode_batch(Batch(0, 1, 0, pack_records([(None, None, b"0123456789")]), leader_epoch=3))
    with pytest.raises(SegmentCorrupt):
        check_batch(data[:cut])


def test_unknown_magic_is_refused():
    data = bytearray(encode_batch(Batch(0, 1, 0, pack_records([(None, None, b"x")]))))
    data[12] = 3
    with pytest.raises(SegmentCorrupt, match="magic"):
        check_batch(bytes(data))
