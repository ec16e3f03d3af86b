"""Read-only questions about workers: health, live attempts, whether one can take work now.

Health is computed, never stored: a worker is stale once `worker_timeout`
(jobqueue.conf) has passed since its last heartbeat. Nothing here writes.
"""

import datetime as dt
from collections.abc import Iterable

from django.db.models import Count, Q, QuerySet

from .. import conf
from ..models import Attempt, AttemptState, Worker, WorkerCredential
from ..types import hash_token

HEALTHY = "healthy"
STALE = "stale"
EXITED = "exited"
HEALTHS = (HEALTHY, STALE, EXITED)


def worker_exited(worker: Worker) -> bool:
    """The worker's last word was its goodbye: a drained worker's runtime sends one last
    heartbeat with `draining: true, ready: false` as it exits (workers.runtime), and no
    running worker sends that pair. Its next registration clears both."""
    return bool(worker.draining and not worker.ready)


def worker_health(worker: Worker, *, now: dt.datetime, timeout: float | None = None) -> str:
    """Return "exited" (it said goodbye: worker_exited), else "healthy" or "stale" (stale
    when more than `timeout` seconds, default the configured worker_timeout, have passed
    since the last heartbeat). An exited worker stays "exited", never turns stale."""
    if worker_exited(worker):
        return EXITED
    if timeout is None:
        timeout = conf.current().worker_timeout
    silent = (now - worker.last_heartbeat_at).total_seconds()
    return STALE if silent > timeout else HEALTHY


def worker_is_draining(worker: Worker) -> bool:
    """Draining as the claim sees it: the worker said so, or an operator asked
    (the claim refuses both before the worker has even heard of the request)."""
    return bool(worker.draining or worker.drain_requested)


def worker_can_claim(worker: Worker, *, now: dt.datetime, timeout: float | None = None) -> bool:
    """Healthy, ready and not draining: the only workers that count as able to
    take a job now (capacity is a separate question)."""
    return (
        worker.ready and not worker_is_draining(worker) and worker_health(worker, now=now, timeout=timeout) == HEALTHY
    )


def active_jobs(*, now: dt.datetime, worker_ids: Iterable[str] | None = None) -> dict[str, int]:
    """Live attempts (active, lease not yet passed) per worker id, counted as
    the claim counts capacity; workers without any are absent (read as 0)."""
    qs = Attempt.objects.filter(state=AttemptState.ACTIVE, lease_expires_at__gt=now)
    if worker_ids is not None:
        qs = qs.filter(worker_id__in=list(worker_ids))
    rows = qs.values("worker_id").annotate(n=Count("id")).order_by()
    return {row["worker_id"]: row["n"] for row in rows}


def workers_all() -> list[Worker]:
    """Every worker but the forgotten (services.worker_forget)."""
    return list(Worker.objects.filter(forgotten_at__isnull=True).order_by("worker_id"))


def workers_with_active_jobs(*, now: dt.datetime) -> QuerySet[Worker]:
    """Workers (forgotten ones too) annotated with `live_attempts` (active, lease not yet
    passed) and `held_attempts` (active at all), in one query."""
    live = Q(attempts__state=AttemptState.ACTIVE, attempts__lease_expires_at__gt=now)
    return Worker.objects.annotate(
        live_attempts=Count("attempts", filter=live),
        held_attempts=Count("attempts", filter=Q(attempts__state=AttemptState.ACTIVE)),
    )


def credential_of(secret: str) -> tuple[int, str, bool] | None:
    """(credential id, worker id, used before) of a live credential; None for an unknown or revoked one."""
    row = (
        WorkerCredential.objects.filter(digest=hash_token(secret), revoked_at__isnull=True)
        .values_list("pk", "worker_id", "last_used_at")
        .first()
    )
    return None if row is None else (row[0], row[1], row[2] is not None)

