"""File-system helpers whose only job is durability."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from pathlib import Path

from conveyor.broker.log import syscalls

from conveyor.errors import StorageFull, StorageIOError, TooManyOpenFiles


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a create, rename or unlink inside ``path`` survive power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syscalls.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and its missing parents so that a power cut keeps them.

    A new directory's entry lives in its parent: each created level is
    followed by an fsync of its parent. The parent of ``path`` is synced even
    when ``path`` already existed, in case a crash came between an earlier
    mkdir and its sync.
    """
    target = Path(path)
    missing = []
    while not target.is_dir():
        missing.append(target)
        if target.parent == target:
            break
        target = target.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            if not directory.is_dir():
                raise
        fsync_dir(directory.parent)
    if not missing:
        fsync_dir(Path(path).parent)


TEMP_SUFFIX = ".tmp"
_temp_counter = itertools.count()


def temp_name(target: Path) -> Path:
    """A temp file beside ``target`` that no other write shares (process, thread and a counter in its name).

    One fixed name let two writers of one file (the topic creator's thread and
    an alter on the loop) truncate, rename away or interleave each other's temp
    file: a lost setting, a FileNotFoundError, or a torn file.
    """
    unique = f"{os.getpid()}.{threading.get_ident()}.{next(_temp_counter)}"
    return target.with_name(f".{target.name}.{unique}{TEMP_SUFFIX}")


def is_temp_file(path: Path) -> bool:
    """A temp file ``atomic_write`` left behind (a crash between its create and its rename)."""
    return path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)


def remove_temp_files(folder: Path) -> list[Path]:
    """Delete the temp files a crash left in ``folder`` (at startup, before anything writes there)."""
    removed = []
    for path in folder.iterdir():
        if is_temp_file(path) and path.is_file():
            syscalls.unlink(path, missing_ok=True)  # through the layer: a test's power-loss model forgets its inode
            removed.append(path)
    return removed


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file.

    Write a temp file of its own beside it, fsync it, rename over, fsync the
    directory. A failed write removes its temp file.
    """
    target = Path(path)
    tmp = temp_name(target)
    with storage_errors(str(target)):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, data)
                syscalls.fsync(fd)
            finally:
                os.close(fd)
            syscalls.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                syscalls.unlink(tmp, missing_ok=True)
            raise
        fsync_dir(target.parent)


def free_name(folder: Path, name: str) -> Path:
    """``folder/name``, or ``name.1``, ``name.2``... if an earlier move took it (nothing is overwritten)."""
    candidate, n = folder / name, 0
    while candidate.exists():
        n += 1
        candidate = folder / f"{name}.{n}"
    return candidate


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = syscalls.write(fd, view)
        view = view[written:]


class storage_errors:  # lower case: used as a context manager, reads like a statement
    """Map OSError to the storage errors producers understand."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"no space left writing {self.what}", path=self.what) from exc
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise TooManyOpenFiles(
                    f"out of file descriptors opening {self.what}; retry once topics or connections close",
                    path=self.what,
                ) from exc
            raise StorageIOError(f"{exc.strerror} writing {self.what}", path=self.what, errno=exc.errno) from exc
