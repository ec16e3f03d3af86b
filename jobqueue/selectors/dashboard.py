"""The queue's facts for the operator's dashboard: counts by state per limit key, the last
hour's outcomes from JobEvent, the oldest waiting job, blocked jobs by reason, running
attempts and workers that are gone. Each a few grouped queries, none per row. Nothing here writes."""

import dataclasses
import datetime as dt
from collections import defaultdict

from django.db.models import BooleanField, Case, CharField, Count, Value, When
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KT
from django.db.models.functions import TruncMinute

from .. import conf
from ..models import SETTLING_EVENT_KINDS, Attempt, AttemptState, Job, JobEvent, JobState
from .blocked import BLOCKED_LIMIT, blocked_among
from .status import payload_refs
from .workers import HEALTHY, active_jobs, worker_health, workers_all

STATES = tuple(s.value for s in JobState)
OUTCOMES = (JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELLED.value)
# The events that settle a job (SETTLING_EVENT_KINDS), and where each says how: a finish and an
# expiry name the job state they produced (which may be `queued` again: no outcome); job_cancel's
# `cancelled` is one. Only they are indexed by time (jobevent_settled_at), and SQLite uses that
# partial index only for a WHERE that holds its condition as written: the kinds as literals,
# not bound parameters. They are the queue's own constants (plain words, checked here), so the
# text is safe to build; the table is named as the model names it.
assert all(kind.isidentifier() for kind in SETTLING_EVENT_KINDS)
SETTLED = RawSQL(
    f'"{JobEvent._meta.db_table}"."kind" IN (' + ", ".join(f"'{kind}'" for kind in SETTLING_EVENT_KINDS) + ")",
    (),
    output_field=BooleanField(),
)


def counts_by(dimension: str) -> list[dict]:
    """[{"key", <state>: n, …, "total"}] per value of `dimension` (project, pool, agent), by key."""
    rows: dict = defaultdict(lambda: dict.fromkeys(STATES, 0))
    for row in Job.objects.values(dimension, "state").annotate(n=Count("id")).order_by():
        rows[row[dimension] or ""][row["state"]] = row["n"]
    return [{"key": key, **counts, "total": sum(counts.values())} for key, counts in sorted(rows.items())]


def outcomes_per_minute(*, now: dt.datetime, minutes: int = 60) -> list[dict]:
    """[{"minute", "succeeded", "failed", "cancelled"}] for each of the last `minutes` minutes
    (oldest first, every minute present), counted from the JobEvents that settled jobs."""
    start = (now - dt.timedelta(minutes=minutes - 1)).replace(second=0, microsecond=0)
    outcome = Case(
        When(kind="cancelled", then=Value(JobState.CANCELLED.value)),
        default=KT("detail__job_state"),  # as text (->> on PostgreSQL): a jsonb there beside a text is an error
        output_field=CharField(),
    )
    rows = (
        JobEvent.objects.filter(SETTLED, at__gte=start, at__lte=now)
        .annotate(minute=TruncMinute("at", tzinfo=dt.UTC), outcome=outcome)
        .values("minute", "outcome")
        .annotate(n=Count("id"))
        .order_by()
    )
    buckets = {start + dt.timedelta(minutes=i): dict.fromkeys(OUTCOMES, 0) for i in range(minutes)}
    for row in rows:
        minute = row["minute"].astimezone(dt.UTC).replace(second=0, microsecond=0)
        if minute in buckets and row["outcome"] in OUTCOMES:
            buckets[minute][row["outcome"]] += row["n"]
    return [{"minute": minute, **counts} for minute, counts in buckets.items()]


def oldest_queued(*, now: dt.datetime) -> dict | None:
    """The queued job that has been claimable longest: {"job_id", "since", "age"} (seconds), or None."""
    row = (
        Job.objects.filter(state=JobState.QUEUED, available_at__lte=now)
        .order_by("available_at", "id")
        .values("id", "available_at")
        .first()
    )
    if row is None:
        return None
    return {"job_id": row["id"], "since": row["available_at"], "age": (now - row["available_at"]).total_seconds()}


def blocked_by_reason(*, now: dt.datetime, limit: int = BLOCKED_LIMIT) -> list[dict]:
    """[{"reason", "jobs": [ids], "count"}], most jobs first: blocked_reasons grouped (at most `limit` jobs)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for item in blocked_among(now=now, workers=workers_all(), live=active_jobs(now=now), limit=limit):
        groups[item["reason"]].append(item["job_id"])
    return sorted(
        ({"reason": reason, "jobs": ids, "count": len(ids)} for reason, ids in groups.items()),
        key=lambda g: (-g["count"], g["reason"]),
    )


def blocked_by_job(*, now: dt.datetime, limit: int = BLOCKED_LIMIT * 10) -> dict[int, str]:
    """{job id: why no worker can take it now} for at most `limit` blocked queued jobs."""
    return {b["job_id"]: b["reason"] for b in blocked_among(now=now, workers=workers_all(), live=active_jobs(now=now), limit=limit)}


@dataclasses.dataclass(frozen=True)
class Running:
    job_id: int
    attempt_number: int
    worker_id: str
    claimed_at: dt.datetime
    elapsed: float  # seconds since the claim
    last_heartbeat_at: dt.datetime | None
    cancel_requested: bool
    refs: dict  # payload_refs: instance, task, workflow, hook
    title: str  # the task snapshot's title, when the payload has one


def running(*, now: dt.datetime, limit: int = 200) -> list[Running]:
    """Active attempts, longest running first, with what their payloads name (one query)."""
    rows = (
        Attempt.objects.filter(state=AttemptState.ACTIVE)
        .values("job_id", "number", "worker_id", "claimed_at", "last_heartbeat_at", "job__payload", "job__cancel_requested_at")
        .order_by("claimed_at", "id")[:limit]
    )
    out = []
    for r in rows:
        payload = r["job__payload"] if isinstance(r["job__payload"], dict) else {}
        task = payload.get("task") if isinstance(payload.get("task"), dict) else {}
        out.append(
            Running(
                job_id=r["job_id"], attempt_number=r["number"], worker_id=r["worker_id"], claimed_at=r["claimed_at"],
                elapsed=(now - r["claimed_at"]).total_seconds(), last_heartbeat_at=r["last_heartbeat_at"],
                cancel_requested=r["job__cancel_requested_at"] is not None, refs=payload_refs(payload),
                title=str(task.get("title") or ""),
            )
        )  # fmt: skip
    return out


def gone_workers(*, now: dt.datetime) -> list[dict]:
    """Workers that are not healthy (stale, or exited after a drain), not forgotten:
    [{"worker_id", "health", "last_heartbeat_at", "silent" (seconds), "active_jobs"}]."""
    timeout = conf.current().worker_timeout
    held = dict(
        Attempt.objects.filter(state=AttemptState.ACTIVE).values_list("worker_id").annotate(n=Count("id")).order_by()
    )
    out = []
    for w in workers_all():
        health = worker_health(w, now=now, timeout=timeout)
        if health != HEALTHY:
            out.append({
                "worker_id": w.worker_id, "health": health, "last_heartbeat_at": w.last_heartbeat_at,
                "silent": (now - w.last_heartbeat_at).total_seconds(), "active_jobs": held.get(w.worker_id, 0),
            })  # fmt: skip
    return out
