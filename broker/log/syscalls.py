"""The file I/O under the log, the offsets and the metadata, with a fault layer.

Every durability-relevant call of ``segment.py``, ``file_log.py`` and
``durable.py`` (write, writev, fsync, fdatasync, ftruncate, rename/replace,
and the unlink of segments)
goes through this module. Normally each function is the ``os`` call and one
``if``. Two test aids can be switched on, by environment variable (read when
the module is imported, so a broker subprocess picks them up) or by
``configure()``:

``CONVEYOR_FSIO_JOURNAL=/path``
    Append one JSON line per durable event to ``/path``: the size (and inode)
    of a file each time an fsync/fdatasync of it succeeds, the listing of a
    directory each time it is fsynced, the range a *failed* fsync left in
    doubt, and every ftruncate. Files replaced by a rename are hard-linked
    into ``/path.shadow/`` first. ``simulate_power_loss()`` then turns a data
    directory (after a kill -9) into what a power cut would have left.

``CONVEYOR_FSIO_FAULTS=SPEC`` and/or ``CONVEYOR_FSIO_CONTROL=/path``
    Inject faults. ``SPEC`` is a comma-separated list of ``KIND`` (always),
    ``KIND=N`` (the next N calls), ``KIND_after=K`` (let K calls through
    first) and ``match=TEXT`` (only paths containing TEXT); ``#`` starts a
    comment. Kinds:
    ``fsync_eio`` (fsync/fdatasync of a file), ``dirsync_eio``,
    ``write_eio``, ``write_enospc``, ``short_write`` (write half, return the
    short count), ``torn_write`` (write half, then fail with EIO),
    ``ftruncate_eio``, ``rename_eio``. The control file holds a SPEC too; it
    is re-read whenever it changes (an empty or missing file: no faults), so
    a test can switch faults on and off while the broker runs.

Each injected fault is logged (``fsio: injected ...``) and journaled.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("conveyor.fsio")

ENV_JOURNAL = "CONVEYOR_FSIO_JOURNAL"
ENV_FAULTS = "CONVEYOR_FSIO_FAULTS"
ENV_CONTROL = "CONVEYOR_FSIO_CONTROL"

KINDS = (
    "fsync_eio",
    "dirsync_eio",
    "write_eio",
    "write_enospc",
    "short_write",
    "torn_write",
    "ftruncate_eio",
    "rename_eio",
)
ALWAYS = -1

Buffers = Sequence[bytes | bytearray | memoryview]


@dataclass
class Fault:
    remaining: int = ALWAYS  # injections left (-1: no limit)
    skip: int = 0  # calls let through before the first injection


@dataclass
class FaultPlan:
    faults: dict[str, Fault] = field(default_factory=dict)
    match: str = ""

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        plan = cls()
        lines = (line.partition("#")[0] for line in spec.splitlines())  # '#' starts a comment
        for item in filter(None, (part.strip() for line in lines for part in line.split(","))):
            name, _, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if name == "match":
                plan.match = value
                continue
            after = name.endswith("_after")
            kind = name[: -len("_after")] if after else name
            if kind not in KINDS:
                raise ValueError(f"unknown fsio fault {kind!r} (known: {', '.join(KINDS)})")
            fault = plan.faults.setdefault(kind, Fault())
            if after:
                fault.skip = int(value)
            elif value not in ("", "always"):
                fault.remaining = int(value)
        return plan

    def fire(self, kind: str, path: str) -> bool:
        fault = self.faults.get(kind)
        if fault is None or fault.remaining == 0 or (self.match and self.match not in path):
            return False
        if fault.skip > 0:
            fault.skip -= 1
            return False
        if fault.remaining > 0:
            fault.remaining -= 1
        return True


class _Layer:
    """The active test aids: a journal, a fault plan, a control file."""

    def __init__(self, journal: str | None, faults: str | None, control: str | None) -> None:
        self.journal_fd = -1
        self.shadow: Path | None = None
        if journal:
            self.journal_fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            end_torn_line(journal, self.journal_fd)
            self.shadow = Path(f"{journal}.shadow")
            self.shadow.mkdir(exist_ok=True)
        self.static = FaultPlan.parse(faults or "")
        self.control = control
        self._stamp: tuple[int, int, int] | None = None
        self.dynamic = FaultPlan()
        self.injected: dict[str, int] = {}
        self.lock = threading.Lock()  # the broker writes offsets files on a thread of their own

    # --- bookkeeping --------------------------------------------------------------

    def record(self, **event: Any) -> None:
        if self.journal_fd >= 0:
            os.write(self.journal_fd, json.dumps(event, separators=(",", ":")).encode() + b"\n")

    def _refresh(self) -> None:
        if not self.control:
            return
        try:
            st = os.stat(self.control)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        text = ""
        try:
            text = Path(self.control).read_text() if stamp != (0, 0, 0) else ""
            self.dynamic = FaultPlan.parse(text)
        except (OSError, ValueError) as exc:
            log.error("fsio: bad control file %s: %s", self.control, exc)
            self.dynamic = FaultPlan()
        log.warning("fsio: faults now %r", text.strip())

    def fire(self, kind: str, path: str) -> bool:
        with self.lock:
            self._refresh()
            if not (self.static.fire(kind, path) or self.dynamic.fire(kind, path)):
                return False
            self.injected[kind] = self.injected.get(kind, 0) + 1
        log.warning("fsio: injected %s on %s", kind, path)
        self.record(op="fault", kind=kind, path=path)
        return True

    # --- the operations -------------------------------------------------------------

    def write(self, fd: int, buffers: Buffers, single: bool) -> int:
        path = fd_path(fd)
        for kind, code in (("write_eio", errno.EIO), ("write_enospc", errno.ENOSPC)):
            if self.fire(kind, path):
                raise OSError(code, os.strerror(code), path)
        data = b"".join(buffers)
        if len(data) > 1:
            if self.fire("short_write", path):
                return os.write(fd, data[: len(data) // 2])
            if self.fire("torn_write", path):
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return os.write(fd, buffers[0]) if single else os.writev(fd, buffers)

    def sync(self, fd: int, data_only: bool) -> None:
        path = fd_path(fd)
        st = os.fstat(fd)
        directory = stat.S_ISDIR(st.st_mode)
        if self.fire("dirsync_eio" if directory else "fsync_eio", path):
            if not directory:
                # As Linux does after a failed writeback: what this sync should have written is
                # in doubt (the page cache may be marked clean without it being on disk).
                self.record(op="fsync_failed", path=path, ino=st.st_ino, size=st.st_size)
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        (os.fdatasync if data_only else os.fsync)(fd)
        if directory:
            entries = {entry.name: entry.inode() for entry in os.scandir(path)}
            self.record(op="dirsync", path=path, entries=entries)
        else:
            self.record(op="sync", path=path, ino=st.st_ino, size=st.st_size)

    def ftruncate(self, fd: int, length: int) -> None:
        path = fd_path(fd)
        if self.fire("ftruncate_eio", path):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        os.ftruncate(fd, length)
        self.record(op="truncate", path=path, ino=os.fstat(fd).st_ino, size=length)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        try:  # the inode may be reused by the next file created: what the journal says of it ends here
            self.record(op="unlink", path=os.fspath(path), ino=os.stat(path).st_ino)
        except FileNotFoundError:
            pass
        os.unlink(path)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str], replace: bool) -> None:
        if self.fire("rename_eio", os.fspath(dst)):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(dst))
        if self.shadow is not None:
            try:  # keep the file being replaced: until the directory is synced, a power cut brings it back
                os.link(dst, self.shadow / str(os.stat(dst).st_ino))
            except OSError:
                pass
        (os.replace if replace else os.rename)(src, dst)


_layer: _Layer | None = None


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd:{fd}"


def configure(*, journal: str | None = None, faults: str | None = None, control: str | None = None) -> None:
    """Switch the test aids on (any argument given) or off (none)."""
    global _layer
    if _layer is not None and _layer.journal_fd >= 0:
        os.close(_layer.journal_fd)
    _layer = _Layer(journal, faults, control) if (journal or faults or control) else None


def configure_from_env(environ: Any = os.environ) -> None:
    configure(journal=environ.get(ENV_JOURNAL), faults=environ.get(ENV_FAULTS), control=environ.get(ENV_CONTROL))
    if _layer is not None:
        log.warning(
            "fsio test layer on: journal=%s faults=%r control=%s",
            environ.get(ENV_JOURNAL),
            environ.get(ENV_FAULTS),
            environ.get(ENV_CONTROL),
        )


def injected() -> dict[str, int]:
    """Faults injected so far in this process, by kind."""
    return dict(_layer.injected) if _layer is not None else {}


# --- the calls the storage code makes (``os`` is looked up each time: tests monkeypatch it) ---


def writev(fd: int, buffers: Buffers) -> int:
    if _layer is None:
        return os.writev(fd, buffers)
    return _layer.write(fd, buffers, single=False)


def write(fd: int, data: bytes | bytearray | memoryview) -> int:
    if _layer is None:
        return os.write(fd, data)
    return _layer.write(fd, (data,), single=True)


def fdatasync(fd: int) -> None:
    if _layer is None:
        return os.fdatasync(fd)
    return _layer.sync(fd, data_only=True)


def fsync(fd: int) -> None:
    if _layer is None:
        return os.fsync(fd)
    return _layer.sync(fd, data_only=False)


def ftruncate(fd: int, length: int) -> None:
    if _layer is None:
        return os.ftruncate(fd, length)
    return _layer.ftruncate(fd, length)


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    if _layer is None:
        return os.replace(src, dst)
    return _layer.rename(src, dst, replace=True)


def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    if _layer is None:
        return os.rename(src, dst)
    return _layer.rename(src, dst, replace=False)


def unlink(path: str | os.PathLike[str], *, missing_ok: bool = False) -> None:
    try:
        if _layer is None:
            os.unlink(path)
        else:
            _layer.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


# --- power loss ----------------------------------------------------------------------------


@dataclass
class PowerLoss:
    """What ``simulate_power_loss`` did."""

    truncated: dict[str, int] = field(default_factory=dict)  # path -> bytes dropped
    removed: list[str] = field(default_factory=list)  # created, never made durable in their directory
    restored: list[str] = field(default_factory=list)  # renamed over, rename never made durable
    holes: dict[str, int] = field(default_factory=dict)  # path -> bytes zeroed (failed fsync)

    @property
    def dropped_bytes(self) -> int:
        return sum(self.truncated.values())


def end_torn_line(journal: str | os.PathLike[str], fd: int) -> None:
    """A kill can cut the journal's last line: the next writer's first event must not be glued to it."""
    with open(journal, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            os.write(fd, b"\n")


def read_journal(journal: str | os.PathLike[str]) -> list[dict[str, Any]]:
    events = []
    for line in Path(journal).read_bytes().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill; the next writer started a line of its own
    return events


def simulate_power_loss(root: str | os.PathLike[str], journal: str | os.PathLike[str]) -> PowerLoss:
    """Turn ``root`` (its writer was killed) into what a power cut would have left.

    The model, from the journal: a file keeps the bytes it had at its last
    successful fsync/fdatasync (appends since are dropped; a file never
    synced is empty); a range a failed fsync left in doubt, and that no
    truncate removed since, reads as zeros (Linux may have marked those
    pages clean without writing them: "fsyncgate"); a name created in a
    directory after that directory's last fsync disappears, and a file
    renamed over an older one after it comes back as the older one.
    Directories never fsynced through this layer are trusted as they are,
    and a truncate below the last synced size is assumed durable. Files are
    known by inode; an unlink through this layer ends what is known of one
    (a file deleted otherwise, and a new file reusing its inode, would
    inherit its synced size). Each cut ends by recording what it left as
    durable, so cuts in a row start from the disk, not from the journal's past.
    """
    root = Path(root).resolve()
    report = PowerLoss()
    # Keyed by inode: a temp file fsynced, then renamed, keeps its data under the new name.
    synced: dict[int, int] = {}
    doubt: dict[int, list[tuple[int, int]]] = {}
    listings: dict[str, dict[str, int]] = {}
    for event in read_journal(journal):
        op = event["op"]
        if op == "dirsync":
            listings[event["path"]] = event["entries"]
            continue
        if op not in ("sync", "fsync_failed", "truncate", "unlink", "baseline"):
            continue
        if op == "baseline":  # an earlier cut: what it left is the durable state, whatever came before
            synced = {int(ino): size for ino, size in event["files"].items()}
            doubt, listings = {}, dict(event["dirs"])
            continue
        key = event["ino"]
        if op == "unlink":  # a file created later may get this inode: it starts with a clean slate
            synced.pop(key, None)
            doubt.pop(key, None)
        elif op == "sync":
            synced[key] = event["size"]
        elif op == "fsync_failed":
            doubt.setdefault(key, []).append((synced.get(key, 0), event["size"]))
        else:  # a truncate cuts what it removes out of every range in doubt
            doubt[key] = [(a, min(b, event["size"])) for a, b in doubt.get(key, []) if a < event["size"]]
    shadow = Path(f"{journal}.shadow")
    # Names: undo creations and renames the directory never made durable.
    for directory, entries in sorted(listings.items(), key=lambda kv: -len(kv[0])):
        path = Path(directory)
        if not path.is_dir() or not path.resolve().is_relative_to(root):
            continue
        for entry in list(os.scandir(path)):
            durable_ino = entries.get(entry.name)
            if durable_ino == entry.inode():
                continue
            old = shadow / str(durable_ino)
            if durable_ino is not None and old.exists():
                shutil.copyfile(old, entry.path)
                report.restored.append(entry.path)
            else:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                report.removed.append(entry.path)
    # Contents: cut every file back to its last synced size, zero what is in doubt.
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            file = os.path.join(dirpath, name)
            if file in report.restored:
                continue
            st = os.stat(file)
            key = st.st_ino
            keep = min(st.st_size, synced.get(key, 0))
            if keep < st.st_size:
                os.truncate(file, keep)
                report.truncated[file] = st.st_size - keep
            zeroed = 0
            with open(file, "r+b") as f:
                for a, b in doubt.get(key, []):
                    b = min(b, keep)
                    if a < b:
                        f.seek(a)
                        f.write(bytes(b - a))
                        zeroed += b - a
            if zeroed:
                report.holes[file] = zeroed
    _record_baseline(root, journal, shadow, listings)
    return report


def _record_baseline(root: Path, journal: str | os.PathLike[str], shadow: Path, listings: dict[str, Any]) -> None:
    """After a cut, what is on disk is durable: the next cut starts from it, not from the journal's past.

    Without this, a file the cut brought back (old bytes under the new file's inode) would be cut
    again to the new file's synced size, and an inode freed and reused would inherit a stale size.
    """
    files = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            files[str(st.st_ino)] = st.st_size
    dirs = {
        directory: {entry.name: entry.inode() for entry in os.scandir(directory)}
        for directory in listings
        if os.path.isdir(directory)
    }
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
    try:
        end_torn_line(journal, fd)
        os.write(fd, json.dumps({"op": "baseline", "files": files, "dirs": dirs}).encode() + b"\n")
    finally:
        os.close(fd)
    if shadow.is_dir():  # the old files it kept are not coming back any more
        for old in shadow.iterdir():
            old.unlink()


configure_from_env()
