"""The one guarded write path of job and attempt states.

Every transition, hot path or cold, goes through `job_move` or
`attempt_move`, or for many rows at once through `attempts_succeed` and the
claim's `sql.lease`: the edge is checked against the model's transition table,
the row is updated only if it is still in the state the caller read
(compare-and-set), and a row count other than one is an error. Under the
claim's write lock (SQLite) or the row locks the services take (PostgreSQL)
a miss cannot happen; if it ever does, the transaction is rolled back rather
than writing over a row another process moved.
"""

import datetime as dt

from .. import sql
from ..models import ATTEMPT_TRANSITIONS, JOB_TRANSITIONS, TERMINAL_JOB_STATES


class LostUpdate(RuntimeError):
    """A guarded write found its row in another state than the one it read."""


def check_transition(table: dict[str, frozenset[str]], old: str, new: str) -> None:
    if new not in table[old]:
        raise AssertionError(f"illegal transition {old} → {new}")


def _value(value):
    if isinstance(value, dt.datetime):
        return sql.ts(value)
    if isinstance(value, dict | list):
        return sql.js(value)
    return value


def _move(cursor, table: str, transitions, row_id: int, old: str, new: str, columns: dict) -> None:
    check_transition(transitions, old, new)
    names = tuple(sorted(columns))
    cursor.execute(sql.move(table, names), [new, *(_value(columns[n]) for n in names), row_id, old])
    if cursor.rowcount != 1:
        raise LostUpdate(f"{table} {row_id} was not {old} any more (moving to {new})")


UNREAD = object()  # job_move's follow_ups when the caller did not read them with the job


def job_move(cursor, *, job_id: int, old: str, new: str, follow_ups=UNREAD, **columns) -> None:
    """Move job `job_id` from `old` to `new`, setting `columns` (sql.JOB_COLUMNS).
    A move into a terminal state enqueues the job's follow-ups for that state in
    the same transaction (services/followups.py): every path that settles a
    job (finish, expiry, cancel) goes through here, or through `attempt_and_job_move`;
    `attempts_succeed` settles only jobs without follow-ups."""
    _move(cursor, "queue_job", JOB_TRANSITIONS, job_id, old, new, columns)
    _settled(cursor, job_id, new, follow_ups, columns)


def _settled(cursor, job_id: int, new: str, follow_ups, columns: dict) -> None:
    if new in TERMINAL_JOB_STATES:
        from .followups import enqueue_follow_ups  # it enqueues jobs, whose services import this module

        # Every settling move sets finished_at from its service's clock: the follow-ups are stamped with it.
        enqueue_follow_ups(cursor, job_id, new, None if follow_ups is UNREAD else follow_ups, now=columns["finished_at"])


def attempt_and_job_move(cursor, *, attempt: dict, job: dict, event: tuple, follow_ups=UNREAD) -> None:
    """`attempt_move(**attempt)`, `job_move(**job)` and the job's event row
    (INSERT_EVENT's parameters): on PostgreSQL in one statement, each move still
    a compare-and-set whose row count must be one."""
    if not sql.postgres():
        attempt_move(cursor, **attempt)
        job_move(cursor, follow_ups=follow_ups, **job)
        cursor.execute(sql.INSERT_EVENT, list(event))
        return
    # The follow-ups and their event first, as on SQLite (job_move writes them before the finish's
    # event); a move that then finds its row moved raises LostUpdate and rolls them back with it.
    job_columns = {k: v for k, v in job.items() if k not in ("job_id", "old", "new")}
    _settled(cursor, job["job_id"], job["new"], follow_ups, job_columns)
    shapes, params = [], []
    for table, transitions, spec, id_name in (
        ("queue_attempt", ATTEMPT_TRANSITIONS, attempt, "attempt_id"),
        ("queue_job", JOB_TRANSITIONS, job, "job_id"),
    ):
        spec = dict(spec)
        row_id, old, new = spec.pop(id_name), spec.pop("old"), spec.pop("new")
        check_transition(transitions, old, new)
        names = tuple(sorted(spec))
        shapes.append((table, names))
        params += [new, *(_value(spec[n]) for n in names), row_id, old]
    cursor.execute(sql.moves_with_event(tuple(shapes)), [*params, *event])
    counts = cursor.fetchone()
    for (table, _), count, spec, id_name in zip(shapes, counts, (attempt, job), ("attempt_id", "job_id"), strict=True):
        if count != 1:
            raise LostUpdate(f"{table} {spec[id_name]} was not {spec['old']} any more (moving to {spec['new']})")


def attempts_succeed(cursor, rows: list[tuple], now: dt.datetime, detail: dict) -> None:
    """Many attempts' `attempt_and_job_move` to succeeded, in one go (sql.succeed): `rows` are
    (attempt id, job id, the job's state as read, error, summary, worker id). It enqueues no
    follow-ups: the caller passes only jobs it read, under its lock, as having none
    (attempts.finish_many). Each move is still a compare-and-set; a row count short of
    `rows` is LostUpdate."""
    check_transition(ATTEMPT_TRANSITIONS, "active", "succeeded")
    for row in rows:
        check_transition(JOB_TRANSITIONS, row[2], "succeeded")
    n_ow, statements = sql.ts(now), sql.succeed(len(rows), sql.postgres())
    if len(statements) == 1:  # PostgreSQL
        params = [p for a, j, state, error, summary, w in rows for p in (a, j, state, error, sql.js(summary), w)]
        cursor.execute(statements[0], [*params, n_ow, n_ow, n_ow, sql.js(detail)])
        moved = cursor.fetchone()
    else:
        attempts, jobs, events = statements
        cursor.execute(attempts, [n_ow, *(p for a, _, _, error, _, _ in rows for p in (a, error))])
        moved_attempts = cursor.rowcount
        cursor.execute(jobs, [n_ow, *(p for _, j, state, _, summary, _ in rows for p in (j, state, sql.js(summary)))])
        moved = (moved_attempts, cursor.rowcount)
        cursor.execute(events, [p for a, j, _, _, _, w in rows for p in (j, "finished", n_ow, w, a, sql.js(detail))])
    for table, count in zip(("queue_attempt", "queue_job"), moved, strict=True):
        if count != len(rows):
            raise LostUpdate(f"{len(rows) - count} of {len(rows)} {table} rows moved under us (settling as succeeded)")


def attempt_move(cursor, *, attempt_id: int, old: str, new: str, **columns) -> None:
    """Move attempt `attempt_id` from `old` to `new`, setting `columns` (sql.ATTEMPT_COLUMNS)."""
    _move(cursor, "queue_attempt", ATTEMPT_TRANSITIONS, attempt_id, old, new, columns)


def checked(cursor, statement: str, params, what: str) -> None:
    """A guarded write that is not a state move (a lease extension, a cancel
    request): exactly one row, or LostUpdate."""
    cursor.execute(statement, params)
    if cursor.rowcount != 1:
        raise LostUpdate(f"{what}: the row moved under us")
