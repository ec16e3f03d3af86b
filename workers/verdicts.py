"""What a failed control-plane call means for the runtime: the one place that
classifies a transport's errors (both transports raise the same domain errors)."""

import enum

from jobqueue.exceptions import Forbidden, NotFound, QueueError, SessionSuperseded, StaleAttempt, Unavailable

from .transport import TransportError, Unauthorized


class Verdict(enum.Enum):
    """What the runtime does about a failed control-plane call."""

    RETRY = "retry"  # the control plane could not answer now: try again later
    STALE = "stale"  # the attempt is no longer this worker's: stop its runner, drop its result
    SUPERSEDED = "superseded"  # another process registered this worker id: stop everything
    UNAUTHORIZED = "unauthorized"  # the token was refused, or may not act as this worker: stop everything
    REFUSED = "refused"  # the call was refused as malformed: sending it again cannot help


def classify(exc: QueueError) -> Verdict:
    """The one place that turns a transport's errors into what the runtime does;
    both transports raise the same domain errors."""
    if isinstance(exc, Unavailable | TransportError):
        return Verdict.RETRY
    if isinstance(exc, StaleAttempt | NotFound):
        return Verdict.STALE
    if isinstance(exc, SessionSuperseded):
        return Verdict.SUPERSEDED
    if isinstance(exc, Unauthorized | Forbidden):
        return Verdict.UNAUTHORIZED
    return Verdict.REFUSED


FATAL = (Verdict.SUPERSEDED, Verdict.UNAUTHORIZED)
