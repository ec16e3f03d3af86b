"""Putting jobs in the queue and taking them out by cancelling."""

import dataclasses
import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from django.db import IntegrityError, OperationalError, connection, transaction

from .. import conf, sql
from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound, Unavailable
from ..models import Job, JobState, RequirementSet
from ..types import CLAIM_FIELDS, Retry
from ..wakeup import Wake
from ..wakeup.emit import CHANNEL, emit, head_and_needs, told, write_row
from .common import actor_of, event, log, now_of, postgres, service
from .followups import checked_follow_ups
from .transitions import checked, job_move

INSERT_CHUNK = 500  # jobs per insert statement: far below either backend's limit on parameters


@dataclasses.dataclass(frozen=True)
class _Row:
    """One job to insert: its columns (sql.JOB_INSERT_COLUMNS) and its class."""

    columns: dict
    labels: list[str]
    capabilities: list[str]
    digest: str  # of its class: RequirementSet.digest_of
    payload_text: str  # the payload as stored (sql.js): encoded once, checked for what clean replaces

    @property
    def key(self) -> str:
        return self.columns["key"]

    @property
    def needs(self) -> tuple:
        """What a worker needs to claim the job (a Wake's `needs`)."""
        return self.columns["pool"], frozenset(self.labels), frozenset(self.capabilities)

    def params(self) -> list:
        c = self.columns
        return [
            self.payload_text if name == "payload" else _json(c[name]) if name == "follow_ups" else c[name]
            for name in sql.JOB_INSERT_COLUMNS
        ] + [self.digest]

    def job(self, pk: int, requirements_id: int, now: dt.datetime) -> Job:
        """The Job as the insert wrote it, without reading it back."""
        fields = {**_NEW_JOB, "summary": {}, **self.columns, "id": pk, "requirements_id": requirements_id,
                  "available_at": now, "created_at": now}  # fmt: skip  (a summary dict of its own per Job)
        return Job.from_db(connection.alias, _JOB_FIELDS, [fields[name] for name in _JOB_FIELDS])


# Every column of a new job that an enqueue does not set, as the insert writes it.
_NEW_JOB = {"state": JobState.QUEUED, "attempt_count": 0, "retried_through": 0, "summary": {}, "reason": "",
            "cancel_requested_at": None, "current_attempt_id": None, "finished_at": None}  # fmt: skip
_JOB_FIELDS = [field.attname for field in Job._meta.concrete_fields]


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _row(
    *,
    key: str,
    payload: dict,
    project: str,
    source: str,
    agent: str,
    runner: str,
    pool: str | None = None,
    labels: Iterable[str] = (),
    capabilities: Iterable[str] = (),
    affinity_key: str | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    retry: Retry | None = None,
    follow_ups: Mapping[str, list[dict]] | None = None,
) -> _Row:
    """One job's spec checked and in the form it is stored; InvalidRequest naming what is wrong."""
    if not isinstance(payload, dict):
        raise InvalidRequest(f"payload must be a JSON object, got {type(payload).__name__}", field="payload")
    clashing = CLAIM_FIELDS.intersection(payload)
    if clashing:
        raise InvalidRequest(f"payload keys {sorted(clashing)} are the queue's own", field="payload")
    retry = retry or Retry()
    pool, labels, capabilities = pool or None, sorted(set(labels)), sorted(set(capabilities))
    payload, payload_text = sql.encoded(payload)  # encoded once, cleaned only when it must be
    columns = {
        "key": key, "payload": payload, "project": project, "source": source, "agent": agent,
        "runner": runner, "pool": pool, "affinity_key": affinity_key, "priority": priority,
        "max_attempts": max_attempts or conf.current().max_attempts, "retry_max_attempts": retry.max_attempts,
        "retry_backoff": retry.backoff, "retry_backoff_max": retry.backoff_max,
        "follow_ups": checked_follow_ups(follow_ups),
    }  # fmt: skip
    digest = RequirementSet.digest_of(pool, labels, capabilities, (project, source, agent, runner))
    return _Row(columns=columns, labels=labels, capabilities=capabilities, digest=digest, payload_text=payload_text)


def _requirement_set(row: _Row) -> None:
    """Create the class of a job (its requirements and its limit keys) unless it exists.
    Enqueue finds the class by digest in its insert; this runs only for a class no job had before."""
    if RequirementSet.objects.filter(digest=row.digest).exists():
        return
    keys = {name: row.columns[name] for name in ("pool", "project", "source", "agent", "runner")}
    try:
        with transaction.atomic():
            RequirementSet.objects.create(labels=row.labels, capabilities=row.capabilities, digest=row.digest, **keys)
    except IntegrityError:  # created concurrently (PostgreSQL)
        pass


