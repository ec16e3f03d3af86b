"""One thread per process that brings other processes' wakes to this
process's notifier, and ticks it (timers, the fallback re-check).

PostgreSQL: one connection of its own, `LISTEN apiary_wakeup`, waiting on its
socket until a notification comes or the notifier's next tick is due. SQLite:
`PRAGMA data_version` on a connection of its own changes whenever another
connection commits; only then does it read the new `queue_wakeup` rows. It
looks when the database's WAL file is written (inotify, Linux: every commit
of every connection writes to it), and otherwise sleeps until the next tick
is due: no poll while nothing is written. A commit is visible some time after
its write (the fsync comes between), so after a write it looks every
POLL until the version moves, for at most SETTLE, and never sooner than
POLL after the write: under a steady stream of commits it looks POLL apart. Where there is no inotify
(another OS, a database not in WAL mode) it looks every POLL while a claim
waits and every IDLE_POLL otherwise. Either way the watcher holds no
transaction open (autocommit), so it never pins an old snapshot or blocks a
WAL checkpoint. Every wait is at most IDLE_POLL, which bounds how late a
timer published meanwhile fires. A broken connection is reopened after a
pause; meanwhile the fallback keeps waiters re-checking.
"""

import ctypes
import ctypes.util
import logging
import os
import select
import sqlite3
import threading
import time

from django.db import connection

from . import emit, notifier
from .notifier import Wake

log = logging.getLogger("apiary.queue")

POLL = 0.01  # SQLite: seconds between data_version checks while a commit settles, or claims wait without inotify
IDLE_POLL = 0.25  # the longest wait: a timer published meanwhile fires at most this late; the rows stay
SETTLE = 0.2  # SQLite: how long after a WAL write the watcher looks for the commit to become visible
RETRY = 1.0  # seconds before reopening a broken watcher connection

_stopping = threading.Event()
_started: dict[int, threading.Event] = {}  # pid → set once its watcher listens (a forked child starts its own)
_start_lock = threading.Lock()


def ensure_running() -> threading.Event:
    """Start this process's watcher unless it runs already; the event is set
    once it hears other processes' wakes."""
    pid = os.getpid()
    if pid in _started:
        return _started[pid]
    with _start_lock:
        if pid in _started:
            return _started[pid]
        listening = threading.Event()
        settings = dict(connection.settings_dict)
        if connection.vendor == "postgresql":
            params = connection.get_connection_params()
            target = _postgres_loop
        else:
            params = settings["NAME"]
            target = _sqlite_loop
        thread = threading.Thread(target=target, args=(params, listening), name="apiary-wakeup-watch", daemon=True)
        thread.start()
        _started[pid] = listening
        return listening


def stop(timeout: float = 5.0) -> None:
    """Stop this process's watcher and close its connection (test teardown)."""
    with _start_lock:
        listening = _started.pop(os.getpid(), None)
        if listening is None:
            return
        _stopping.set()
    for thread in threading.enumerate():
        if thread.name == "apiary-wakeup-watch":
            thread.join(timeout)
    _stopping.clear()


def _deliver(message: str) -> None:
    try:
        sender, wake = emit.decode(message)
    except (ValueError, TypeError):
        log.warning("wake-up watcher: ignored a malformed message")
        return
    if sender != emit.origin():
        try:
            notifier.publish(wake)
        except Exception:  # noqa: BLE001 - one bad wake must not stop the watcher
            log.exception("wake-up watcher: could not deliver a wake")


