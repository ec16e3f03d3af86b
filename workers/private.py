"""State only its owner may read: `.apiary/` is 0700; the databases (with
SQLite's -wal and -shm), worker histories, logs and the secret key are 0600.

Each helper creates with the private mode from the start (no window in which
another user could open the file) and tightens what already exists with a
wider mode, saying so in one warning line that names the path and its old
mode. SQLite creates a database's -wal and -shm with the database file's
permissions, so a database file made here keeps its companions private too.
"""

import logging
import os
from pathlib import Path

log = logging.getLogger("apiary.files")

DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def tighten(path: Path) -> bool:
    """Drop group and other permissions from an existing `path`; True when it had any."""
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return False
    return _narrowed(path, mode, path.chmod)


def _narrowed(path, mode: int, chmod) -> bool:
    """`chmod` to `mode` less group and other permissions, with the warning, when it has any."""
    if not mode & 0o077:
        return False
    chmod(mode & ~0o077)
    log.warning("%s was mode %04o (readable by other users); now %04o", path, mode, mode & ~0o077)
    return True


def private_dir(path: Path) -> Path:
    """`path` and any missing parents made 0700 (umask aside); an existing `path` tightened."""
    made_private_dir(path)
    return Path(path)


def made_private_dir(path: Path) -> bool:
    """private_dir's work; True when `path` was made now (so it is empty), False when it was there."""
    path = Path(path)
    try:
        # mkdir first: for a directory that exists (every step's, after the first) that is one
        # call and the tighten's stat, not a stat of every parent.
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        tighten(path)
        return False
    except FileNotFoundError:
        private_dir(path.parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # another thread made it meanwhile
            tighten(path)
            return False
    os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask
    return True


def private_file(path: Path) -> Path:
    """`path` created empty at 0600 if missing, else tightened."""
    path = Path(path)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    except FileExistsError:
        tighten(path)
    return path


def private_sqlite(path: Path) -> Path:
    """A SQLite database file (created empty if missing: SQLite takes an empty
    file as a new database) and its companions, all 0600, before SQLite opens it."""
    private_file(path)
    for suffix in SQLITE_COMPANIONS:
        tighten(Path(f"{path}{suffix}"))
    return path


def open_private(path: Path, mode: str = "ab", **kwargs):
    """`open(path, mode)` for a file that must be 0600 (logs): created so, or tightened."""
    fd = open_private_fd(path, append="a" in mode)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def open_private_fd(path: Path, *, append: bool) -> int:
    """open_private's descriptor, for writing (appending, or from empty), without a file object."""
    return _open_narrowed(path, os.O_CREAT | os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))


def write_private(path: Path, data: bytes) -> None:
    """`path` holding `data` alone, 0600 as open_private makes it: written by the descriptor,
    without the file objects (and their isatty and seek calls) that a file written whole needs not."""
    fd = _open_narrowed(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to the descriptor (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_narrowed(path: Path, flags: int) -> int:
    fd = os.open(path, flags, FILE_MODE)  # the mode applies only if it is created here
    try:
        # By the descriptor: the file just opened, with no second lookup of its path.
        _narrowed(path, os.fstat(fd).st_mode & 0o7777, lambda narrow: os.fchmod(fd, narrow))
    except BaseException:
        os.close(fd)
        raise
    return fd


def tighten_tree(root: Path) -> int:
    """Group and other permissions dropped from everything under `root`,
    reported in one warning line; returns how many were changed."""
    changed = []
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(directory, name)
            try:
                mode = path.lstat().st_mode & 0o7777
            except FileNotFoundError:
                continue
            if mode & 0o077 and not path.is_symlink():
                path.chmod(mode & ~0o077)
                changed.append((path, mode))
    if changed:
        path, mode = changed[0]
        log.warning(
            "%d file(s) under %s were readable by other users (e.g. %s, mode %04o); now owner-only",
            len(changed), root, path, mode,
        )  # fmt: skip
    return len(changed)
