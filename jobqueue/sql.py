"""Every SQL statement of the queue services, and the helpers that run them.

The hot path (claim, heartbeat, finish) runs once or more per job per worker,
and the ORM's query compilation costs several times what SQLite needs to
execute it (measured: about 4.8 ms per claim+finish through the ORM against
well under 1 ms as SQL), so the services run plain statements. They are SQL
that SQLite and PostgreSQL both accept; where a statement differs by backend
(row locks, an index hint), the builder below takes `postgres` and says why.

Statements with a variable number of terms (IN lists, UNIONs, SET clauses)
are built here from placeholders only: no value is ever formatted into SQL,
and column names come from fixed tuples.
"""

import datetime as dt
import functools
import json

from django.db import connection

from .text import clean

# --------------------------------------------------------------------------- claim

# The last column, the newest job class, tells the claim whether it has classes to read (RequirementCache).
WORKER_FOR_CLAIM = """
SELECT w.session, w.pool, w.labels, w.capabilities, w.capacity, w.draining, w.ready, w.drain_requested,
       (SELECT COUNT(*) FROM queue_attempt a
         WHERE a.worker_id = w.worker_id AND a.state = 'active' AND a.lease_expires_at > %s),
       (SELECT MAX(id) FROM queue_requirementset)
  FROM queue_worker w
 WHERE w.worker_id = %s
"""

# PostgreSQL: serialise the claims of one worker before counting its attempts (see jobs_claim).
LOCK_WORKER = "SELECT 1 FROM queue_worker WHERE worker_id = %s FOR UPDATE"

REQUIREMENT_SET_COLUMNS = "id, pool, labels, capabilities, project, source, agent, runner"


def requirement_sets(gaps: int) -> str:
    """Requirement sets newer than an id, plus `gaps` ids below it not seen yet."""
    where = "id > %s" + (f" OR id IN ({placeholders(gaps)})" if gaps else "")
    return f"SELECT {REQUIREMENT_SET_COLUMNS} FROM queue_requirementset WHERE {where} ORDER BY id"


@functools.lru_cache(maxsize=64)
def live_counts(dimensions: tuple[str, ...], keyed_dimensions: tuple[str, ...]) -> str:
    """Live (active, unexpired) attempts grouped by their jobs' keys in
    `dimensions` (parameters: now, then one key per `keyed_dimensions` entry:
    only attempts whose job has one of those keys are counted)."""
    columns = ", ".join(f"j.{d}" for d in dimensions)
    where = "a.state = 'active' AND a.lease_expires_at > %s"
    if keyed_dimensions:
        where += " AND (" + " OR ".join(f"j.{d} = %s" for d in keyed_dimensions) + ")"
    return (
        f"SELECT {columns}, COUNT(*) FROM queue_attempt a JOIN queue_job j ON j.id = a.job_id"
        f" WHERE {where} GROUP BY {columns}"
    )


LOCK_LIMIT_KEYS = "SELECT bool_and(pg_try_advisory_xact_lock(k)) FROM unnest(%s::bigint[]) AS k"

TRY_LOCK_PIN = "SELECT pg_try_advisory_xact_lock(%s, %s)"

LOCK_WORKER_ID = "SELECT pg_advisory_xact_lock(%s, %s)"

INSERT_PIN = "INSERT INTO queue_affinity (key, worker_id, pinned_at) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"

PIN_OF = "SELECT worker_id FROM queue_affinity WHERE key = %s"
PIN_OF_JOB = "SELECT p.worker_id FROM queue_job j JOIN queue_affinity p ON p.key = j.affinity_key WHERE j.id = %s"

# One class's queued jobs in claim order, skipping affinity jobs pinned to another worker.
_WALK = (
    "SELECT j.id, j.priority, j.available_at{rows} FROM queue_job j{hint}"
    " LEFT JOIN queue_affinity af ON af.key = j.affinity_key"
    " WHERE j.state = 'queued' AND j.requirements_id = %s AND j.available_at <= %s"
    " AND (j.affinity_key IS NULL OR af.worker_id IS NULL OR af.worker_id = %s){skip}"
    " ORDER BY j.priority DESC, j.available_at, j.id LIMIT %s"
)


