"""Every state change of the queue, one durable transaction each.

Views, admin actions, commands and the worker runtime call these functions;
nothing else writes queue rows. Each takes `now` from the injected clock
(`clock=` or jobqueue.clock's current clock), raises domain errors from
jobqueue.exceptions, and writes a JobEvent row per job transition in the same
transaction.

Writes are guarded compare-and-set updates (`filter(state=…).update(…)`),
so a row another process moved is never overwritten.
"""

import dataclasses
import datetime as dt
import functools
import hashlib
import hmac
import logging
import random
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable

from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import F

from workers.models import Worker
from workflows.models import Task, WorkflowInstance

from . import conf, sql
from .clock import Clock, get_clock
from .exceptions import InvalidRequest, NotFound, SessionSuperseded, StaleAttempt, Unavailable
from .models import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATES,
    Affinity,
    Attempt,
    AttemptState,
    Job,
    JobEvent,
    JobState,
    RequirementSet,
)

log = logging.getLogger("apiary.queue")

WORKER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
OUTCOMES = (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.CANCELLED)
BASE_CAPABILITY = "apiary.workflow"
CANDIDATE_SPARES = 8  # PostgreSQL: extra candidates per claim, for rows other claimers hold locked
PIN_LOCK_SPACE = 0x41504941  # "APIA": the advisory-lock key space of affinity pins
UNION_TERMS = 400  # classes walked per candidate statement (SQLite's compound SELECT limit is 500)

_jitter = random.Random()


def _service(fn):
    """One durable transaction per call; a database that stays locked or
    unreachable past the busy timeout surfaces as `Unavailable` (retryable)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with transaction.atomic(durable=True):
                return fn(*args, **kwargs)
        except OperationalError as exc:
            raise Unavailable(f"database unavailable: {exc}") from exc

    return wrapper


def _now(clock: Clock | None) -> dt.datetime:
    return (clock or get_clock()).now()


def _postgres() -> bool:
    return connection.vendor == "postgresql"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def check_transition(table: dict[str, frozenset[str]], old: str, new: str) -> None:
    if new not in table[old]:
        raise AssertionError(f"illegal transition {old} → {new}")


def _event(job: Job, kind: str, at: dt.datetime, *, worker_id=None, attempt=None, **detail) -> None:
    JobEvent.objects.create(job=job, kind=kind, at=at, worker_id=worker_id, attempt=attempt, detail=detail)


def _move_job(job: Job, new_state: str, **fields) -> None:
    """Guarded write of a job's state: only from the state we read, along a legal edge."""
    check_transition(JOB_TRANSITIONS, job.state, new_state)
    updated = Job.objects.filter(pk=job.pk, state=job.state).update(state=new_state, **fields)
    if updated != 1:  # impossible while we hold the write lock (SQLite) or the row lock (PostgreSQL)
        raise RuntimeError(f"job {job.pk} moved under us (expected {job.state})")
    job.state = new_state
    for name, value in fields.items():
        if not isinstance(value, F):
            setattr(job, name, value)


def _end_attempt(attempt: Attempt, new_state: str, now: dt.datetime, **fields) -> None:
    check_transition(ATTEMPT_TRANSITIONS, attempt.state, new_state)
    updated = Attempt.objects.filter(pk=attempt.pk, state=AttemptState.ACTIVE).update(
        state=new_state, finished_at=now, **fields
    )
    if updated != 1:
        raise RuntimeError(f"attempt {attempt.pk} moved under us")
    attempt.state = new_state
    attempt.finished_at = now


def _settle_terminal(job: Job, now: dt.datetime, *, summary=None, error: str = "") -> None:
    """A terminal job's instance and task follow it in the same transaction."""
    instance_fields = {"state": job.state, "finished_at": now, "error": error or job.reason}
    if summary is not None:
        instance_fields["summary"] = summary
    WorkflowInstance.objects.filter(pk=job.instance_id).update(**instance_fields)
    Task.objects.filter(pk=job.task_id, generation=job.generation).update(state=job.state, updated_at=now)


# --------------------------------------------------------------------------- enqueue


@dataclasses.dataclass(frozen=True)
class Retry:
    """Workflow retry policy for attempts that finish `failed`."""

    max_attempts: int = 1
    backoff: float = 0.0
    backoff_max: float = 300.0


