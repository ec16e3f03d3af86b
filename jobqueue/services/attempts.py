"""Fenced calls on an attempt (heartbeat, finish) and the end of attempts
whose lease ran out (the reaper, start-up reconciliation)."""

import dataclasses
import datetime as dt
import hmac
import inspect
import random
from collections.abc import Callable

from django.db import connection

from .. import conf, sql
from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound, QueueError, SessionSuperseded, StaleAttempt, WorkerMismatch
from ..metrics import timed_heartbeat
from ..models import Attempt, AttemptState, JobState
from ..text import clean
from ..types import OUTCOMES, Heartbeat
from ..wakeup import Wake
from ..wakeup.emit import emit
from .common import event, hash_token, now_of, postgres, service
from .identity import acting_as as check_acting_as
from .transitions import UNREAD, attempt_and_job_move, attempt_move, attempts_succeed, checked, job_move

_jitter = random.Random()


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
    superseded: bool  # the worker id has registered again since this attempt's claim
    requirements_id: int
    has_follow_ups: bool  # the finish reads them (sql.FOLLOW_UPS) only then


def _fenced(cursor, attempt_id: int, token: str, n_ow, acting_as: str | None = None) -> _Fenced:
    """The attempt, when `token` is its token; StaleAttempt or NotFound
    otherwise. With `acting_as` (the worker id of the caller's credential),
    WorkerMismatch unless the attempt is that worker's."""
    return _fenced_row(sql.one(cursor, sql.fenced_attempt(postgres()), [n_ow, attempt_id]), attempt_id, token, acting_as)


def _fenced_row(row: tuple | None, attempt_id: int, token: str, acting_as: str | None) -> _Fenced:
    """_fenced's checks on the attempt's row as read (sql.fenced_attempt's columns)."""
    if row is None:
        raise NotFound(f"attempt {attempt_id} does not exist", attempt_id=attempt_id)
    if not hmac.compare_digest(row[0], hash_token(token)):
        raise StaleAttempt(f"the token does not match attempt {attempt_id}", attempt_id=attempt_id)
    fenced = _Fenced(*row[1:])
    if acting_as is not None:
        try:
            check_acting_as(fenced.worker_id, acting_as)
        except WorkerMismatch:
            raise WorkerMismatch(
                f"attempt {attempt_id} belongs to worker {fenced.worker_id!r}, not to this credential's {acting_as!r}",
                attempt_id=attempt_id,
            ) from None
    return fenced


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


def fenced_live(cursor, attempt_id: int, token: str, now: dt.datetime, acting_as: str | None = None) -> _Fenced:
    """The attempt when `token` is its token and it is its job's current, live
    attempt (its row and its job's locked on PostgreSQL); the same errors as a
    heartbeat otherwise. For services that write on an attempt's behalf."""
    fenced = _fenced(cursor, attempt_id, token, sql.ts(now), acting_as)
    _require_live(attempt_id, fenced)
    return fenced


@timed_heartbeat
@service
def attempt_heartbeat(
    *, attempt_id: int, token: str, acting_as: str | None = None, clock: Clock | None = None
) -> Heartbeat:
    """Extend the lease to now + lease_duration; answers whether a cancel was requested."""
    now = now_of(clock)
    with connection.cursor() as cursor:
        return extend_lease(cursor, attempt_id, token, now, acting_as)[1]


def extend_lease(cursor, attempt_id: int, token: str, now: dt.datetime, acting_as: str | None) -> tuple[_Fenced, Heartbeat]:
    """A heartbeat's work, in the caller's transaction (attempt_heartbeat's, or
    records.attempt_heartbeat_with_checkpoint's): the fenced attempt and the answer."""
    a = fenced_live(cursor, attempt_id, token, now, acting_as)
    expires = now + conf.current().lease
    checked(cursor, sql.EXTEND_LEASE, [sql.ts(expires), sql.ts(now), attempt_id], f"lease of attempt {attempt_id}")
    return a, Heartbeat(lease_expires_at=expires, cancel=bool(a.cancel_requested))


def _backoff(base: float, cap: float, failures: int) -> float:
    """Exponential, capped, with equal jitter so retries of many jobs spread out."""
    delay = min(cap, base * 2 ** min(failures - 1, 64))  # 2**64 × any base is past any cap
    return delay / 2 + _jitter.uniform(0, delay / 2)


def _finish_opening(rows: dict, kw: dict) -> tuple[_Fenced | None, str | None]:
    """A finish's checks on its attempt as read (sql.fenced_attempt's row in `rows`): InvalidRequest,
    NotFound, StaleAttempt…, or (the attempt, None) to settle, or (None, the answer) for the
    same finish again. Nothing is written."""
    attempt_id, outcome = kw["attempt_id"], kw["outcome"]
    if outcome not in OUTCOMES:
        raise InvalidRequest(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}", field="outcome")
    a = _fenced_row(rows.get(attempt_id), attempt_id, kw["token"], kw.get("acting_as"))
    if a.state == outcome and a.job_state_after:  # the same finish again
        return None, a.job_state_after
    _require_live(attempt_id, a)
    return a, None