@functools.lru_cache(maxsize=256)
def candidate_walk(classes: int, skipped: int, postgres: bool) -> str:
    """The union of `classes` short walks (parameters per walk: class id, now,
    worker id, the `skipped` job ids, limit), merged and cut (last parameter: limit):
    (id, priority, available_at) per job, and on SQLite the CANDIDATE_COLUMNS after
    them (there the walk's rows are the candidates: one writer at a time, no row
    locks to take). SQLite without ANALYZE statistics may prefer another index and
    sort, so it is told to use the claim-order index; PostgreSQL picks it by itself."""
    walk = _WALK.format(
        rows="" if postgres else "".join(f", j.{c} AS c_{c}" for c in CANDIDATE_COLUMNS),
        hint="" if postgres else " INDEXED BY job_claim_order",
        skip=f" AND j.id NOT IN ({placeholders(skipped)})" if skipped else "",
    )
    parts = [f"SELECT * FROM ({walk}) AS c{i}" for i in range(classes)]
    return " UNION ALL ".join(parts) + " ORDER BY priority DESC, available_at, id LIMIT %s"


CANDIDATE_COLUMNS = ("id", "attempt_count", "agent", "runner", "project", "source", "pool", "affinity_key", "payload")


@functools.lru_cache(maxsize=256)
def candidates(ids: int) -> str:
    """PostgreSQL: the walked jobs, still queued, best first, locked, skipping rows another
    claimer holds; the LIMIT counts only rows it could lock (parameters: now, the ids, limit)."""
    return (
        f"SELECT {', '.join('j.' + c for c in CANDIDATE_COLUMNS)} FROM queue_job j"
        f" WHERE j.state = 'queued' AND j.available_at <= %s AND j.id IN ({placeholders(ids)})"
        " ORDER BY j.priority DESC, j.available_at, j.id LIMIT %s FOR UPDATE OF j SKIP LOCKED"
    )


INSERT_EVENT = """
INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail) VALUES (%s, %s, %s, %s, %s, %s)
"""


def insert_events(rows: int) -> str:
    """INSERT_EVENT for `rows` events in one statement: its parameters per row."""
    return "INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail) VALUES " + ", ".join(
        ["(%s, %s, %s, %s, %s, %s)"] * rows
    )


# --------------------------------------------------------------------------- enqueue

# What an enqueue sets per job (jobs.job_enqueue_in); the other columns start as every new job's.
JOB_INSERT_COLUMNS = (
    "key", "payload", "project", "source", "agent", "runner", "pool", "affinity_key", "priority", "max_attempts",
    "retry_max_attempts", "retry_backoff", "retry_backoff_max", "follow_ups",
)  # fmt: skip
_JSON_COLUMNS = frozenset({"payload", "follow_ups"})