def _requirement_set(
    pool: str | None, labels: Iterable[str], capabilities: Iterable[str], keys: tuple[str, str, str, str]
) -> RequirementSet:
    """The class of a job: its requirements and its limit keys (project, source, agent, runner)."""
    labels, capabilities = sorted(set(labels)), sorted(set(capabilities))
    digest = RequirementSet.digest_of(pool, labels, capabilities, keys)
    found = RequirementSet.objects.filter(digest=digest).first()
    if found:
        return found
    project, source, agent, runner = keys
    try:
        with transaction.atomic():
            return RequirementSet.objects.create(
                pool=pool, labels=labels, capabilities=capabilities, digest=digest,
                project=project, source=source, agent=agent, runner=runner,
            )
    except IntegrityError:  # created concurrently (PostgreSQL)
        return RequirementSet.objects.get(digest=digest)


def enqueue_key(task: Task, workflow: str) -> str:
    return f"{task.pk}:{task.generation}:{workflow}"


@_service
def job_enqueue(
    *,
    task: Task,
    workflow: str,
    agent: str,
    runner: str,
    project: str,
    pool: str | None = None,
    labels: Iterable[str] = (),
    capabilities: Iterable[str] = (),
    affinity: bool = False,
    priority: int = 0,
    max_attempts: int | None = None,
    retry: Retry | None = None,
    clock: Clock | None = None,
) -> tuple[Job, bool]:
    """Persist a dispatch of `workflow` on the task's current generation.

    Returns (job, created). The same key returns the existing job and creates
    nothing. The job is committed when this returns, before any claim can see it.
    """
    now = _now(clock)
    key = enqueue_key(task, workflow)
    existing = Job.objects.filter(key=key).first()
    if existing:
        return existing, False
    retry = retry or Retry()
    pool = pool or None
    requirements = _requirement_set(
        pool, labels, [*capabilities, BASE_CAPABILITY, f"runner:{runner}"], (project, task.source, agent, runner)
    )
    try:
        with transaction.atomic():
            instance = WorkflowInstance.objects.create(
                task=task, generation=task.generation, workflow=workflow, created_at=now
            )
            job = Job.objects.create(
                key=key,
                task=task,
                instance=instance,
                generation=task.generation,
                workflow=workflow,
                project=project,
                source=task.source,
                agent=agent,
                runner=runner,
                pool=pool,
                requirements=requirements,
                affinity=affinity,
                priority=priority,
                available_at=now,
                max_attempts=max_attempts or conf.current().max_attempts,
                retry_max_attempts=retry.max_attempts,
                retry_backoff=retry.backoff,
                retry_backoff_max=retry.backoff_max,
                created_at=now,
            )
    except IntegrityError:  # the same key enqueued concurrently (PostgreSQL)
        return Job.objects.get(key=key), False
    _event(job, "enqueued", now)
    Task.objects.filter(pk=task.pk, generation=task.generation).update(state="active", updated_at=now)
    return job, True


# --------------------------------------------------------------------------- claim


@dataclasses.dataclass(frozen=True)
class Claim:
    """A leased job, as a worker needs it. `token` is the only copy of the attempt's secret."""

    job_id: int
    attempt_id: int
    attempt_number: int
    token: str
    lease_expires_at: dt.datetime
    workflow: str
    instance_id: int
    agent: str
    runner: str
    task: dict


