"""The embedded worker's step history store (see executor.History)."""

import datetime as dt

from django.db import connection

from jobqueue import sql
from jobqueue.types import Claim

from .models import StepRun

# One statement each, in autocommit, where update_or_create took a transaction of a SELECT and an
# INSERT: a step costs two short writes. The upsert keeps update_or_create's meaning (a row that
# exists gets the new start, and keeps the rest); INSERT … ON CONFLICT is SQLite's (3.24+) and
# PostgreSQL's both.
_TABLE = StepRun._meta.db_table
_STARTED_ROW = "(%s, %s, %s, 'running', %s, %s, %s, '')"


def _started(rows: int) -> str:
    return (
        f"INSERT INTO {_TABLE} (instance_id, attempt_number, step_id, status, worker_id, started_at, log_path, output_tail)"
        f" VALUES {', '.join([_STARTED_ROW] * rows)}"
        " ON CONFLICT (instance_id, attempt_number, step_id) DO UPDATE SET status = excluded.status,"
        " worker_id = excluded.worker_id, started_at = excluded.started_at, log_path = excluded.log_path"
    )


_STARTED = _started(1)
_FINISHED = (
    f"UPDATE {_TABLE} SET status = %s, ended_at = %s, exit_code = %s, output_tail = %s"
    " WHERE instance_id = %s AND attempt_number = %s AND step_id = %s"
)


# A step's start and finish written as one row (the batch held both): what the start's upsert
# and then the finish's update leave, whether or not the row was there before.
_WHOLE_COLUMNS = "instance_id, attempt_number, step_id, status, worker_id, started_at, log_path, ended_at, exit_code, output_tail"
_WHOLE_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
_WHOLE_CONFLICT = (
    " ON CONFLICT (instance_id, attempt_number, step_id) DO UPDATE SET status = excluded.status,"
    " worker_id = excluded.worker_id, started_at = excluded.started_at, log_path = excluded.log_path,"
    " ended_at = excluded.ended_at, exit_code = excluded.exit_code, output_tail = excluded.output_tail"
)


def _write(statement: str, params: tuple) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def _write_many(calls: list[dict]) -> list[tuple[None, None]]:
    """Many history writes in the caller's transaction (group commit) in few statements. The
    writes of different steps touch different rows, so only each step's own order counts: a
    step whose start and finish are both here is one row written whole, the starts of the
    others one multi-row upsert, and what is left (a finish whose start was committed before,
    anything else) runs one by one in its order."""
    by_step: dict[tuple, list[tuple[str, tuple]]] = {}
    for call in calls:
        statement, params = call["statement"], call["params"]
        step = params[:3] if statement is _STARTED else params[4:7]  # (instance, attempt number, step id)
        by_step.setdefault(step, []).append((statement, params))
    starts, wholes, singles = [], [], []
    for writes in by_step.values():
        kinds = [statement for statement, _ in writes]
        if kinds == [_STARTED]:
            starts.extend(writes[0][1])
        elif kinds == [_STARTED, _FINISHED]:
            (instance, number, step, worker, started, log_path), (status, ended, code, tail, *_) = writes[0][1], writes[1][1]
            wholes.extend((instance, number, step, status, worker, started, log_path, ended, code, tail))
        else:
            singles.extend(writes)
    with connection.cursor() as cursor:
        if starts:
            cursor.execute(_started(len(starts) // 6), starts)
        if wholes:
            rows = ", ".join([_WHOLE_ROW] * (len(wholes) // 10))
            cursor.execute(f"INSERT INTO {_TABLE} ({_WHOLE_COLUMNS}) VALUES {rows}{_WHOLE_CONFLICT}", wholes)
        for statement, params in singles:
            cursor.execute(statement, params)
    return [(None, None)] * len(calls)


_write.body = _write  # a call a GroupCommitter may batch (it runs inside the batch's transaction)
_write.many = _write_many


class DatabaseHistory:
    """The embedded worker writes step history straight into the control
    plane's database. StepRun rows are history, not queue state.

    With a `committer` (the embedded worker's transport's, jobqueue.groupcommit) each write is
    deferred into the worker's next commit: a step's history costs no commit of its own, and
    a step shows as running with the next commit of anything else, or about
    groupcommit.DEFER_SECONDS after it started.
    Without one, each write is a single autocommit statement."""

    def __init__(self, committer=None):
        self.committer = committer

    def _send(self, statement: str, params: tuple) -> None:
        if self.committer is None:
            _write(statement, params)
        else:
            self.committer.defer(_write, statement=statement, params=params)

    def step_started(self, *, claim: Claim, worker_id: str, step_id: str, started_at: dt.datetime, log_path: str) -> None:
        instance_id = claim.payload["instance_id"]  # the executor read the payload (payload.read) first
        self._send(_STARTED, (
            instance_id, claim.attempt_number, step_id, worker_id,
            sql.ts(started_at), log_path,
        ))  # fmt: skip

    def step_finished(self, *, claim: Claim, worker_id: str, step_id: str, result) -> None:
        instance_id = claim.payload["instance_id"]
        self._send(_FINISHED, (
            result.status, sql.ts(result.ended_at), result.exit_code,
            result.output_tail, instance_id, claim.attempt_number, step_id,
        ))  # fmt: skip
