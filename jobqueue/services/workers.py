"""The worker registry: registration (a new session), heartbeats, drain, forgetting."""

import datetime as dt
import hmac
import secrets
from collections.abc import Iterable

from django.db import connection

from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound, SessionSuperseded
from ..models import Affinity, Attempt, AttemptState, Worker
from ..types import (
    MAX_CAPABILITIES,
    MAX_CAPACITY,
    MAX_LABELS,
    MAX_NAME_LENGTH,
    WORKER_ID_PATTERN,
    WORKER_ID_RE,
)
from ..wakeup import Wake
from ..wakeup.emit import emit
from .attempts import expire
from .common import now_of, postgres, service, worker_event
from .identity import refuse_reserved


def _worker_for_call(worker_id: str, session: str) -> Worker:
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    if not hmac.compare_digest(worker.session, session):
        raise SessionSuperseded(f"worker {worker_id!r} was registered again by a newer process", worker_id=worker_id)
    return worker


def _names(values: Iterable[str], field: str, most: int) -> list[str]:
    names = sorted(set(values))
    if len(names) > most:
        raise InvalidRequest(f"{field}: at most {most} values, got {len(names)}", field=field)
    for name in names:
        if not name or len(name) > MAX_NAME_LENGTH:
            raise InvalidRequest(f"{field}: each value 1–{MAX_NAME_LENGTH} characters, got {name[:80]!r}", field=field)
    return names


def register(
    *,
    now: dt.datetime,
    worker_id: str,
    pool: str | None = None,
    labels: Iterable[str] = (),
    capabilities: Iterable[str] = (),
    capacity: int = 1,
    embedded: bool = False,
    version: str = "",
    hostname: str = "",
    pid: int | None = None,
) -> Worker:
    """A new session for the worker id, inside the caller's transaction (the
    services that decide who may register call it). Attempts the id still
    holds are expired at once: the process that held them is gone."""
    if not WORKER_ID_RE.fullmatch(worker_id or ""):
        raise InvalidRequest(f"worker id {worker_id!r} must match {WORKER_ID_PATTERN}", field="worker_id")
    if not embedded:
        refuse_reserved(worker_id)
    if not 1 <= capacity <= MAX_CAPACITY:
        raise InvalidRequest(f"capacity must be 1–{MAX_CAPACITY}, got {capacity}", field="capacity")
    if pool is not None and len(pool) > MAX_NAME_LENGTH:
        raise InvalidRequest(f"pool: at most {MAX_NAME_LENGTH} characters", field="pool")
    labels = _names(labels, "labels", MAX_LABELS)
    capabilities = _names(capabilities, "capabilities", MAX_CAPABILITIES)
    held = Attempt.objects.select_related("job").filter(worker_id=worker_id, state=AttemptState.ACTIVE)
    if postgres():
        held = held.select_for_update(of=("self", "job"))
    worker_fields = dict(
        pool=pool or None,
        labels=labels,
        capabilities=capabilities,
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
        forgotten_at=None,  # a forgotten worker that registers is back
    )
    worker, _ = Worker.objects.update_or_create(worker_id=worker_id, defaults=worker_fields)
    for attempt in held:
        expire(attempt, now, f"worker {worker_id} registered a new session")
    return worker


@service
def worker_register(*, clock: Clock | None = None, **registration) -> Worker:
    """Register with no identity check: the embedded worker, and tests. Remote
    workers come in through `worker_enroll` or `worker_reregister`
    (services/credentials.py), which decide who may register an id first."""
    return register(now=now_of(clock), **registration)


@service
def workers_forget(*, older_than: float, clock: Clock | None = None) -> int:
    """Delete the workers that have been silent for `older_than` seconds and
    never held an attempt (registrations that claimed nothing). Workers with
    attempts stay: their rows are the attempts' history. Credentials stay
    too: one that comes back registers with its own. Returns how many."""
    cutoff = now_of(clock) - dt.timedelta(seconds=older_than)
    silent = Worker.objects.filter(last_heartbeat_at__lt=cutoff, embedded=False).exclude(
        worker_id__in=Attempt.objects.values("worker_id")
    )
    ids = list(silent.values_list("worker_id", flat=True)[:1000])
    if not ids:
        return 0
    # Guarded: a worker that registered since the read above is not silent any more.
    deleted, _ = Worker.objects.filter(worker_id__in=ids, last_heartbeat_at__lt=cutoff).delete()
    return deleted