class _RequirementCache:
    """Requirement sets (job classes) are immutable and never deleted, so each
    process keeps the ones it has seen and asks only for what it has not.

    On PostgreSQL ids are handed out at insert and become visible at commit,
    so a set can appear *below* the highest id already seen. Ids skipped that
    way are remembered as gaps and asked for again on every call until they
    show up, or for GAP_SECONDS (a rolled-back insert leaves a gap for good).
    Shared by the threads of a process (gthread listener, the daemon's worker):
    the lock guards the state, never a query."""

    GAP_SECONDS = 300.0

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.sets: dict[int, tuple[str | None, frozenset, frozenset, dict[str, str | None]]] = {}
            self.last_id = 0
            self.gaps: dict[int, float] = {}  # id → monotonic time it was first missed

    def eligible(self, cursor, pool: str | None, labels: set[str], capabilities: set[str]) -> list[tuple[int, dict]]:
        """[(set id, its limit keys by dimension)] for the sets this worker satisfies."""
        with self.lock:
            last_id, gaps = self.last_id, sorted(self.gaps)
        statement, params = sql.REQUIREMENT_SETS, [last_id]
        if gaps:
            statement = statement.replace("WHERE id > %s", f"WHERE id > %s OR id IN ({', '.join(['%s'] * len(gaps))})")
            params += gaps
        cursor.execute(statement, params)
        rows = cursor.fetchall()
        now = time.monotonic()
        with self.lock:
            for pk, need_pool, need_labels, need_caps, project, source, agent, runner in rows:
                keys = {"project": project, "source": source, "agent": agent, "runner": runner, "pool": need_pool}
                self.sets[pk] = (need_pool, frozenset(sql.from_js(need_labels)), frozenset(sql.from_js(need_caps)), keys)
                self.gaps.pop(pk, None)
            newest = max((row[0] for row in rows), default=0)
            for missing in range(self.last_id + 1, newest):
                if missing not in self.sets:
                    self.gaps.setdefault(missing, now)
            self.last_id = max(self.last_id, newest)
            for pk, since in list(self.gaps.items()):
                if now - since > self.GAP_SECONDS:
                    del self.gaps[pk]
            known = list(self.sets.items())
        return [
            (pk, keys)
            for pk, (need_pool, need_labels, need_caps, keys) in known
            if RequirementSet.met(need_pool, need_labels, need_caps, pool=pool, labels=labels, capabilities=capabilities)
        ]


_requirements = _RequirementCache()


def _live_counts(cursor, dimensions: tuple[str, ...], now, only: list[tuple[str, str, int]] | None = None) -> Counter:
    """Live (active, unexpired) attempts per (dimension, key), counted from the
    attempts themselves inside the claim: no counter that a crashed worker could leak."""
    columns = ", ".join(f"j.{d}" for d in dimensions)
    where, params = "a.state = 'active' AND a.lease_expires_at > %s", [now]
    if only:
        where += " AND (" + " OR ".join(f"j.{d} = %s" for d, _, _ in only) + ")"
        params += [k for _, k, _ in only]
    cursor.execute(
        f"SELECT {columns}, COUNT(*) FROM queue_attempt a JOIN queue_job j ON j.id = a.job_id"
        f" WHERE {where} GROUP BY {columns}",
        params,
    )
    counts: Counter = Counter()
    for row in cursor.fetchall():
        for d, key in zip(dimensions, row[:-1], strict=True):
            counts[(d, key)] += row[-1]
    return counts


def _lock_limit_keys(cursor, keys: list[tuple[str, str, int]]) -> bool:
    """PostgreSQL: a transaction-scoped advisory lock per limited key, so two
    claims touching the same key are serialised and count each other's
    attempts. try-locks never wait, so they cannot deadlock; a key another
    claimer holds skips this job for now, as skip_locked skips a locked row."""
    ids = sorted(
        int.from_bytes(hashlib.blake2b(f"apiary-limit:{d}:{k}".encode(), digest_size=8).digest(), "big", signed=True)
        for d, k, _ in keys
    )
    cursor.execute("SELECT bool_and(pg_try_advisory_xact_lock(k)) FROM unnest(%s::bigint[]) AS k", [ids])
    return bool(cursor.fetchone()[0])


def _pin(task_id: int, worker_id: str, now: dt.datetime) -> bool:
    """First claim of an affinity task pins it to the claimer; True when pinned to us.

    On PostgreSQL a concurrent claimer pinning the same task would make the
    insert wait for its commit, and two claims pinning two tasks in opposite
    orders would deadlock: a try-lock per task passes the job over instead."""
    if _postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", [PIN_LOCK_SPACE, task_id % 2**31])
            if not cursor.fetchone()[0]:
                return False
    Affinity.objects.bulk_create([Affinity(task_id=task_id, worker_id=worker_id, pinned_at=now)], ignore_conflicts=True)
    return Affinity.objects.filter(task_id=task_id).values_list("worker_id", flat=True).first() == worker_id


def _worker_for_call(worker_id: str, session: str) -> Worker:
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    if not hmac.compare_digest(worker.session, session):
        raise SessionSuperseded(f"worker {worker_id!r} was registered again by a newer process", worker_id=worker_id)
    return worker