# Writes that ride with a finish (services/chaining.py: its job's last record and log ends):
# carry(i, cursor, attempt, now) for the i-th call of a batch, once its attempt passed the fence
# and before it is settled; never for a finish sent again (its first carried them).
Carry = Callable[[int, object, "_Fenced", dt.datetime], None]


def finish_many(calls: list[dict], carry: Carry | None = None) -> list[tuple[object, Exception | None]]:
    """Many attempt_finish calls in the caller's transaction (group commit): one fenced read
    of all their attempts, then one settling of every plain success (no cancel requested, no
    follow-ups) together; any other finish is settled as attempt_finish settles one. Calls
    that one read cannot serve (different clocks, an attempt twice, unknown arguments) run
    one by one."""
    ids = [kw.get("attempt_id") for kw in calls]
    if len({id(kw.get("clock")) for kw in calls}) > 1 or len(set(ids)) < len(ids) or any(
        not set(kw) <= _FINISH_ARGUMENTS for kw in calls
    ):
        return [
            (finish_one(kw, carry, i) if set(kw) <= _FINISH_ARGUMENTS else attempt_finish.body(**kw), None)
            for i, kw in enumerate(calls)
        ]
    now = now_of(calls[0].get("clock"))
    answers: list = [None] * len(calls)
    plain = []
    with connection.cursor() as cursor:
        cursor.execute(sql.fenced_attempts(len(ids), postgres()), [sql.ts(now), *ids])
        rows = {row[0]: row[1:] for row in cursor.fetchall()}
        for i, kw in enumerate(calls):
            try:
                a, again = _finish_opening(rows, kw)
            except QueueError as exc:  # refused before it wrote anything
                answers[i] = (None, exc)
                continue
            if a is None:
                answers[i] = (again, None)
                continue
            if carry is not None:
                carry(i, cursor, a, now)
            if kw["outcome"] == AttemptState.SUCCEEDED and not a.cancel_requested and not a.has_follow_ups:
                plain.append((i, kw, a))
            else:
                answers[i] = (_settle(cursor, a, kw, now), None)
        if plain:
            attempts_succeed(
                cursor,
                [(kw["attempt_id"], a.job_id, a.job_state, clean(kw.get("error") or ""), kw.get("summary") or {}, a.worker_id)
                 for _, kw, a in plain],
                now,
                {"outcome": AttemptState.SUCCEEDED, "job_state": JobState.SUCCEEDED},
            )  # fmt: skip
            for i, _, _ in plain:
                answers[i] = (JobState.SUCCEEDED, None)
            if conf.current().limits.active_dimensions():  # _freed's wake, once for the slots they all freed
                emit(cursor, Wake(requirements=None, count=len(plain)))
    return answers


@service(many=finish_many)
def attempt_finish(
    *,
    attempt_id: int,
    token: str,
    outcome: str,
    summary: dict | None = None,
    error: str | None = None,
    acting_as: str | None = None,
    clock: Clock | None = None,
) -> str:
    """End the attempt with the worker's outcome; returns the job's resulting
    state. A cancel recorded before this finish makes it `cancelled`; a failure
    with a retry left queues the job again after the backoff. Sending the same
    finish again returns the same answer and changes nothing. Writes queue
    tables only."""
    kw = {"attempt_id": attempt_id, "token": token, "outcome": outcome, "summary": summary, "error": error,
          "acting_as": acting_as, "clock": clock}  # fmt: skip
    return finish_one(kw)


def finish_one(kw: dict, carry: Carry | None = None, index: int = 0) -> str:
    """attempt_finish's body for its keyword arguments `kw`, with `carry` (finish_many's) for call `index`."""
    attempt_id, outcome = kw["attempt_id"], kw["outcome"]
    if outcome not in OUTCOMES:  # before the clock and the read, as it always was
        raise InvalidRequest(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}", field="outcome")
    now = now_of(kw.get("clock"))
    with connection.cursor() as cursor:
        row = sql.one(cursor, sql.fenced_attempt(postgres()), [sql.ts(now), attempt_id])
        a, again = _finish_opening({attempt_id: row} if row is not None else {}, kw)
        if a is None:
            return again
        if carry is not None:
            carry(index, cursor, a, now)
        return _settle(cursor, a, kw, now)


_FINISH_ARGUMENTS = frozenset(inspect.signature(attempt_finish.body).parameters)


def _settle(cursor, a: _Fenced, kw: dict, now: dt.datetime) -> str:
    """A checked finish's writes (the attempt, the job, its event, its follow-ups, its wakes);
    the job's new state."""
    attempt_id, outcome = kw["attempt_id"], kw["outcome"]
    summary, error = kw.get("summary") or {}, clean(kw.get("error") or "")
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
    attempt = {
        "attempt_id": attempt_id, "old": a.state, "new": outcome, "finished_at": now, "error": error,
        "job_state": new_state,
    }  # fmt: skip
    detail = {"outcome": outcome, "job_state": new_state}
    job = {"job_id": a.job_id, "old": a.job_state, "new": new_state}
    if new_state == JobState.QUEUED:
        available = now + dt.timedelta(seconds=_backoff(a.retry_backoff, a.retry_backoff_max, failures))
        job |= {"available_at": available, "current_attempt_id": None}
        detail |= {"retry_at": available.isoformat(), "failures": failures}
    else:
        job |= {"summary": summary, "finished_at": now, "reason": reason}
    attempt_and_job_move(
        cursor, attempt=attempt, job=job, follow_ups=UNREAD if a.has_follow_ups else "{}",
        event=(a.job_id, "finished", sql.ts(now), a.worker_id, attempt_id, sql.js(detail)),
    )  # fmt: skip
    retry_in = (available - now).total_seconds() if new_state == JobState.QUEUED else None
    _freed(cursor, a.job_id, a.requirements_id, retry_in)
    return new_state


