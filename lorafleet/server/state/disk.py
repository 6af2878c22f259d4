"""A full data disk as one clear, recoverable condition instead of a crash.

A full disk shows up in three ways: `OSError` ENOSPC/EDQUOT from a checkpoint write, the same
wrapped in another library's error (safetensors), and SQLite's "database or disk is full".
`is_disk_full` recognises all of them so that every one becomes `DiskFull` (507) with one
message that names no server path.

SQLite cannot write anything, not even a DELETE, once the disk is completely full (its WAL must
grow), so deleting checkpoints to make room would fail exactly when it is needed. `DiskGuard`
keeps a reserve file in the data dir for that case: the first time the disk is found full the
reserve is released, so that the bookkeeping (results, deletions) still has room, and while the
disk stays full new checkpoint writes are refused before they start instead of eating that
room. Once deletions free enough space the reserve is taken back and writes are admitted again:
no restart.

Test hook (off unless `LORAFLEET_FAULT_DISK_FULL` is set, like faults.py): while the file it
names exists, the disk reports no free space, checkpoint writes are refused as on a full disk
and each database write first fails as on a full disk (then the store's remedies run). The
reliability battery uses it where a real small filesystem cannot be mounted.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from pathlib import Path

from lorafleet.server.errors import DiskFull

log = logging.getLogger(__name__)

RESERVE_NAME = ".disk-reserve"
FULL_MESSAGE = (
    "the server's data disk is full; delete checkpoints you no longer need "
    "(RestClient.delete_checkpoint) or ask the operator to free space, then retry"
)
FAULT_ENV = "LORAFLEET_FAULT_DISK_FULL"
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_FULL = 13
_CHUNK = 1 << 16


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or anything in its cause/context chain, is an out-of-space error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DiskFull):
            return True
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        if isinstance(current, sqlite3.OperationalError) and (
            getattr(current, "sqlite_errorcode", None) == _SQLITE_FULL
            or "database or disk is full" in str(current)
        ):
            return True
        # safetensors (Rust) reports the OS error only in its message
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full_error() -> DiskFull:
    return DiskFull(FULL_MESSAGE)


def injected_full() -> bool:
    """The test hook: True while the file named by `LORAFLEET_FAULT_DISK_FULL` exists (read
    at each call, one environment lookup, so a test can arm it in a running server)."""
    path = os.environ.get(FAULT_ENV)
    return path is not None and path != "" and os.path.exists(path)


class DiskGuard:
    """The data disk's state (ok / full) and the reserve that keeps bookkeeping writable."""

    def __init__(self, data_dir: Path, reserve_bytes: int):
        """`reserve_bytes` is capped at 1/16 of the filesystem, so that a small volume is not
        mostly reserve."""
        self.data_dir = data_dir
        self.path = data_dir / RESERVE_NAME
        stat = os.statvfs(data_dir)
        self.reserve_bytes = max(0, min(reserve_bytes, stat.f_blocks * stat.f_frsize // 16))
        self._lock = threading.Lock()
        self._full = False
        self.times_full = 0
        if not self._take_reserve():
            self._mark_full("at start-up")

    # ------------------------------------------------------------------ state
    @property
    def full(self) -> bool:
        with self._lock:
            return self._full

    def free_bytes(self) -> int:
        if injected_full():
            return 0
        stat = os.statvfs(self.data_dir)
        return stat.f_bavail * stat.f_frsize

    def state(self) -> str:
        """The state, "ok" or "full", rechecked (space may have been freed from outside)."""
        self.refresh()
        return "full" if self.full else "ok"

    # ------------------------------------------------------------------ transitions
    def release(self) -> bool:
        """Called when a write found the disk full: gives the reserve back to the filesystem so
        that the bookkeeping can go on; True if there was a reserve to give (a retry may now
        succeed)."""
        with self._lock:
            self._mark_full("on a write")
            try:
                self.path.unlink()
            except FileNotFoundError:
                return False
            log.warning("data disk full: released the %d-byte reserve", self.reserve_bytes)
            return True

    def refresh(self) -> bool:
        """While full: takes the reserve back once there is room for it and as much again (a
        deletion freed space), which ends the full state. Returns whether the disk is ok."""
        with self._lock:
            if not self._full:
                return True
            if self.free_bytes() < 2 * self.reserve_bytes + _CHUNK:
                return False
            if not self._take_reserve():
                return False
            self._full = False
            log.warning("data disk has room again: reserve restored, writes admitted")
            return True

    def check_room(self) -> None:
        """Before a checkpoint write: DiskFull while the disk is full, instead of a write that
        would eat the room the bookkeeping needs."""
        if injected_full():
            self.release()
        if not self.refresh():
            raise disk_full_error()

    # ------------------------------------------------------------------ the reserve file
    def _mark_full(self, when: str) -> None:
        if not self._full:
            self._full = True
            self.times_full += 1
            log.warning(
                "data disk full (%s): checkpoint writes are refused until space is freed", when
            )

    def _take_reserve(self) -> bool:
        """(Re)creates the reserve file, 0600, with incompressible bytes (a sparse or compressed
        file would reserve nothing); False when the disk has no room for it."""
        if self.reserve_bytes == 0:
            return True
        try:
            if self.path.stat().st_size == self.reserve_bytes:
                return True
            self.path.unlink()  # cut short by a crash, or another size configured
        except FileNotFoundError:
            pass
        if injected_full():
            return False
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            left = self.reserve_bytes
            while left > 0:
                left -= os.write(fd, os.urandom(min(_CHUNK, left)))
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.path.unlink()
            if exc.errno in _FULL_ERRNOS:
                return False
            raise
        os.close(fd)
        return True