@functools.lru_cache(maxsize=64)
def insert_jobs(rows: int, postgres: bool, notify: bool = False) -> str:
    """Insert `rows` jobs, each with its requirement set found by digest in the
    same statement; answers (id, key, requirements_id) of each job inserted.
    Parameters: per row JOB_INSERT_COLUMNS and the digest; then `now` (available_at,
    created_at), and on PostgreSQL `now` again: there the same statement writes each
    inserted job's `enqueued` event too (one round trip fewer; SQLite has no
    data-modifying WITH). A key already in the queue inserts nothing (its dedup), and
    so does a row whose requirement set does not exist yet: the caller creates the set
    and inserts that row again. PostgreSQL types a VALUES list's text as text, so JSON
    cells are cast.
    With `notify` (PostgreSQL, one row), the statement also announces the job's wake
    (wakeup.emit's message, its class filled in; parameters after `now`: the channel,
    then emit.head_and_needs)."""
    cells = ", ".join("CAST(%s AS jsonb)" if postgres and c in _JSON_COLUMNS else "%s" for c in JOB_INSERT_COLUMNS)
    names = ", ".join(JOB_INSERT_COLUMNS)
    empty = "CAST('{}' AS jsonb)" if postgres else "'{}'"
    insert = (
        f"INSERT INTO queue_job ({names}, requirements_id, available_at, created_at, state, attempt_count,"
        " retried_through, summary, reason)"
        f" SELECT {', '.join('v.' + c for c in JOB_INSERT_COLUMNS)}, r.id, %s, %s, 'queued', 0, 0, {empty}, ''"
        " FROM v JOIN queue_requirementset r ON r.digest = v.digest"
        " WHERE true ON CONFLICT (key) DO NOTHING"  # SQLite: an upsert after a join needs a WHERE to parse
        " RETURNING id, key, requirements_id"
    )
    values = f"v ({names}, digest) AS (VALUES {', '.join([f'({cells}, %s)'] * rows)})"
    if not postgres:
        return f"WITH {values} {insert}"
    event = (
        "INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail)"
        f" SELECT id, 'enqueued', %s, NULL, NULL, {empty} FROM j"
    )
    answer = "SELECT id, key, requirements_id FROM j"
    if notify:
        answer = (
            "SELECT id, key, requirements_id, pg_notify(CAST(%s AS text), json_build_array(CAST(%s AS text),"
            " CAST(%s AS bigint), requirements_id, NULL, 1, 0, CAST(%s AS json))::text) FROM j"
        )
    return f"WITH {values}, j AS ({insert}), e AS ({event}) {answer}"


def pins_of(keys: int) -> str:
    """The workers holding affinity keys (parameters: the keys)."""
    return f"SELECT key, worker_id FROM queue_affinity WHERE key IN ({placeholders(keys)})"


# --------------------------------------------------------------------------- fenced calls


def fenced_attempt(postgres: bool) -> str:
    """An attempt with what heartbeat and finish decide on; on PostgreSQL the
    attempt and job rows are locked for the rest of the transaction. Only
    whether the job has follow-ups: their specs (hook payloads, each with a
    task snapshot) are read by the finish that needs them, not by every heartbeat."""
    return _FENCED_ATTEMPT + (" FOR UPDATE OF a, j" if postgres else "")


@functools.lru_cache(maxsize=64)
def fenced_attempts(ids: int, postgres: bool) -> str:
    """fenced_attempt for `ids` attempts at once, each row led by its attempt id
    (parameters: now, the ids). PostgreSQL locks them in id order."""
    statement = "SELECT a.id, " + _FENCED_ATTEMPT.strip().removeprefix("SELECT ")
    statement = statement.replace("WHERE a.id = %s", f"WHERE a.id IN ({placeholders(ids)})")
    return statement + (" ORDER BY a.id FOR UPDATE OF a, j" if postgres else "")


_FENCED_ATTEMPT = """
SELECT a.token_hash, a.state, a.lease_expires_at, a.lease_expires_at > %s, a.job_state, a.number, a.worker_id,
       j.id, j.state, j.current_attempt_id, j.cancel_requested_at IS NOT NULL, j.retry_max_attempts,
       j.retry_backoff, j.retry_backoff_max, a.session <> w.session, j.requirements_id,
       j.follow_ups IS NOT NULL AND CAST(j.follow_ups AS TEXT) <> '{}'
  FROM queue_attempt a JOIN queue_job j ON j.id = a.job_id JOIN queue_worker w ON w.worker_id = a.worker_id
 WHERE a.id = %s
"""

EXTEND_LEASE = """
UPDATE queue_attempt SET lease_expires_at = %s, last_heartbeat_at = %s WHERE id = %s AND state = 'active'
"""

FOLLOW_UPS = "SELECT follow_ups FROM queue_job WHERE id = %s"