def _insert(cursor, rows: list[_Row], now: dt.datetime) -> dict[str, tuple[int, int]]:
    """Insert what is new of `rows` (and, on PostgreSQL, their events); {key: (job id, requirement set id)}
    of the jobs inserted."""
    if not rows:
        return {}
    at = sql.ts(now)
    params = [p for row in rows for p in row.params()] + [at, at] + ([at] if postgres() else [])
    cursor.execute(sql.insert_jobs(len(rows), postgres()), params)
    return {key: (pk, requirements_id) for pk, key, requirements_id in cursor.fetchall()}


def _existing(keys: list[str]) -> dict[str, Job]:
    return {job.key: job for job in Job.objects.filter(key__in=keys)} if keys else {}


def _enqueue(rows: list[_Row], now: dt.datetime) -> list[tuple[Job, bool]]:
    """Insert `rows` (at most INSERT_CHUNK) in the caller's transaction; (job, created) per row, in order."""
    firsts: dict[str, _Row] = {}
    for row in rows:  # a key given twice: the first spec is the job (the insert must not choose)
        firsts.setdefault(row.key, row)
    with connection.cursor() as cursor:
        inserted = _insert(cursor, list(firsts.values()), now)
        existing = _existing([key for key in firsts if key not in inserted])
        # Neither inserted nor there: the row's class is new. Create it, then insert those again.
        orphans = [row for key, row in firsts.items() if key not in inserted and key not in existing]
        if orphans:
            for row in {row.digest: row for row in orphans}.values():
                _requirement_set(row)
            inserted |= _insert(cursor, orphans, now)
            # PostgreSQL: a key that still did not insert was enqueued by another transaction meanwhile.
            existing |= _existing([row.key for row in orphans if row.key not in inserted])
        results, created = [], {}
        for row in rows:
            if row.key in created or row.key not in inserted:  # an existing key, or one earlier in `rows`
                results.append((created.get(row.key) or existing[row.key], False))
                continue
            job = created[row.key] = firsts[row.key].job(*inserted[row.key], now)
            results.append((job, True))
        if not postgres():  # PostgreSQL's insert wrote them
            _enqueued_events(cursor, list(created.values()), now)
        _wake(cursor, [(job, row) for (job, new), row in zip(results, rows, strict=True) if new])
    return results


def _enqueued_events(cursor, jobs: list[Job], now: dt.datetime) -> None:
    """SQLite: the `enqueued` event of each job created: common.event's row; for many, one
    multi-row insert (an executemany steps the statement once per row)."""
    if len(jobs) == 1:
        event(cursor, job_id=jobs[0].pk, kind="enqueued", at=now)
    elif jobs:
        at, detail = sql.ts(now), sql.js({})
        cursor.execute(sql.insert_events(len(jobs)), [p for job in jobs for p in (job.pk, "enqueued", at, None, None, detail)])


def _wake(cursor, created: list[tuple[Job, _Row]]) -> None:
    """One wake per job class (and pinned worker) for the jobs created, each for as many waiters as jobs."""
    pins = {}
    keys = sorted({job.affinity_key for job, _ in created if job.affinity_key is not None})
    if keys:
        cursor.execute(sql.pins_of(len(keys)), keys)
        pins = dict(cursor.fetchall())
    counts: Counter = Counter()
    needs = {}
    for job, row in created:
        counts[job.requirements_id, pins.get(job.affinity_key)] += 1
        needs[job.requirements_id] = row.needs
    for (requirements_id, worker_id), count in counts.items():
        emit(cursor, Wake(requirements=requirements_id, worker_id=worker_id, count=count, needs=needs[requirements_id]))


def _in_transaction(name: str) -> None:
    if not connection.in_atomic_block:
        raise RuntimeError(f"{name}() runs inside its caller's transaction; use job_enqueue() otherwise")


def job_enqueue_in(*, clock: Clock | None = None, **spec) -> tuple[Job, bool]:
    """Persist a job under its dedup `key`; returns (job, created).

    `spec`: key, payload, project, source, agent, runner (required); pool,
    labels, capabilities, affinity_key, priority, max_attempts, retry,
    follow_ups. The same key returns the existing job and creates nothing.
    `payload` is stored as given (NUL and lone surrogates become U+FFFD) and
    handed to every claim of the job unchanged; its keys may not be the
    queue's own (jobqueue.types.CLAIM_FIELDS). Capabilities and labels are
    required of the claiming worker verbatim; the limit keys count its live attempts.

    This runs inside the caller's transaction, for a service of a layer above
    that writes its own rows together with the job (a workflow instance):
    both commit, or neither does. `job_enqueue` is the same as a service of
    its own, committed when it returns, before any claim can see the job.

    `follow_ups` ({terminal state: [job spec, …]}, services/followups.py) are
    enqueued in the transaction that settles this job in that state."""
    _in_transaction("job_enqueue_in")
    now = now_of(clock)
    return _enqueue([_row(**spec)], now)[0]