@_service
def jobs_claim(*, worker_id: str, session: str, max_jobs: int = 1, clock: Clock | None = None) -> list[Claim]:
    """Lease up to `max_jobs` eligible queued jobs to the worker (never beyond
    its free capacity), best first: priority, then age. [] when there is none.
    Eligibility is DESIGN §3.3: pool, labels, capabilities, affinity pin,
    limits counted from live attempts, capacity, ready and not draining."""
    now = _now(clock)
    cfg = conf.current()
    postgres = _postgres()
    n_ow = sql.ts(now)
    with connection.cursor() as cursor:
        if postgres:
            # Serialise claims of one worker, then count its attempts in a new
            # statement: READ COMMITTED gives each statement a fresh snapshot,
            # but a sub-select in the locking statement would still see the
            # world from before it waited for the lock.
            cursor.execute("SELECT 1 FROM workers_worker WHERE worker_id = %s FOR UPDATE", [worker_id])
        row = sql.one(cursor, sql.WORKER_FOR_CLAIM, [n_ow, worker_id])
        if row is None:
            raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
        w_session, pool, labels, capabilities, capacity, draining, ready, drain_requested, busy = row
        if not hmac.compare_digest(w_session, session):
            raise SessionSuperseded(f"worker {worker_id!r} was registered again by a newer process", worker_id=worker_id)
        wanted = min(max_jobs, capacity - busy)
        if draining or drain_requested or not ready or wanted <= 0:
            return []
        eligible = _requirements.eligible(cursor, pool, set(sql.from_js(labels)), set(sql.from_js(capabilities)))
        if not eligible:
            return []
        limits = cfg.limits
        dimensions = limits.active_dimensions()
        counts = _live_counts(cursor, dimensions, n_ow) if dimensions else Counter()

        claims: list[Claim] = []
        passed_over: set[int] = set()
        for _round in range(4):  # each round claims or passes over ≥1 job; a short answer is fine
            want = wanted - len(claims)
            open_sets = [
                pk for pk, keys in eligible
                if not any(counts[(d, keys[d])] >= limits.limit(d, keys[d]) > 0 for d in dimensions)
            ]
            batch = _candidates(cursor, open_sets, worker_id, n_ow, passed_over, want) if open_sets else []
            for cand in batch:
                keys = [(d, cand[d], lim) for d in dimensions if (lim := limits.limit(d, cand[d])) > 0]
                if keys and postgres:
                    if not _lock_limit_keys(cursor, keys):
                        passed_over.add(cand["id"])
                        continue
                    fresh = _live_counts(cursor, dimensions, n_ow, keys)  # recounted under the lock
                    for d, k, _ in keys:
                        counts[(d, k)] = fresh[(d, k)]
                if any(counts[(d, k)] >= lim for d, k, lim in keys) or (
                    cand["affinity"] and not _pin(cand["task_id"], worker_id, now)
                ):
                    passed_over.add(cand["id"])
                    continue
                claims.append(_lease(cursor, cand, worker_id, w_session, now, cfg))
                for d, k, _ in keys:
                    counts[(d, k)] += 1
            if len(batch) < want or len(claims) == wanted:
                break
        return claims


