"""One thread per process that brings other processes' wakes to this
process's notifier, and ticks it (timers, the fallback re-check).

PostgreSQL: one connection of its own, `LISTEN apiary_wakeup`. SQLite:
`PRAGMA data_version` on a connection of its own changes whenever another
connection commits; only then does it read the new `queue_wakeup` rows.
Either way the watcher holds no transaction open (autocommit), so it never
pins an old snapshot or blocks a WAL checkpoint. With no claim waiting,
SQLite is checked only four times a second (a waiter's arrival ends the
nap): the rows stay, and the next read catches up. A broken connection is
reopened after a pause; meanwhile the fallback keeps waiters re-checking.
"""

import logging
import os
import sqlite3
import threading
import time

from django.db import connection

from . import emit, notifier
from .notifier import Wake

log = logging.getLogger("apiary.queue")

POLL = 0.01  # SQLite: seconds between data_version checks while claims wait (a read of shared memory)
IDLE_POLL = 0.25  # and while none waits: the rows stay, a later read catches up
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


def _sqlite_loop(path: str, listening: threading.Event) -> None:
    if not path or path == ":memory:" or "mode=memory" in str(path):
        # No file other processes could write: only this process's own wakes exist.
        listening.set()
        while not _stopping.is_set():
            notifier.tick()
            time.sleep(POLL)
        return
    last_id = None  # kept across reopens: the rows written meanwhile are read, not skipped
    while not _stopping.is_set():
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5)
            try:
                if last_id is None:
                    last_id = db.execute("SELECT COALESCE(MAX(id), 0) FROM queue_wakeup").fetchone()[0]
                _caught_up()
                listening.set()
                version = None
                while not _stopping.is_set():
                    current = db.execute("PRAGMA data_version").fetchone()[0]
                    if current != version:
                        version = current
                        for row_id, message in db.execute(
                            "SELECT id, message FROM queue_wakeup WHERE id > ? ORDER BY id", (last_id,)
                        ).fetchall():
                            last_id = row_id
                            _deliver(message)
                    notifier.tick()
                    _nap()
            finally:
                db.close()
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive anything; it reopens
            log.warning("wake-up watcher: %s; reopening in %.0fs", exc, RETRY)
            _pause()


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
                    for note in db.notifies(timeout=0.05):
                        _deliver(note.payload)
                    notifier.tick()
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive anything; it reconnects
            log.warning("wake-up watcher: %s; reconnecting in %.0fs", exc, RETRY)
            _pause()


def _pause() -> None:
    deadline = time.monotonic() + RETRY
    while time.monotonic() < deadline and not _stopping.is_set():
        notifier.tick()
        time.sleep(POLL)
