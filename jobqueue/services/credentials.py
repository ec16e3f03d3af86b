"""Per-worker credentials: each worker's own bearer secret, bound to its id.

The shared `worker_token` enrols: a registration made with it, for an id
that has no credential and no live session, issues the id's first
credential in the same transaction (`worker_enroll`). From then on the
worker calls with its credential, which acts only as its own id. An
operator can issue more (`credential_issue`: the overlap of a rotation) and
revoke them (`credentials_revoke`). README "Security" has the threat model.

Secrets are `apw_` + 256 random bits; only their SHA-256 is stored, so a
lookup by digest is as safe as a constant-time compare (the digest of an
unguessable secret is unguessable) and costs one indexed query.
"""

import datetime as dt
import hashlib
import hmac
import secrets

from django.db import connection

from .. import conf, sql
from ..clock import Clock
from ..exceptions import (
    CredentialRequired,
    CredentialRevoked,
    EnrollmentClosed,
    InvalidRequest,
    NotFound,
)
from ..models import Attempt, AttemptState, Worker, WorkerCredential
from ..types import CREDENTIAL_PREFIX, WORKER_ID_PATTERN, WORKER_ID_RE
from .attempts import expire
from .common import hash_token, now_of, postgres, service, worker_event
from .identity import acting_as as check_acting_as
from .identity import refuse_reserved
from .workers import register

ID_LOCK_SPACE = 0x41505749  # "APWI": the advisory-lock key space of worker ids


def _lock_id(worker_id: str) -> None:
    """Serialise who-may-register decisions about one worker id: two enrolments
    of a new id at once must not both be admitted. SQLite's IMMEDIATE
    transactions already run one at a time; PostgreSQL takes a transaction-
    scoped advisory lock (one key per transaction, so it cannot deadlock)."""
    if postgres():
        key = int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=4).digest(), "big", signed=True)
        with connection.cursor() as cursor:
            cursor.execute(sql.LOCK_WORKER_ID, [ID_LOCK_SPACE, key])


def _new(worker_id: str, issued_by: str, now: dt.datetime, enrollment_key: str = "") -> tuple[WorkerCredential, str]:
    secret = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    credential = WorkerCredential.objects.create(
        worker_id=worker_id,
        digest=hash_token(secret),
        hint=secret[: len(CREDENTIAL_PREFIX) + 6],
        issued_by=issued_by,
        enrollment_digest=hash_token(enrollment_key) if enrollment_key else "",
        created_at=now,
    )
    return credential, secret


def _lost_answer(credentials, enrollment_key: str):
    """The credential an earlier enrolment with this same key issued and
    nothing has used since: its answer never reached the worker (a timeout,
    a proxy's 502), which is now asking again. None otherwise."""
    if not enrollment_key:
        return None
    unused = list(credentials.filter(revoked_at__isnull=True, last_used_at__isnull=True, issued_by="enrollment"))
    if len(unused) == 1 and hmac.compare_digest(unused[0].enrollment_digest, hash_token(enrollment_key)):
        return unused[0]
    return None


@service
def credential_issue(*, worker_id: str, clock: Clock | None = None) -> tuple[WorkerCredential, str]:
    """An operator's new credential for `worker_id` (`apiary worker token create`);
    returns it and its secret, which is not kept. Earlier credentials stay
    valid until revoked: hand the new one to the worker, restart it, then
    revoke the old ones. Issuing one also admits an id whose credentials
    were revoked."""
    if not WORKER_ID_RE.fullmatch(worker_id or ""):
        raise InvalidRequest(f"worker id {worker_id!r} must match {WORKER_ID_PATTERN}", field="worker_id")
    refuse_reserved(worker_id)
    _lock_id(worker_id)
    return _new(worker_id, "operator", now_of(clock))


@service
def credentials_revoke(
    *, worker_id: str, keep_newest: bool = False, actor: str | None = None, clock: Clock | None = None
) -> list[WorkerCredential]:
    """Revoke the id's credentials (all, or all but the newest: the end of a
    rotation's overlap). Revoking all of them also expires the attempts the
    id holds, so its jobs go back to the queue at once, and refuses its
    re-enrolment by the shared token until an operator issues a new credential.
    Returns the credentials revoked; NotFound when the id has none to revoke."""
    now = now_of(clock)
    _lock_id(worker_id)
    live = list(WorkerCredential.objects.filter(worker_id=worker_id, revoked_at__isnull=True).order_by("created_at"))
    if keep_newest:
        live = live[:-1]
    if not live:
        raise NotFound(f"worker {worker_id!r} has no credential to revoke", worker_id=worker_id)
    WorkerCredential.objects.filter(pk__in=[c.pk for c in live], revoked_at__isnull=True).update(revoked_at=now)
    if not keep_newest:
        held = Attempt.objects.select_related("job").filter(worker_id=worker_id, state=AttemptState.ACTIVE)
        if postgres():
            held = held.select_for_update(of=("self", "job"))
        for attempt in held:
            expire(attempt, now, f"worker {worker_id}'s credentials were revoked")
    for credential in live:
        credential.revoked_at = now
    worker_event(
        worker_id=worker_id, kind="credentials_revoked", at=now, actor=actor, credentials=len(live),
        keep_newest=keep_newest,
    )  # fmt: skip
    return live


