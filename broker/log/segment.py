"""One log segment: a ``.log`` file of record batches and its sparse ``.index``.

The index maps an offset to a file position every ``index_interval`` bytes,
so finding a batch is a bisect plus a short forward scan. Index entries are
buffered and written when the log syncs: the index is a hint that recovery
rebuilds, the ``.log`` file is the truth.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conveyor.broker.log import syscalls
from conveyor.broker.log.durable import storage_errors, write_all
from conveyor.broker.wire.record import (
    CRC_START,
    HEADER,
    HEADER_SIZE,
    HEADER_V2,
    LENGTH_PREFIX,
    MAX_HEADER_SIZE,
    Batch,
    BatchHeader,
    check_batch,
    decode_header,
)

from conveyor.errors import ConveyorError, SegmentCorrupt

log = logging.getLogger(__name__)

INDEX_ENTRY = struct.Struct(">II")  # offset relative to the segment base, file position
READ_CHUNK = 1 << 20
_LENGTH = struct.Struct(">I")  # batch_length, at byte 8 of a header
_MAGIC_AND_RESERVED = re.compile(b"[\x01\x02]\x00\x00\x00")  # bytes 12-15 of every header (magic 1 or 2)


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


@dataclass(slots=True)
class ScanResult:
    valid_size: int
    next_offset: int
    last_timestamp_ms: int
    error: SegmentCorrupt | None
    headers: list[tuple[BatchHeader, int]]


class Segment:
    def __init__(self, directory: Path, base_offset: int, *, index_interval: int = 4096) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.path = directory / f"{segment_name(base_offset)}.log"
        self.index_path = directory / f"{segment_name(base_offset)}.index"
        self.index_interval = index_interval
        self.next_offset = base_offset
        self.last_timestamp_ms = 0
        self._index_offsets = array("q")
        self._index_positions = array("q")
        self._index_pending = bytearray()
        self._bytes_since_index = index_interval  # the first batch is always indexed
        self.recovered_headers: list[BatchHeader] = []
        self._torn = False  # a failed write's partial bytes are still past ``size``
        with storage_errors(str(self.path)):
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self._fd).st_size

    # --- writing -------------------------------------------------------------

    def append(self, header: bytes, body: bytes, base_offset: int, count: int, timestamp_ms: int) -> None:
        """One ``writev`` per batch: header and body, never copied together."""
        position = self.size
        self.cut_torn_tail()  # O_APPEND would write after them
        try:
            with storage_errors(str(self.path)):
                written = syscalls.writev(self._fd, (header, body))
                if written != len(header) + len(body):  # a short write: finish it or fail loudly
                    write_all(self._fd, (header + body)[written:])
        except Exception:
            self._undo_partial_write(position)
            raise
        self.size += len(header) + len(body)
        self.next_offset = base_offset + count
        self.last_timestamp_ms = timestamp_ms
        self._maybe_index(base_offset, position, len(header) + len(body))

    def _undo_partial_write(self, position: int) -> None:
        """Never leave half a batch behind a failed write."""
        try:
            syscalls.ftruncate(self._fd, position)
        except OSError:
            self._torn = True  # O_APPEND would write after the partial bytes: the next append cuts them first
            log.exception("%s: could not cut a partial write at %d", self.path, position)

    def cut_torn_tail(self) -> None:
        """Bytes a failed write left past ``size`` go before the file grows or is synced.

        Recovery cuts a torn tail only in the newest segment: a sealed segment must be whole, and
        a roll syncs the segment it seals, so the log cuts before every sync too.
        """
        if self._torn:
            with storage_errors(str(self.path)):
                syscalls.ftruncate(self._fd, self.size)
            self._torn = False

    def _maybe_index(self, offset: int, position: int, size: int) -> None:
        if self._bytes_since_index >= self.index_interval:
            self._index_offsets.append(offset)
            self._index_positions.append(position)
            self._index_pending += INDEX_ENTRY.pack(offset - self.base_offset, position)
            self._bytes_since_index = 0
        self._bytes_since_index += size

    def sync(self) -> None:
        with storage_errors(str(self.path)):
            syscalls.fdatasync(self._fd)
        self.flush_index()

    def flush_index(self) -> None:
        if not self._index_pending:
            return
        with storage_errors(str(self.index_path)):
            fd = os.open(self.index_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                write_all(fd, self._index_pending)
            finally:
                os.close(fd)
        self._index_pending.clear()

    def truncate(self, size: int, next_offset: int) -> None:
        """Cut the file at ``size`` (a batch boundary) and forget index past it.

        Only the cut must succeed. What it removes was never confirmed (a torn tail, or batches
        a failed fsync left in doubt), and the index is a hint: if syncing the cut or rewriting
        the index fails, the next successful sync makes the new size durable, and recovery
        handles a tail that comes back after a power cut.
        """
        with storage_errors(str(self.path)):
            syscalls.ftruncate(self._fd, size)
        self.size = size
        self._torn = False
        self.next_offset = next_offset
        keep = bisect_right(self._index_positions, size - 1)
        del self._index_offsets[keep:]
        del self._index_positions[keep:]
        self._bytes_since_index = self.index_interval
        try:
            with storage_errors(str(self.path)):
                syscalls.fdatasync(self._fd)
            self._rewrite_index()
        except ConveyorError as exc:
            self._index_pending.clear()  # it may name cut batches; the index is rebuilt on open
            log.warning("%s: cut at %d, not yet durable: %s", self.path, size, exc)

    def _rewrite_index(self) -> None:
        data = b"".join(
            INDEX_ENTRY.pack(o - self.base_offset, p)
            for o, p in zip(self._index_offsets, self._index_positions, strict=True)
        )
        with storage_errors(str(self.index_path)):
            fd = os.open(self.index_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        self._index_pending.clear()

    # --- opening -------------------------------------------------------------

    def scan(self, start_position: int = 0, start_offset: int | None = None) -> ScanResult:
        """Walk batches from ``start_position``; stop at the first bad one."""
        expected = self.base_offset if start_offset is None else start_offset
        position, last_ts = start_position, 0
        headers: list[tuple[BatchHeader, int]] = []
        error: SegmentCorrupt | None = None
        buf, buf_start = b"", position
        while position < self.size:
            rel = position - buf_start
            if len(buf) - rel < HEADER_SIZE or len(buf) - rel < _peek_size(buf, rel):
                buf, buf_start = self._pread_from(position), position
                rel = 0
            try:
                header = check_batch(buf, rel)
            except SegmentCorrupt as exc:
                error = SegmentCorrupt(
                    f"{self.path}: {exc.message} at position {position}", path=str(self.path), position=position
                )
                break
            if header.base_offset != expected or header.count < 1:
                error = SegmentCorrupt(
                    f"{self.path}: offset {header.base_offset} where {expected} was expected at position {position}",
                    path=str(self.path),
                    position=position,
                )
                break
            headers.append((header, position))
            position += header.size
            expected = header.next_offset
            last_ts = header.timestamp_ms
        return ScanResult(position, expected, last_ts, error, headers)

    def _pread_from(self, position: int) -> bytes:
        """Read enough from ``position`` to hold at least the next whole batch."""
        head = os.pread(self._fd, MAX_HEADER_SIZE, position)
        want = READ_CHUNK
        if len(head) >= HEADER_SIZE:
            want = max(want, _peek_size(head, 0))
        return os.pread(self._fd, min(want, self.size - position), position)

    def walk_headers(self, start: int = 0, end: int | None = None) -> list[BatchHeader]:
        """Headers of trusted batches in ``[start, end)``, one small read each."""
        end = self.size if end is None else end
        out: list[BatchHeader] = []
        while start < end:
            header = decode_header(os.pread(self._fd, MAX_HEADER_SIZE, start))
            out.append(header)
            start += header.size
        return out

    def recover(self, *, sealed: bool, before_cut: Callable[[int, int], None] | None = None) -> int:
        """Check this segment on open; return the bytes cut from a torn tail.

        Every batch is CRC-checked, the newest segment's too: its index is not
        trusted (a bad batch before its last entry would otherwise be found only
        when a consumer reaches it). A sealed segment must be whole: any bad
        batch raises ``SegmentCorrupt``. In the newest segment a bad batch is a
        torn tail only if no whole, CRC-valid batch lies at or after it (a write
        cut short leaves nothing valid behind it); then the tail is cut. If one
        does, the bad batch is corruption of confirmed data: ``SegmentCorrupt``
        names the file and position and nothing is cut.
        """
        result = self.scan()
        if result.error is not None:
            if sealed:
                raise result.error
            self._refuse_if_corrupt(result)
        self._adopt_scan(result)
        self.recovered_headers = [h for h, _p in result.headers]
        cut = self.size - result.valid_size
        if cut:
            if before_cut is not None:  # the caller may keep the bytes (evidence says they were confirmed)
                before_cut(result.valid_size, result.next_offset)
            log.warning("%s: truncating torn tail, %d bytes after offset %d", self.path, cut, result.next_offset)
            self.truncate(result.valid_size, result.next_offset)
        return cut

    def _refuse_if_corrupt(self, result: ScanResult) -> None:
        assert result.error is not None
        bad = result.valid_size
        found = self.find_valid_batch(bad, result.next_offset)
        if found is None:
            return
        position, header = found
        end_offset = self._highest_offset_from(position, header)
        raise SegmentCorrupt(
            f"{result.error.message}, but a whole valid batch follows at position {position} (offset "
            f"{header.base_offset}; valid batches reach offset {end_offset}): this is corruption of stored data, "
            "not a torn write, and nothing was cut",
            path=str(self.path),
            position=bad,
            valid_position=position,
            end_offset=end_offset,
        )

    def find_valid_batch(self, start: int, expected: int) -> tuple[int, BatchHeader] | None:
        """The first whole, CRC-valid batch at or after ``start`` that can belong to this segment.

        At ``start`` itself any whole batch counts (its offset or the unchecked header bytes are what is
        damaged). Further on, a candidate is found by its magic and reserved bytes and must carry an offset
        a real later batch could have (``expected`` up to one offset per byte skipped): a batch that a
        producer sent inside a message body does not make a torn tail look like corruption.
        """
        whole = self._whole_by_crc(start, expected)
        if whole is not None:
            return start, whole
        window = 8 * READ_CHUNK
        position = start + 1
        while position + HEADER_SIZE <= self.size:
            data = os.pread(self._fd, min(window + HEADER_SIZE, self.size - position), position)
            for found in _MAGIC_AND_RESERVED.finditer(data, 12):
                candidate = position + found.start() - 12
                header = self._valid_at(candidate)
                if header is not None and expected <= header.base_offset <= expected + (candidate - start):
                    return candidate, header
            position += window
        return None

    def _valid_at(self, position: int) -> BatchHeader | None:
        try:
            return check_batch(self._pread_from(position))
        except SegmentCorrupt:
            return None

    def _whole_by_crc(self, position: int, expected: int) -> BatchHeader | None:
        """The batch at ``position`` if the bytes its CRC covers (from byte 20, sized by the body length
        inside them) are all there and match; its offset is taken as ``expected`` (the stored one is not
        covered: it may be what is damaged). The magic byte is not covered either: both layouts are tried."""
        head = os.pread(self._fd, MAX_HEADER_SIZE, position)
        if len(head) >= HEADER_SIZE:
            _b, _l, _m, _a, _r, crc, count, ts, pid, seq, body_length = HEADER.unpack_from(head)
            found = self._crc_matches(position, HEADER_SIZE, body_length, count, crc)
            if found:
                return BatchHeader(expected, count, ts, pid, seq, body_length, crc)
        if len(head) >= MAX_HEADER_SIZE:
            _b, _l, _m, _a, _r, crc, count, ts, pid, seq, epoch, body_length = HEADER_V2.unpack_from(head)
            found = self._crc_matches(position, MAX_HEADER_SIZE, body_length, count, crc)
            if found:
                return BatchHeader(expected, count, ts, pid, seq, body_length, crc, epoch, MAX_HEADER_SIZE)
        return None

    def _crc_matches(self, position: int, header_size: int, body_length: int, count: int, crc: int) -> bool:
        end = position + header_size + body_length
        if end > self.size or count < 1:
            return False
        return zlib.crc32(os.pread(self._fd, end - position - CRC_START, position + CRC_START)) == crc

    def _highest_offset_from(self, position: int, header: BatchHeader) -> int:
        """The end of the valid batches from ``position`` on, skipping damage: offsets a quarantine must not reuse."""
        highest = header.next_offset
        position += header.size
        while position < self.size:
            result = self.scan(position, highest)
            highest = max(highest, result.next_offset)
            if result.error is None:
                break
            found = self.find_valid_batch(result.valid_size, result.next_offset)
            if found is None:
                break
            position, header = found
            highest = max(highest, header.next_offset)
            position += header.size
        return highest

    def _adopt_scan(self, result: ScanResult) -> None:
        self._index_offsets, self._index_positions = array("q"), array("q")
        self._bytes_since_index = self.index_interval
        for header, position in result.headers:
            self._maybe_index(header.base_offset, position, header.size)
        self.next_offset = result.next_offset
        if result.headers:
            self.last_timestamp_ms = result.last_timestamp_ms
        self._rewrite_index()

    # --- reading -------------------------------------------------------------

    def read(self, offset: int, *, max_bytes: int, max_batches: int = 1 << 30, until: int | None = None) -> list[Batch]:
        """Batches from the one holding ``offset``, up to ``max_bytes`` (at least one), and no further than
        the one holding ``until - 1`` (what a reader with a few credits needs: not a MiB of small batches).

        Every batch read from disk is CRC-checked: a corrupt one is never served.
        """
        i = bisect_right(self._index_offsets, offset) - 1
        position = self._index_positions[i] if i >= 0 else 0
        expected = self._index_offsets[i] if i >= 0 else self.base_offset
        batches: list[Batch] = []
        taken = 0
        while position < self.size and len(batches) < max_batches:
            buf = self._pread_from(position)
            rel, end = 0, len(buf)
            while rel < end and len(batches) < max_batches:
                # A cheap look at the length field; the header is decoded once, below.
                left = end - rel
                if rel and (left < HEADER_SIZE or left < LENGTH_PREFIX + _LENGTH.unpack_from(buf, rel + 8)[0]):
                    break  # incomplete here: re-read from it (at rel 0, check_batch says what is wrong)
                try:
                    header = check_batch(buf, rel)
                    if header.base_offset != expected:  # the base offset is outside the CRC
                        raise SegmentCorrupt(f"offset {header.base_offset} where {expected} was expected")
                except SegmentCorrupt as exc:
                    if batches:  # serve the good batches before it; a read at the bad one raises
                        return batches
                    raise SegmentCorrupt(
                        f"{self.path}: {exc.message} at position {position + rel}",
                        path=str(self.path),
                        position=position + rel,
                    ) from None
                size = header.size
                if header.next_offset > offset:
                    if batches and taken + size > max_bytes:
                        return batches
                    body = buf[rel + header.header_size : rel + size]
                    batches.append(
                        Batch(
                            header.base_offset,
                            header.count,
                            header.timestamp_ms,
                            body,
                            header.producer_id,
                            header.sequence,
                            header.leader_epoch,
                        )
                    )
                    taken += size
                    if until is not None and header.next_offset >= until:
                        return batches
                rel += size
                expected = header.next_offset
            if rel == 0:
                if batches:
                    return batches
                raise SegmentCorrupt(
                    f"{self.path}: unreadable batch at position {position}", path=str(self.path), position=position
                )
            position += rel
            if taken >= max_bytes:
                break
        return batches

    def timestamp_position(self, timestamp_ms: int) -> int | None:
        """The first offset in this segment whose batch time is >= ``timestamp_ms``."""
        for header, _pos in self.scan().headers:
            if header.timestamp_ms >= timestamp_ms:
                return header.base_offset
        return None

    # --- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        if self._fd >= 0:
            self.flush_index()
            os.close(self._fd)
            self._fd = -1

    def delete(self) -> None:
        self.close()
        for path in (self.path, self.index_path):
            syscalls.unlink(path, missing_ok=True)


def _peek_size(buf: bytes | memoryview, pos: int) -> int:
    """Whole size of the batch at ``pos`` from its header, or the largest header size."""
    if len(buf) - pos < HEADER_SIZE:
        return MAX_HEADER_SIZE
    try:
        return decode_header(buf, pos).size
    except SegmentCorrupt:
        return MAX_HEADER_SIZE