@service
def worker_heartbeat(
    *, worker_id: str, session: str, draining: bool = False, ready: bool = True, clock: Clock | None = None
) -> Worker:
    """Record that the worker is alive and what it says of itself; the returned
    worker's `drain_requested` is the operator's answer."""
    now = now_of(clock)
    worker = _worker_for_call(worker_id, session)
    Worker.objects.filter(pk=worker_id, session=session).update(
        last_heartbeat_at=now, draining=draining, ready=ready, forgotten_at=None  # forgotten too soon: it is alive
    )
    worker.last_heartbeat_at, worker.draining, worker.ready = now, draining, ready
    return worker


def _set_drain(worker_id: str, requested: bool, actor: str | None, clock: Clock | None) -> Worker:
    if not Worker.objects.filter(pk=worker_id).update(drain_requested=requested):
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    kind = "drain_requested" if requested else "drain_withdrawn"
    worker_event(worker_id=worker_id, kind=kind, at=now_of(clock), actor=actor)
    return Worker.objects.get(pk=worker_id)


@service
def worker_drain(*, worker_id: str, actor: str | None = None, clock: Clock | None = None) -> Worker:
    """Ask the worker to stop claiming, finish its jobs and exit; it learns on its next heartbeat."""
    return _set_drain(worker_id, True, actor, clock)


@service
def worker_undrain(*, worker_id: str, actor: str | None = None, clock: Clock | None = None) -> Worker:
    worker = _set_drain(worker_id, False, actor, clock)
    with connection.cursor() as cursor:
        emit(cursor, Wake(requirements=None, worker_id=worker_id))  # it may claim again
    return worker


@service
def worker_forget(*, worker_id: str, actor: str | None = None, clock: Clock | None = None) -> Worker:
    """An operator forgets a worker that is gone (stale, or exited after a drain) and holds no
    active attempt: it leaves the worker lists, the status document and the blocked-job
    reasons (a job waiting for its pool then says no worker is there) until it registers or
    heartbeats again. Its row stays, forgotten: its attempts are the jobs' history.
    Its affinity pins are released with it (an `affinity_released` event each). InvalidRequest
    for a healthy worker or one that still holds attempts."""
    from ..selectors.workers import HEALTHY, worker_health  # read-only; selectors import no service

    now = now_of(clock)
    qs = Worker.objects.select_for_update() if postgres() else Worker.objects
    worker = qs.filter(pk=worker_id, forgotten_at__isnull=True).first()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    if worker_health(worker, now=now) == HEALTHY:
        raise InvalidRequest(
            f"worker {worker_id!r} is healthy (last heartbeat {worker.last_heartbeat_at.isoformat()}): "
            "only a stale or exited worker can be forgotten; drain it first",
            field="worker_id",
        )
    held = sorted(Attempt.objects.filter(worker_id=worker_id, state=AttemptState.ACTIVE).values_list("job_id", flat=True))
    if held:
        raise InvalidRequest(
            f"worker {worker_id!r} still holds attempts of job {', '.join(map(str, held))}: they end when their "
            "leases run out (the reaper expires them); forget it after that",
            field="worker_id",
        )
    # Guarded: a heartbeat or registration since the read above means it is back.
    if not Worker.objects.filter(pk=worker_id, session=worker.session, last_heartbeat_at=worker.last_heartbeat_at).update(
        forgotten_at=now
    ):
        raise InvalidRequest(f"worker {worker_id!r} just came back; not forgotten", field="worker_id")
    worker_event(worker_id=worker_id, kind="forgotten", at=now, actor=actor, last_heartbeat_at=worker.last_heartbeat_at.isoformat())
    # Its pins go with it: the operator says it is gone, so the tasks pinned to it may run anywhere.
    keys = list(Affinity.objects.filter(worker_id=worker_id).order_by("key").values_list("key", flat=True))
    if keys:
        Affinity.objects.filter(worker_id=worker_id, key__in=keys).delete()
        for key in keys:
            worker_event(worker_id=worker_id, kind="affinity_released", at=now, actor=actor, key=key, because="forgotten")
        with connection.cursor() as cursor:
            emit(cursor, Wake(requirements=None))
    worker.forgotten_at = now
    return worker