def _candidates(cursor, classes: list[int], worker_id: str, n_ow, passed_over: set[int], want: int) -> list[dict]:
    """Up to `want` claimable jobs of the given classes, best first.

    Each class is walked on its own through the partial index
    (requirements, -priority, available_at, id) and stops after `want` rows;
    the union of those short walks is merged and cut. Only pinned-elsewhere
    affinity jobs and jobs passed over earlier in this claim are skipped one by
    one. On PostgreSQL the chosen rows are then locked, skipping any another
    claimer holds."""
    walk = (
        "SELECT j.id, j.priority, j.available_at FROM queue_job j{hint}"
        " LEFT JOIN queue_affinity af ON af.task_id = j.task_id"
        " WHERE j.state = 'queued' AND j.requirements_id = %s AND j.available_at <= %s"
        " AND (NOT j.affinity OR af.worker_id IS NULL OR af.worker_id = %s){skip}"
        " ORDER BY j.priority DESC, j.available_at, j.id LIMIT %s"
    ).format(
        # SQLite without ANALYZE statistics may prefer another index and sort;
        # PostgreSQL picks the claim-order index by itself.
        hint="" if _postgres() else " INDEXED BY job_claim_order",
        skip=f" AND j.id NOT IN ({', '.join(['%s'] * len(passed_over))})" if passed_over else "",
    )
    # On PostgreSQL concurrent claimers see the same best jobs; a few spare
    # candidates let one that finds them locked take the next ones instead of
    # coming back empty. SQLite claims one at a time: no spares needed.
    postgres = _postgres()
    walk_limit = want + (CANDIDATE_SPARES if postgres else 0)
    skipped = sorted(passed_over)
    found: list[tuple] = []
    # SQLite allows at most 500 terms in one compound SELECT: walk the classes in chunks.
    for first in range(0, len(classes), UNION_TERMS):
        parts, params = [], []
        for i, pk in enumerate(classes[first : first + UNION_TERMS]):
            parts.append(f"SELECT * FROM ({walk}) AS c{i}")
            params += [pk, n_ow, worker_id, *skipped, walk_limit]
        cursor.execute(
            " UNION ALL ".join(parts) + " ORDER BY priority DESC, available_at, id LIMIT %s", [*params, walk_limit]
        )
        found += cursor.fetchall()
    found.sort(key=lambda row: (-row[1], row[2], row[0]))
    ids = [row[0] for row in found[:walk_limit]]
    if not ids:
        return []
    statement = (
        f"SELECT {sql.CANDIDATE_COLUMNS} FROM queue_job j JOIN workflows_task t ON t.id = j.task_id"
        f" WHERE j.state = 'queued' AND j.available_at <= %s AND j.id IN ({', '.join(['%s'] * len(ids))})"
        " ORDER BY j.priority DESC, j.available_at, j.id LIMIT %s"
    )
    if postgres:
        statement += " FOR UPDATE OF j SKIP LOCKED"  # the LIMIT counts only rows it could lock
    cursor.execute(statement, [n_ow, *ids, want])
    names = ("id", "attempt_count", "workflow", "instance_id", "agent", "runner", "project", "source", "pool")
    names += ("affinity", "task_id", "t_source", "item_key", "generation", "title", "body", "payload")
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _lease(cursor, cand: dict, worker_id: str, session: str, now: dt.datetime, cfg: conf.QueueConfig) -> Claim:
    token = secrets.token_urlsafe(32)  # 256 bits; only its hash is stored
    number = cand["attempt_count"] + 1
    expires = now + cfg.lease
    n_ow = sql.ts(now)
    row = sql.one(
        cursor,
        sql.INSERT_ATTEMPT,
        [cand["id"], number, worker_id, session, hash_token(token), n_ow, sql.ts(expires)],
    )
    attempt_id = row[0]
    check_transition(JOB_TRANSITIONS, JobState.QUEUED, JobState.LEASED)
    cursor.execute(sql.LEASE_JOB, [attempt_id, cand["id"]])
    if cursor.rowcount != 1:  # impossible under the write lock (SQLite) or the row lock (PostgreSQL)
        raise RuntimeError(f"job {cand['id']} moved under the claim")
    cursor.execute(sql.INSERT_EVENT, [cand["id"], "claimed", n_ow, worker_id, attempt_id, sql.js({"number": number})])
    task = {
        "id": cand["task_id"],
        "source": cand["t_source"],
        "item_key": cand["item_key"],
        "generation": cand["generation"],
        "title": cand["title"],
        "body": cand["body"],
        "payload": sql.from_js(cand["payload"]),
    }
    return Claim(
        job_id=cand["id"],
        attempt_id=attempt_id,
        attempt_number=number,
        token=token,
        lease_expires_at=expires,
        workflow=cand["workflow"],
        instance_id=cand["instance_id"],
        agent=cand["agent"],
        runner=cand["runner"],
        task=task,
    )


# --------------------------------------------------------------------------- fenced calls


@dataclasses.dataclass(frozen=True)
class _Fenced:
    state: str
    lease_expires_at: object
    live: bool
    job_state_after: str
    number: int
    worker_id: str
    job_id: int
    job_state: str
    current_attempt_id: int | None
    cancel_requested: bool
    retry_max_attempts: int
    retry_backoff: float
    retry_backoff_max: float
    instance_id: int
    task_id: int
    generation: int
    superseded: bool  # the worker id has registered again since this attempt's claim