def _sqlite_loop(
    path: str, listening: threading.Event, *, stopping: threading.Event | None = None, written=None, deliver=None
) -> None:
    # stopping, written, deliver: a test's own, for a loop it runs on its own (the process's
    # watcher may run meanwhile, and must go on with the module's).
    stopping = _stopping if stopping is None else stopping
    written = _written if written is None else written
    deliver = _deliver if deliver is None else deliver
    if not path or path == ":memory:" or "mode=memory" in str(path):
        # No file other processes could write: only this process's own wakes exist.
        listening.set()
        while not stopping.is_set():
            notifier.tick()
            stopping.wait(_until_tick())
        return
    last_id = None  # kept across reopens: the rows written meanwhile are read, not skipped
    while not stopping.is_set():
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5)
            writes = None
            try:
                if last_id is None:
                    last_id = db.execute("SELECT COALESCE(MAX(id), 0) FROM queue_wakeup").fetchone()[0]
                writes = _wal_writes(path)  # after that read: in WAL mode the file exists now, and stays while we are open
                _caught_up()
                listening.set()
                version, settling_until = None, 0.0
                while not stopping.is_set():
                    current = db.execute("PRAGMA data_version").fetchone()[0]
                    if current != version:
                        version, settling_until = current, 0.0
                        for row_id, message in db.execute(
                            "SELECT id, message FROM queue_wakeup WHERE id > ? ORDER BY id", (last_id,)
                        ).fetchall():
                            last_id = row_id
                            deliver(message)
                    notifier.tick()
                    if writes is None:
                        _nap()
                    elif time.monotonic() < settling_until:
                        stopping.wait(POLL)  # written, not visible yet (or written again): look again soon
                    elif written(writes, _until_tick()):
                        settling_until = time.monotonic() + SETTLE
                        # A commit shows some time after its write; and while commits keep coming
                        # (this process's own, hundreds a second) there is always a new write and
                        # a new version: without this wait the loop would look without rest.
                        stopping.wait(POLL)
            finally:
                if writes is not None:
                    os.close(writes)
                db.close()
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive anything; it reopens
            log.warning("wake-up watcher: %s; reopening in %.0fs", exc, RETRY)
            _pause()


_IN_MODIFY = 0x2
_libc = None


def _wal_writes(path: str) -> int | None:
    """An inotify descriptor that becomes readable when the database's WAL file is written;
    None where there is no inotify or no WAL file (the database is not in WAL mode)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):  # no libc to load, or one without inotify (not Linux)
        return None
    if fd < 0:
        return None
    if _libc.inotify_add_watch(fd, os.fsencode(f"{path}-wal"), _IN_MODIFY) < 0:
        os.close(fd)
        return None
    return fd


def _written(writes: int, timeout: float) -> bool:
    """Wait at most `timeout` for a write to the WAL; True when one came (its events are read)."""
    poller = select.poll()  # not select(): a descriptor past 1023 (a listener with many sockets) is fine
    poller.register(writes, select.POLLIN)
    if not poller.poll(max(0, int(timeout * 1000))):
        return False
    try:
        while os.read(writes, 4096):
            pass
    except BlockingIOError:
        pass
    return True


def _until_tick() -> float:
    return min(IDLE_POLL, notifier.next_tick())


def _caught_up() -> None:
    """Listening (again): wakes sent before now may have been missed, so
    every waiting claim looks once more, and no quiet memo stays trusted."""
    notifier.publish(Wake(requirements=None, count=notifier.waiting() or 1))


def _nap() -> None:
    if notifier.waiting():
        time.sleep(POLL)
    else:  # nobody to wake: check rarely, until a waiter arrives
        notifier.arrived.wait(IDLE_POLL)
        notifier.arrived.clear()


def _postgres_loop(params: dict, listening: threading.Event) -> None:
    import psycopg

    for name in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(name, None)
    while not _stopping.is_set():
        try:
            with psycopg.connect(**params, autocommit=True) as db:
                db.execute(f"LISTEN {emit.CHANNEL}")
                _caught_up()
                listening.set()
                while not _stopping.is_set():
                    for note in db.notifies(timeout=_until_tick()):  # a notification ends the wait
                        _deliver(note.payload)
                    notifier.tick()
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive anything; it reconnects
            log.warning("wake-up watcher: %s; reconnecting in %.0fs", exc, RETRY)
            _pause()


def _pause() -> None:
    deadline = time.monotonic() + RETRY
    while time.monotonic() < deadline and not _stopping.is_set():
        notifier.tick()
        _stopping.wait(min(_until_tick(), max(0.0, deadline - time.monotonic())))
