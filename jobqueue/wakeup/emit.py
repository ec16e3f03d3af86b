"""Announcing a wake from inside a service's transaction.

The wake leaves only if the transaction commits, and only then: on
PostgreSQL as a NOTIFY on `CHANNEL` (delivered at commit), on SQLite as a row
of `queue_wakeup` that every process's watcher reads. This process's own
waiters hear it at once through `on_commit`; the watchers skip wakes of
their own origin so nobody hears one twice.
"""

import itertools
import json
import logging
import os
import secrets
import time

from django.db import transaction

from .. import sql
from . import notifier
from .notifier import Wake

CHANNEL = "apiary_wakeup"
PRUNE_EVERY = 256  # SQLite: every this many rows, drop the ones no watcher can still need
KEEP = 4096

_origin = (0, "")
log = logging.getLogger("apiary.queue")


def origin() -> str:
    """This process's mark on the wakes it sends (new after a fork)."""
    global _origin
    if _origin[0] != os.getpid():
        _origin = (os.getpid(), secrets.token_hex(8))
    return _origin[1]


_serial = itertools.count()


def encode(wake: Wake) -> str:
    """[origin, serial, class, worker, count, due, needs]. The serial makes
    every message distinct: PostgreSQL folds identical NOTIFYs of one
    transaction into one, and 500 jobs expired together are 500 wakes."""
    at = round(time.time() + wake.delay, 3) if wake.delay > 0 else 0
    message = [origin(), next(_serial), wake.requirements, wake.worker_id, wake.count, at, _needs(wake)]
    return json.dumps(message, separators=(",", ":"))


def head_and_needs(wake: Wake) -> tuple[str, int, str]:
    """encode()'s message without its class, for a statement that fills the class in itself
    (sql.insert_jobs with `notify`): origin, serial, and `needs` as JSON."""
    return origin(), next(_serial), json.dumps(_needs(wake), separators=(",", ":"))


def _needs(wake: Wake) -> list | None:
    return None if wake.needs is None else [wake.needs[0], sorted(wake.needs[1]), sorted(wake.needs[2])]


def decode(text: str) -> tuple[str, Wake]:
    sender, _serial_number, requirements, worker_id, count, at, needs = json.loads(text)
    delay = max(0.0, at - time.time()) if at else 0.0
    if needs is not None:
        needs = (needs[0], frozenset(needs[1]), frozenset(needs[2]))
    return sender, Wake(requirements=requirements, worker_id=worker_id, count=count, delay=delay, needs=needs)


def emit(cursor, wake: Wake) -> None:
    """Announce `wake` when the current transaction commits."""
    if sql.postgres():
        cursor.execute(sql.NOTIFY, [CHANNEL, encode(wake)])
    else:
        write_row(cursor, wake)
    transaction.on_commit(lambda: told(wake))


def write_row(cursor, wake: Wake) -> None:
    """SQLite: `wake`'s row for the other processes' watchers, in the caller's transaction.
    This process's waiters hear it only from `told`, which the caller runs after its commit
    (emit runs it on commit)."""
    cursor.execute(sql.INSERT_WAKEUP, [encode(wake)])
    row_id = cursor.lastrowid
    if row_id and row_id % PRUNE_EVERY == 0:
        cursor.execute(sql.PRUNE_WAKEUPS, [row_id - KEEP])


def told(wake: Wake) -> None:
    """This process's waiters hear `wake`, after the commit that holds it (emit's on-commit hook,
    or a caller that committed by itself). A failure is logged, never raised: the caller's write
    is committed and must be answered as such, and a waiter that missed the wake finds the job
    by its next poll."""
    try:
        notifier.publish(wake)
    except Exception:
        log.exception("telling this process's waiters of a committed wake failed")