@service
def credential_used(*, credential_id: int, clock: Clock | None = None) -> bool:
    """Mark a credential's first use (its first authenticated call). An enrolment
    key then no longer gets its worker a fresh credential: the answer was not lost."""
    return bool(
        WorkerCredential.objects.filter(pk=credential_id, last_used_at__isnull=True).update(last_used_at=now_of(clock))
    )


def _keyless_unused(credentials):
    """Credentials an enrolment without a key issued and nothing ever used: what a
    worker from before per-worker credentials got when it registered, and ignored."""
    return credentials.filter(issued_by="enrollment", enrollment_digest="", last_used_at__isnull=True)


@service
def worker_enroll(*, enrollment_key: str = "", clock: Clock | None = None, **registration) -> tuple[Worker, str]:
    """Registration with the shared token: a new worker id is admitted and
    gets its first credential (returned with the worker; shown once). Refused
    for the reserved id, when enrolment is closed, for an id that already has
    credentials (it must register with one) or was revoked, and for an id a
    live process holds (it has not been silent for `worker_timeout`).

    `enrollment_key` is a random value the worker chose and kept before
    sending: sent again with the same key, an enrolment whose credential
    was never used is answered again (with a new credential that replaces
    the unused one), so a lost answer does not lock the worker out."""
    worker_id = registration["worker_id"]
    refuse_reserved(worker_id)
    cfg = conf.current()
    if not cfg.enrollment:
        raise EnrollmentClosed(
            "enrolment by the shared worker token is closed (settings.queue.enrollment: false); "
            f"an operator issues worker {worker_id!r} a credential with `apiary worker token create {worker_id}`",
            worker_id=worker_id,
        )
    now = now_of(clock)
    _lock_id(worker_id)
    credentials = WorkerCredential.objects.filter(worker_id=worker_id)
    retried = _lost_answer(credentials, enrollment_key)
    if retried is not None:
        deleted, _ = WorkerCredential.objects.filter(pk=retried.pk, last_used_at__isnull=True).delete()
        if deleted:  # still unused (guarded: a first call may have come meanwhile)
            worker = register(now=now, embedded=False, **registration)
            return worker, _new(worker_id, "enrollment", now, enrollment_key)[1]
    # Credentials an old worker was given and ignored do not make its id enrolled: it is still
    # the shared token's to register (subject to the live-process check below), as before.
    held = credentials.filter(revoked_at__isnull=True).exclude(pk__in=_keyless_unused(credentials).values("pk"))
    if held.exists():
        raise CredentialRequired(
            f"worker {worker_id!r} is enrolled: register with its own credential, not the shared token", worker_id=worker_id
        )
    if credentials.filter(revoked_at__isnull=False).exists():
        raise CredentialRevoked(
            f"worker {worker_id!r}'s credentials were revoked; an operator admits it again with "
            f"`apiary worker token create {worker_id}`",
            worker_id=worker_id,
        )
    live = Worker.objects.filter(
        pk=worker_id, ready=True, last_heartbeat_at__gt=now - dt.timedelta(seconds=cfg.worker_timeout)
    ).exists()
    if live:
        raise CredentialRequired(
            f"worker {worker_id!r} is held by a live process (it heartbeated less than "
            f"{cfg.worker_timeout:g}s ago); only its own credential may register it again",
            worker_id=worker_id,
        )
    _keyless_unused(credentials).delete()
    worker = register(now=now, embedded=False, **registration)
    _, secret = _new(worker_id, "enrollment", now, enrollment_key)
    return worker, secret


@service
def worker_reregister(
    *, acting_as: str, credential_id: int | None = None, clock: Clock | None = None, **registration
) -> Worker:
    """Registration with the id's own credential (`credential_id`, the row it
    matched): a new session, as after a restart (attempts of the old one are
    expired). The credential's `last_used_at` says, during a rotation,
    whether the old one is still in use."""
    worker_id = registration["worker_id"]
    check_acting_as(worker_id, acting_as)
    refuse_reserved(worker_id)
    now = now_of(clock)
    _lock_id(worker_id)
    WorkerCredential.objects.filter(pk=credential_id, worker_id=worker_id).update(last_used_at=now)
    return register(now=now, embedded=False, **registration)
