"""The data directory's lock: one process at a time reads or writes a data directory.

Two brokers on one directory both append at the same end offset and each cut
the other's batches as torn tails at the next start: confirmed messages are
lost. So whatever opens a data directory (the broker, any offline tool) takes
an exclusive ``flock`` before it reads or recovers anything, as Kafka does
with its ``.lock`` file:

- on ``DATA_DIR/.lock``, which also holds the owner's pid for the error message;
- on the directory itself, so deleting ``.lock`` (by hand, by a cleanup job)
  does not let a second process in.

``flock`` locks die with their process: a broker killed with -9 leaves no stale
lock behind. Two opens in one process conflict too (locks belong to open file
descriptions), so a test that simulates a crash must ``release()`` by hand.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from conveyor.broker.log.durable import make_dirs

from conveyor.errors import DataDirLocked, StorageIOError

LOCK_FILE = ".lock"


class DataDirLock:
    """An exclusive lock on a data directory, held until ``release()`` (or the process ends)."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE
        self._fds: list[int] = []
        try:
            make_dirs(self.data_dir)
        except OSError as exc:
            raise StorageIOError(f"{exc.strerror} creating {self.data_dir}", path=str(self.data_dir)) from None
        try:
            # The directory first: it cannot be deleted from under a running broker as the file can.
            self._lock(os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY))
            self._lock(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644))
            self._write_pid(self._fds[-1])
        except BaseException:
            self.release()
            raise

    def _lock(self, fd: int) -> None:
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise StorageIOError(f"{exc.strerror} locking {self.path}", path=str(self.path)) from None
            holder = holder_pid(self.data_dir)
            who = f"pid {holder}" if holder is not None else "another process"
            raise DataDirLocked(
                f"{self.data_dir} is in use by {who} (lock {self.path})",
                path=str(self.data_dir),
                pid=holder,
            ) from None

    @staticmethod
    def _write_pid(fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Let another process in. The file stays: deleting it would race with the next owner's open."""
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def holder_pid(data_dir: str | os.PathLike[str]) -> int | None:
    """The pid holding ``data_dir``'s lock: from ``.lock``, or from ``/proc/locks`` if the file is gone."""
    directory = Path(data_dir)
    try:
        text = (directory / LOCK_FILE).read_text().strip()
        if text.isdigit():
            return int(text)
    except (OSError, UnicodeDecodeError):
        pass
    return _pid_from_proc_locks(directory)


def _pid_from_proc_locks(directory: Path) -> int | None:
    """Linux lists every lock with its holder and the inode it is on."""
    try:
        st = directory.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    inode = f":{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->" after the number)
        if "FLOCK" in parts and len(parts) >= 6:
            i = parts.index("FLOCK")
            pid, device_inode = parts[i + 3], parts[i + 4]
            if device_inode.endswith(inode) and pid.isdigit():
                return int(pid)
    return None
