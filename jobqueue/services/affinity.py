"""Affinity pins: jobs sharing an affinity key run on the worker that claimed the first of them."""

import datetime as dt
import hashlib

from django.db import connection

from .. import sql
from ..clock import Clock
from ..models import Affinity
from ..wakeup import Wake
from ..wakeup.emit import emit
from .common import log, now_of, postgres, service, worker_event

PIN_LOCK_SPACE = 0x41504941  # "APIA": the advisory-lock key space of affinity pins


def pin(cursor, key: str, worker_id: str, now: dt.datetime) -> bool | None:
    """Inside a claim: pin `key` to the claimer unless it is pinned already;
    True when it is pinned to us, False when to another worker, None when
    another claim holds the key's lock right now (PostgreSQL).

    On PostgreSQL a concurrent claimer pinning the same key would make the
    insert wait for its commit, and two claims pinning two keys in opposite
    orders would deadlock: a try-lock per key passes the job over instead."""
    if postgres():
        lock = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big", signed=True)
        cursor.execute(sql.TRY_LOCK_PIN, [PIN_LOCK_SPACE, lock])
        if not cursor.fetchone()[0]:
            return None
    cursor.execute(sql.INSERT_PIN, [key, worker_id, sql.ts(now)])
    return sql.one(cursor, sql.PIN_OF, [key])[0] == worker_id


@service
def affinity_release(*, key: str, actor: str | None = None, clock: Clock | None = None) -> bool:
    """Unpin an affinity key; its waiting jobs go to any eligible worker. False when it was not
    pinned. The worker it was pinned to gets an `affinity_released` event naming the key and `actor`."""
    pin = Affinity.objects.filter(key=key).first()
    deleted, _ = Affinity.objects.filter(key=key).delete() if pin else (0, None)
    if deleted:
        log.info("affinity released: %s", key)
        worker_event(worker_id=pin.worker_id, kind="affinity_released", at=now_of(clock), actor=actor, key=key)
        with connection.cursor() as cursor:
            emit(cursor, Wake(requirements=None))  # its jobs may go to anyone now
    return bool(deleted)