def _fenced(cursor, attempt_id: int, token: str, n_ow) -> _Fenced:
    """The attempt, when `token` is its token; StaleAttempt or NotFound otherwise."""
    statement = sql.FENCED_ATTEMPT + (" FOR UPDATE OF a, j" if _postgres() else "")
    row = sql.one(cursor, statement, [n_ow, attempt_id])
    if row is None:
        raise NotFound(f"attempt {attempt_id} does not exist", attempt_id=attempt_id)
    if not hmac.compare_digest(row[0], hash_token(token)):
        raise StaleAttempt(f"the token does not match attempt {attempt_id}", attempt_id=attempt_id)
    return _Fenced(*row[1:])


def _require_live(attempt_id: int, a: _Fenced) -> None:
    if a.state == AttemptState.EXPIRED and a.superseded:  # PROTOCOL: the old session's calls answer so
        raise SessionSuperseded(
            f"worker {a.worker_id!r} was registered again by a newer process; attempt {attempt_id} was expired",
            worker_id=a.worker_id,
        )
    if a.state != AttemptState.ACTIVE:
        raise StaleAttempt(f"attempt {attempt_id} already ended ({a.state})", attempt_id=attempt_id)
    if a.current_attempt_id != attempt_id:
        raise StaleAttempt(f"attempt {attempt_id} is not job {a.job_id}'s current attempt", attempt_id=attempt_id)
    if not a.live:
        raise StaleAttempt(f"attempt {attempt_id}'s lease expired at {a.lease_expires_at}", attempt_id=attempt_id)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    lease_expires_at: dt.datetime
    cancel: bool


@_service
def attempt_heartbeat(*, attempt_id: int, token: str, clock: Clock | None = None) -> Heartbeat:
    """Extend the lease to now + lease_duration; answers whether a cancel was requested."""
    now = _now(clock)
    with connection.cursor() as cursor:
        a = _fenced(cursor, attempt_id, token, sql.ts(now))
        _require_live(attempt_id, a)
        expires = now + conf.current().lease
        cursor.execute(sql.EXTEND_LEASE, [sql.ts(expires), sql.ts(now), attempt_id])
    return Heartbeat(lease_expires_at=expires, cancel=bool(a.cancel_requested))


def _backoff(base: float, cap: float, failures: int) -> float:
    """Exponential, capped, with equal jitter so retries of many jobs spread out."""
    delay = min(cap, base * 2 ** min(failures - 1, 64))  # 2**64 × any base is past any cap
    return delay / 2 + _jitter.uniform(0, delay / 2)


@_service
def attempt_finish(
    *,
    attempt_id: int,
    token: str,
    outcome: str,
    summary: dict | None = None,
    error: str | None = None,
    clock: Clock | None = None,
) -> str:
    """End the attempt with the worker's outcome; returns the job's resulting
    state. A cancel recorded before this finish makes it `cancelled`; a failure
    with a retry left queues the job again after the backoff. Sending the same
    finish again returns the same answer and changes nothing."""
    if outcome not in OUTCOMES:
        raise InvalidRequest(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}", field="outcome")
    now = _now(clock)
    n_ow = sql.ts(now)
    summary, error = summary or {}, sql.clean(error or "")
    with connection.cursor() as cursor:
        a = _fenced(cursor, attempt_id, token, n_ow)
        if a.state == outcome and a.job_state_after:  # the same finish again
            return a.job_state_after
        _require_live(attempt_id, a)
        reason = ""
        if a.cancel_requested or outcome == AttemptState.CANCELLED:
            new_state = JobState.CANCELLED
            reason = "cancelled on request" if a.cancel_requested else "cancelled by the worker"
        elif outcome == AttemptState.SUCCEEDED:
            new_state = JobState.SUCCEEDED
        else:
            failures = sql.one(cursor, sql.FAILED_ATTEMPTS, [a.job_id])[0] + 1
            new_state = JobState.QUEUED if failures < a.retry_max_attempts else JobState.FAILED
            reason = error or f"attempt {a.number} failed"
        check_transition(ATTEMPT_TRANSITIONS, a.state, outcome)
        check_transition(JOB_TRANSITIONS, a.job_state, new_state)
        cursor.execute(sql.END_ATTEMPT, [outcome, n_ow, error, new_state, attempt_id])
        detail = {"outcome": outcome, "job_state": new_state}
        if new_state == JobState.QUEUED:
            available = now + dt.timedelta(seconds=_backoff(a.retry_backoff, a.retry_backoff_max, failures))
            cursor.execute(sql.REQUEUE_JOB, [sql.ts(available), a.job_id])
            detail |= {"retry_at": available.isoformat(), "failures": failures}
        else:
            cursor.execute(sql.SETTLE_JOB, [new_state, sql.js(summary), n_ow, reason, a.job_id])
            cursor.execute(sql.SETTLE_INSTANCE, [new_state, n_ow, error or reason, sql.js(summary), a.instance_id])
            cursor.execute(sql.SETTLE_TASK, [new_state, n_ow, a.task_id, a.generation])
        cursor.execute(sql.INSERT_EVENT, [a.job_id, "finished", n_ow, a.worker_id, attempt_id, sql.js(detail)])
    return new_state