# What counts against a job's budgets: its attempts since an operator's last retry (job_retry).
FAILED_ATTEMPTS = """
SELECT COUNT(*) FROM queue_attempt a JOIN queue_job j ON j.id = a.job_id
 WHERE a.job_id = %s AND a.state = 'failed' AND a.number > j.retried_through
"""

EXPIRED_ATTEMPTS = """
SELECT COUNT(*) FROM queue_attempt a JOIN queue_job j ON j.id = a.job_id
 WHERE a.job_id = %s AND a.state = 'expired' AND a.number > j.retried_through
"""

REQUEST_CANCEL = """
UPDATE queue_job SET cancel_requested_at = %s, reason = %s
 WHERE id = %s AND state = 'leased' AND cancel_requested_at IS NULL
"""

# --------------------------------------------------------------------------- guarded moves

# The columns a guarded move may set besides `state` (services.transitions).
JOB_COLUMNS = frozenset(
    {"available_at", "current_attempt_id", "attempt_count", "summary", "reason", "finished_at", "cancel_requested_at",
     "retried_through"}
)  # fmt: skip
ATTEMPT_COLUMNS = frozenset({"finished_at", "error", "job_state"})


@functools.lru_cache(maxsize=64)
def move(table: str, columns: tuple[str, ...]) -> str:
    """`UPDATE <table> SET state = %s, <columns> = %s … WHERE id = %s AND state = %s`:
    the compare-and-set of one row's state (parameters: new state, the
    columns' values, id, expected old state)."""
    allowed = {"queue_job": JOB_COLUMNS, "queue_attempt": ATTEMPT_COLUMNS}[table]
    unknown = set(columns) - allowed
    if unknown:
        raise ValueError(f"{table}: a guarded move cannot set {sorted(unknown)}")
    sets = "".join(f", {c} = %s" for c in columns)
    return f"UPDATE {table} SET state = %s{sets} WHERE id = %s AND state = %s"


