"""Domain errors of the queue. Each carries a stable code; the API maps codes to
HTTP statuses in one place (jobqueue.api.errors). Services never know about HTTP."""


class QueueError(Exception):
    code = "queue_error"

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(QueueError):
    code = "invalid_request"


class NotFound(QueueError):
    code = "not_found"


class StaleAttempt(QueueError):
    """The token does not match, the attempt is not current, its lease passed,
    or it already finished with another outcome. Nothing was changed."""

    code = "stale_attempt"


class SessionSuperseded(QueueError):
    """The worker id was registered again by a newer process."""

    code = "session_superseded"


class Unavailable(QueueError):
    """The database stayed locked or unreachable beyond the busy timeout."""

    code = "unavailable"

    @classmethod
    def of(cls, exc: Exception) -> "Unavailable":
        """What a database error (OperationalError, a failed COMMIT) is answered as: retryable."""
        mapped = cls(f"database unavailable: {exc}")
        mapped.__cause__ = exc
        return mapped


class Forbidden(QueueError):
    """The caller is authenticated but may not do this (PROTOCOL.md "Worker
    identity"): each subclass is one documented reason, with its own code."""

    code = "forbidden"


class WorkerMismatch(Forbidden):
    """A per-worker credential acts only as its own worker id."""

    code = "worker_mismatch"


class CredentialRequired(Forbidden):
    """The call needs the worker id's own credential: the shared token only enrolls new ids."""

    code = "credential_required"


class CredentialRevoked(Forbidden):
    """An operator revoked this worker id's credentials; only an operator can admit it again."""

    code = "credential_revoked"


class EnrollmentClosed(Forbidden):
    """`settings.queue.enrollment: false`: the shared token enrolls no new worker."""

    code = "enrollment_closed"


class ReservedWorkerId(Forbidden):
    """`embedded` belongs to the control plane's own worker."""

    code = "reserved_worker_id"


class OperatorTokenRequired(Forbidden):
    """A worker's own credential asked for what only the shared token reads (other jobs' step logs)."""

    code = "operator_token_required"


class RateLimited(QueueError):
    """Too many calls of one kind from one worker; `retry_after` seconds until the next is accepted."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: float, **details):
        super().__init__(message, **details)
        self.retry_after = retry_after
