"""The worker registry: registration (a new session), heartbeats, drain."""

import hmac
import secrets
from collections.abc import Iterable

from django.db import connection

from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound, SessionSuperseded
from ..models import Attempt, AttemptState, Worker
from ..types import WORKER_ID_PATTERN, WORKER_ID_RE
from ..wakeup import Wake
from ..wakeup.emit import emit
from .attempts import expire
from .common import now_of, postgres, service


def _worker_for_call(worker_id: str, session: str) -> Worker:
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    if not hmac.compare_digest(worker.session, session):
        raise SessionSuperseded(f"worker {worker_id!r} was registered again by a newer process", worker_id=worker_id)
    return worker


@service
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
        raise InvalidRequest(f"worker id {worker_id!r} must match {WORKER_ID_PATTERN}", field="worker_id")
    if capacity < 1:
        raise InvalidRequest(f"capacity must be at least 1, got {capacity}", field="capacity")
    now = now_of(clock)
    held = Attempt.objects.select_related("job").filter(worker_id=worker_id, state=AttemptState.ACTIVE)
    if postgres():
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
        expire(attempt, now, f"worker {worker_id} registered a new session")
    return worker


@service
def worker_heartbeat(
    *, worker_id: str, session: str, draining: bool = False, ready: bool = True, clock: Clock | None = None
) -> Worker:
    """Record that the worker is alive and what it says of itself; the returned
    worker's `drain_requested` is the operator's answer."""
    now = now_of(clock)
    worker = _worker_for_call(worker_id, session)
    Worker.objects.filter(pk=worker_id, session=session).update(last_heartbeat_at=now, draining=draining, ready=ready)
    worker.last_heartbeat_at, worker.draining, worker.ready = now, draining, ready
    return worker


def _set_drain(worker_id: str, requested: bool) -> Worker:
    if not Worker.objects.filter(pk=worker_id).update(drain_requested=requested):
        raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
    return Worker.objects.get(pk=worker_id)


@service
def worker_drain(*, worker_id: str) -> Worker:
    """Ask the worker to stop claiming, finish its jobs and exit; it learns on its next heartbeat."""
    return _set_drain(worker_id, True)


@service
def worker_undrain(*, worker_id: str) -> Worker:
    worker = _set_drain(worker_id, False)
    with connection.cursor() as cursor:
        emit(cursor, Wake(requirements=None, worker_id=worker_id))  # it may claim again
    return worker