def _freed(cursor, job_id: int, requirements_id: int, retry_in: float | None) -> None:
    """Wake the waiting claims an attempt's end may serve: the job itself when
    it is queued again (after its backoff; only its pinned worker, when its
    affinity key is pinned), and one waiter of any class for the limit slot
    it freed. (Its own worker's freed capacity needs none: that worker's
    runtime claims again when its job ends.)"""
    if retry_in is not None:
        pinned = sql.one(cursor, sql.PIN_OF_JOB, [job_id])
        emit(cursor, Wake(requirements=requirements_id, worker_id=pinned[0] if pinned else None, delay=max(0.0, retry_in)))
    if conf.current().limits.active_dimensions():
        emit(cursor, Wake(requirements=None))


@service
def attempt_abandon(*, attempt_id: int, token: str, why: str, clock: Clock | None = None) -> str:
    """The worker will never run this attempt (it hung up before the claim
    answer reached it): expire it now, as its lease would later, so the job
    is claimable again at once. Returns the job's state."""
    now = now_of(clock)
    with connection.cursor() as cursor:
        a = _fenced(cursor, attempt_id, token, sql.ts(now))  # on PostgreSQL: attempt and job locked
        _require_live(attempt_id, a)
    attempt = Attempt.objects.select_related("job").get(pk=attempt_id)
    return expire(attempt, now, why)


def expire(attempt: Attempt, now: dt.datetime, why: str) -> str:
    """End an active attempt as expired; requeue its job, or settle it. The
    caller holds the attempt and job rows (read with `select_related("job")`)."""
    job = attempt.job
    with connection.cursor() as cursor:
        attempt_move(cursor, attempt_id=attempt.pk, old=attempt.state, new=AttemptState.EXPIRED, finished_at=now, error=why)
        attempt.state, attempt.finished_at = AttemptState.EXPIRED, now
        if job.current_attempt_id != attempt.pk or job.state != JobState.LEASED:
            return job.state
        expiries = sql.one(cursor, sql.EXPIRED_ATTEMPTS, [job.pk])[0]  # this one included
        fields: dict = {"finished_at": now}
        if job.cancel_requested_at is not None:
            new_state = JobState.CANCELLED
        elif expiries >= job.max_attempts:
            new_state = JobState.FAILED
            fields["reason"] = f"{why}: lease expired {expiries} times; max_attempts ({job.max_attempts}) reached"
        else:
            new_state, fields = JobState.QUEUED, {"available_at": now, "current_attempt_id": None}
        job_move(cursor, job_id=job.pk, old=job.state, new=new_state, **fields)
        job.state = new_state
        for name, value in fields.items():
            setattr(job, name, value)
        event(
            cursor, job_id=job.pk, kind="expired", at=now, worker_id=attempt.worker_id, attempt_id=attempt.pk,
            why=why, job_state=new_state,
        )
        _freed(cursor, job.pk, job.requirements_id, 0.0 if new_state == JobState.QUEUED else None)
    return new_state


def _expire_passed(now: dt.datetime, batch: int, why: str) -> list[Attempt]:
    """Expire up to `batch` attempts whose lease has passed. On PostgreSQL the
    attempt and job rows are locked first (a cancel, a finish or a worker
    registering at the same moment is either done before or waits), and rows
    another transaction holds are left for the next round."""
    qs = Attempt.objects.select_related("job").filter(state=AttemptState.ACTIVE, lease_expires_at__lte=now)
    if postgres():
        qs = qs.select_for_update(skip_locked=True, of=("self", "job"))
    expired = list(qs.order_by("lease_expires_at")[:batch])
    for attempt in expired:
        where = f"on worker {attempt.worker_id}" + (f" {why}" if why else "")
        expire(attempt, now, f"lease expired at {attempt.lease_expires_at.isoformat()} {where}")
    return expired


@service
def leases_expire(*, clock: Clock | None = None, batch: int = 500) -> list[Attempt]:
    """Expire attempts whose lease has passed; returns them (state `expired`)."""
    return _expire_passed(now_of(clock), batch, "")


@service
def reconcile(*, clock: Clock | None = None) -> int:
    """Start-up: expire the leases that ran out while the control plane was
    down; returns how many. (Nothing else needs repair: no other table keeps
    a copy of a job's state.)"""
    now = now_of(clock)
    expired = 0
    while batch := _expire_passed(now, 500, "while the control plane was down"):
        expired += len(batch)
    return expired