# --------------------------------------------------------------------------- cancel


def _cancel(job: Job, now: dt.datetime, reason: str) -> Job:
    if job.terminal or job.cancel_requested_at is not None:
        return job
    if job.state == JobState.QUEUED:
        _move_job(job, JobState.CANCELLED, finished_at=now, reason=reason, cancel_requested_at=now)
        _event(job, "cancelled", now, reason=reason)
        _settle_terminal(job, now)
    else:  # leased: the next heartbeat answers cancel; expiry settles it if no heartbeat ever comes
        Job.objects.filter(pk=job.pk, state=JobState.LEASED).update(cancel_requested_at=now, reason=reason)
        job.cancel_requested_at, job.reason = now, reason
        _event(job, "cancel_requested", now, reason=reason)
    return job


def _locked_job(**lookup) -> Job:
    qs = Job.objects.select_for_update() if _postgres() else Job.objects
    job = qs.filter(**lookup).first()
    if job is None:
        raise NotFound(f"no job with {', '.join(f'{k}={v}' for k, v in lookup.items())}")
    return job


@_service
def job_cancel(*, job_id: int, reason: str = "cancelled on request", clock: Clock | None = None) -> Job:
    """Queued → cancelled at once; leased → cancel requested; terminal → unchanged."""
    return _cancel(_locked_job(pk=job_id), _now(clock), reason)


@_service
def instance_cancel(*, instance_id: int, reason: str = "cancelled on request", clock: Clock | None = None) -> Job:
    return _cancel(_locked_job(instance_id=instance_id), _now(clock), reason)


# --------------------------------------------------------------------------- expiry


def _expire(attempt: Attempt, now: dt.datetime, why: str) -> str:
    """End an active attempt as expired; requeue its job, or settle it."""
    job = attempt.job
    _end_attempt(attempt, AttemptState.EXPIRED, now, error=why)
    if job.current_attempt_id != attempt.pk or job.state != JobState.LEASED:
        return job.state
    expiries = job.attempts.filter(state=AttemptState.EXPIRED).count()  # this one included
    if job.cancel_requested_at is not None:
        _move_job(job, JobState.CANCELLED, finished_at=now)
    elif expiries >= job.max_attempts:
        reason = f"{why}: lease expired {expiries} times; max_attempts ({job.max_attempts}) reached"
        _move_job(job, JobState.FAILED, finished_at=now, reason=reason)
    else:
        _move_job(job, JobState.QUEUED, available_at=now, current_attempt=None)
    _event(job, "expired", now, worker_id=attempt.worker_id, attempt=attempt, why=why, job_state=job.state)
    if job.terminal:
        _settle_terminal(job, now)
    return job.state


def _expire_passed(now: dt.datetime, batch: int, why: str) -> list[Attempt]:
    """Expire up to `batch` attempts whose lease has passed. On PostgreSQL the
    attempt and job rows are locked first (a cancel, a finish or a worker
    registering at the same moment is either done before or waits), and rows
    another transaction holds are left for the next round."""
    qs = Attempt.objects.select_related("job").filter(state=AttemptState.ACTIVE, lease_expires_at__lte=now)
    if _postgres():
        qs = qs.select_for_update(skip_locked=True, of=("self", "job"))
    expired = list(qs.order_by("lease_expires_at")[:batch])
    for attempt in expired:
        where = f"on worker {attempt.worker_id}" + (f" {why}" if why else "")
        _expire(attempt, now, f"lease expired at {attempt.lease_expires_at.isoformat()} {where}")
    return expired


@_service
def leases_expire(*, clock: Clock | None = None, batch: int = 500) -> list[Attempt]:
    """Expire attempts whose lease has passed; returns them (state `expired`)."""
    return _expire_passed(_now(clock), batch, "")


# --------------------------------------------------------------------------- affinity


