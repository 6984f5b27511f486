"""One log segment: a ``.log`` file of record batches and its sparse ``.index``.

The index maps an offset to a file position every ``index_interval`` bytes,
so finding a batch is a bisect plus a short forward scan. Index entries are
buffered and written when the log syncs: the index is a hint that recovery
rebuilds, the ``.log`` file is the truth.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from broker import fsio
from broker.errors import ConveyorError, SegmentCorrupt
from broker.fsutil import storage_errors, write_all
from broker.record import HEADER_SIZE, LENGTH_PREFIX, Batch, BatchHeader, check_batch, decode_header

log = logging.getLogger(__name__)

INDEX_ENTRY = struct.Struct(">II")  # offset relative to the segment base, file position
READ_CHUNK = 1 << 20
_LENGTH = struct.Struct(">I")  # batch_length, at byte 8 of a header


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
        if self._torn:  # an earlier failed write left bytes past ``size``: they go before anything is added
            with storage_errors(str(self.path)):
                fsio.ftruncate(self._fd, position)
            self._torn = False
        try:
            with storage_errors(str(self.path)):
                written = fsio.writev(self._fd, (header, body))
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
            fsio.ftruncate(self._fd, position)
        except OSError:
            self._torn = True  # O_APPEND would write after the partial bytes: the next append cuts them first
            log.exception("%s: could not cut a partial write at %d", self.path, position)

    def _maybe_index(self, offset: int, position: int, size: int) -> None:
        if self._bytes_since_index >= self.index_interval:
            self._index_offsets.append(offset)
            self._index_positions.append(position)
            self._index_pending += INDEX_ENTRY.pack(offset - self.base_offset, position)
            self._bytes_since_index = 0
        self._bytes_since_index += size

    def sync(self) -> None:
        with storage_errors(str(self.path)):
            fsio.fdatasync(self._fd)
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
            fsio.ftruncate(self._fd, size)
        self.size = size
        self._torn = False
        self.next_offset = next_offset
        keep = bisect_right(self._index_positions, size - 1)
        del self._index_offsets[keep:]
        del self._index_positions[keep:]
        self._bytes_since_index = self.index_interval
        try:
            with storage_errors(str(self.path)):
                fsio.fdatasync(self._fd)
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
        head = os.pread(self._fd, HEADER_SIZE, position)
        want = READ_CHUNK
        if len(head) == HEADER_SIZE:
            want = max(want, _peek_size(head, 0))
        return os.pread(self._fd, min(want, self.size - position), position)

    def walk_headers(self, start: int = 0, end: int | None = None) -> list[BatchHeader]:
        """Headers of trusted batches in ``[start, end)``, one small read each."""
        end = self.size if end is None else end
        out: list[BatchHeader] = []
        while start < end:
            header = decode_header(os.pread(self._fd, HEADER_SIZE, start))
            out.append(header)
            start += header.size
        return out

    def recover(self, *, sealed: bool) -> int:
        """Check this segment on open; return the bytes cut from a torn tail.

        A sealed segment must be whole: any bad batch raises ``SegmentCorrupt``.
        The newest segment is scanned from its last trustworthy index entry and
        truncated at the first batch that is incomplete or fails its CRC.
        """
        start_pos, start_offset = (0, None) if sealed else self._trusted_index_start()
        prefix = self._trusted_prefix(start_pos, start_offset)
        if prefix is None:  # the headers do not chain up to the index entry: check the whole file
            start_pos, start_offset, prefix = 0, None, []
        result = self.scan(start_pos, start_offset)
        if result.error is not None and sealed:
            raise result.error
        self._adopt_scan(prefix, result)
        self.recovered_headers = [h for h, _p in prefix] + [h for h, _p in result.headers]
        cut = self.size - result.valid_size
        if cut:
            log.warning("%s: truncating torn tail, %d bytes after offset %d", self.path, cut, result.next_offset)
            self.truncate(result.valid_size, result.next_offset)
        return cut

    def _trusted_index_start(self) -> tuple[int, int | None]:
        self._load_index()
        while self._index_offsets:
            offset, position = self._index_offsets[-1], self._index_positions[-1]
            try:
                head = check_batch(self._pread_from(position))
                if head.base_offset == offset:
                    return position, offset
            except SegmentCorrupt:
                pass
            self._index_offsets.pop()
            self._index_positions.pop()
        return 0, None

    def _trusted_prefix(self, end: int, end_offset: int | None) -> list[tuple[BatchHeader, int]] | None:
        """Headers and positions before ``end``, or None if they do not chain up to ``end_offset``.

        Not CRC-checked (the data was synced before the index entry was written),
        but walked, so the rebuilt index never keeps a stale or garbage entry.
        """
        if end_offset is None:
            return []
        try:
            headers = self.walk_headers(0, end)
        except SegmentCorrupt:
            return None
        out: list[tuple[BatchHeader, int]] = []
        position, expected = 0, self.base_offset
        for header in headers:
            if header.base_offset != expected or header.count < 1:
                return None
            out.append((header, position))
            position += header.size
            expected = header.next_offset
        return out if (position, expected) == (end, end_offset) else None

    def _adopt_scan(self, prefix: list[tuple[BatchHeader, int]], result: ScanResult) -> None:
        self._index_offsets, self._index_positions = array("q"), array("q")
        self._bytes_since_index = self.index_interval
        for header, position in [*prefix, *result.headers]:
            self._maybe_index(header.base_offset, position, header.size)
        self.next_offset = result.next_offset
        if result.headers:
            self.last_timestamp_ms = result.last_timestamp_ms
        self._rewrite_index()

    def _load_index(self) -> None:
        try:
            data = self.index_path.read_bytes()
        except FileNotFoundError:
            data = b""
        offsets, positions = array("q"), array("q")
        for i in range(len(data) // INDEX_ENTRY.size):
            rel, pos = INDEX_ENTRY.unpack_from(data, i * INDEX_ENTRY.size)
            if pos >= self.size or (positions and pos <= positions[-1]):
                break  # an index entry past the data, or out of order: stop trusting it
            offsets.append(self.base_offset + rel)
            positions.append(pos)
        self._index_offsets, self._index_positions = offsets, positions

    # --- reading -------------------------------------------------------------

    def read(self, offset: int, *, max_bytes: int, max_batches: int = 1 << 30) -> list[Batch]:
        """Batches from the one holding ``offset``, up to ``max_bytes`` (at least one).

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
                    body = buf[rel + HEADER_SIZE : rel + size]
                    batches.append(
                        Batch(
                            header.base_offset,
                            header.count,
                            header.timestamp_ms,
                            body,
                            header.producer_id,
                            header.sequence,
                        )
                    )
                    taken += size
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
            fsio.unlink(path, missing_ok=True)


def _peek_size(buf: bytes | memoryview, pos: int) -> int:
    """Whole size of the batch at ``pos`` from its header, or the header size."""
    if len(buf) - pos < HEADER_SIZE:
        return HEADER_SIZE
    try:
        return decode_header(buf, pos).size
    except SegmentCorrupt:
        return HEADER_SIZE
