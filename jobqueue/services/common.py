"""What every queue service shares: the transaction wrapper, the clock, the
backend test, token digests and the event row."""

import contextlib
import datetime as dt
import functools
import logging

from django.db import OperationalError, transaction

from .. import sql
from ..clock import Clock, get_clock
from ..exceptions import Unavailable
from ..sql import postgres  # noqa: F401 - the services' one backend test, re-exported for them
from ..types import hash_token  # noqa: F401 - the services' one digest, re-exported for them

log = logging.getLogger("apiary.queue")


def service(fn=None, *, many=None):
    """One durable transaction per call; a database that stays locked or
    unreachable past the busy timeout surfaces as `Unavailable` (retryable).

    `many(calls)`, when given, is the body for many calls at once inside a
    caller's transaction (jobqueue.groupcommit): [kwargs, …] in, one
    (result, error) per call out, where a call answered with an error wrote
    nothing; anything it raises rolls the whole transaction back."""
    if fn is None:
        return functools.partial(service, many=many)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with transaction.atomic(durable=True):
                return fn(*args, **kwargs)
        except OperationalError as exc:
            raise Unavailable.of(exc) from exc

    wrapper.body = fn  # the service inside a caller's transaction (jobqueue.groupcommit runs many in one)
    fn.many = many
    return wrapper


def savepoint_on_postgres():
    """Around an insert that a concurrent call may collide with: on PostgreSQL a savepoint, so
    the IntegrityError leaves the transaction usable; on SQLite nothing, since the transaction
    holds the write lock (no concurrent call) and a failed statement undoes only itself."""
    return transaction.atomic() if postgres() else contextlib.nullcontext()


def now_of(clock: Clock | None) -> dt.datetime:
    return (clock or get_clock()).now()


def event(cursor, *, job_id: int, kind: str, at: dt.datetime, worker_id=None, attempt_id=None, **detail) -> None:
    """A JobEvent row, in the transition's own transaction."""
    cursor.execute(sql.INSERT_EVENT, [job_id, kind, sql.ts(at), worker_id, attempt_id, sql.js(detail)])


def actor_of(actor: str | None) -> dict:
    """The `actor` detail of an operator's event (the admin user's name, `cli:<os user>`); none
    for the queue's own moves."""
    return {"actor": actor} if actor else {}


def worker_event(*, worker_id: str, kind: str, at: dt.datetime, actor: str | None = None, **detail) -> None:
    """A WorkerEvent row (an operator's action on a worker), in the service's transaction."""
    from ..models import WorkerEvent  # models import nothing of the services; this keeps common.py model-free

    WorkerEvent.objects.create(worker_id=worker_id, kind=kind, at=at, detail={**detail, **actor_of(actor)})
