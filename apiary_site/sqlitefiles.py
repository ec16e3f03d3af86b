"""Copies of the SQLite queue database for `apiary backup` and `apiary restore`.

A copy is made with SQLite's online backup API in one step: the whole copy
reads one snapshot (a read transaction, which in WAL mode never blocks the
daemon's writers), so it holds exactly the transactions committed before it
began — every finish acknowledged by then, and none half. The copy is written
beside its destination at 0600, switched out of WAL mode (one self-contained
file), checked with `PRAGMA integrity_check`, and only then renamed into place.
"""

import contextlib
import os
import sqlite3
from pathlib import Path

from workers import private

HEADER = b"SQLite format 3\x00"
APIARY_TABLES = ("django_migrations", "queue_job", "queue_attempt")
BUSY_TIMEOUT = 30.0  # seconds `replace` waits for another connection to let go of the old database's WAL


class CopyError(Exception):
    pass


class InUse(CopyError):
    """Another process has the database open, so its WAL cannot be folded in first."""


def problem_with(path: Path) -> str | None:
    """Why `path` is not a sound Apiary database, or None."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(len(HEADER))
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    if header != HEADER:
        return "not a SQLite database"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            try:
                verdict = [row[0] for row in db.execute("PRAGMA integrity_check")]
            except sqlite3.DatabaseError as exc:  # damage the check itself trips over
                verdict = [str(exc)]
    except sqlite3.DatabaseError as exc:
        return f"SQLite cannot read it ({exc})"
    if verdict != ["ok"]:
        return "it fails PRAGMA integrity_check: " + "; ".join(verdict[:5])
    missing = [t for t in APIARY_TABLES if t not in tables]
    if missing:
        return f"not an Apiary database (no {', '.join(missing)} table)"
    return None


def snapshot(source: Path, target: Path) -> None:
    """A consistent copy of `source` at `target` (which must not exist), 0600."""
    draft = target.with_name(f".{target.name}.partial-{os.getpid()}")
    private.private_file(draft)
    try:
        with contextlib.closing(sqlite3.connect(source, timeout=30)) as src, contextlib.closing(
            sqlite3.connect(draft)
        ) as copy:
            src.backup(copy)  # pages=-1: every page in one step, from one snapshot
            copy.execute("PRAGMA journal_mode=DELETE")
        problem = problem_with(draft)
        if problem:
            raise CopyError(f"the copy of {source} is unsound: {problem}")
        with open(draft, "rb+") as handle:
            os.fsync(handle.fileno())
        os.link(draft, target)  # atomic, and never over an existing file
        _fsync_dir(target.parent)
    finally:
        draft.unlink(missing_ok=True)
        for suffix in private.SQLITE_COMPANIONS:
            Path(f"{draft}{suffix}").unlink(missing_ok=True)


def replace(database: Path, backup: Path) -> Path | None:
    """Put a copy of `backup` in place of `database` atomically; the previous
    database is kept beside it (returned). No process may have it open."""
    incoming = database.with_name(f".{database.name}.restoring-{os.getpid()}")
    incoming.unlink(missing_ok=True)
    snapshot(backup, incoming)
    kept = None
    try:
        if database.exists() and database.stat().st_size:  # not the empty file of a new state directory
            _fold_wal(database)  # everything of the old one is in its main file, or nothing is touched
            kept = _free_name(database.with_name(database.name + ".before-restore"))
            os.link(database, kept)
    except BaseException:
        incoming.unlink(missing_ok=True)
        raise
    # The old database's -wal/-shm must go before the new file arrives: SQLite
    # would replay a stale WAL into it.
    for suffix in private.SQLITE_COMPANIONS:
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    os.replace(incoming, database)
    _fsync_dir(database.parent)
    return kept


def _fold_wal(database: Path) -> None:
    """Checkpoint `database`'s WAL into its main file and truncate it. InUse
    when another connection keeps it from completing (SQLite answers busy):
    the kept copy would then miss what is only in the WAL, which is deleted next."""
    with contextlib.closing(sqlite3.connect(database, timeout=BUSY_TIMEOUT)) as old:
        busy, _log, _done = old.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy:
        raise InUse(
            f"another process has {database} open (its WAL could not be checkpointed within "
            f"{BUSY_TIMEOUT:g}s): stop it (any apiary command, not only `apiary run`) and retry"
        )


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
