"""Who a call may act as: the checks every identity-aware service shares
(README "Security"). Pure decisions over a few reads, inside the caller's
transaction."""

from .. import conf
from ..exceptions import CredentialRequired, ReservedWorkerId, WorkerMismatch
from ..models import WorkerCredential
from ..types import EMBEDDED_ID


def refuse_reserved(worker_id: str) -> None:
    if worker_id == EMBEDDED_ID:
        raise ReservedWorkerId(
            f"worker id {EMBEDDED_ID!r} is reserved for the control plane's embedded worker", worker_id=worker_id
        )


# Who a call acts as when it came with the shared token instead of a credential. Not a
# possible worker id (it has spaces), so it never matches one.
LEGACY = "<the shared token>"


def acting_as(worker_id: str, principal: str) -> None:
    """A per-worker credential (`principal`, its worker id) acts only as its own
    id. The shared token (`LEGACY`) acts only for an id with no credential that
    ever made a call, never for `embedded`, and only while enrolment is open: a
    worker whose client predates per-worker credentials keeps its session and
    jobs (also after a restart on the old code, which ignores the credential
    its registration gets) until it runs a client that enrols."""
    if principal == LEGACY:
        refuse_reserved(worker_id)
        enrolled = WorkerCredential.objects.filter(worker_id=worker_id).exclude(
            # what an old worker was given at a registration and ignored (services/credentials.py)
            issued_by="enrollment", enrollment_digest="", last_used_at__isnull=True
        )
        if not conf.current().enrollment or enrolled.exists():
            raise CredentialRequired(
                f"worker {worker_id!r} is enrolled: this call needs its own credential, not the shared token",
                worker_id=worker_id,
            )
        return
    if principal != worker_id:
        raise WorkerMismatch(
            f"this credential belongs to worker {principal!r}; it cannot act as worker {worker_id!r}",
            worker_id=worker_id,
        )
