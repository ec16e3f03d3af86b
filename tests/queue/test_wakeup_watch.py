"""Wakes from other processes (jobqueue.wakeup.watch): a NOTIFY on
PostgreSQL, a queue_wakeup row on SQLite, written by another connection,
reach this process's waiters; this process's own are not heard twice."""

import json

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
