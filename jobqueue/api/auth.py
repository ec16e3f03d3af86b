"""Bearer authentication, after DRF's TokenAuthentication: a per-worker
credential (`apw_…`, acting as its worker id) or the shared worker token.

The shared token is `settings.APIARY_WORKER_TOKEN`, set by the control plane
at start-up from `settings.queue.worker_token` (and, during a rotation,
`APIARY_PREVIOUS_WORKER_TOKENS` from `previous_worker_tokens`, each use of
one logged as old); read on every request; unset or empty, it matches
nothing. What each may do is decided by the views and services (README
"Security").

Only the Authorization header counts (a token in the query string ends up
in access logs and proxy histories, so it is never looked at). Comparison is constant-time over
SHA-256 digests of the raw header bytes, so neither the token's content nor
its length leaks through timing. The token is never logged or echoed: error
messages say only "missing" or "wrong".
"""

import hashlib
import hmac
import logging
import time

from django.conf import settings
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

# Imports stay within rest_framework.authentication/exceptions: DRF imports
# this module while rest_framework.views is still initialising.

log = logging.getLogger("apiary.api")

KEYWORD = b"bearer"
AUTHENTICATE = 'Bearer realm="apiary"'  # the WWW-Authenticate challenge of every 401


class WorkerPrincipal:
    """Who an authenticated request is. `worker_id` is set for a per-worker
    credential, which acts only as that id; None for the shared token, which
    only enrols new worker ids (and reads `status`)."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, worker_id: str | None = None, credential_id: int | None = None):
        self.worker_id = worker_id
        self.credential_id = credential_id  # the credential row it matched

    def __str__(self) -> str:
        return f"worker {self.worker_id}" if self.worker_id else "enrolment token"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


_NO_TOKEN = hashlib.sha256(b"\x00").digest()
_old_logged: dict[int, float] = {}
OLD_TOKEN_LOG_EVERY = 60.0  # seconds between two warnings about the same previous token


def _shared_token_matches(given: bytes) -> bool:
    """Whether `given` (a digest) is the worker token or one of the previous
    ones. Every configured token is compared, so which one matched, or that
    none did, takes the same time."""
    current = getattr(settings, "APIARY_WORKER_TOKEN", "") or ""
    previous = list(getattr(settings, "APIARY_PREVIOUS_WORKER_TOKENS", ()) or ())
    matched = hmac.compare_digest(given, _digest(current) if current else _NO_TOKEN) and bool(current)
    old_hits = [hmac.compare_digest(given, _digest(token)) for token in previous]
    if matched or True not in old_hits:
        return matched
    old = old_hits.index(True)
    now = time.monotonic()
    if now - _old_logged.get(old, -OLD_TOKEN_LOG_EVERY) >= OLD_TOKEN_LOG_EVERY:
        _old_logged[old] = now
        log.warning(
            "a worker authenticated with settings.queue.previous_worker_tokens[%d], an old worker token; "
            "finish the rotation on every worker, then remove it",
            old,
        )
    return True


def principal_of(token: bytes) -> WorkerPrincipal:
    """The principal of a Bearer token's bytes; AuthenticationFailed when it is
    none. A per-worker credential costs one indexed query."""
    # Not at import time: see the note on imports above.
    from jobqueue.selectors import credential_of
    from jobqueue.services import credential_used
    from jobqueue.types import CREDENTIAL_PREFIX

    try:
        text = token.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if text.startswith(CREDENTIAL_PREFIX):
        found = credential_of(text)
        if found is None:
            raise AuthenticationFailed("unknown or revoked worker credential")
        credential_id, worker_id, used = found
        if not used:  # its first call: from now on the enrolment key that got it opens nothing
            credential_used(credential_id=credential_id)
        return WorkerPrincipal(worker_id, credential_id=credential_id)
    if not _shared_token_matches(hashlib.sha256(token).digest()):
        raise AuthenticationFailed("wrong worker token")
    return WorkerPrincipal()


def _raw_header(request) -> bytes:
    """The Authorization header as the bytes that were sent. WSGI servers
    decode header bytes as latin-1 (PEP 3333), so encoding back is lossless;
    a value that cannot be encoded did not come off a wire and is refused."""
    value = request.META.get("HTTP_AUTHORIZATION", "")
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        raise AuthenticationFailed("malformed Authorization header") from None


def bearer_of(request) -> bytes | None:
    """The Bearer token's bytes; None for no (or another scheme's) credentials."""
    parts = _raw_header(request).split()
    if not parts or parts[0].lower() != KEYWORD:
        return None
    if len(parts) != 2:
        raise AuthenticationFailed("malformed Authorization header: expected 'Bearer <worker token>'")
    return parts[1]


# request.META: what the ASGI endpoint already found (api/asgi.py): the principal, the refusal, or None.
PRINCIPAL = "apiary.principal"


class WorkerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        if PRINCIPAL in request.META:
            known = request.META[PRINCIPAL]
            if isinstance(known, AuthenticationFailed):
                raise known
            return None if known is None else (known, None)
        token = bearer_of(request)
        if token is None:
            return None  # no credentials for us: IsAuthenticated answers 401 "not provided"
        return principal_of(token), None

    def authenticate_header(self, request) -> str:
        # Without it DRF turns every 401 into a 403.
        return AUTHENTICATE
