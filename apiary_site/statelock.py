"""One daemon per state directory: `apiary run` holds an exclusive
`flock` on `.apiary/daemon.lock` for as long as it lives, and writes its pid
and start time into it for the one it turns away. The kernel drops the lock
when the process ends, however it ends, so a crashed daemon leaves nothing
stale behind. `apiary restore` takes the same lock so that no daemon starts
on a database being replaced.

The descriptor is not inherited (Python opens files close-on-exec), so the
listener and the steps a daemon starts never keep its lock alive.
"""

import datetime as dt
import fcntl
import os
from pathlib import Path

from workers import private

NAME = "daemon.lock"


class StateLocked(Exception):
    """Another process holds the state directory; the message names it."""


class StateLock:
    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, state_dir: Path, *, purpose: str = "apiary run") -> "StateLock":
        path = private.private_dir(state_dir) / NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, private.FILE_MODE)
        private.tighten(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not written its pid yet"
            os.close(fd)
            raise StateLocked(f"{state_dir} is in use by {holder} (it holds {path}); stop it first") from None
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{purpose} pid {os.getpid()}, started {started}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1