@_service
def affinity_release(*, task_id: int, clock: Clock | None = None) -> bool:
    """Unpin a task; its waiting jobs go to any eligible worker. False when it was not pinned."""
    deleted, _ = Affinity.objects.filter(task_id=task_id).delete()
    if deleted:
        log.info("affinity released: task %s", task_id)
    return bool(deleted)


# --------------------------------------------------------------------------- workers


@_service
def worker_register(
    *,
    worker_id: str,
    pool: str | None = None,
    labels: Iterable[str] = (),
    capabilities: Iterable[str] = (),
    capacity: int = 1,
    embedded: bool = False,
    version: str = "",
    hostname: str = "",
    pid: int | None = None,
    clock: Clock | None = None,
) -> Worker:
    """Start a new session for the worker id. Attempts the id still holds are
    expired at once: the process that held them is gone."""
    if not WORKER_ID_RE.fullmatch(worker_id or ""):
        raise InvalidRequest(
            f"worker id {worker_id!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}", field="worker_id"
        )
    if capacity < 1:
        raise InvalidRequest(f"capacity must be at least 1, got {capacity}", field="capacity")
    now = _now(clock)
    held = Attempt.objects.select_related("job").filter(worker_id=worker_id, state=AttemptState.ACTIVE)
    if _postgres():
        held = held.select_for_update(of=("self", "job"))
    worker_fields = dict(
        pool=pool or None,
        labels=sorted(set(labels)),
        capabilities=sorted(set(capabilities)),
        capacity=capacity,
        session=secrets.token_hex(16),
        embedded=embedded,
        draining=False,
        ready=True,
        drain_requested=False,  # a new process is a new decision; see README "Drain"
        version=version,
        hostname=hostname,
        pid=pid,
        registered_at=now,
        last_heartbeat_at=now,
    )
    worker, _ = Worker.objects.update_or_create(worker_id=worker_id, defaults=worker_fields)
    for attempt in held:
        _expire(attempt, now, f"worker {worker_id} registered a new session")
    return worker


@_service
def worker_heartbeat(
    *, worker_id: str, session: str, draining: bool = False, ready: bool = True, clock: Clock | None = None
) -> Worker:
    """Record that the worker is alive and what it says of itself; the returned
    worker's `drain_requested` is the operator's answer."""
    now = _now(clock)
    worker = _worker_for_call(worker_id, session)
    Worker.objects.filter(pk=worker_id, session=session).update(last_heartbeat_at=now, draining=draining, ready=ready)
    worker.last_heartbeat_at, worker.draining, worker.ready = now, draining, ready
    return worker


def _set_drain(worker_id: str, requested: bool) -> Worker:
    if not Worker.objects.filter(pk=worker_id).update(drain_requested=requested):
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    return Worker.objects.get(pk=worker_id)


@_service
def worker_drain(*, worker_id: str) -> Worker:
    """Ask the worker to stop claiming, finish its jobs and exit; it learns on its next heartbeat."""
    return _set_drain(worker_id, True)


@_service
def worker_undrain(*, worker_id: str) -> Worker:
    return _set_drain(worker_id, False)


# --------------------------------------------------------------------------- start-up


@dataclasses.dataclass(frozen=True)
class Reconciled:
    expired: int
    instances: int
    tasks: int


@_service
def reconcile(*, clock: Clock | None = None) -> Reconciled:
    """Start-up repair: expire leases that ran out while the control plane was
    down, and make every terminal job's instance and task agree with it."""
    now = _now(clock)
    expired = 0
    while batch := _expire_passed(now, 500, "while the control plane was down"):
        expired += len(batch)
    instances = tasks = 0
    drifted = Job.objects.filter(state__in=TERMINAL_JOB_STATES).exclude(instance__state=F("state"))
    for job in drifted.select_related("task"):
        _settle_terminal(job, job.finished_at or now)
        instances += 1
    # A task follows its newest generation's terminal jobs (the last to finish wins).
    for task in Task.objects.filter(state="active"):
        jobs = Job.objects.filter(task=task, generation=task.generation)
        if jobs.exists() and not jobs.exclude(state__in=TERMINAL_JOB_STATES).exists():
            last = jobs.order_by("-finished_at", "-id").first()
            Task.objects.filter(pk=task.pk).update(state=last.state, updated_at=now)
            tasks += 1
    return Reconciled(expired=expired, instances=instances, tasks=tasks)
