"""Follow-up jobs: what a job asks to have enqueued when it settles.

A job may carry, per terminal state, specs of jobs to enqueue (`follow_ups`
at enqueue). They are enqueued in the very transaction that moves the job to
that state (transitions.job_move), so an outcome is never recorded without
its follow-ups nor the other way round, across any crash: a transactional
outbox with no relay. Each follow-up is an ordinary job with its own dedup
key: enqueued once however often its parent's settling is retried, then
claimed, fenced and retried like any job. The queue reads nothing of them
but their fields; the workflow layer uses them for hooks.
"""

import datetime as dt
from collections.abc import Mapping

from .. import sql
from ..clock import FrozenClock
from ..exceptions import InvalidRequest
from ..models import TERMINAL_JOB_STATES
from ..types import Retry
from .common import event

SPEC_FIELDS = frozenset(
    {"key", "payload", "project", "source", "agent", "runner", "pool", "labels", "capabilities", "affinity_key",
     "priority", "max_attempts", "retry"}
)  # fmt: skip
REQUIRED = frozenset({"key", "payload", "project", "source", "agent", "runner"})
MAX_FOLLOW_UPS = 16  # per terminal state


def checked_follow_ups(follow_ups: Mapping | None) -> dict:
    """`follow_ups` as stored: {terminal state: [spec, …]}; InvalidRequest naming what is wrong."""
    if not follow_ups:
        return {}
    if not isinstance(follow_ups, Mapping):
        raise InvalidRequest("follow_ups must map terminal states to lists of job specs", field="follow_ups")
    out = {}
    for state, specs in follow_ups.items():
        if state not in TERMINAL_JOB_STATES:
            raise InvalidRequest(f"follow_ups: {state!r} is not a terminal state", field="follow_ups")
        if not isinstance(specs, list) or len(specs) > MAX_FOLLOW_UPS:
            raise InvalidRequest(f"follow_ups.{state}: a list of at most {MAX_FOLLOW_UPS} job specs", field="follow_ups")
        for spec in specs:
            if not isinstance(spec, Mapping) or not set(spec) >= REQUIRED or not set(spec) <= SPEC_FIELDS:
                raise InvalidRequest(
                    f"follow_ups.{state}: each spec needs {sorted(REQUIRED)} and may have {sorted(SPEC_FIELDS - REQUIRED)}",
                    field="follow_ups",
                )
        out[str(state)] = [dict(spec) for spec in specs]
    return out


def enqueue_follow_ups(cursor, job_id: int, state: str, follow_ups=None, *, now: dt.datetime) -> list[int]:
    """Enqueue job `job_id`'s follow-ups for `state` (read here unless given),
    inside the caller's transaction, at the settling service's `now`; their ids."""
    from .jobs import job_enqueue_in  # jobs imports transitions, which calls this

    if follow_ups is None:
        row = sql.one(cursor, sql.FOLLOW_UPS, [job_id])
        follow_ups = row[0] if row else None
    specs = (sql.from_js(follow_ups) or {}).get(state, []) if follow_ups else []
    ids = []
    for spec in specs:
        spec = dict(spec)
        retry = spec.pop("retry", None)
        job, created = job_enqueue_in(retry=Retry(**retry) if retry else None, clock=FrozenClock(now), **spec)
        if created:
            ids.append(job.pk)
    if ids:
        event(cursor, job_id=job_id, kind="follow_ups_enqueued", at=now, state=state, jobs=ids)
    return ids
