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
