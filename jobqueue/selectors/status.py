"""The status document: exactly the `GET status` body of PROTOCOL.md.

`apiary status --json` prints it and the text renderer reads it. Nothing here writes.
"""

import datetime as dt

from django.db.models import Count

from .. import conf
from ..clock import get_clock
from ..models import Attempt, AttemptState, Job, JobState, Worker
from .blocked import BLOCKED_LIMIT, blocked_among, rfc3339
from .workers import active_jobs, worker_health, worker_is_draining, workers_all


def payload_refs(payload) -> dict:
    """Protocol v1's status names the workflow, instance and task of each
    active job, the instance that spawned it and, for a hook job, the outcome
    it follows (issue 10). The queue stores
    none of them: they are payload keys the enqueuer (workflows.services)
    writes, read here only to fill those fields."""
    payload = payload if isinstance(payload, dict) else {}
    task = payload.get("task") if isinstance(payload.get("task"), dict) else {}
    return {
        "instance_id": payload.get("instance_id"),
        "task_id": task.get("id"),
        "workflow": payload.get("workflow"),
        "parent_instance_id": payload.get("parent_instance_id"),
        "hook": hook.get("outcome") if isinstance(hook := payload.get("hook"), dict) else None,
    }


def job_counts() -> dict[str, int]:
    counts = {state.value: 0 for state in JobState}
    for row in Job.objects.values("state").annotate(n=Count("id")).order_by():
        counts[row["state"]] = row["n"]
    return counts


def _worker_view(worker: Worker, *, now: dt.datetime, live: dict[str, int], timeout: float) -> dict:
    return {
        "worker_id": worker.worker_id,
        "pool": worker.pool,
        "labels": list(worker.labels),
        "capabilities": list(worker.capabilities),
        "capacity": worker.capacity,
        "active_jobs": live.get(worker.worker_id, 0),
        "health": worker_health(worker, now=now, timeout=timeout),
        # What the claim obeys: the worker's own word or an operator's request.
        "draining": worker_is_draining(worker),
        "ready": worker.ready,
        "last_heartbeat_at": rfc3339(worker.last_heartbeat_at),
    }


def active_attempts() -> list[dict]:
    """Every attempt still holding its job (including one whose lease ran out
    but that the reaper has not expired yet: its lease time shows that)."""
    rows = (
        Attempt.objects.filter(state=AttemptState.ACTIVE)
        .values(
            "job_id",
            "job__payload",
            "worker_id",
            "number",
            "lease_expires_at",
            "job__cancel_requested_at",
        )
        .order_by("job_id", "id")
    )
    return [
        {
            "job_id": r["job_id"],
            **payload_refs(r["job__payload"]),
            "worker_id": r["worker_id"],
            "attempt_number": r["number"],
            "lease_expires_at": rfc3339(r["lease_expires_at"]),
            "cancel_requested": r["job__cancel_requested_at"] is not None,
        }
        for r in rows
    ]


def status_document(*, now: dt.datetime | None = None) -> dict:
    """The `GET status` document of PROTOCOL.md, read at `now` (default: the
    injected clock). `blocked` holds at most BLOCKED_LIMIT jobs."""
    now = now or get_clock().now()
    timeout = conf.current().worker_timeout
    workers = workers_all()
    live = active_jobs(now=now)
    return {
        "jobs": job_counts(),
        "workers": [_worker_view(w, now=now, live=live, timeout=timeout) for w in workers],
        "active": active_attempts(),
        "blocked": blocked_among(now=now, workers=workers, live=live, limit=BLOCKED_LIMIT),
    }


