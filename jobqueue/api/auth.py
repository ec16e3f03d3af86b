"""Bearer authentication with the shared worker token, after DRF's TokenAuthentication.

The expected token is `settings.APIARY_WORKER_TOKEN`, set by the control
plane at start-up from `settings.queue.worker_token` and read on every
request; unset or empty, every request is refused. Only the Authorization
header counts (a token in the query string ends up in access logs and proxy
histories, so it is never looked at). Comparison is constant-time over
SHA-256 digests of the raw header bytes, so neither the token's content nor
its length leaks through timing. The token is never logged or echoed: error
messages say only "missing" or "wrong".
"""

import hashlib
import hmac

from django.conf import settings
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

# Imports stay within rest_framework.authentication/exceptions: DRF imports
# this module while rest_framework.views is still initialising.

KEYWORD = b"bearer"
AUTHENTICATE = 'Bearer realm="apiary"'  # the WWW-Authenticate challenge of every 401


class WorkerPrincipal:
    """Who a request with the right token is: "a worker" (the protocol has
    one shared token; the worker id travels in the body)."""

    is_authenticated = True
    is_anonymous = False

    def __str__(self) -> str:
        return "worker"


def _expected_digest() -> bytes | None:
    expected = getattr(settings, "APIARY_WORKER_TOKEN", "") or ""
    if not expected:
        return None
    return hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()


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


class WorkerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        parts = _raw_header(request).split()
        if not parts or parts[0].lower() != KEYWORD:
            return None  # no credentials for us: IsAuthenticated answers 401 "not provided"
        if len(parts) != 2:
            raise AuthenticationFailed("malformed Authorization header: expected 'Bearer <worker token>'")
        expected = _expected_digest()
        given = hashlib.sha256(parts[1]).digest()
        # Compare even when no token is configured, so that case takes the same time.
        matches = hmac.compare_digest(given, expected or hashlib.sha256(b"\x00").digest())
        if expected is None or not matches:
            raise AuthenticationFailed("wrong worker token")
        return WorkerPrincipal(), None

    def authenticate_header(self, request) -> str:
        # Without it DRF turns every 401 into a 403.
        return AUTHENTICATE
