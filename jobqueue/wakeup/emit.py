"""Announcing a wake from inside a service's transaction.

The wake leaves only if the transaction commits, and only then: on
PostgreSQL as a NOTIFY on `CHANNEL` (delivered at commit), on SQLite as a row
of `queue_wakeup` that every process's watcher reads. This process's own
waiters hear it at once through `on_commit`; the watchers skip wakes of
their own origin so nobody hears one twice.
"""

import json
import os
import secrets
import time

from django.db import connection, transaction

from .. import sql
from . import notifier
from .notifier import Wake

CHANNEL = "apiary_wakeup"
PRUNE_EVERY = 256  # SQLite: every this many rows, drop the ones no watcher can still need
KEEP = 4096

_origin = (0, "")


def origin() -> str:
    """This process's mark on the wakes it sends (new after a fork)."""
    global _origin
    if _origin[0] != os.getpid():
        _origin = (os.getpid(), secrets.token_hex(8))
    return _origin[1]


def encode(wake: Wake) -> str:
    at = round(time.time() + wake.delay, 3) if wake.delay > 0 else 0
    return json.dumps([origin(), wake.requirements, wake.worker_id, wake.count, at], separators=(",", ":"))


def decode(text: str) -> tuple[str, Wake]:
    sender, requirements, worker_id, count, at = json.loads(text)
    delay = max(0.0, at - time.time()) if at else 0.0
    return sender, Wake(requirements=requirements, worker_id=worker_id, count=count, delay=delay)


def emit(cursor, wake: Wake) -> None:
    """Announce `wake` when the current transaction commits."""
    if connection.vendor == "postgresql":
        cursor.execute(sql.NOTIFY, [CHANNEL, encode(wake)])
    else:
        cursor.execute(sql.INSERT_WAKEUP, [encode(wake)])
        row_id = cursor.lastrowid
        if row_id and row_id % PRUNE_EVERY == 0:
            cursor.execute(sql.PRUNE_WAKEUPS, [row_id - KEEP])
    transaction.on_commit(lambda: notifier.publish(wake))
