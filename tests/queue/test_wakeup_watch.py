"""Wakes from other processes (jobqueue.wakeup.watch): a NOTIFY on
PostgreSQL, a queue_wakeup row on SQLite, written by another connection,
reach this process's waiters; this process's own are not heard twice."""

import json
import os
import sqlite3
import threading

import pytest
from django.db import connection

from jobqueue import sql
from jobqueue.services.common import postgres
from jobqueue.wakeup import Waiter, emit, notifier, watch

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 10.0  # deadline for the watcher thread; not a timing assertion
ANY = (None, frozenset(), frozenset())


def send(origin: str, *, at: float = 0) -> None:
    """A wake as another process's commit sends it (autocommit: committed at once)."""
    message = json.dumps([origin, 0, None, None, 1, at, None])
    with connection.cursor() as cursor:
        if postgres():
            cursor.execute(sql.NOTIFY, [emit.CHANNEL, message])
        else:
            cursor.execute(sql.INSERT_WAKEUP, [message])


def test_a_wake_from_another_process_reaches_a_waiter_and_our_own_is_skipped():
    assert watch.ensure_running().wait(WAIT)
    first, second = Waiter("w1", ANY), Waiter("w2", ANY)
    notifier.add(first)
    notifier.add(second)
    before = notifier.mark()
    send(emit.origin())  # ours: the in-process path delivered it already
    send("another-process")
    assert first.wait(WAIT)
    assert notifier.mark() == before + 1  # one delivered: ours, read before it, was skipped
    assert not second.wait(0)


def test_a_delayed_wake_from_another_process_waits_for_its_time():
    assert watch.ensure_running().wait(WAIT)
    first, second = Waiter("w1", ANY), Waiter("w2", ANY)
    notifier.add(first)
    notifier.add(second)
    before = notifier.mark()
    send("another-process", at=9_999_999_999)  # a retry due in the far future
    send("another-process")  # due now, sent after it
    assert first.wait(WAIT)
    assert notifier.mark() == before + 1  # both read (in order); only the one due now delivered
    assert not second.wait(0)


def test_on_sqlite_the_watcher_waits_for_a_write_to_the_wal_instead_of_polling(tmp_path):
    """What the SQLite watcher blocks on between two ticks: a descriptor that stays quiet while
    nothing is written and becomes readable when another connection commits."""
    if postgres():
        pytest.skip("SQLite's watcher")
    path = str(tmp_path / "queue.db")
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE t (x)")
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("SELECT count(*) FROM t")
    writes = watch._wal_writes(path)
    assert writes is not None, "no inotify: the watcher polls"
    try:
        assert not watch._written(writes, 0.05)
        writer.execute("INSERT INTO t VALUES (1)")
        assert watch._written(writes, WAIT)
        assert not watch._written(writes, 0)  # what it read covers that write
    finally:
        os.close(writes)
        reader.close()
        writer.close()


def test_without_a_wal_the_sqlite_watcher_has_nothing_to_wait_on_and_polls(tmp_path):
    path = str(tmp_path / "rollback.db")
    sqlite3.connect(path, isolation_level=None).execute("CREATE TABLE t (x)")
    assert watch._wal_writes(path) is None


class _CountingStop:
    """watch._stopping for one loop: records each wait, and stops the loop after `looks` looks."""

    def __init__(self, looks: int):
        self.looks, self.waits = looks, []

    def is_set(self) -> bool:
        self.looks -= 1
        return self.looks < 0

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False


def test_on_sqlite_commits_that_keep_coming_are_looked_at_poll_apart_not_without_rest(tmp_path):
    """Under load this process commits hundreds of times a second: each commit writes the WAL and
    moves data_version, so a watcher that looked again at once after each write never rested."""
    if postgres():
        pytest.skip("SQLite's watcher")
    path = str(tmp_path / "queue.db")
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE queue_wakeup (id INTEGER PRIMARY KEY AUTOINCREMENT, message TEXT NOT NULL)")
    written = []

    def a_commit_came(writes, timeout):  # as under load: by the time it looks, another commit came
        writer.execute("INSERT INTO queue_wakeup (message) VALUES ('[]')")
        written.append(timeout)
        return True

    stop = _CountingStop(looks=40)
    try:
        # Its own stop, writes and delivery, passed in: not the module's, which the process's
        # watcher (started by an earlier test) goes on using meanwhile.
        watch._sqlite_loop(path, threading.Event(), stopping=stop, written=a_commit_came, deliver=lambda message: None)
    finally:
        writer.close()
    assert len(written) >= 10
    assert stop.waits.count(watch.POLL) >= len(written)  # a rest after every write it saw