def jobs_enqueue_in(specs: Sequence[Mapping], *, clock: Clock | None = None) -> list[tuple[Job, bool]]:
    """job_enqueue_in for many jobs at once, in the caller's transaction: `specs` are its
    keyword arguments; (job, created) per spec, in order. A spec whose key is already
    in the queue, or earlier in `specs`, returns that job and creates nothing. Any bad
    spec (InvalidRequest) refuses them all before anything is written. One insert per
    INSERT_CHUNK jobs, and one wake per job class for all of its new jobs."""
    _in_transaction("jobs_enqueue_in")
    now = now_of(clock)
    rows = [_row(**spec) for spec in specs]
    return [result for i in range(0, len(rows), INSERT_CHUNK) for result in _enqueue(rows[i : i + INSERT_CHUNK], now)]


_job_enqueue = service(job_enqueue_in)


def job_enqueue(*, clock: Clock | None = None, **spec) -> tuple[Job, bool]:
    """job_enqueue_in as a service of its own: committed when it returns, before any claim
    can see the job.

    Outside any transaction, a new job of a class already known and without an affinity
    key takes a shorter way, with the same rows and the same single commit: on PostgreSQL
    one statement (_enqueue_alone), on SQLite a transaction of its own (_enqueue_alone_sqlite).
    A key already queued answers its job; a class not seen before takes the service."""
    if not connection.in_atomic_block and connection.get_autocommit():
        row = _row(**spec)
        if row.columns["affinity_key"] is None:
            try:
                done = (_enqueue_alone if postgres() else _enqueue_alone_sqlite)(row, now_of(clock))
            except OperationalError as exc:
                raise Unavailable.of(exc) from exc
            if done is not None:
                return done
    return _job_enqueue(clock=clock, **spec)


job_enqueue.body = job_enqueue_in  # a group commit's batch runs it as the plain service would


def _enqueue_alone(row: _Row, now: dt.datetime) -> tuple[Job, bool] | None:
    """PostgreSQL, in autocommit: `row` inserted with its event and its wake in one statement,
    atomic and committed as one, in one round trip where BEGIN … COMMIT costs four.
    (job, created); None when its class does not exist yet (nothing was written)."""
    wake = Wake(requirements=None, needs=row.needs)
    at = sql.ts(now)
    with sql.prepared_cursor() as cursor:
        cursor.execute(sql.insert_jobs(1, True, notify=True), [*row.params(), at, at, at, CHANNEL, *head_and_needs(wake)])
        inserted = cursor.fetchall()
    if not inserted:
        return _already(row)
    pk, _key, requirements_id, _notified = inserted[0]
    told(dataclasses.replace(wake, requirements=requirements_id))  # this process's waiters
    return row.job(pk, requirements_id, now), True


def _enqueue_alone_sqlite(row: _Row, now: dt.datetime) -> tuple[Job, bool] | None:
    """SQLite, in autocommit: `row` inserted with its event and its wake between a BEGIN
    IMMEDIATE and a COMMIT of its own, on Django's cursor (so its error mapping and execute
    wrappers see every statement). It is the transaction transaction.atomic would open,
    without atomic's bookkeeping (savepoint state, on-commit hooks, durability and thread
    checks), which is about a fifth of a one-row enqueue's CPU. Nothing inside needs it:
    the statements are the job's insert, its event and its wake row (with, now and then, the
    wake rows' prune), and this process's waiters hear the wake after the COMMIT, as emit's
    on-commit hook would tell them. (job, created); None when its class does not exist yet
    (nothing was written), or when the connection holds a transaction already, which is not
    ours to commit or roll back (the service's atomic then says what is wrong)."""
    at = sql.ts(now)
    with connection.cursor() as cursor:
        raw = connection.connection
        if raw.in_transaction:
            return None
        try:
            # The write lock at once, as the settings' transaction_mode takes it. Inside the try:
            # whatever raises once BEGIN has taken effect must end this transaction here.
            cursor.execute("BEGIN IMMEDIATE")
            cursor.execute(sql.insert_jobs(1, False), [*row.params(), at, at])
            inserted = cursor.fetchone()
            if inserted is not None:
                pk, _key, requirements_id = inserted
                event(cursor, job_id=pk, kind="enqueued", at=now)
                wake = Wake(requirements=requirements_id, needs=row.needs)
                write_row(cursor, wake)
            cursor.execute("COMMIT")
        except BaseException:
            if raw.in_transaction:  # not when BEGIN failed or COMMIT (or SQLite) ended it
                _roll_back(raw)
            raise
    if inserted is None:
        return _already(row)
    told(wake)
    return row.job(pk, requirements_id, now), True


