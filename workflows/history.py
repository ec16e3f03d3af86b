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
_STARTED = (
    f"INSERT INTO {_TABLE} (instance_id, attempt_number, step_id, status, worker_id, started_at, log_path, output_tail)"
    " VALUES (%s, %s, %s, 'running', %s, %s, %s, '')"
    " ON CONFLICT (instance_id, attempt_number, step_id) DO UPDATE SET status = excluded.status,"
    " worker_id = excluded.worker_id, started_at = excluded.started_at, log_path = excluded.log_path"
)
_FINISHED = (
    f"UPDATE {_TABLE} SET status = %s, ended_at = %s, exit_code = %s, output_tail = %s"
    " WHERE instance_id = %s AND attempt_number = %s AND step_id = %s"
)


def _write(statement: str, params: tuple) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


_write.body = _write  # a call a GroupCommitter may batch (it runs inside the batch's transaction)


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
