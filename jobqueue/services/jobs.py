"""Putting jobs in the queue and taking them out by cancelling."""

import datetime as dt
from collections.abc import Iterable, Mapping

from django.db import IntegrityError, connection, transaction

from .. import conf, sql
from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound
from ..models import Job, JobState, RequirementSet
from ..text import clean
from ..types import CLAIM_FIELDS, Retry
from ..wakeup import Wake
from ..wakeup.emit import emit
from .common import actor_of, event, now_of, postgres, service
from .followups import checked_follow_ups
from .transitions import checked, job_move


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


def job_enqueue_in(
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
    clock: Clock | None = None,
) -> tuple[Job, bool]:
    """Persist a job under its dedup `key`; returns (job, created).

    The same key returns the existing job and creates nothing. `payload` is
    stored as given (NUL and lone surrogates become U+FFFD) and handed to
    every claim of the job unchanged; its keys may not be the queue's own
    (jobqueue.types.CLAIM_FIELDS). Capabilities and labels are required of
    the claiming worker verbatim; the limit keys count its live attempts.

    This runs inside the caller's transaction, for a service of a layer above
    that writes its own rows together with the job (a workflow instance):
    both commit, or neither does. `job_enqueue` is the same as a service of
    its own, committed when it returns, before any claim can see the job.

    `follow_ups` ({terminal state: [job spec, …]}, services/followups.py) are
    enqueued in the transaction that settles this job in that state."""
    if not connection.in_atomic_block:
        raise RuntimeError("job_enqueue_in() runs inside its caller's transaction; use job_enqueue() otherwise")
    if not isinstance(payload, dict):
        raise InvalidRequest(f"payload must be a JSON object, got {type(payload).__name__}", field="payload")
    clashing = CLAIM_FIELDS.intersection(payload)
    if clashing:
        raise InvalidRequest(f"payload keys {sorted(clashing)} are the queue's own", field="payload")
    follow_ups = checked_follow_ups(follow_ups)
    now = now_of(clock)
    existing = Job.objects.filter(key=key).first()
    if existing:
        return existing, False
    retry = retry or Retry()
    pool = pool or None
    requirements = _requirement_set(pool, labels, capabilities, (project, source, agent, runner))
    try:
        with transaction.atomic():
            job = Job.objects.create(
                key=key,
                payload=clean(payload),
                project=project,
                source=source,
                agent=agent,
                runner=runner,
                pool=pool,
                requirements=requirements,
                affinity_key=affinity_key,
                priority=priority,
                available_at=now,
                max_attempts=max_attempts or conf.current().max_attempts,
                retry_max_attempts=retry.max_attempts,
                retry_backoff=retry.backoff,
                retry_backoff_max=retry.backoff_max,
                follow_ups=follow_ups,
                created_at=now,
            )
    except IntegrityError:  # the same key enqueued concurrently (PostgreSQL)
        return Job.objects.get(key=key), False
    with connection.cursor() as cursor:
        event(cursor, job_id=job.pk, kind="enqueued", at=now)
        pinned = sql.one(cursor, sql.PIN_OF, [affinity_key]) if affinity_key is not None else None
        needs = (requirements.pool, frozenset(requirements.labels), frozenset(requirements.capabilities))
        emit(cursor, Wake(requirements=requirements.pk, worker_id=pinned[0] if pinned else None, needs=needs))
    return job, True


job_enqueue = service(job_enqueue_in)


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