def _roll_back(raw) -> None:
    """End a transaction of _enqueue_alone_sqlite's that failed, keeping the failure the one
    raised. A ROLLBACK that fails too leaves the connection in a transaction no later call
    could begin over: it is closed, so the next one opens a fresh connection (SQLite drops
    the uncommitted writes with it)."""
    try:
        raw.rollback()
    except Exception:
        log.exception("rolling back a failed enqueue failed; closing the connection")
        connection.close()


def _already(row: _Row) -> tuple[Job, bool] | None:
    """After an insert that wrote nothing: the job already queued under `row`'s key, or None
    (its class does not exist yet)."""
    existing = _existing([row.key])
    return (existing[row.key], False) if row.key in existing else None


def _cancel(job: Job, now: dt.datetime, reason: str, actor: str | None = None) -> Job:
    if job.terminal or job.cancel_requested_at is not None:
        return job
    with connection.cursor() as cursor:
        if job.state == JobState.QUEUED:
            job_move(
                cursor, job_id=job.pk, old=job.state, new=JobState.CANCELLED,
                finished_at=now, reason=reason, cancel_requested_at=now,
            )
            job.state, job.finished_at = JobState.CANCELLED, now
            event(cursor, job_id=job.pk, kind="cancelled", at=now, reason=reason, **actor_of(actor))
        else:  # leased: the next heartbeat answers cancel; expiry settles it if no heartbeat ever comes
            checked(cursor, sql.REQUEST_CANCEL, [sql.ts(now), reason, job.pk], f"cancel request of job {job.pk}")
            event(cursor, job_id=job.pk, kind="cancel_requested", at=now, reason=reason, **actor_of(actor))
    job.cancel_requested_at, job.reason = now, reason
    return job


@service
def job_cancel(
    *, job_id: int, reason: str = "cancelled on request", actor: str | None = None, clock: Clock | None = None
) -> Job:
    """Queued → cancelled at once; leased → cancel requested; terminal → unchanged.
    `actor` (who asked: an admin user, `cli:<os user>`) goes in the event."""
    qs = Job.objects.select_for_update() if postgres() else Job.objects
    job = qs.filter(pk=job_id).first()
    if job is None:
        raise NotFound(f"no job {job_id}", job_id=job_id)
    return _cancel(job, now_of(clock), reason, actor)


RETRYABLE = frozenset({JobState.FAILED, JobState.CANCELLED})


@service
def job_retry(*, job_id: int, actor: str | None = None, clock: Clock | None = None) -> Job:
    """An operator's retry: a failed or cancelled job is queued again as itself — the same
    key (no second job for the enqueuer's dedup), the same journal (what it records done is
    final, records.py: the workflow layer never repeats a done publish or spawn) — and its next claim is a new
    attempt, numbered after the last. Its budgets start afresh: max_attempts and the retry
    policy count only attempts after this one (`retried_through`). What its last end left is
    cleared (finished_at, reason, a cancel request); its summary (the last finished attempt's
    account, naming that attempt) stays until the next finish replaces it. Its follow-ups stay: each is
    enqueued at most once per outcome (its own dedup key), so a retried job that now
    succeeds enqueues its `succeeded` follow-ups, while those of the outcome it already had
    (a failure hook that ran) are not enqueued again. Refused (InvalidRequest, naming the
    state) for a job that is queued, leased or succeeded."""
    qs = Job.objects.select_for_update() if postgres() else Job.objects
    job = qs.filter(pk=job_id).first()
    if job is None:
        raise NotFound(f"no job {job_id}", job_id=job_id)
    if job.state == JobState.SUCCEEDED:
        raise InvalidRequest(
            f"job {job_id} succeeded: only a failed or cancelled job can be retried", field="job_id", state=job.state
        )
    if job.state not in RETRYABLE:
        raise InvalidRequest(
            f"job {job_id} is {job.state}, not finished: only a failed or cancelled job can be retried",
            field="job_id", state=job.state,
        )  # fmt: skip
    now = now_of(clock)
    before, reason = job.state, job.reason
    with connection.cursor() as cursor:
        job_move(
            cursor, job_id=job.pk, old=before, new=JobState.QUEUED, available_at=now, finished_at=None, reason="",
            cancel_requested_at=None, current_attempt_id=None, retried_through=job.attempt_count,
        )  # fmt: skip
        event(
            cursor, job_id=job.pk, kind="retried", at=now, previous_state=before, previous_reason=reason,
            attempts_before=job.attempt_count, **actor_of(actor),
        )  # fmt: skip
        pinned = sql.one(cursor, sql.PIN_OF, [job.affinity_key]) if job.affinity_key is not None else None
        emit(cursor, Wake(requirements=job.requirements_id, worker_id=pinned[0] if pinned else None))
    job.refresh_from_db()
    return job