@functools.lru_cache(maxsize=64)
def moves_with_event(moves: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """PostgreSQL: the guarded moves `moves` ((table, columns) each, parameters as
    `move`'s) and an event row (INSERT_EVENT's parameters) in one statement, which
    answers each move's row count: one round trip instead of one per row."""
    parts = [f"m{i} AS ({move(table, columns)} RETURNING 1)" for i, (table, columns) in enumerate(moves)]
    parts.append("e AS (INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail)"
                 " VALUES (%s, %s, %s, %s, %s, %s))")
    counts = ", ".join(f"(SELECT COUNT(*) FROM m{i})" for i in range(len(moves)))
    return f"WITH {', '.join(parts)} SELECT {counts}"


_ATTEMPT_INSERT_COLUMNS = (
    "job_id, number, worker_id, session, token_hash, state, claimed_at, lease_expires_at, error, job_state"
)


@functools.lru_cache(maxsize=64)
def lease(rows: int, postgres: bool) -> tuple[str, ...]:
    """A claim's leases of `rows` jobs: their attempts, the jobs' moves to leased
    (a compare-and-set: the caller checks that `rows` rows moved) and their
    `claimed` events.

    PostgreSQL: one statement, answering (attempt id, job id, jobs moved) per
    attempt. Parameters: per row (job id, attempt number, token hash); worker id,
    session, now, lease expiry; the events' now and worker id.
    SQLite (no data-modifying WITH): three statements. The attempts' insert,
    answering (attempt id, job id); parameters per row: job id, number, worker id,
    session, token hash, now, expiry. The jobs' move; per row: job id, attempt id,
    number. The events' insert: INSERT_EVENT's parameters per row."""
    if postgres:
        values = ", ".join(["(CAST(%s AS bigint), CAST(%s AS integer), %s)"] * rows)
        return (
            f"WITH v (job_id, number, token_hash) AS (VALUES {values}),"
            f" a AS (INSERT INTO queue_attempt ({_ATTEMPT_INSERT_COLUMNS})"
            "  SELECT v.job_id, v.number, %s, %s, v.token_hash, 'active', %s, %s, '', '' FROM v"
            "  RETURNING id, job_id, number),"
            " j AS (UPDATE queue_job SET state = 'leased', current_attempt_id = a.id, attempt_count = a.number"
            "  FROM a WHERE queue_job.id = a.job_id AND queue_job.state = 'queued' RETURNING 1),"
            " e AS (INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail)"
            "  SELECT a.job_id, 'claimed', %s, %s, a.id, jsonb_build_object('number', a.number) FROM a)"
            " SELECT a.id, a.job_id, (SELECT COUNT(*) FROM j) FROM a",
        )
    # The attempt's own values come first in each row; worker, session and times are shared.
    attempts = ", ".join(["(%s, %s, %s, %s, %s, 'active', %s, %s, '', '')"] * rows)
    return (
        f"INSERT INTO queue_attempt ({_ATTEMPT_INSERT_COLUMNS}) VALUES {attempts} RETURNING id, job_id",
        # Not WITH … UPDATE: Python's sqlite3 counts rows only for a statement that starts with its verb.
        "UPDATE queue_job SET state = 'leased', current_attempt_id = v.column2, attempt_count = v.column3"
        f" FROM (VALUES {', '.join(['(%s, %s, %s)'] * rows)}) AS v"
        " WHERE queue_job.id = v.column1 AND queue_job.state = 'queued'",
        insert_events(rows),
    )


@functools.lru_cache(maxsize=64)
def succeed(rows: int, postgres: bool) -> tuple[str, ...]:
    """Settle `rows` attempts as succeeded, and their jobs: each attempt active →
    succeeded, each job from the state it was read in → succeeded, a `finished`
    event each (compare-and-sets: the caller checks that `rows` rows moved per table).

    PostgreSQL: one statement answering (attempts moved, jobs moved). Parameters:
    per row (attempt id, job id, the job's state, error, summary JSON, worker id);
    then now (attempts), now (jobs), now and the detail JSON (events).
    SQLite: three statements. The attempts' move: now, then per row (attempt id,
    error). The jobs' move: now, then per row (job id, its state, summary JSON).
    The events' insert: INSERT_EVENT's parameters per row."""
    if postgres:
        values = ", ".join(["(CAST(%s AS bigint), CAST(%s AS bigint), %s, %s, CAST(%s AS jsonb), %s)"] * rows)
        return (
            f"WITH v (attempt_id, job_id, job_state, error, summary, worker_id) AS (VALUES {values}),"
            " ma AS (UPDATE queue_attempt SET state = 'succeeded', finished_at = %s, error = v.error,"
            "  job_state = 'succeeded' FROM v WHERE queue_attempt.id = v.attempt_id AND queue_attempt.state = 'active'"
            "  RETURNING 1),"
            " mj AS (UPDATE queue_job SET state = 'succeeded', summary = v.summary, finished_at = %s, reason = ''"
            "  FROM v WHERE queue_job.id = v.job_id AND queue_job.state = v.job_state RETURNING 1),"
            " e AS (INSERT INTO queue_jobevent (job_id, kind, at, worker_id, attempt_id, detail)"
            "  SELECT v.job_id, 'finished', %s, v.worker_id, v.attempt_id, CAST(%s AS jsonb) FROM v)"
            " SELECT (SELECT COUNT(*) FROM ma), (SELECT COUNT(*) FROM mj)",
        )
    return (
        "UPDATE queue_attempt SET state = 'succeeded', finished_at = %s, error = v.column2, job_state = 'succeeded'"
        f" FROM (VALUES {', '.join(['(%s, %s)'] * rows)}) AS v"
        " WHERE queue_attempt.id = v.column1 AND queue_attempt.state = 'active'",
        "UPDATE queue_job SET state = 'succeeded', summary = v.column3, finished_at = %s, reason = ''"
        f" FROM (VALUES {', '.join(['(%s, %s, %s)'] * rows)}) AS v"
        " WHERE queue_job.id = v.column1 AND queue_job.state = v.column2",
        insert_events(rows),
    )


# --------------------------------------------------------------------------- values


def placeholders(n: int) -> str:
    return ", ".join(["%s"] * n)


def ts(value):
    """A datetime as the backend stores it: on SQLite the naive UTC text Django's
    adapt_datetimefield_value makes (the services' datetimes are aware), without
    its per-call settings lookups; on PostgreSQL the datetime itself."""
    if value is None or postgres():
        return value
    if value.tzinfo is dt.UTC:  # the clock's and the database's: already UTC, nothing to convert
        return str(value.replace(tzinfo=None))
    return _sqlite_text(value, value.utcoffset())


@functools.lru_cache(maxsize=256)
def _sqlite_text(value: dt.datetime, _offset: dt.timedelta | None) -> str:
    """ts on SQLite. Cached: a call passes the same few datetimes (its `now`, a lease's
    end) to several statements, and the conversion costs ~25 times the lookup. Keyed
    with the offset too: two wall times a DST fold apart compare equal in one zone."""
    if value.tzinfo is None:  # as Django's adapter stores a naive one: as it is
        return str(value)
    return str(value.astimezone(dt.UTC).replace(tzinfo=None))


@functools.cache
def postgres() -> bool:
    """Whether the database is PostgreSQL (else SQLite): one database per process (settings.DATABASES),
    asked once, since Django's per-thread connection lookup costs more than a small statement's work."""
    return connection.vendor == "postgresql"


def prepared_cursor():
    """PostgreSQL: a cursor (Django's wrapper, so error mapping and execute_wrapper
    see it) whose statements are bound on the server and prepared on their first run
    on a connection. Django's own cursors bind on the client and never prepare
    (its default, for poolers in transaction mode): each statement is then parsed
    and planned again, about half of a one-row enqueue's server time here. For the
    statements run thousands of times a second; the connection keeps psycopg's
    last 100 prepared statements (all dropped at a rollback, then prepared again).
    Needs a prepare_threshold in the connection's OPTIONS (settings._postgres sets
    one): None, Django's default, turns preparing off, and this cursor is then plain."""
    connection.close_if_health_check_failed()  # as connection.cursor() does
    connection.ensure_connection()
    return connection._prepare_cursor(_prepared_class()(connection.connection))


@functools.cache
def _prepared_class():
    import psycopg  # here: a SQLite process never loads it

    class Prepared(psycopg.Cursor):
        def execute(self, query, params=None, *, prepare=True, binary=None):
            return super().execute(query, params, prepare=prepare, binary=binary)

    return Prepared


def js(value) -> str:
    """`value` as JSON text that both backends store: NUL and lone surrogates as U+FFFD (clean)."""
    return encoded(value)[1]


def encoded(value) -> tuple[object, str]:
    """`value` as both backends store it (clean's, or `value` itself when it holds nothing clean
    replaces) and its JSON text. Encoded first as it is: its ASCII-only text shows either as an
    escape (`\\u0000`, `\\udXXX`), so only a value that may hold one is walked by clean and
    encoded again. The test is loose (an emoji's surrogate pair, Hangul at U+D000–U+D7FF and a
    backslash before `ud` pass it too): such text costs the walk, as every value did before."""
    text = json.dumps(value, separators=(",", ":"))
    if "\\u0000" in text or "\\ud" in text:
        value = clean(value)
        return value, json.dumps(value, separators=(",", ":"))
    return value, text


def from_js(value):
    """JSON columns come back as text on both backends (Django registers a text loader for jsonb)."""
    return json.loads(value) if isinstance(value, str | bytes) else value


def one(cursor, statement: str, params) -> tuple | None:
    cursor.execute(statement, params)
    return cursor.fetchone()


# Wake-ups for waiting claims (jobqueue.wakeup.emit).
NOTIFY = "SELECT pg_notify(%s, %s)"
INSERT_WAKEUP = "INSERT INTO queue_wakeup (message) VALUES (%s)"
PRUNE_WAKEUPS = "DELETE FROM queue_wakeup WHERE id <= %s"
