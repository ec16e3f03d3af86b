"""Read-only queries over the queue: the status document, why queued jobs
wait, worker health. Nothing here writes.

    status.py    status_document (the `GET status` body), job_counts, active_attempts
    blocked.py   blocked_reasons
    logs.py      log_streams, log_read (what attempts streamed)
    workers.py   worker_health, worker_can_claim, active_jobs, workers_all, credential_of
"""

from django.db import connection

from .. import sql
from .blocked import BLOCKED_LIMIT, blocked_reasons, rfc3339
from .logs import LogText, StreamInfo, latest_attempt_number, log_read, log_streams
from .status import active_attempts, job_counts, payload_refs, status_document
from .workers import (
    EXITED,
    HEALTHS,
    HEALTHY,
    STALE,
    active_jobs,
    credential_of,
    worker_can_claim,
    worker_exited,
    worker_health,
    worker_is_draining,
    workers_all,
    workers_with_active_jobs,
)


def affinity_pin(*, key: str) -> str | None:
    """The worker id an affinity key is pinned to, or None."""
    with connection.cursor() as cursor:
        row = sql.one(cursor, sql.PIN_OF, [key])
    return row[0] if row else None


__all__ = [
    "BLOCKED_LIMIT",
    "EXITED",
    "HEALTHS",
    "HEALTHY",
    "LogText",
    "StreamInfo",
    "STALE",
    "active_attempts",
    "active_jobs",
    "affinity_pin",
    "blocked_reasons",
    "credential_of",
    "job_counts",
    "latest_attempt_number",
    "log_read",
    "log_streams",
    "payload_refs",
    "rfc3339",
    "status_document",
    "worker_can_claim",
    "worker_exited",
    "worker_health",
    "worker_is_draining",
    "workers_all",
    "workers_with_active_jobs",
]
